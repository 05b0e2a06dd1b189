// Parses the expressions of a chat template ({{ ... }} and the arguments of
// tags) with jinja2's grammar and precedence. Not part of the public API.
#pragma once

#include "absl/status/statusor.h"
#include "model/tokenizer/jinja/ast.h"
#include "model/tokenizer/jinja/token_stream.h"

namespace moh {
namespace jinja {

// One expression from the current token on; `with_conditional`: whether
// "a if c else b" is allowed at its top (jinja2 refuses it in if/for tags).
absl::StatusOr<ExprPtr> ParseExpression(TokenStream& tokens,
                                        bool with_conditional);
// An expression, or several separated by commas: a tuple (a list here).
absl::StatusOr<ExprPtr> ParseTuple(TokenStream& tokens, bool with_conditional);

}  // namespace jinja
}  // namespace moh
