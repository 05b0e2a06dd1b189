// The filters ("x | trim") and tests ("x is defined") of the chat-template
// engine; model/tokenizer/chat_template.h lists them. They behave as jinja2's
// (and transformers' tojson). Not part of the public API.
#pragma once

#include <cstddef>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/tokenizer/jinja/call.h"
#include "model/tokenizer/jinja/value.h"

namespace moh {
namespace jinja {

// value | name(args). INVALID_ARGUMENT (without a position) for an unknown
// filter, bad arguments, or a string longer than `max_string_bytes`.
absl::StatusOr<Value> ApplyFilter(absl::string_view name, const Value& value,
                                  const CallArgs& args,
                                  size_t max_string_bytes);
// value is name(args).
absl::StatusOr<bool> ApplyTest(absl::string_view name, const Value& value,
                               const CallArgs& args);

}  // namespace jinja
}  // namespace moh
