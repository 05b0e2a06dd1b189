#include "model/tokenizer/jinja/value.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "model/tokenizer/jinja/text.h"

namespace moh {
namespace jinja {

void SetItem(Dict* dict, const std::string& key, Value value) {
  for (auto& [k, v] : *dict) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  dict->emplace_back(key, std::move(value));
}

// ------------------------------------------------------------------ Value --

Value::Value() : kind_(Kind::kUndefined) {
  static const auto* const kReason = new std::shared_ptr<const std::string>(
      std::make_shared<const std::string>("value is undefined"));
  string_ = *kReason;
}

Value Value::Undefined(std::string why) {
  Value v(Kind::kUndefined);
  v.string_ = std::make_shared<const std::string>(std::move(why));
  return v;
}

Value Value::None() {
  Value v(Kind::kNone);
  return v;
}

Value Value::Bool(bool value) {
  Value v(Kind::kBool);
  v.bool_ = value;
  v.int_ = value ? 1 : 0;
  return v;
}

Value Value::Int(int64_t value) {
  Value v(Kind::kInt);
  v.int_ = value;
  return v;
}

Value Value::Float(double value) {
  Value v(Kind::kFloat);
  v.float_ = value;
  return v;
}

Value Value::String(std::string value) {
  Value v(Kind::kString);
  v.string_ = std::make_shared<const std::string>(std::move(value));
  return v;
}

Value Value::MakeSequence(List items, bool tuple) {
  int depth = 0;
  for (const Value& item : items) depth = std::max(depth, item.depth());
  Value v(Kind::kList);
  v.list_ = std::make_shared<const ListData>(
      ListData{std::move(items), depth + 1, tuple});
  return v;
}

Value Value::MakeList(List items) {
  return MakeSequence(std::move(items), /*tuple=*/false);
}

Value Value::MakeTuple(List items) {
  return MakeSequence(std::move(items), /*tuple=*/true);
}

Value Value::MakeDict(Dict items) {
  int depth = 0;
  for (const auto& [key, item] : items) depth = std::max(depth, item.depth());
  Value v(Kind::kDict);
  v.dict_ =
      std::make_shared<const DictData>(DictData{std::move(items), depth + 1});
  return v;
}

Value Value::MakeNamespace(Dict attributes) {
  Value v(Kind::kNamespace);
  v.namespace_ = std::make_shared<Dict>(std::move(attributes));
  return v;
}

Value Value::Function(std::string name) {
  Value v(Kind::kFunction);
  v.string_ = std::make_shared<const std::string>(std::move(name));
  return v;
}

bool Value::IsNumber() const {
  return kind_ == Kind::kBool || kind_ == Kind::kInt || kind_ == Kind::kFloat;
}

double Value::AsDouble() const {
  return kind_ == Kind::kFloat ? float_ : static_cast<double>(int_);
}

const Dict& Value::AsDict() const {
  return kind_ == Kind::kNamespace ? *namespace_ : dict_->items;
}

const Value* Value::Find(absl::string_view key) const {
  if (kind_ != Kind::kDict && kind_ != Kind::kNamespace) return nullptr;
  for (const auto& [k, v] : AsDict()) {
    if (k == key) return &v;
  }
  return nullptr;
}

int Value::depth() const {
  switch (kind_) {
    case Kind::kList:
      return list_->depth;
    case Kind::kDict:
      return dict_->depth;
    case Kind::kNamespace: {
      // Namespaces hold no namespaces (the renderer refuses it), so this
      // recursion is one level deep.
      int depth = 0;
      for (const auto& [k, v] : *namespace_) depth = std::max(depth, v.depth());
      return depth + 1;
    }
    default:
      return 0;
  }
}

bool Value::Truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
    case Kind::kInt:
      return int_ != 0;
    case Kind::kFloat:
      return float_ != 0;
    case Kind::kString:
      return !string_->empty();
    case Kind::kList:
      return !list_->items.empty();
    case Kind::kDict:
      return !dict_->items.empty();
    case Kind::kNamespace:
    case Kind::kFunction:
      return true;
  }
  return false;
}

std::string Value::TypeName() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return is_tuple() ? "tuple" : "list";
    case Kind::kDict:
      return "dict";
    case Kind::kNamespace:
      return "Namespace";
    case Kind::kFunction:
      return "builtin_function_or_method";
  }
  return "object";
}

// ------------------------------------------------------------ str / repr --

std::string FloatRepr(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value < 0 ? "-inf" : "inf";
  // The fewest significant digits that read back as `value`.
  char buf[40];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*e", precision - 1, value);
    if (std::strtod(buf, nullptr) == value) break;
  }
  std::string text(buf);
  std::string sign;
  if (text[0] == '-') {
    sign = "-";
    text.erase(0, 1);
  }
  const size_t e = text.find('e');
  const int exponent = std::atoi(text.c_str() + e + 1);
  std::string digits = text.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  // As Python's repr: positional notation for 1e-4 <= |value| < 1e16.
  const int point = exponent + 1;  // Digits before the decimal point.
  if (point < -3 || point > 16) {
    std::string mantissa = digits.substr(0, 1);
    if (digits.size() > 1) absl::StrAppend(&mantissa, ".", digits.substr(1));
    char exp[8];
    std::snprintf(exp, sizeof(exp), "e%c%02d", exponent < 0 ? '-' : '+',
                  std::abs(exponent));
    return absl::StrCat(sign, mantissa, exp);
  }
  if (point <= 0) {
    return absl::StrCat(sign, "0.", std::string(-point, '0'), digits);
  }
  if (point >= static_cast<int>(digits.size())) {
    return absl::StrCat(sign, digits, std::string(point - digits.size(), '0'),
                        ".0");
  }
  return absl::StrCat(sign, digits.substr(0, point), ".", digits.substr(point));
}

