#include "model/tokenizer/jinja_builtins.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "model/tokenizer/jinja_text.h"

namespace moh {
namespace jinja {
namespace {

using Kind = Value::Kind;

template <typename... Parts>
absl::Status Error(const Parts&... parts) {
  return absl::InvalidArgumentError(absl::StrCat(parts...));
}

// The arguments of a call bound to its parameters, as Python binds them.
class Params {
 public:
  static absl::StatusOr<Params> Bind(absl::string_view function,
                                     std::vector<absl::string_view> names,
                                     const CallArgs& args) {
    Params params;
    params.values_.resize(names.size());
    if (args.positional.size() > names.size()) {
      return Error(function, "() takes at most ", names.size(),
                   " argument(s), got ", args.positional.size());
    }
    for (size_t i = 0; i < args.positional.size(); ++i) {
      params.values_[i] = args.positional[i];
    }
    for (const auto& [name, value] : args.keyword) {
      auto it = std::find(names.begin(), names.end(), name);
      if (it == names.end() || params.values_[it - names.begin()]) {
        return Error(function, "() got an unexpected keyword argument '", name,
                     "'");
      }
      params.values_[it - names.begin()] = value;
    }
    return params;
  }

  // Argument `i`, or `fallback` when it was not given.
  Value Get(size_t i, Value fallback = Value::None()) const {
    return values_[i] ? *values_[i] : fallback;
  }
  bool Has(size_t i) const { return values_[i].has_value(); }

