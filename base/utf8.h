// UTF-8 validity: the tokenizer's decoding, and text that leaves the server in
// a protobuf string field or a status message (which must be valid UTF-8: a
// client's protobuf library refuses a whole message over one bad byte).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/strings/string_view.h"

namespace moh {

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";

// Length of the valid UTF-8 character starting non-empty `s`; 0 when `s`
// holds only an incomplete but so far valid prefix; -k when its first k bytes
// form a maximal invalid subpart (Unicode 3.9, as Rust's from_utf8_lossy).
int NextUtf8(std::string_view s);
// Appends `s` with each maximal invalid subpart replaced by U+FFFD. An
// incomplete character at the end is left unconsumed unless `final`.
// Returns the number of bytes consumed.
size_t AppendLossyUtf8(std::string_view s, bool final, std::string* out);
bool IsValidUtf8(std::string_view s);
// `text` with each maximal invalid subpart (and an incomplete character at
// its end) replaced by U+FFFD: bytes read from a file (a checkpoint's pickle,
// a ZIP entry's name) quoted into a message a client will parse.
std::string LossyUtf8(absl::string_view text);

}  // namespace moh
