#include "model/checkpoint/torch_unpickler.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <string_view>
#include <utility>

#include "absl/strings/str_format.h"
#include "base/status_macros.h"

namespace moh {
namespace pickle {
namespace {

// Globals that data.pkl may name; everything else is refused.
const std::map<std::string, at::ScalarType>& StorageTypes() {
  static const auto* types = new std::map<std::string, at::ScalarType>{
      {"torch.FloatStorage", at::kFloat},
      {"torch.HalfStorage", at::kHalf},
      {"torch.BFloat16Storage", at::kBFloat16},
      {"torch.LongStorage", at::kLong},
      {"torch.IntStorage", at::kInt}};
  return *types;
}
constexpr char kOrderedDict[] = "collections.OrderedDict";
constexpr char kRebuildTensor[] = "torch._utils._rebuild_tensor_v2";
// Named only by NEWOBJ, and only as an inert placeholder (see the header).
constexpr char kNamespace[] = "argparse.Namespace";
constexpr int kMaxDepth = 32;

// Reads a tuple of Python ints into `out`.
bool IntTuple(const Value& value, std::vector<int64_t>* out) {
  if (value.kind != Value::Kind::kTuple) return false;
  for (const ValuePtr& item : value.items) {
    if (item->kind != Value::Kind::kInt) return false;
    out->push_back(item->integer);
  }
  return true;
}

}  // namespace

absl::StatusOr<const uint8_t*> Unpickler::Read(size_t n) {
  if (n > size_ - pos_) return ErrorAt("truncated opcode argument");
  const uint8_t* p = data_ + pos_;
  pos_ += n;
  return p;
}

absl::StatusOr<uint64_t> Unpickler::ReadUnsigned(int bytes) {
  MOH_ASSIGN_OR_RETURN(const uint8_t* p, Read(bytes));
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

absl::StatusOr<std::string> Unpickler::ReadLine() {
  const void* end = std::memchr(data_ + pos_, '\n', size_ - pos_);
  if (end == nullptr) return ErrorAt("unterminated line");
  const size_t length = static_cast<const uint8_t*>(end) - (data_ + pos_);
  std::string line(reinterpret_cast<const char*>(data_) + pos_, length);
  pos_ += length + 1;
  return line;
}

absl::StatusOr<ValuePtr> Unpickler::Pop() {
  const size_t floor = marks_.empty() ? 0 : marks_.back();
  if (stack_.size() <= floor) return ErrorAt("stack underflow");
  ValuePtr value = std::move(stack_.back());
  stack_.pop_back();
  return value;
}

absl::StatusOr<ValuePtr> Unpickler::Top() {
  const size_t floor = marks_.empty() ? 0 : marks_.back();
  if (stack_.size() <= floor) return ErrorAt("stack underflow");
  return stack_.back();
}

absl::StatusOr<std::vector<ValuePtr>> Unpickler::PopToMark() {
  if (marks_.empty()) return ErrorAt("no MARK on the stack");
  std::vector<ValuePtr> items(
      std::make_move_iterator(stack_.begin() + marks_.back()),
      std::make_move_iterator(stack_.end()));
  stack_.resize(marks_.back());
  marks_.pop_back();
  return items;
}

absl::Status Unpickler::Adopt(Value& parent, ValuePtr child) {
  if (child.get() == &parent || child->depth + 1 > kMaxDepth) {
    return ErrorAt("value nested too deeply or inside itself");
  }
  child->sealed = true;
  parent.depth = std::max(parent.depth, child->depth + 1);
  parent.items.push_back(std::move(child));
  return absl::OkStatus();
}

absl::Status Unpickler::MakeTuple(std::vector<ValuePtr> items) {
  auto tuple = std::make_shared<Value>(Value::Kind::kTuple);
  for (ValuePtr& item : items) MOH_RETURN_IF_ERROR(Adopt(*tuple, item));
  return Push(std::move(tuple));
}

absl::Status Unpickler::Append(std::vector<ValuePtr> items) {
  MOH_ASSIGN_OR_RETURN(ValuePtr list, Top());
  if (list->kind != Value::Kind::kList || list->sealed) {
    return ErrorAt("APPEND to something other than an open list");
  }
  for (ValuePtr& item : items) MOH_RETURN_IF_ERROR(Adopt(*list, item));
  return absl::OkStatus();
}

absl::Status Unpickler::SetItems(std::vector<ValuePtr> items) {
  MOH_ASSIGN_OR_RETURN(ValuePtr dict, Top());
  if (dict->kind != Value::Kind::kDict || dict->sealed) {
    return ErrorAt("SETITEM on something other than an open dict");
  }
  if (items.size() % 2 != 0) return ErrorAt("odd number of SETITEMS values");
  for (ValuePtr& item : items) MOH_RETURN_IF_ERROR(Adopt(*dict, item));
  return absl::OkStatus();
}

absl::Status Unpickler::Global() {
  MOH_ASSIGN_OR_RETURN(std::string module, ReadLine());
  MOH_ASSIGN_OR_RETURN(std::string name, ReadLine());
  auto global = std::make_shared<Value>(Value::Kind::kGlobal);
  global->text = absl::StrCat(module, ".", name);
  auto storage = StorageTypes().find(global->text);
  if (storage != StorageTypes().end()) {
    global->dtype = storage->second;
  } else if (global->text != kOrderedDict && global->text != kRebuildTensor &&
             global->text != kNamespace) {
    return Error(absl::StrCat("refusing to load global '", global->text,
                              "' (only tensors are read)"));
  }
  return Push(std::move(global));
}

// ('storage', storage_type, key, location, numel) -> the storage's bytes.
absl::Status Unpickler::PersistentLoad() {
  MOH_ASSIGN_OR_RETURN(ValuePtr pid, Pop());
  const std::vector<ValuePtr>& f = pid->items;
  if (pid->kind != Value::Kind::kTuple || f.size() != 5 ||
      f[0]->kind != Value::Kind::kString || f[0]->text != "storage" ||
      f[1]->kind != Value::Kind::kGlobal ||
      StorageTypes().count(f[1]->text) == 0 ||
      f[2]->kind != Value::Kind::kString || f[4]->kind != Value::Kind::kInt ||
      f[4]->integer < 0) {
    return ErrorAt(
        "persistent id is not ('storage', <storage type>, key, location, "
        "numel)");
  }
  const std::string entry_name =
      absl::StrCat(archive_prefix_, "data/", f[2]->text);
  MOH_ASSIGN_OR_RETURN(ZipArchive::Entry entry,
                       archive_.StoredEntry(entry_name));
  auto storage = std::make_shared<Value>(Value::Kind::kStorage);
  storage->dtype = f[1]->dtype;
  storage->text = f[2]->text;
  storage->begin = entry.data_offset;
  if (__builtin_mul_overflow(static_cast<uint64_t>(f[4]->integer),
                             c10::elementSize(storage->dtype),
                             &storage->bytes) ||
      storage->bytes > entry.size) {
    return Error(absl::StrCat("storage '", f[2]->text, "' of ", f[4]->integer,
                              " elements does not fit its entry of ",
                              entry.size, " bytes"));
  }
  return Push(std::move(storage));
}

absl::Status Unpickler::Reduce() {
  MOH_ASSIGN_OR_RETURN(ValuePtr args, Pop());
  MOH_ASSIGN_OR_RETURN(ValuePtr callable, Pop());
  if (callable->kind != Value::Kind::kGlobal ||
      args->kind != Value::Kind::kTuple) {
    return ErrorAt("REDUCE needs a global and an argument tuple");
  }
  const std::vector<ValuePtr>& a = args->items;
  if (callable->text == kOrderedDict && a.empty()) {
    return Push(std::make_shared<Value>(Value::Kind::kDict));
  }
  if (callable->text != kRebuildTensor) {
    return ErrorAt(absl::StrCat("refusing to call '", callable->text, "'"));
  }
  // _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
  //                    backward_hooks[, metadata])
  auto tensor = std::make_shared<Value>(Value::Kind::kTensor);
  if ((a.size() != 6 && a.size() != 7) || a[0]->kind != Value::Kind::kStorage ||
      a[1]->kind != Value::Kind::kInt || !IntTuple(*a[2], &tensor->sizes) ||
      !IntTuple(*a[3], &tensor->strides)) {
    return ErrorAt(
        "_rebuild_tensor_v2 arguments are not (storage, offset, size, stride, "
        "...)");
  }
  tensor->integer = a[1]->integer;
  tensor->items.push_back(a[0]);
  return Push(std::move(tensor));
}

// NEWOBJ (cls.__new__(cls, *args)) as protocol 2 pickles an
// argparse.Namespace: an inert placeholder; nothing else may be built.
absl::Status Unpickler::NewObj() {
  MOH_ASSIGN_OR_RETURN(ValuePtr args, Pop());
  MOH_ASSIGN_OR_RETURN(ValuePtr cls, Pop());
  if (cls->kind != Value::Kind::kGlobal || cls->text != kNamespace) {
    return ErrorAt(absl::StrCat("refusing NEWOBJ of ",
                                cls->kind == Value::Kind::kGlobal
                                    ? "'" + cls->text + "'"
                                    : std::string("a non-global"),
                                " (only argparse.Namespace is accepted)"));
  }
  if (args->kind != Value::Kind::kTuple || !args->items.empty()) {
    return ErrorAt("NEWOBJ of argparse.Namespace with arguments");
  }
  return Push(std::make_shared<Value>(Value::Kind::kNamespace));
}

// BUILD on a dict sets instance attributes (state_dict()'s `_metadata`),
// which carry no tensors: checked for type, then ignored. BUILD on a
// Namespace gives it its state dict, kept as data (once, before the
// Namespace is placed in a container).
absl::Status Unpickler::Build() {
  MOH_ASSIGN_OR_RETURN(ValuePtr state, Pop());
  MOH_ASSIGN_OR_RETURN(ValuePtr target, Top());
  if (target->kind == Value::Kind::kNamespace &&
      state->kind == Value::Kind::kDict) {
    if (target->sealed || !target->items.empty()) {
      return ErrorAt(
          "BUILD on an argparse.Namespace that already has a state or is in "
          "a container");
    }
    return Adopt(*target, std::move(state));
  }
  if (target->kind != Value::Kind::kDict ||
      (state->kind != Value::Kind::kDict &&
       state->kind != Value::Kind::kNone)) {
    return ErrorAt(
        "BUILD is only supported on a dict or an argparse.Namespace with a "
        "dict state");
  }
  return absl::OkStatus();
}

absl::Status Unpickler::UnsupportedOpcode(uint8_t opcode) const {
  return ErrorAt(absl::StrFormat("unsupported pickle opcode 0x%02x", opcode));
}

absl::Status Unpickler::ScalarOp(uint8_t opcode) {
  using Kind = Value::Kind;
  auto scalar = [](Kind kind, int64_t integer) {
    auto value = std::make_shared<Value>(kind);
    value->integer = integer;
    return value;
  };
  switch (opcode) {
    case 'N':  // NONE
      return Push(std::make_shared<Value>(Kind::kNone));
    case 0x88:  // NEWTRUE
    case 0x89:  // NEWFALSE
      return Push(scalar(Kind::kBool, opcode == 0x88));
    case 'X':     // BINUNICODE
    case 0x8c:    // SHORT_BINUNICODE
    case 0x8d: {  // BINUNICODE8
      const int length_bytes = opcode == 'X' ? 4 : opcode == 0x8c ? 1 : 8;
      MOH_ASSIGN_OR_RETURN(uint64_t length, ReadUnsigned(length_bytes));
      MOH_ASSIGN_OR_RETURN(const uint8_t* p, Read(length));
      auto value = std::make_shared<Value>(Kind::kString);
      value->text.assign(reinterpret_cast<const char*>(p), length);
      return Push(std::move(value));
    }
    case 'J': {  // BININT
      MOH_ASSIGN_OR_RETURN(uint64_t v, ReadUnsigned(4));
      return Push(scalar(Kind::kInt, static_cast<int32_t>(v)));
    }
    case 'K':    // BININT1
    case 'M': {  // BININT2
      MOH_ASSIGN_OR_RETURN(uint64_t v, ReadUnsigned(opcode == 'K' ? 1 : 2));
      return Push(scalar(Kind::kInt, static_cast<int64_t>(v)));
    }
    case 0x8a: {  // LONG1: little-endian two's complement.
      MOH_ASSIGN_OR_RETURN(uint64_t n, ReadUnsigned(1));
      if (n > 8) return ErrorAt("LONG1 integer wider than 64 bits");
      MOH_ASSIGN_OR_RETURN(uint64_t v, ReadUnsigned(static_cast<int>(n)));
      if (n > 0 && n < 8 && (v >> (8 * n - 1)) != 0) v |= ~0ULL << (8 * n);
      return Push(scalar(Kind::kInt, static_cast<int64_t>(v)));
    }
    case 'G': {  // BINFLOAT: big-endian double.
      MOH_ASSIGN_OR_RETURN(const uint8_t* p, Read(8));
      uint64_t bits = 0;
      for (int i = 0; i < 8; ++i) bits = (bits << 8) | p[i];
      auto value = std::make_shared<Value>(Kind::kFloat);
      std::memcpy(&value->real, &bits, sizeof(bits));
      return Push(std::move(value));
    }
    default:
      return UnsupportedOpcode(opcode);
  }
}

absl::Status Unpickler::ContainerOp(uint8_t opcode) {
  using Kind = Value::Kind;
  switch (opcode) {
    case '}':  // EMPTY_DICT
      return Push(std::make_shared<Value>(Kind::kDict));
    case ']':  // EMPTY_LIST
      return Push(std::make_shared<Value>(Kind::kList));
    case ')':  // EMPTY_TUPLE
      return MakeTuple({});
    case 't': {  // TUPLE
      MOH_ASSIGN_OR_RETURN(std::vector<ValuePtr> items, PopToMark());
      return MakeTuple(std::move(items));
    }
    case 0x85:    // TUPLE1
    case 0x86:    // TUPLE2
    case 0x87: {  // TUPLE3
      std::vector<ValuePtr> items(opcode - 0x84);
      for (size_t i = items.size(); i-- > 0;) {
        MOH_ASSIGN_OR_RETURN(items[i], Pop());
      }
      return MakeTuple(std::move(items));
    }
    case 'a': {  // APPEND
      MOH_ASSIGN_OR_RETURN(ValuePtr item, Pop());
      return Append({std::move(item)});
    }
    case 'e': {  // APPENDS
      MOH_ASSIGN_OR_RETURN(std::vector<ValuePtr> items, PopToMark());
      return Append(std::move(items));
    }
    case 's': {  // SETITEM
      MOH_ASSIGN_OR_RETURN(ValuePtr value, Pop());
      MOH_ASSIGN_OR_RETURN(ValuePtr key, Pop());
      return SetItems({std::move(key), std::move(value)});
    }
    case 'u': {  // SETITEMS
      MOH_ASSIGN_OR_RETURN(std::vector<ValuePtr> items, PopToMark());
      return SetItems(std::move(items));
    }
    default:
      return UnsupportedOpcode(opcode);
  }
}

absl::Status Unpickler::MemoOp(uint8_t opcode) {
  switch (opcode) {
    case 'q':     // BINPUT
    case 'r':     // LONG_BINPUT
    case 0x94: {  // MEMOIZE
      uint64_t index = memo_.size();
      if (opcode != 0x94) {
        MOH_ASSIGN_OR_RETURN(index, ReadUnsigned(opcode == 'q' ? 1 : 4));
      }
      MOH_ASSIGN_OR_RETURN(memo_[index], Top());
      return absl::OkStatus();
    }
    case 'h':    // BINGET
    case 'j': {  // LONG_BINGET
      MOH_ASSIGN_OR_RETURN(uint64_t index, ReadUnsigned(opcode == 'h' ? 1 : 4));
      auto it = memo_.find(index);
      if (it == memo_.end()) {
        return ErrorAt(absl::StrCat("memo entry ", index, " is not set"));
      }
      return Push(it->second);
    }
    default:
      return UnsupportedOpcode(opcode);
  }
}

absl::Status Unpickler::Step(uint8_t opcode, bool* stop) {
  switch (opcode) {
    case 0x80: {  // PROTO
      MOH_ASSIGN_OR_RETURN(uint64_t version, ReadUnsigned(1));
      if (version < 2 || version > 5) {
        return ErrorAt(absl::StrCat("unsupported pickle protocol ", version));
      }
      return absl::OkStatus();
    }
    case 0x95:  // FRAME: its length is of no use when reading from memory.
      return ReadUnsigned(8).status();
    case '.':  // STOP
      *stop = true;
      return absl::OkStatus();
    case '(':  // MARK
      marks_.push_back(stack_.size());
      return absl::OkStatus();
    case 'N':
    case 0x88:
    case 0x89:
    case 'X':
    case 0x8c:
    case 0x8d:
    case 'J':
    case 'K':
    case 'M':
    case 0x8a:
    case 'G':
      return ScalarOp(opcode);
    case '}':
    case ']':
    case ')':
    case 't':
    case 0x85:
    case 0x86:
    case 0x87:
    case 'a':
    case 'e':
    case 's':
    case 'u':
      return ContainerOp(opcode);
    case 'q':
    case 'r':
    case 0x94:
    case 'h':
    case 'j':
      return MemoOp(opcode);
    case 'c':  // GLOBAL
      return Global();
    case 'Q':  // BINPERSID
      return PersistentLoad();
    case 'R':  // REDUCE
      return Reduce();
    case 0x81:  // NEWOBJ
      return NewObj();
    case 'b':  // BUILD
      return Build();
    default:
      return UnsupportedOpcode(opcode);
  }
}

absl::StatusOr<ValuePtr> Unpickler::Run() {
  bool stop = false;
  while (!stop) {
    if (pos_ >= size_) return Error("ends without a STOP opcode (truncated?)");
    op_offset_ = pos_;
    MOH_RETURN_IF_ERROR(Step(data_[pos_++], &stop));
  }
  return Pop();
}

}  // namespace pickle
}  // namespace moh
