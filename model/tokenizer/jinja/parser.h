// Parses a chat template into statements (ast.h) with jinja2's
// grammar, for the subset documented in model/tokenizer/chat_template.h. Not
// part of the public API.
#pragma once

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/tokenizer/jinja/ast.h"

namespace moh {
namespace jinja {

// INVALID_ARGUMENT "chat template line L col C: <what>" on a syntax error, a
// tag this engine does not support (named), or nesting deeper than
// kMaxNesting (token_stream.h).
absl::StatusOr<Body> ParseTemplate(absl::string_view source);

}  // namespace jinja
}  // namespace moh
