// Splits a chat template into tokens as jinja2's lexer does with
// trim_blocks=True and lstrip_blocks=True (transformers' environment):
// newlines normalized to "\n", one trailing newline dropped, whitespace
// control ("{%-", "-%}", "{%+", "+%}", "{{-", "-}}", "{#-", "-#}") applied to
// the text tokens, comments dropped. Not part of the public API.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moh {
namespace jinja {

struct Token {
  enum class Kind {
    kText,           // text: template text, whitespace control applied
    kVariableBegin,  // {{
    kVariableEnd,    // }}
    kBlockBegin,     // {%
    kBlockEnd,       // %}
    kName,           // text
    kString,         // text: the literal's value, escapes decoded
    kInt,            // int_value
    kFloat,          // float_value
    kOperator,       // text: + - * / // % ** ~ == != < <= > >= = ( ) ...
    kEnd,            // End of the template.
  };
  Kind kind;
  std::string text;
  int64_t int_value = 0;
  double float_value = 0;
  int line = 1;
  int column = 1;  // In code points, from 1.
};

// INVALID_ARGUMENT "chat template line L col C: <what>".
absl::Status SyntaxError(int line, int column, absl::string_view what);

// The tokens of `source`, ending with kEnd; a syntax error for an unclosed
// tag, comment or string, or a character that starts no token.
absl::StatusOr<std::vector<Token>> Tokenize(absl::string_view source);

}  // namespace jinja
}  // namespace moh
