#include "model/tokenizer/jinja/call.h"

#include <algorithm>

namespace moh {
namespace jinja {

using Kind = Value::Kind;

absl::StatusOr<Params> Params::Bind(absl::string_view function,
                                    std::vector<absl::string_view> names,
                                    const CallArgs& args) {
  Params params;
  params.values_.resize(names.size());
  if (args.positional.size() > names.size()) {
    return ArgumentError(function, "() takes at most ", names.size(),
                         " argument(s), got ", args.positional.size());
  }
  for (size_t i = 0; i < args.positional.size(); ++i) {
    params.values_[i] = args.positional[i];
  }
  for (const auto& [name, value] : args.keyword) {
    auto it = std::find(names.begin(), names.end(), name);
    if (it == names.end() || params.values_[it - names.begin()]) {
      return ArgumentError(function, "() got an unexpected keyword argument '",
                           name, "'");
    }
    params.values_[it - names.begin()] = value;
  }
  return params;
}

absl::StatusOr<std::string> ToStr(const Value& value, size_t limit) {
  std::string out;
  if (!AppendStr(value, limit, &out)) {
    return ArgumentError("string longer than ", limit, " bytes");
  }
  return out;
}

absl::StatusOr<int64_t> ToInt(const Value& value, absl::string_view what) {
  if (value.is(Kind::kInt) || value.is(Kind::kBool)) return value.AsInt();
  return ArgumentError(what, " must be an integer, not '", value.TypeName(),
                       "'");
}

absl::StatusOr<std::optional<std::string>> OptionalString(
    const Value& value, absl::string_view what) {
  if (value.is(Kind::kNone)) return std::nullopt;
  if (!value.is(Kind::kString)) {
    return ArgumentError(what, " must be a string, not '", value.TypeName(),
                         "'");
  }
  return value.AsString();
}

absl::StatusOr<Value> MakeCheckedList(List items) {
  if (items.size() > kMaxListItems) {
    return ArgumentError("list longer than ", kMaxListItems, " items");
  }
  return Value::MakeList(std::move(items));
}

absl::StatusOr<Value> MakeCheckedString(std::string s, size_t limit) {
  if (s.size() > limit) {
    return ArgumentError("string longer than ", limit, " bytes");
  }
  return Value::String(std::move(s));
}

}  // namespace jinja
}  // namespace moh
