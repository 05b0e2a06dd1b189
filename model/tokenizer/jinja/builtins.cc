#include "model/tokenizer/jinja/builtins.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "model/tokenizer/jinja/text.h"

namespace moh {
namespace jinja {
namespace {

using Kind = Value::Kind;

// str.split(sep, maxsplit).
absl::StatusOr<Value> Split(const std::string& s,
                            const std::optional<std::string>& sep,
                            int64_t maxsplit) {
  List parts;
  if (sep) {
    if (sep->empty()) return ArgumentError("split(): empty separator");
    size_t pos = 0;
    for (int64_t n = 0; maxsplit < 0 || n < maxsplit; ++n) {
      const size_t found = s.find(*sep, pos);
      if (found == std::string::npos) break;
      parts.push_back(Value::String(s.substr(pos, found - pos)));
      pos = found + sep->size();
      if (parts.size() > kMaxListItems) break;
    }
    parts.push_back(Value::String(s.substr(pos)));
    return MakeCheckedList(std::move(parts));
  }
  const std::vector<char32_t> chars = DecodeUtf8(s);
  size_t i = 0;
  while (parts.size() <= kMaxListItems) {
    while (i < chars.size() && IsSpace(chars[i])) ++i;
    if (i == chars.size()) break;
    if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
      parts.push_back(Value::String(
          EncodeUtf8(std::vector<char32_t>(chars.begin() + i, chars.end()))));
      break;
    }
    const size_t start = i;
    while (i < chars.size() && !IsSpace(chars[i])) ++i;
    parts.push_back(Value::String(EncodeUtf8(
        std::vector<char32_t>(chars.begin() + start, chars.begin() + i))));
  }
  return MakeCheckedList(std::move(parts));
}

}  // namespace

absl::StatusOr<Value> Items(const Value& value) {
  if (value.is(Kind::kUndefined)) return Value::MakeList({});
  if (!value.is(Kind::kDict)) {
    return ArgumentError("can only get item pairs from a mapping, not '",
                         value.TypeName(), "'");
  }
  List pairs;
  for (const auto& [key, item] : value.AsDict()) {
    pairs.push_back(Value::MakeTuple({Value::String(key), item}));
  }
  return Value::MakeList(std::move(pairs));
}

// ------------------------------------------------------------- methods --

namespace {

absl::StatusOr<Value> StringMethod(const std::string& s, absl::string_view name,
                                   const CallArgs& args, size_t limit) {
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    MOH_ASSIGN_OR_RETURN(Params p, Params::Bind(name, {"chars"}, args));
    MOH_ASSIGN_OR_RETURN(const auto chars,
                         OptionalString(p.Get(0), absl::StrCat(name, "()")));
    const StripSide side = name == "strip"    ? StripSide::kBoth
                           : name == "lstrip" ? StripSide::kLeft
                                              : StripSide::kRight;
    return Value::String(Strip(s, chars ? &*chars : nullptr, side));
  }
  if (name == "split") {
    MOH_ASSIGN_OR_RETURN(Params p,
                         Params::Bind(name, {"sep", "maxsplit"}, args));
    MOH_ASSIGN_OR_RETURN(const auto sep, OptionalString(p.Get(0), "split()"));
    MOH_ASSIGN_OR_RETURN(const int64_t maxsplit,
                         ToInt(p.Get(1, Value::Int(-1)), "split(): maxsplit"));
    return Split(s, sep, maxsplit);
  }
  if (name == "startswith" || name == "endswith") {
    MOH_ASSIGN_OR_RETURN(Params p, Params::Bind(name, {"prefix"}, args));
    List candidates = {p.Get(0)};
    if (p.Get(0).is(Kind::kList)) candidates = p.Get(0).AsList();
    for (const Value& candidate : candidates) {
      if (!candidate.is(Kind::kString)) {
        return ArgumentError(name, "() takes a string or a tuple of strings");
      }
      const std::string& c = candidate.AsString();
      const bool match = c.size() <= s.size() &&
                         (name == "startswith" ? s.compare(0, c.size(), c) == 0
                                               : s.compare(s.size() - c.size(),
                                                           c.size(), c) == 0);
      if (match) return Value::Bool(true);
    }
    return Value::Bool(false);
  }
  if (name == "replace") {
    MOH_ASSIGN_OR_RETURN(Params p,
                         Params::Bind(name, {"old", "new", "count"}, args));
    MOH_ASSIGN_OR_RETURN(const auto old, OptionalString(p.Get(0), "replace()"));
    MOH_ASSIGN_OR_RETURN(const auto rep, OptionalString(p.Get(1), "replace()"));
    if (!old || !rep) return ArgumentError("replace() needs two strings");
    MOH_ASSIGN_OR_RETURN(const int64_t count,
                         ToInt(p.Get(2, Value::Int(-1)), "replace(): count"));
    return MakeCheckedString(PyReplace(s, *old, *rep, count), limit);
  }
  if (name == "join") {
    MOH_ASSIGN_OR_RETURN(Params p, Params::Bind(name, {"iterable"}, args));
    MOH_ASSIGN_OR_RETURN(const List items, Iterate(p.Get(0)));
    std::vector<std::string> parts;
    for (const Value& item : items) {
      if (!item.is(Kind::kString)) {
        return ArgumentError("join(): expected str items, found '",
                             item.TypeName(), "'");
      }
      parts.push_back(item.AsString());
    }
    return MakeCheckedString(absl::StrJoin(parts, s), limit);
  }
  static constexpr absl::string_view kCase[] = {"upper", "lower", "title",
                                                "capitalize"};
  if (std::find(std::begin(kCase), std::end(kCase), name) != std::end(kCase)) {
    MOH_ASSIGN_OR_RETURN(Params p, Params::Bind(name, {}, args));
    (void)p;
    if (name == "upper") return Value::String(Upper(s));
    if (name == "lower") return Value::String(Lower(s));
    if (name == "title") return Value::String(PyTitle(s));
    return Value::String(Capitalize(s));
  }
  return ArgumentError("'str object' has no attribute '", name, "'");
}

absl::StatusOr<Value> DictMethod(const Value& dict, absl::string_view name,
                                 const CallArgs& args) {
  if (name == "get") {
    MOH_ASSIGN_OR_RETURN(Params p,
                         Params::Bind(name, {"key", "default"}, args));
    const Value key = p.Get(0);
    const Value* found =
        key.is(Kind::kString) ? dict.Find(key.AsString()) : nullptr;
    return found != nullptr ? *found : p.Get(1);
  }
  MOH_ASSIGN_OR_RETURN(Params p, Params::Bind(name, {}, args));
  (void)p;
  if (name == "items") return Items(dict);
  if (name != "keys" && name != "values") {
    return ArgumentError("'dict object' has no attribute '", name, "'");
  }
  List items;
  for (const auto& [key, item] : dict.AsDict()) {
    items.push_back(name == "keys" ? Value::String(key) : item);
  }
  return Value::MakeList(std::move(items));
}

}  // namespace

