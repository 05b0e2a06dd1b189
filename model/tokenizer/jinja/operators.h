// Python's operators on the chat-template engine's values, as jinja2
// applies them: arithmetic, signs, attribute and item access, slices. Errors
// are INVALID_ARGUMENT without a position (the renderer adds it); using an
// undefined value is an error carrying its reason, as with jinja2's default
// Undefined. Not part of the public API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/tokenizer/jinja/value.h"

namespace moh {
namespace jinja {

// a op b for + - * / // % **: numbers (ints stay ints, overflow is an
// error), str + str, list + list, str/list * int. Strings built are at most
// `max_string_bytes` long, lists at most kMaxListItems items.
absl::StatusOr<Value> BinaryOperation(absl::string_view op, const Value& a,
                                      const Value& b, size_t max_string_bytes);
// -x or +x of a number.
absl::StatusOr<Value> UnaryOperation(absl::string_view op,
                                     const Value& operand);
// object.name: a dict's item or a namespace's attribute; undefined when
// absent.
absl::StatusOr<Value> GetAttribute(const Value& object,
                                   const std::string& name);
// object[key]: a dict's item (also a namespace's attribute), or a list's or
// string's index (negative from the end); undefined when absent.
absl::StatusOr<Value> GetItem(const Value& object, const Value& key);
// object[start:stop:step] of a list or string; nullopt bounds are absent.
absl::StatusOr<Value> GetSlice(const Value& object,
                               std::optional<int64_t> start,
                               std::optional<int64_t> stop,
                               std::optional<int64_t> step);

}  // namespace jinja
}  // namespace moh
