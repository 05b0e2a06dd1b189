#include "model/tokenizer/jinja/filters.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "model/tokenizer/jinja/builtins.h"
#include "model/tokenizer/jinja/operators.h"
#include "model/tokenizer/jinja/text.h"

namespace moh {
namespace jinja {
namespace {

using Kind = Value::Kind;

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
      return ArgumentError("object of type '", value.TypeName(),
                           "' has no len()");
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
    // More than `limit` spaces can never be written (a value that needs no
    // line break writes none): the string stops at limit + 1.
    options.indent = std::string(
        std::clamp<int64_t>(indent.AsInt(), 0, static_cast<int64_t>(limit) + 1),
        ' ');
  } else if (indent.is(Kind::kString)) {
    options.indent = indent.AsString();
  } else if (!indent.is(Kind::kNone)) {
    return ArgumentError("tojson(): indent must be an integer or a string");
  }
  const Value separators = p.Get(2);
  if (!separators.is(Kind::kNone)) {
    if (!separators.is(Kind::kList) || separators.AsList().size() != 2 ||
        !separators.AsList()[0].is(Kind::kString) ||
        !separators.AsList()[1].is(Kind::kString)) {
      return ArgumentError("tojson(): separators must be two strings");
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
  if (value.is(Kind::kUndefined)) return ArgumentError(value.AsString());
  MOH_ASSIGN_OR_RETURN(Params p,
                       Params::Bind("int", {"default", "base"}, args));
  const Value fallback = p.Get(0, Value::Int(0));
  MOH_ASSIGN_OR_RETURN(const int64_t base,
                       ToInt(p.Get(1, Value::Int(10)), "int(): base"));
  if (base < 2 || base > 36) {
    return ArgumentError("int(): base must be in 2..36");
  }
  switch (value.kind()) {
    case Kind::kInt:
    case Kind::kBool:
      return Value::Int(value.AsInt());
    case Kind::kFloat: {
      const double d = value.AsDouble();
      if (!std::isfinite(d) || std::fabs(d) >= 9.2e18) {
        return ArgumentError("cannot convert float ", FloatRepr(d),
                             " to integer");
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
  if (value.is(Kind::kUndefined)) return ArgumentError(value.AsString());
  if (value.IsNumber()) return Value::Float(value.AsDouble());
  if (value.is(Kind::kString)) {
    if (auto d = ParseFloat(value.AsString())) return Value::Float(*d);
  }
  return p.Get(0, Value::Float(0.0));
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
    if (value.is(Kind::kFloat)) {
      return Value::Float(std::fabs(value.AsDouble()));
    }
    if (value.IsNumber() && value.AsInt() != INT64_MIN) {
      return Value::Int(std::abs(value.AsInt()));
    }
    return ArgumentError("bad operand type for abs(): '", value.TypeName(),
                         "'");
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

// The value of `attribute` of `item`: "a.b" looks up a then b, a part of
// digits indexes a list (jinja2's attribute getter).
absl::StatusOr<Value> AttributeOf(const Value& item,
                                  const std::string& attribute) {
  Value value = item;
  for (absl::string_view part : absl::StrSplit(attribute, '.')) {
    Value key = Value::String(std::string(part));
    int64_t index;
    if (!part.empty() &&
        std::all_of(part.begin(), part.end(),
                    [](char c) { return c >= '0' && c <= '9'; }) &&
        absl::SimpleAtoi(part, &index)) {
      key = Value::Int(index);
    }
    MOH_ASSIGN_OR_RETURN(value, GetItem(value, key));
  }
  return value;
}

// select/reject(test, args...) and selectattr/rejectattr(attribute, test,
// args...): the items whose value passes the test (truthy without one).
absl::StatusOr<Value> SelectOrReject(absl::string_view name, const Value& value,
                                     const CallArgs& args) {
  if (!args.keyword.empty()) {
    return ArgumentError(name, "() takes no keyword arguments");
  }
  const bool by_attribute = absl::EndsWith(name, "attr");
  const bool keep_passing = absl::StartsWith(name, "select");
  size_t next = 0;
  std::string attribute;
  if (by_attribute) {
    if (args.positional.empty() || !args.positional[0].is(Kind::kString)) {
      return ArgumentError(name, "() needs an attribute name");
    }
    attribute = args.positional[next++].AsString();
  }
  std::string test;
  if (next < args.positional.size()) {
    if (!args.positional[next].is(Kind::kString)) {
      return ArgumentError(name, "(): the test must be named by a string");
    }
    test = args.positional[next++].AsString();
  }
  CallArgs test_args;
  test_args.positional.assign(args.positional.begin() + next,
                              args.positional.end());
  MOH_ASSIGN_OR_RETURN(const List items, Iterate(value));
  List kept;
  for (const Value& item : items) {
    Value tested = item;
    if (by_attribute) {
      MOH_ASSIGN_OR_RETURN(tested, AttributeOf(item, attribute));
    }
    bool passes = tested.Truthy();
    if (!test.empty()) {
      MOH_ASSIGN_OR_RETURN(passes, ApplyTest(test, tested, test_args));
    }
    if (passes == keep_passing) kept.push_back(item);
  }
  return Value::MakeList(std::move(kept));
}

// map(attribute=name[, default=value]) or map(filter, args...).
absl::StatusOr<Value> Map(const Value& value, const CallArgs& args,
                          size_t limit) {
  MOH_ASSIGN_OR_RETURN(const List items, Iterate(value));
  List mapped;
  if (args.positional.empty()) {
    MOH_ASSIGN_OR_RETURN(Params p,
                         Params::Bind("map", {"attribute", "default"}, args));
    if (!p.Get(0).is(Kind::kString)) {
      return ArgumentError("map() needs a filter name or attribute=");
    }
    for (const Value& item : items) {
      MOH_ASSIGN_OR_RETURN(Value v, AttributeOf(item, p.Get(0).AsString()));
      if (v.is(Kind::kUndefined) && p.Has(1)) v = p.Get(1);
      mapped.push_back(std::move(v));
    }
    return Value::MakeList(std::move(mapped));
  }
  if (!args.positional[0].is(Kind::kString)) {
    return ArgumentError("map(): the filter must be named by a string");
  }
  CallArgs filter_args = args;
  filter_args.positional.erase(filter_args.positional.begin());
  for (const Value& item : items) {
    MOH_ASSIGN_OR_RETURN(Value v, ApplyFilter(args.positional[0].AsString(),
                                              item, filter_args, limit));
    mapped.push_back(std::move(v));
  }
  return Value::MakeList(std::move(mapped));
}

// Python's sorted() on `keys`, case-insensitive for strings unless
// `case_sensitive`; the order of `items` (one per key) follows.
absl::StatusOr<List> Sorted(List items, const List& keys, bool case_sensitive,
                            bool reverse) {
  std::vector<Value> sort_keys;
  for (const Value& key : keys) {
    sort_keys.push_back(key.is(Kind::kString) && !case_sensitive
                            ? Value::String(Lower(key.AsString()))
                            : key);
  }
  std::vector<size_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  absl::Status error;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    absl::StatusOr<int> c = Compare(sort_keys[a], sort_keys[b]);
    if (!c.ok()) {
      error.Update(c.status());
      return false;
    }
    return reverse ? *c > 0 : *c < 0;
  });
  MOH_RETURN_IF_ERROR(error);
  List sorted;
  for (size_t i : order) sorted.push_back(std::move(items[i]));
  return sorted;
}

// sort(reverse, case_sensitive, attribute) and dictsort(case_sensitive, by,
// reverse).
absl::StatusOr<Value> Sort(absl::string_view name, const Value& value,
                           const CallArgs& args) {
  List items, keys;
  bool case_sensitive, reverse;
  if (name == "dictsort") {
    MOH_ASSIGN_OR_RETURN(
        Params p,
        Params::Bind(name, {"case_sensitive", "by", "reverse"}, args));
    case_sensitive = p.Get(0, Value::Bool(false)).Truthy();
    reverse = p.Get(2, Value::Bool(false)).Truthy();
    const Value by = p.Get(1, Value::String("key"));
    if (!by.is(Kind::kString) ||
        (by.AsString() != "key" && by.AsString() != "value")) {
      return ArgumentError("dictsort(): by must be 'key' or 'value'");
    }
    MOH_ASSIGN_OR_RETURN(const Value pairs, Items(value));
    for (const Value& pair : pairs.AsList()) {
      items.push_back(pair);
      keys.push_back(pair.AsList()[by.AsString() == "key" ? 0 : 1]);
    }
  } else {
    MOH_ASSIGN_OR_RETURN(
        Params p,
        Params::Bind(name, {"reverse", "case_sensitive", "attribute"}, args));
    reverse = p.Get(0, Value::Bool(false)).Truthy();
    case_sensitive = p.Get(1, Value::Bool(false)).Truthy();
    MOH_ASSIGN_OR_RETURN(items, Iterate(value));
    for (const Value& item : items) {
      Value key = item;
      if (p.Get(2).is(Kind::kString)) {
        MOH_ASSIGN_OR_RETURN(key, AttributeOf(item, p.Get(2).AsString()));
      }
      keys.push_back(std::move(key));
    }
  }
  MOH_ASSIGN_OR_RETURN(List sorted,
                       Sorted(std::move(items), keys, case_sensitive, reverse));
  return Value::MakeList(std::move(sorted));
}

}  // namespace

absl::StatusOr<Value> ApplyFilter(absl::string_view name, const Value& value,
                                  const CallArgs& args, size_t limit) {
  if (name == "tojson") return ToJson(value, args, limit);
  if (name == "select" || name == "reject" || name == "selectattr" ||
      name == "rejectattr") {
    return SelectOrReject(name, value, args);
  }
  if (name == "map") return Map(value, args, limit);
  if (name == "sort" || name == "dictsort") return Sort(name, value, args);
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
    MOH_ASSIGN_OR_RETURN(const std::string separator,
                         ToStr(p.Get(0, Value::String("")), limit));
    MOH_ASSIGN_OR_RETURN(List items, Iterate(value));
    if (!p.Get(1).is(Kind::kNone)) {  // join(d, attribute): item.attribute
      MOH_ASSIGN_OR_RETURN(const std::string attribute, ToStr(p.Get(1), limit));
      for (Value& item : items) {
        MOH_ASSIGN_OR_RETURN(item, AttributeOf(item, attribute));
      }
    }
    std::string out;
    for (size_t i = 0; i < items.size(); ++i) {
      if (i > 0) out += separator;
      if (!AppendStr(items[i], limit, &out) || out.size() > limit) {
        return ArgumentError("string longer than ", limit, " bytes");
      }
    }
    return Value::String(std::move(out));
  }
  if (name == "replace") {
    MOH_ASSIGN_OR_RETURN(
        Params p, Params::Bind("replace", {"old", "new", "count"}, args));
    if (!p.Has(0) || !p.Has(1)) {
      return ArgumentError("replace() needs old and new");
    }
    MOH_ASSIGN_OR_RETURN(const std::string s, ToStr(value, limit));
    MOH_ASSIGN_OR_RETURN(const std::string old, ToStr(p.Get(0), limit));
    MOH_ASSIGN_OR_RETURN(const std::string replacement, ToStr(p.Get(1), limit));
    int64_t count = -1;
    if (!p.Get(2).is(Kind::kNone)) {
      MOH_ASSIGN_OR_RETURN(count, ToInt(p.Get(2), "replace(): count"));
    }
    return MakeCheckedString(PyReplace(s, old, replacement, count), limit);
  }
  MOH_ASSIGN_OR_RETURN(std::optional<Value> result,
                       ApplySimpleFilter(name, value, limit));
  if (!result) return ArgumentError("no filter named '", name, "'");
  if (!args.positional.empty() || !args.keyword.empty()) {
    return ArgumentError(name, "() takes no arguments");
  }
  return *std::move(result);
}

}  // namespace jinja
}  // namespace moh
