// Client text echoed into a status message or a log line is cut short, so a
// huge field cannot break the client's metadata limit or flood the logs.
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace moh {

// `text` itself when at most `max_bytes` long; else its first bytes (whole
// UTF-8 characters) followed by "... (N bytes)".
std::string Abbreviate(absl::string_view text, size_t max_bytes = 64);

}  // namespace moh
