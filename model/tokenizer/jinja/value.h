// The values of the chat-template engine (model/tokenizer/chat_template.h)
// and the Python semantics jinja2 gives them: truthiness, str()/repr(),
// json.dumps, ==, <. Not part of the public API.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moh {
namespace jinja {

class Value;
using List = std::vector<Value>;
// Insertion-ordered, as Python dicts are; keys are unique. Only string keys
// are supported.
using Dict = std::vector<std::pair<std::string, Value>>;

// Sets dict[key] = value: an existing key keeps its place, as in Python.
void SetItem(Dict* dict, const std::string& key, Value value);

// Lists and dicts nest at most this deep, so that printing, comparing or
// serializing a value never exhausts the stack.
inline constexpr int kMaxValueDepth = 64;

// A cheap-to-copy immutable value (strings, lists and dicts are shared), or a
// namespace() object: the one mutable kind, shared by all its copies as in
// Python.
class Value {
 public:
  enum class Kind {
    kUndefined,  // jinja2's default Undefined: prints "", is falsy
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,  // A list, or a tuple (is_tuple()): they differ only in repr and ==.
    kDict,
    kNamespace,
    kFunction,  // A global function (raise_exception, range, ...), by name.
  };

  // An undefined value; `why` is the error reported when it is used where a
  // value is needed, e.g. "'foo' is undefined".
  static Value Undefined(std::string why);
  Value();  // Undefined.
  static Value None();
  static Value Bool(bool value);
  static Value Int(int64_t value);
  static Value Float(double value);
  static Value String(std::string value);
  static Value MakeList(List items);
  static Value MakeTuple(List items);
  static Value MakeDict(Dict items);
  static Value MakeNamespace(Dict attributes);
  static Value Function(std::string name);

  Kind kind() const { return kind_; }
  bool is(Kind kind) const { return kind_ == kind; }
  // bool, int or float (Python's numbers.Number).
  bool IsNumber() const;

  bool AsBool() const { return bool_; }
  int64_t AsInt() const { return int_; }
  // Any number as a double.
  double AsDouble() const;
  // The string; also the reason of an undefined value, a function's name.
  const std::string& AsString() const { return *string_; }
  const List& AsList() const { return list_->items; }
  bool is_tuple() const { return kind_ == Kind::kList && list_->tuple; }
  // A dict's items, or a namespace's attributes.
  const Dict& AsDict() const;
  // A namespace's attributes.
  Dict& MutableAttributes() const { return *namespace_; }

  // Member `key` of a dict or namespace; nullptr when absent.
  const Value* Find(absl::string_view key) const;
  // How deep lists, dicts and namespaces nest in this value (0: a scalar).
  int depth() const;
  // Python's bool().
  bool Truthy() const;
  // Python's type name, for error messages: "str", "int", "list", ...
  std::string TypeName() const;

 private:
  struct ListData {
    List items;
    int depth;
    bool tuple;
  };
  struct DictData {
    Dict items;
    int depth;
  };

  explicit Value(Kind kind) : kind_(kind) {}
  static Value MakeSequence(List items, bool tuple);

  Kind kind_;
  bool bool_ = false;
  int64_t int_ = 0;
  double float_ = 0;
  std::shared_ptr<const std::string> string_;
  std::shared_ptr<const ListData> list_;
  std::shared_ptr<const DictData> dict_;
  std::shared_ptr<Dict> namespace_;
};

// Appends Python's str(value) / repr(value) to `out`; false (with `out`
// partly written) once `out` would exceed `limit` bytes. Undefined prints "".
bool AppendStr(const Value& value, size_t limit, std::string* out);
bool AppendRepr(const Value& value, size_t limit, std::string* out);
// Python's repr(float): the shortest string that reads back the same.
std::string FloatRepr(double value);

// json.dumps(value, ensure_ascii=, indent=, separators=, sort_keys=).
struct JsonOptions {
  bool ensure_ascii = false;
  std::optional<std::string> indent;  // nullopt: all on one line.
  std::optional<std::pair<std::string, std::string>> separators;
  bool sort_keys = false;
};
// INVALID_ARGUMENT when a value has no JSON form (undefined, namespace) or
// the text would exceed `limit` bytes.
absl::Status AppendJson(const Value& value, const JsonOptions& options,
                        size_t limit, std::string* out);

// Python's a == b (1 == 1.0 == True; lists and dicts by their items).
bool Equals(const Value& a, const Value& b);
// Python's ordering of a and b: <0, 0 or >0; INVALID_ARGUMENT when they are
// not comparable (e.g. a string and a number).
absl::StatusOr<int> Compare(const Value& a, const Value& b);

}  // namespace jinja
}  // namespace moh
