// Parses a chat template into statements (jinja_ast.h) with jinja2's
// grammar and operator precedence, for the subset documented in
// model/tokenizer/chat_template.h. Not part of the public API.
#pragma once

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/tokenizer/jinja_ast.h"

namespace moh {
namespace jinja {

// Blocks and expressions nest at most this deep, so that parsing and
// rendering a hostile template cannot exhaust the stack.
inline constexpr int kMaxNesting = 100;

// INVALID_ARGUMENT "chat template line L col C: <what>" on a syntax error, a
// tag this engine does not support (named), or nesting deeper than
// kMaxNesting.
absl::StatusOr<Body> ParseTemplate(absl::string_view source);

}  // namespace jinja
}  // namespace moh