 private:
  std::vector<std::optional<Value>> values_;
};

absl::StatusOr<std::string> ToStr(const Value& value, size_t limit) {
  std::string out;
  if (!AppendStr(value, limit, &out)) {
    return Error("string longer than ", limit, " bytes");
  }
  return out;
}

absl::StatusOr<int64_t> ToInt(const Value& value, absl::string_view what) {
  if (value.is(Kind::kInt) || value.is(Kind::kBool)) return value.AsInt();
  return Error(what, " must be an integer, not '", value.TypeName(), "'");
}

// A string argument, or nullopt for none/absent.
absl::StatusOr<std::optional<std::string>> OptionalString(
    const Value& value, absl::string_view what) {
  if (value.is(Kind::kNone)) return std::nullopt;
  if (!value.is(Kind::kString)) {
    return Error(what, " must be a string, not '", value.TypeName(), "'");
  }
  return value.AsString();
}

absl::StatusOr<Value> MakeCheckedList(List items) {
  if (items.size() > kMaxListItems) {
    return Error("list longer than ", kMaxListItems, " items");
  }
  return Value::MakeList(std::move(items));
}

absl::StatusOr<Value> MakeCheckedString(std::string s, size_t limit) {
  if (s.size() > limit) return Error("string longer than ", limit, " bytes");
  return Value::String(std::move(s));
}

// --------------------------------------------------------- str helpers --

// jinja2's title filter: words begin after -, whitespace, (, {, [ or <.
std::string JinjaTitle(absl::string_view text) {
  std::vector<char32_t> chars = DecodeUtf8(text);
  bool word_start = true;
  for (char32_t& c : chars) {
    const bool separator =
        IsSpace(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
    c = word_start ? ToUpper(c) : ToLower(c);
    word_start = separator;
  }
  return EncodeUtf8(chars);
}

// str.replace(old, new, count); count < 0: all.
std::string Replace(const std::string& s, const std::string& old,
                    const std::string& replacement, int64_t count) {
  std::string out;
  if (old.empty()) {  // Python inserts `replacement` around every character.
    const std::vector<char32_t> chars = DecodeUtf8(s);
    for (size_t i = 0; i <= chars.size(); ++i) {
      if (count < 0 || static_cast<int64_t>(i) < count) out += replacement;
      if (i < chars.size()) AppendUtf8(chars[i], &out);
    }
    return out;
  }
  size_t pos = 0;
  for (int64_t n = 0; count < 0 || n < count; ++n) {
    const size_t found = s.find(old, pos);
    if (found == std::string::npos) break;
    out.append(s, pos, found - pos);
    out += replacement;
    pos = found + old.size();
  }
  out.append(s, pos, std::string::npos);
  return out;
}

// str.split(sep, maxsplit).
absl::StatusOr<Value> Split(const std::string& s,
                            const std::optional<std::string>& sep,
                            int64_t maxsplit) {
  List parts;
  if (sep) {
    if (sep->empty()) return Error("split(): empty separator");
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

// Python's int(text, base): whitespace around, a sign, digits with single
// underscores between them.
std::optional<int64_t> ParseInt(const std::string& text, int base) {
  const std::string s = Strip(text, nullptr, StripSide::kBoth);
  size_t i = 0;
  bool negative = false;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) negative = s[i++] == '-';
  if (i == s.size()) return std::nullopt;
  int64_t value = 0;
  for (bool digit_before = false; i < s.size(); ++i) {
    if (s[i] == '_' && digit_before && i + 1 < s.size() && s[i + 1] != '_') {
      continue;
    }
    const char c = static_cast<char>(std::tolower(s[i]));
    const int d = c >= '0' && c <= '9'     ? c - '0'
                  : (c >= 'a' && c <= 'z') ? c - 'a' + 10
                                           : 99;
    if (d >= base) return std::nullopt;
    if (value > (INT64_MAX - d) / base) return std::nullopt;
    value = value * base + d;
    digit_before = true;
  }
  return negative ? -value : value;
}

// Python's float(text) for decimal text, "inf" and "nan".
std::optional<double> ParseFloat(const std::string& text) {
  const std::string s = Strip(text, nullptr, StripSide::kBoth);
  if (s.empty() || s.find_first_of("xXpP_") != std::string::npos) {
    return std::nullopt;
  }
  char* end = nullptr;
  const double value = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size()) return std::nullopt;
  return value;
}

// ------------------------------------------------------------- filters --

absl::StatusOr<Value> Length(const Value& value) {
  switch (value.kind()) {
    case Kind::kString:
      return Value::Int(CodePointCount(value.AsString()));
    case Kind::kList:
      return Value::Int(value.AsList().size());
    case Kind::kDict:
      return Value::Int(value.AsDict().size());
    case Kind::kUndefined:
      return Value::Int(0);
    default:
      return Error("object of type '", value.TypeName(), "' has no len()");
  }
}

absl::StatusOr<Value> ToJson(const Value& value, const CallArgs& args,
                             size_t limit) {
  MOH_ASSIGN_OR_RETURN(Params p, Params::Bind("tojson",
                                              {"ensure_ascii", "indent",
                                               "separators", "sort_keys"},
                                              args));
  JsonOptions options;
  options.ensure_ascii = p.Get(0, Value::Bool(false)).Truthy();
  const Value indent = p.Get(1);
  if (indent.is(Kind::kInt)) {
    options.indent = std::string(std::max<int64_t>(0, indent.AsInt()), ' ');
  } else if (indent.is(Kind::kString)) {
    options.indent = indent.AsString();
  } else if (!indent.is(Kind::kNone)) {
    return Error("tojson(): indent must be an integer or a string");
  }
  const Value separators = p.Get(2);
  if (!separators.is(Kind::kNone)) {
    if (!separators.is(Kind::kList) || separators.AsList().size() != 2 ||
        !separators.AsList()[0].is(Kind::kString) ||
        !separators.AsList()[1].is(Kind::kString)) {
      return Error("tojson(): separators must be two strings");
    }
    options.separators.emplace(separators.AsList()[0].AsString(),
                               separators.AsList()[1].AsString());
  }
  options.sort_keys = p.Get(3, Value::Bool(false)).Truthy();
  std::string out;
  MOH_RETURN_IF_ERROR(AppendJson(value, options, limit, &out));
  return Value::String(std::move(out));
}

absl::StatusOr<Value> FirstOrLast(const Value& value, bool first) {
  MOH_ASSIGN_OR_RETURN(const List items, Iterate(value));
  if (items.empty()) {
    return Value::Undefined(absl::StrCat("No ", first ? "first" : "last",
                                         " item, sequence was empty."));
  }
  return first ? items.front() : items.back();
}

absl::StatusOr<Value> IntFilter(const Value& value, const CallArgs& args) {
  MOH_ASSIGN_OR_RETURN(Params p,
                       Params::Bind("int", {"default", "base"}, args));
  const Value fallback = p.Get(0, Value::Int(0));
  MOH_ASSIGN_OR_RETURN(const int64_t base,
                       ToInt(p.Get(1, Value::Int(10)), "int(): base"));
  if (base < 2 || base > 36) return Error("int(): base must be in 2..36");
  switch (value.kind()) {
    case Kind::kInt:
    case Kind::kBool:
      return Value::Int(value.AsInt());
    case Kind::kFloat: {
      const double d = value.AsDouble();
      if (!std::isfinite(d) || std::fabs(d) >= 9.2e18) {
        return Error("cannot convert float ", FloatRepr(d), " to integer");
      }
      return Value::Int(static_cast<int64_t>(d));
    }
    case Kind::kString: {
      if (auto i = ParseInt(value.AsString(), static_cast<int>(base))) {
        return Value::Int(*i);
      }
      const std::optional<double> d = ParseFloat(value.AsString());
      if (d && std::isfinite(*d) && std::fabs(*d) < 9.2e18) {
        return Value::Int(static_cast<int64_t>(*d));
      }
      return fallback;
    }
    default:
      return fallback;
  }
}

absl::StatusOr<Value> FloatFilter(const Value& value, const CallArgs& args) {
  MOH_ASSIGN_OR_RETURN(Params p, Params::Bind("float", {"default"}, args));
  if (value.IsNumber()) return Value::Float(value.AsDouble());
  if (value.is(Kind::kString)) {
    if (auto d = ParseFloat(value.AsString())) return Value::Float(*d);
  }
  return p.Get(0, Value::Float(0.0));
}

absl::StatusOr<Value> Items(const Value& value) {
  if (value.is(Kind::kUndefined)) return Value::MakeList({});
  if (!value.is(Kind::kDict)) {
    return Error("can only get item pairs from a mapping, not '",
                 value.TypeName(), "'");
  }
  List pairs;
  for (const auto& [key, item] : value.AsDict()) {
    pairs.push_back(Value::MakeList({Value::String(key), item}));
  }
  return Value::MakeList(std::move(pairs));
}

// Filters taking no argument but the value.
absl::StatusOr<std::optional<Value>> ApplySimpleFilter(absl::string_view name,
                                                       const Value& value,
                                                       size_t limit) {
  if (name == "length" || name == "count") return Length(value);
  if (name == "first" || name == "last") {
    return FirstOrLast(value, name == "first");
  }
  if (name == "items") return Items(value);
  if (name == "list") {
    MOH_ASSIGN_OR_RETURN(List items, Iterate(value));
    return Value::MakeList(std::move(items));
  }
  if (name == "abs") {
    if (value.is(Kind::kFloat))
      return Value::Float(std::fabs(value.AsDouble()));
    if (value.IsNumber() && value.AsInt() != INT64_MIN) {
      return Value::Int(std::abs(value.AsInt()));
    }
    return Error("bad operand type for abs(): '", value.TypeName(), "'");
  }
  static constexpr absl::string_view kStringFilters[] = {
      "upper", "lower", "title", "capitalize", "string"};
  if (std::find(std::begin(kStringFilters), std::end(kStringFilters), name) ==
      std::end(kStringFilters)) {
    return std::nullopt;
  }
  MOH_ASSIGN_OR_RETURN(const std::string s, ToStr(value, limit));
  if (name == "upper") return Value::String(Upper(s));
  if (name == "lower") return Value::String(Lower(s));
  if (name == "title") return Value::String(JinjaTitle(s));
  if (name == "capitalize") return Value::String(Capitalize(s));
  return Value::String(s);
}

}  // namespace

absl::StatusOr<Value> ApplyFilter(absl::string_view name, const Value& value,
                                  const CallArgs& args, size_t limit) {
  if (name == "tojson") return ToJson(value, args, limit);
  if (name == "int") return IntFilter(value, args);
  if (name == "float") return FloatFilter(value, args);
  if (name == "default" || name == "d") {
    MOH_ASSIGN_OR_RETURN(
        Params p, Params::Bind(name, {"default_value", "boolean"}, args));
    const bool boolean = p.Get(1, Value::Bool(false)).Truthy();
    if (value.is(Kind::kUndefined) || (boolean && !value.Truthy())) {
      return p.Get(0, Value::String(""));
    }
    return value;
  }
  if (name == "trim") {
    MOH_ASSIGN_OR_RETURN(Params p, Params::Bind("trim", {"chars"}, args));
    MOH_ASSIGN_OR_RETURN(const auto chars,
                         OptionalString(p.Get(0), "trim(): chars"));
    MOH_ASSIGN_OR_RETURN(const std::string s, ToStr(value, limit));
    return Value::String(Strip(s, chars ? &*chars : nullptr, StripSide::kBoth));
  }
  if (name == "join") {
    MOH_ASSIGN_OR_RETURN(Params p,
                         Params::Bind("join", {"d", "attribute"}, args));
    if (p.Has(1)) return Error("join(): attribute= is not supported");
    MOH_ASSIGN_OR_RETURN(const std::string separator,
                         ToStr(p.Get(0, Value::String("")), limit));
    MOH_ASSIGN_OR_RETURN(const List items, Iterate(value));
    std::string out;
    for (size_t i = 0; i < items.size(); ++i) {
      if (i > 0) out += separator;
      if (!AppendStr(items[i], limit, &out) || out.size() > limit) {
        return Error("string longer than ", limit, " bytes");
      }
    }
    return Value::String(std::move(out));
  }
  if (name == "replace") {
    MOH_ASSIGN_OR_RETURN(
        Params p, Params::Bind("replace", {"old", "new", "count"}, args));
    if (!p.Has(0) || !p.Has(1)) return Error("replace() needs old and new");
    MOH_ASSIGN_OR_RETURN(const std::string s, ToStr(value, limit));
    MOH_ASSIGN_OR_RETURN(const std::string old, ToStr(p.Get(0), limit));
    MOH_ASSIGN_OR_RETURN(const std::string replacement, ToStr(p.Get(1), limit));
    int64_t count = -1;
    if (!p.Get(2).is(Kind::kNone)) {
      MOH_ASSIGN_OR_RETURN(count, ToInt(p.Get(2), "replace(): count"));
    }
    return MakeCheckedString(Replace(s, old, replacement, count), limit);
  }
  MOH_ASSIGN_OR_RETURN(std::optional<Value> result,
                       ApplySimpleFilter(name, value, limit));
  if (!result) return Error("no filter named '", name, "'");
  if (!args.positional.empty() || !args.keyword.empty()) {
    return Error(name, "() takes no arguments");
  }
  return *std::move(result);
}

// --------------------------------------------------------------- tests --

absl::StatusOr<bool> ApplyTest(absl::string_view name, const Value& value,
                               const CallArgs& args) {
  const auto arg = [&]() -> absl::StatusOr<Value> {
    if (args.positional.size() != 1 || !args.keyword.empty()) {
      return Error("test '", name, "' takes one argument");
    }
    return args.positional[0];
  };
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
  if (name == "odd" || name == "even" || name == "divisibleby") {
    MOH_ASSIGN_OR_RETURN(const int64_t n, ToInt(value, name));
    if (name == "divisibleby") {
      MOH_ASSIGN_OR_RETURN(const Value divisor, arg());
      MOH_ASSIGN_OR_RETURN(const int64_t d, ToInt(divisor, "divisibleby"));
      if (d == 0) return Error("integer modulo by zero");
      return d == -1 || n % d == 0;
    }
    return (n % 2 != 0) == (name == "odd");
  }
  if (name == "eq" || name == "equalto" || name == "==" || name == "sameas") {
    MOH_ASSIGN_OR_RETURN(const Value other, arg());
    if (name == "sameas" && other.kind() != value.kind()) return false;
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
  return Error("no test named '", name, "'");
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
        return Error(name, "() takes a string or a tuple of strings");
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
    if (!old || !rep) return Error("replace() needs two strings");
    MOH_ASSIGN_OR_RETURN(const int64_t count,
                         ToInt(p.Get(2, Value::Int(-1)), "replace(): count"));
    return MakeCheckedString(Replace(s, *old, *rep, count), limit);
  }
  if (name == "join") {
    MOH_ASSIGN_OR_RETURN(Params p, Params::Bind(name, {"iterable"}, args));
    MOH_ASSIGN_OR_RETURN(const List items, Iterate(p.Get(0)));
    std::vector<std::string> parts;
    for (const Value& item : items) {
      if (!item.is(Kind::kString)) {
        return Error("join(): expected str items, found '", item.TypeName(),
                     "'");
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
  return Error("'str object' has no attribute '", name, "'");
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
    return Error("'dict object' has no attribute '", name, "'");
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
      return Error(object.AsString());
    case Kind::kString:
      return StringMethod(object.AsString(), name, args, limit);
    case Kind::kDict:
      return DictMethod(object, name, args);
    default:
      return Error("'", object.TypeName(), " object' has no method '", name,
                   "' here");
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
      return Error("range() takes 1 to 3 integer arguments");
    }
    int64_t bounds[3] = {0, 0, 1};
    for (size_t i = 0; i < args.positional.size(); ++i) {
      MOH_ASSIGN_OR_RETURN(bounds[args.positional.size() == 1 ? 1 : i],
                           ToInt(args.positional[i], "range() argument"));
    }
    const auto [start, stop, step] = bounds;
    if (step == 0) return Error("range() arg 3 must not be zero");
    const double count =
        std::max(0.0, std::ceil((static_cast<double>(stop) - start) / step));
    if (count > static_cast<double>(kMaxListItems)) {
      return Error("range() of more than ", kMaxListItems, " items");
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
    return Error(name, "() takes one mapping and keyword arguments");
  }
  Dict items = args.positional.empty() ? Dict() : args.positional[0].AsDict();
  for (const auto& [key, value] : args.keyword) {
    auto it = std::find_if(items.begin(), items.end(),
                           [&](const auto& item) { return item.first == key; });
    if (it != items.end()) {
      it->second = value;
    } else {
      items.emplace_back(key, value);
    }
  }
  if (name == "dict") return Value::MakeDict(std::move(items));
  for (const auto& [key, value] : items) {
    if (HoldsNamespace(value))
      return Error("a namespace cannot hold a namespace");
  }
  return Value::MakeNamespace(std::move(items));
}

// -------------------------------------------------------------- helpers --

absl::StatusOr<bool> Contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Kind::kString:
      if (!item.is(Kind::kString)) {
        return Error("'in <string>' requires string as left operand, not ",
                     item.TypeName());
      }
      return container.AsString().find(item.AsString()) != std::string::npos;
    case Kind::kList:
      return std::any_of(container.AsList().begin(), container.AsList().end(),
                         [&](const Value& v) { return Equals(v, item); });
    case Kind::kDict:
      return item.is(Kind::kString) &&
             container.Find(item.AsString()) != nullptr;
    case Kind::kUndefined:
      return false;
    default:
      return Error("argument of type '", container.TypeName(),
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
      return Error("'", value.TypeName(), "' object is not iterable");
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