namespace {

// Approximates Python's str.isprintable() for characters outside ASCII.
bool IsPrintable(char32_t c) {
  return !(c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200F) || (c >= 0x2028 && c <= 0x202F) ||
           (c >= 0x205F && c <= 0x206F) || c == 0x3000 || c == 0xFEFF ||
           (c >= 0xD800 && c <= 0xF8FF));
}

void AppendStringRepr(const std::string& s, std::string* out) {
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  out->push_back(quote);
  for (char32_t c : DecodeUtf8(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out->push_back('\\');
      out->push_back(static_cast<char>(c));
    } else if (c == '\n') {
      out->append("\\n");
    } else if (c == '\r') {
      out->append("\\r");
    } else if (c == '\t') {
      out->append("\\t");
    } else if (IsPrintable(c)) {
      AppendUtf8(c, out);
    } else {
      char buf[12];
      std::snprintf(
          buf, sizeof(buf),
          c < 0x100 ? "\\x%02x" : (c < 0x10000 ? "\\u%04x" : "\\U%08x"),
          static_cast<unsigned>(c));
      out->append(buf);
    }
  }
  out->push_back(quote);
}

bool AppendPython(const Value& value, bool repr, size_t limit,
                  std::string* out) {
  using Kind = Value::Kind;
  switch (value.kind()) {
    case Kind::kUndefined:
      if (repr) out->append("Undefined");
      break;
    case Kind::kNone:
      out->append("None");
      break;
    case Kind::kBool:
      out->append(value.AsBool() ? "True" : "False");
      break;
    case Kind::kInt:
      absl::StrAppend(out, value.AsInt());
      break;
    case Kind::kFloat:
      out->append(FloatRepr(value.AsDouble()));
      break;
    case Kind::kString:
      if (repr) {
        AppendStringRepr(value.AsString(), out);
      } else {
        out->append(value.AsString());
      }
      break;
    case Kind::kList:
      out->push_back(value.is_tuple() ? '(' : '[');
      for (size_t i = 0; i < value.AsList().size(); ++i) {
        if (i > 0) out->append(", ");
        if (!AppendPython(value.AsList()[i], true, limit, out)) return false;
      }
      if (value.is_tuple() && value.AsList().size() == 1) out->push_back(',');
      out->push_back(value.is_tuple() ? ')' : ']');
      break;
    case Kind::kDict:
    case Kind::kNamespace: {
      const bool ns = value.is(Kind::kNamespace);
      out->append(ns ? "<Namespace {" : "{");
      bool first = true;
      for (const auto& [key, item] : value.AsDict()) {
        if (!first) out->append(", ");
        first = false;
        AppendStringRepr(key, out);
        out->append(": ");
        if (!AppendPython(item, true, limit, out)) return false;
      }
      out->append(ns ? "}>" : "}");
      break;
    }
    case Kind::kFunction:
      absl::StrAppend(out, "<built-in function ", value.AsString(), ">");
      break;
  }
  return out->size() <= limit;
}

}  // namespace

bool AppendStr(const Value& value, size_t limit, std::string* out) {
  return AppendPython(value, /*repr=*/false, limit, out);
}

bool AppendRepr(const Value& value, size_t limit, std::string* out) {
  return AppendPython(value, /*repr=*/true, limit, out);
}

// ------------------------------------------------------------ comparison --

bool Equals(const Value& a, const Value& b) {
  using Kind = Value::Kind;
  if (a.IsNumber() && b.IsNumber()) {
    if (a.is(Kind::kFloat) || b.is(Kind::kFloat)) {
      return a.AsDouble() == b.AsDouble();
    }
    return a.AsInt() == b.AsInt();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    case Kind::kString:
    case Kind::kFunction:
      return a.AsString() == b.AsString();
    case Kind::kList:
      return a.is_tuple() == b.is_tuple() &&
             std::equal(a.AsList().begin(), a.AsList().end(),
                        b.AsList().begin(), b.AsList().end(), Equals);
    case Kind::kDict:
      if (a.AsDict().size() != b.AsDict().size()) return false;
      for (const auto& [key, item] : a.AsDict()) {
        const Value* other = b.Find(key);
        if (other == nullptr || !Equals(item, *other)) return false;
      }
      return true;
    case Kind::kNamespace:
      return &a.AsDict() == &b.AsDict();
    default:
      return false;
  }
}

absl::StatusOr<int> Compare(const Value& a, const Value& b) {
  using Kind = Value::Kind;
  if (a.IsNumber() && b.IsNumber()) {
    if (a.is(Kind::kFloat) || b.is(Kind::kFloat)) {
      const double x = a.AsDouble(), y = b.AsDouble();
      return x < y ? -1 : (x > y ? 1 : 0);
    }
    return a.AsInt() < b.AsInt() ? -1 : (a.AsInt() > b.AsInt() ? 1 : 0);
  }
  if (a.is(Kind::kString) && b.is(Kind::kString)) {
    const int c = a.AsString().compare(b.AsString());
    return c < 0 ? -1 : (c > 0 ? 1 : 0);
  }
  if (a.is(Kind::kList) && b.is(Kind::kList) && a.is_tuple() == b.is_tuple()) {
    const List &x = a.AsList(), &y = b.AsList();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!Equals(x[i], y[i])) return Compare(x[i], y[i]);
    }
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "cannot order '", a.TypeName(), "' and '", b.TypeName(), "' values"));
}

}  // namespace jinja
}  // namespace moh
