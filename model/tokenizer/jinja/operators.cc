#include "model/tokenizer/jinja/operators.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/tokenizer/jinja/call.h"
#include "model/tokenizer/jinja/text.h"

namespace moh {
namespace jinja {
namespace {

using Kind = Value::Kind;

absl::Status UndefinedError(const Value& value) {
  return absl::InvalidArgumentError(value.AsString());
}

// Python's slice bounds for a sequence of `size` items: the indices visited.
absl::StatusOr<std::vector<size_t>> SliceIndices(
    int64_t size, const std::optional<int64_t>& start_arg,
    const std::optional<int64_t>& stop_arg, int64_t step) {
  if (step == 0) {
    return absl::InvalidArgumentError("slice step cannot be zero");
  }
  const auto clamp = [&](const std::optional<int64_t>& arg, int64_t dflt) {
    if (!arg) return dflt;
    int64_t i = *arg;
    if (i < 0) i += size;
    if (i < 0) return step < 0 ? int64_t{-1} : int64_t{0};
    if (i >= size) return step < 0 ? size - 1 : size;
    return i;
  };
  const int64_t start = clamp(start_arg, step < 0 ? size - 1 : 0);
  const int64_t stop = clamp(stop_arg, step < 0 ? -1 : size);
  std::vector<size_t> indices;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
    indices.push_back(static_cast<size_t>(i));
  }
  return indices;
}

absl::Status TypeError(absl::string_view op, const Value& a, const Value& b) {
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported operand types for ", op, ": '", a.TypeName(),
                   "' and '", b.TypeName(), "'"));
}

absl::Status Overflow() {
  return absl::InvalidArgumentError("integer result does not fit in 64 bits");
}

// `text` or `list` repeated `times` times, within the limits.
// `items` as a list, or as a tuple when `like` is one.
Value LikeSequence(const Value& like, List items) {
  return like.is_tuple() ? Value::MakeTuple(std::move(items))
                         : Value::MakeList(std::move(items));
}

absl::StatusOr<Value> Repeat(const Value& sequence, int64_t times,
                             size_t max_bytes) {
  times = std::max<int64_t>(times, 0);
  if (sequence.is(Kind::kString)) {
    const std::string& s = sequence.AsString();
    if (!s.empty() && static_cast<uint64_t>(times) > max_bytes / s.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("string longer than ", max_bytes, " bytes"));
    }
    std::string out;
    for (int64_t i = 0; i < times; ++i) out += s;
    return Value::String(std::move(out));
  }
  const List& items = sequence.AsList();
  if (!items.empty() &&
      static_cast<uint64_t>(times) > kMaxListItems / items.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("list longer than ", kMaxListItems, " items"));
  }
  List out;
  for (int64_t i = 0; i < times; ++i) {
    out.insert(out.end(), items.begin(), items.end());
  }
  return LikeSequence(sequence, std::move(out));
}

absl::StatusOr<Value> IntArithmetic(absl::string_view op, int64_t x,
                                    int64_t y) {
  int64_t r;
  if (op == "+") {
    if (__builtin_add_overflow(x, y, &r)) return Overflow();
  } else if (op == "-") {
    if (__builtin_sub_overflow(x, y, &r)) return Overflow();
  } else if (op == "*") {
    if (__builtin_mul_overflow(x, y, &r)) return Overflow();
  } else if (op == "//" || op == "%") {
    if (y == 0) {
      return absl::InvalidArgumentError("integer division or modulo by zero");
    }
    if (x == INT64_MIN && y == -1) return Overflow();
    int64_t q = x / y, m = x % y;
    if (m != 0 && ((m < 0) != (y < 0))) --q, m += y;  // Python floors.
    r = op == "//" ? q : m;
  } else if (op == "**") {
    if (y < 0) return Value::Float(std::pow(x, static_cast<double>(y)));
    r = 1;
    for (int64_t base = x; y > 0; y >>= 1) {
      if ((y & 1) && __builtin_mul_overflow(r, base, &r)) return Overflow();
      if (y > 1 && __builtin_mul_overflow(base, base, &base)) return Overflow();
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown operator ", op));
  }
  return Value::Int(r);
}

}  // namespace

