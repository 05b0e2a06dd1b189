// Calls of the chat-template engine's builtins (filters.h,
// builtins.h): their arguments, binding them to parameters as Python
// does, and the conversions and size checks the builtins share. Not part of
// the public API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "model/tokenizer/jinja/value.h"

namespace moh {
namespace jinja {

// Lists built by filters, methods and operators hold at most this many
// items (jinja2's sandbox allows range() as many).
inline constexpr size_t kMaxListItems = 100000;

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

// INVALID_ARGUMENT with the parts concatenated.
template <typename... Parts>
absl::Status ArgumentError(const Parts&... parts) {
  return absl::InvalidArgumentError(absl::StrCat(parts...));
}

// The arguments of a call bound to its parameters, as Python binds them.
class Params {
 public:
  // Binds positional arguments in order, then keyword ones by name; an
  // error for too many arguments or an unknown or repeated keyword.
  static absl::StatusOr<Params> Bind(absl::string_view function,
                                     std::vector<absl::string_view> names,
                                     const CallArgs& args);

  // Argument `i`, or `fallback` when it was not given.
  Value Get(size_t i, Value fallback = Value::None()) const {
    return values_[i] ? *values_[i] : fallback;
  }
  bool Has(size_t i) const { return values_[i].has_value(); }

 private:
  std::vector<std::optional<Value>> values_;
};

// str(value), at most `limit` bytes.
absl::StatusOr<std::string> ToStr(const Value& value, size_t limit);
// An int (or bool) argument; `what` names it in the error.
absl::StatusOr<int64_t> ToInt(const Value& value, absl::string_view what);
// A string argument, or nullopt for none.
absl::StatusOr<std::optional<std::string>> OptionalString(
    const Value& value, absl::string_view what);
// `items` as a list, or an error beyond kMaxListItems.
absl::StatusOr<Value> MakeCheckedList(List items);
// `s` as a string value, or an error beyond `limit` bytes.
absl::StatusOr<Value> MakeCheckedString(std::string s, size_t limit);

}  // namespace jinja
}  // namespace moh