absl::StatusOr<Value> CallMethod(const Value& object, absl::string_view name,
                                 const CallArgs& args, size_t limit) {
  switch (object.kind()) {
    case Kind::kUndefined:
      return ArgumentError(object.AsString());
    case Kind::kString:
      return StringMethod(object.AsString(), name, args, limit);
    case Kind::kDict:
      return DictMethod(object, name, args);
    default:
      return ArgumentError("'", object.TypeName(), " object' has no method '",
                           name, "' here");
  }
}

// ----------------------------------------------------- global functions --

bool IsGlobalFunction(absl::string_view name) {
  return name == "raise_exception" || name == "range" || name == "namespace" ||
         name == "dict";
}

absl::StatusOr<Value> CallGlobalFunction(absl::string_view name,
                                         const CallArgs& args) {
  if (name == "raise_exception") {
    MOH_ASSIGN_OR_RETURN(Params p, Params::Bind(name, {"message"}, args));
    std::string message;
    AppendStr(p.Get(0, Value::String("")), 64 << 10, &message);
    return absl::AbortedError(message);
  }
  if (name == "range") {
    if (!args.keyword.empty() || args.positional.empty() ||
        args.positional.size() > 3) {
      return ArgumentError("range() takes 1 to 3 integer arguments");
    }
    int64_t bounds[3] = {0, 0, 1};
    for (size_t i = 0; i < args.positional.size(); ++i) {
      MOH_ASSIGN_OR_RETURN(bounds[args.positional.size() == 1 ? 1 : i],
                           ToInt(args.positional[i], "range() argument"));
    }
    const auto [start, stop, step] = bounds;
    if (step == 0) return ArgumentError("range() arg 3 must not be zero");
    const double count =
        std::max(0.0, std::ceil((static_cast<double>(stop) - start) / step));
    if (count > static_cast<double>(kMaxListItems)) {
      return ArgumentError("range() of more than ", kMaxListItems, " items");
    }
    List items;
    for (int64_t i = 0; i < static_cast<int64_t>(count); ++i) {
      items.push_back(Value::Int(start + i * step));
    }
    return Value::MakeList(std::move(items));
  }
  // namespace(...) and dict(...): a mapping positional argument, then
  // keyword arguments.
  if (args.positional.size() > 1 ||
      (args.positional.size() == 1 && !args.positional[0].is(Kind::kDict))) {
    return ArgumentError(name, "() takes one mapping and keyword arguments");
  }
  Dict items = args.positional.empty() ? Dict() : args.positional[0].AsDict();
  for (const auto& [key, value] : args.keyword) SetItem(&items, key, value);
  if (name == "dict") return Value::MakeDict(std::move(items));
  for (const auto& [key, value] : items) {
    if (HoldsNamespace(value)) {
      return ArgumentError("a namespace cannot hold a namespace");
    }
  }
  return Value::MakeNamespace(std::move(items));
}

