// Reading a small text file (a PEM certificate, a token list) whole.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moh {

// The contents of `path`; INVALID_ARGUMENT "<what>: cannot read <path>" when
// it cannot be read or is empty. `what` names the field or flag that gave
// the path.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path,
                                          absl::string_view what);

}  // namespace moh
