// The `is` tests of filters.h ("x is defined", "x is divisibleby(3)"), as
// jinja2's tests.py.
#include <cstdint>
#include <optional>
#include <string>

#include "base/status_macros.h"
#include "model/tokenizer/jinja/builtins.h"
#include "model/tokenizer/jinja/filters.h"
#include "model/tokenizer/jinja/text.h"

namespace moh {
namespace jinja {
namespace {

using Kind = Value::Kind;

// The tests that take no argument; nullopt for other names.
absl::StatusOr<std::optional<bool>> TestWithoutArgument(absl::string_view name,
                                                        const Value& value) {
  if (name == "defined") return !value.is(Kind::kUndefined);
  if (name == "undefined") return value.is(Kind::kUndefined);
  if (name == "none") return value.is(Kind::kNone);
  if (name == "string") return value.is(Kind::kString);
  if (name == "number") return value.IsNumber();
  if (name == "integer") return value.is(Kind::kInt);
  if (name == "float") return value.is(Kind::kFloat);
  if (name == "boolean") return value.is(Kind::kBool);
  if (name == "true") return value.is(Kind::kBool) && value.AsBool();
  if (name == "false") return value.is(Kind::kBool) && !value.AsBool();
  if (name == "mapping") return value.is(Kind::kDict);
  if (name == "callable") return value.is(Kind::kFunction);
  if (name == "iterable" || name == "sequence") {
    return value.is(Kind::kString) || value.is(Kind::kList) ||
           value.is(Kind::kDict) || value.is(Kind::kUndefined);
  }
  if (name == "lower" || name == "upper") {
    if (!value.is(Kind::kString)) return false;
    const std::string& s = value.AsString();
    return (name == "lower" ? Lower(s) : Upper(s)) == s;
  }
  if (name == "odd" || name == "even") {
    MOH_ASSIGN_OR_RETURN(const int64_t n, ToInt(value, name));
    return (n % 2 != 0) == (name == "odd");
  }
  return std::nullopt;
}

}  // namespace

absl::StatusOr<bool> ApplyTest(absl::string_view name, const Value& value,
                               const CallArgs& args) {
  MOH_ASSIGN_OR_RETURN(const std::optional<bool> result,
                       TestWithoutArgument(name, value));
  if (result) {
    if (!args.positional.empty() || !args.keyword.empty()) {
      return ArgumentError("test '", name, "' takes no argument");
    }
    return *result;
  }
  const auto arg = [&]() -> absl::StatusOr<Value> {
    if (args.positional.size() != 1 || !args.keyword.empty()) {
      return ArgumentError("test '", name, "' takes one argument");
    }
    return args.positional[0];
  };
  if (name == "divisibleby") {
    MOH_ASSIGN_OR_RETURN(const int64_t n, ToInt(value, name));
    MOH_ASSIGN_OR_RETURN(const Value divisor, arg());
    MOH_ASSIGN_OR_RETURN(const int64_t d, ToInt(divisor, "divisibleby"));
    if (d == 0) return ArgumentError("integer modulo by zero");
    return d == -1 || n % d == 0;
  }
  if (name == "eq" || name == "equalto" || name == "==" || name == "sameas") {
    MOH_ASSIGN_OR_RETURN(const Value other, arg());
    if (name == "sameas" &&
        (other.kind() != value.kind() || value.is(Kind::kUndefined))) {
      return false;  // Python's `is`; two undefined values are distinct.
    }
    return Equals(value, other);
  }
  if (name == "ne" || name == "!=") {
    MOH_ASSIGN_OR_RETURN(const Value other, arg());
    return !Equals(value, other);
  }
  if (name == "in") {
    MOH_ASSIGN_OR_RETURN(const Value container, arg());
    return Contains(container, value);
  }
  static constexpr absl::string_view kOrder[][2] = {
      {"lt", "<"},  {"le", "<="},      {"gt", ">"},
      {"ge", ">="}, {"lessthan", "<"}, {"greaterthan", ">"}};
  for (const auto& [word, op] : kOrder) {
    if (name != word && name != op) continue;
    MOH_ASSIGN_OR_RETURN(const Value other, arg());
    MOH_ASSIGN_OR_RETURN(const int c, Compare(value, other));
    return op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0;
  }
  return ArgumentError("no test named '", name, "'");
}

}  // namespace jinja
}  // namespace moh