absl::StatusOr<Value> BinaryOperation(absl::string_view op, const Value& a,
                                      const Value& b, size_t max_bytes) {
  for (const Value* v : {&a, &b}) {
    if (v->is(Kind::kUndefined)) {
      return absl::InvalidArgumentError(v->AsString());
    }
  }
  if (a.IsNumber() && b.IsNumber()) {
    if (op == "/") {
      if (b.AsDouble() == 0) {
        return absl::InvalidArgumentError("division by zero");
      }
      return Value::Float(a.AsDouble() / b.AsDouble());
    }
    if (!a.is(Kind::kFloat) && !b.is(Kind::kFloat)) {
      return IntArithmetic(op, a.AsInt(), b.AsInt());
    }
    const double x = a.AsDouble(), y = b.AsDouble();
    if ((op == "//" || op == "%") && y == 0) {
      return absl::InvalidArgumentError("float division or modulo by zero");
    }
    if (op == "+") return Value::Float(x + y);
    if (op == "-") return Value::Float(x - y);
    if (op == "*") return Value::Float(x * y);
    if (op == "**") return Value::Float(std::pow(x, y));
    double m = std::fmod(x, y);
    if (m != 0 && ((m < 0) != (y < 0))) m += y;
    if (op == "%") return Value::Float(m);
    return Value::Float(std::round((x - m) / y));  // "//"
  }
  const auto is_sequence = [](const Value& v) {
    return v.is(Kind::kString) || v.is(Kind::kList);
  };
  const auto is_int = [](const Value& v) {
    return v.is(Kind::kInt) || v.is(Kind::kBool);
  };
  if (op == "+" && a.kind() == b.kind() && is_sequence(a) &&
      a.is_tuple() == b.is_tuple()) {
    if (a.is(Kind::kString)) {
      if (a.AsString().size() + b.AsString().size() > max_bytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("string longer than ", max_bytes, " bytes"));
      }
      return Value::String(a.AsString() + b.AsString());
    }
    if (a.AsList().size() + b.AsList().size() > kMaxListItems) {
      return absl::InvalidArgumentError(
          absl::StrCat("list longer than ", kMaxListItems, " items"));
    }
    List items = a.AsList();
    items.insert(items.end(), b.AsList().begin(), b.AsList().end());
    return LikeSequence(a, std::move(items));
  }
  if (op == "*" && is_sequence(a) && is_int(b)) {
    return Repeat(a, b.AsInt(), max_bytes);
  }
  if (op == "*" && is_int(a) && is_sequence(b)) {
    return Repeat(b, a.AsInt(), max_bytes);
  }
  if (op == "%" && a.is(Kind::kString)) {
    return absl::InvalidArgumentError(
        "string formatting with '%' is not supported");
  }
  return TypeError(op, a, b);
}

absl::StatusOr<Value> UnaryOperation(absl::string_view op,
                                     const Value& operand) {
  if (operand.is(Kind::kUndefined)) return UndefinedError(operand);
  if (operand.is(Kind::kFloat)) {
    return Value::Float(op == "-" ? -operand.AsDouble() : operand.AsDouble());
  }
  if (!operand.IsNumber() || (op == "-" && operand.AsInt() == INT64_MIN)) {
    return ArgumentError("bad operand type for unary ", op, ": '",
                         operand.TypeName(), "'");
  }
  return Value::Int(op == "-" ? -operand.AsInt() : operand.AsInt());
}

absl::StatusOr<Value> GetAttribute(const Value& object,
                                   const std::string& name) {
  if (object.is(Kind::kUndefined)) return UndefinedError(object);
  if (const Value* member = object.Find(name)) return *member;
  return Value::Undefined(absl::StrCat(
      "'", object.TypeName(), " object' has no attribute '", name, "'"));
}

absl::StatusOr<Value> GetItem(const Value& object, const Value& key) {
  if (object.is(Kind::kUndefined)) return UndefinedError(object);
  if (key.is(Kind::kString)) return GetAttribute(object, key.AsString());
  const bool is_index = key.is(Kind::kInt) || key.is(Kind::kBool);
  if (is_index && (object.is(Kind::kList) || object.is(Kind::kString))) {
    std::vector<char32_t> chars;
    if (object.is(Kind::kString)) chars = DecodeUtf8(object.AsString());
    const int64_t size = object.is(Kind::kList)
                             ? static_cast<int64_t>(object.AsList().size())
                             : static_cast<int64_t>(chars.size());
    const int64_t i = key.AsInt() < 0 ? key.AsInt() + size : key.AsInt();
    if (i >= 0 && i < size) {
      if (object.is(Kind::kList)) return object.AsList()[i];
      std::string c;
      AppendUtf8(chars[i], &c);
      return Value::String(std::move(c));
    }
  }
  std::string key_text;
  AppendRepr(key, 200, &key_text);
  return Value::Undefined(absl::StrCat("'", object.TypeName(),
                                       " object' has no element ", key_text));
}

absl::StatusOr<Value> GetSlice(const Value& object,
                               std::optional<int64_t> start,
                               std::optional<int64_t> stop,
                               std::optional<int64_t> step) {
  if (object.is(Kind::kUndefined)) return UndefinedError(object);
  std::vector<char32_t> chars;
  int64_t size;
  if (object.is(Kind::kList)) {
    size = static_cast<int64_t>(object.AsList().size());
  } else if (object.is(Kind::kString)) {
    chars = DecodeUtf8(object.AsString());
    size = static_cast<int64_t>(chars.size());
  } else {
    return ArgumentError("'", object.TypeName(),
                         "' object is not subscriptable");
  }
  MOH_ASSIGN_OR_RETURN(const std::vector<size_t> indices,
                       SliceIndices(size, start, stop, step.value_or(1)));
  if (object.is(Kind::kList)) {
    List items;
    for (size_t i : indices) items.push_back(object.AsList()[i]);
    return LikeSequence(object, std::move(items));
  }
  std::string text;
  for (size_t i : indices) AppendUtf8(chars[i], &text);
  return Value::String(std::move(text));
}

}  // namespace jinja
}  // namespace moh