// -------------------------------------------------------------- helpers --

absl::StatusOr<bool> Contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Kind::kString:
      if (!item.is(Kind::kString)) {
        return ArgumentError(
            "'in <string>' requires string as left operand, not ",
            item.TypeName());
      }
      return container.AsString().find(item.AsString()) != std::string::npos;
    case Kind::kList:
      return std::any_of(container.AsList().begin(), container.AsList().end(),
                         [&](const Value& v) { return Equals(v, item); });
    case Kind::kDict:
      if ((item.is(Kind::kList) && !item.is_tuple()) || item.is(Kind::kDict)) {
        return ArgumentError("unhashable type: '", item.TypeName(), "'");
      }
      return item.is(Kind::kString) &&
             container.Find(item.AsString()) != nullptr;
    case Kind::kUndefined:
      return false;
    default:
      return ArgumentError("argument of type '", container.TypeName(),
                           "' is not iterable");
  }
}

absl::StatusOr<List> Iterate(const Value& value) {
  switch (value.kind()) {
    case Kind::kList:
      return value.AsList();
    case Kind::kDict: {
      List keys;
      for (const auto& [key, item] : value.AsDict()) {
        keys.push_back(Value::String(key));
      }
      return keys;
    }
    case Kind::kString: {
      List chars;
      for (char32_t c : DecodeUtf8(value.AsString())) {
        std::string s;
        AppendUtf8(c, &s);
        chars.push_back(Value::String(std::move(s)));
      }
      return chars;
    }
    case Kind::kUndefined:
      return List();
    default:
      return ArgumentError("'", value.TypeName(), "' object is not iterable");
  }
}

bool HoldsNamespace(const Value& value) {
  switch (value.kind()) {
    case Kind::kNamespace:
      return true;
    case Kind::kList:
      return std::any_of(value.AsList().begin(), value.AsList().end(),
                         HoldsNamespace);
    case Kind::kDict:
      return std::any_of(
          value.AsDict().begin(), value.AsDict().end(),
          [](const auto& item) { return HoldsNamespace(item.second); });
    default:
      return false;
  }
}

}  // namespace jinja
}  // namespace moh
