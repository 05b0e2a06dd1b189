// The filters, tests, methods and global functions of the chat-template
// engine (model/tokenizer/chat_template.h lists them), with the behaviour
// jinja2 and Python give them. Not part of the public API.
//
// Errors are INVALID_ARGUMENT without a position (the renderer adds it),
// except raise_exception(msg): ABORTED carrying `msg` alone.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/tokenizer/jinja_value.h"

namespace moh {
namespace jinja {

// Lists built by filters, methods and operators hold at most this many
// items (jinja2's sandbox allows range() as many).
inline constexpr size_t kMaxListItems = 100000;

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

// Strings built by builtins are at most `max_string_bytes` long.
absl::StatusOr<Value> ApplyFilter(absl::string_view name, const Value& value,
                                  const CallArgs& args,
                                  size_t max_string_bytes);
absl::StatusOr<bool> ApplyTest(absl::string_view name, const Value& value,
                               const CallArgs& args);
// object.name(args): str, dict and list methods.
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
// Whether a namespace occurs in `value` (namespaces may not hold one).
bool HoldsNamespace(const Value& value);

}  // namespace jinja
}  // namespace moh
