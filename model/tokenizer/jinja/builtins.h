// The methods ("x".strip(), d.items()) and global functions (range,
// namespace, raise_exception, dict) of the chat-template engine, and the
// Python semantics of `in` and iteration they and the renderer share;
// model/tokenizer/chat_template.h lists them. Not part of the public API.
//
// Errors are INVALID_ARGUMENT without a position (the renderer adds it),
// except raise_exception(msg): ABORTED carrying `msg` alone.
#pragma once

#include <cstddef>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/tokenizer/jinja/call.h"
#include "model/tokenizer/jinja/value.h"

namespace moh {
namespace jinja {

// object.name(args): str and dict methods. Strings built are at most
// `max_string_bytes` long.
absl::StatusOr<Value> CallMethod(const Value& object, absl::string_view name,
                                 const CallArgs& args, size_t max_string_bytes);

// Whether `name` is a global function: raise_exception, range, namespace,
// dict.
bool IsGlobalFunction(absl::string_view name);
absl::StatusOr<Value> CallGlobalFunction(absl::string_view name,
                                         const CallArgs& args);

// Python's `item in container`.
absl::StatusOr<bool> Contains(const Value& container, const Value& item);
// The items `for x in value` visits: a list's items, a dict's keys, a
// string's characters, nothing for undefined; an error for other kinds.
absl::StatusOr<List> Iterate(const Value& value);
// A dict's (key, value) pairs as tuples; none for undefined.
absl::StatusOr<Value> Items(const Value& value);
// Whether a namespace occurs in `value` (namespaces may not hold one).
bool HoldsNamespace(const Value& value);

}  // namespace jinja
}  // namespace moh
