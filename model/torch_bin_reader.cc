#include "model/torch_bin_reader.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "model/status_macros.h"
#include "model/zip_archive.h"

namespace moh {
namespace {

// Restricted unpickler: builds only dicts, tuples, lists, scalars, strings,
// storages and tensors; calls nothing but the allowed constructors.

struct Value;
using ValuePtr = std::shared_ptr<Value>;

struct Value {
  enum class Kind {
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kTuple,
    kList,
    kDict,
    kGlobal,
    kStorage,
    kTensor,
  };
  explicit Value(Kind k) : kind(k) {}

  Kind kind;
  int64_t integer = 0;  // kBool, kInt; kTensor: storage offset (elements).
  double real = 0;      // kFloat
  std::string text;     // kString; kGlobal "module.name"; kStorage its key.
  // kTuple, kList; kDict: key, value, key, value, ...; kTensor: its storage.
  std::vector<ValuePtr> items;
  at::ScalarType dtype = at::kFloat;    // Storage globals, kStorage.
  uint64_t begin = 0, bytes = 0;        // kStorage: byte range in the file.
  std::vector<int64_t> sizes, strides;  // kTensor.
  int depth = 0;                        // Nesting depth of containers.
  bool sealed = false;  // Contained in another value: no longer mutable.
};

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
constexpr int kMaxDepth = 32;

class Unpickler {
 public:
  // `where` names data.pkl in messages; `archive_prefix` is "<archive>/".
  Unpickler(std::string where, const uint8_t* data, size_t size,
            const ZipArchive& archive, std::string archive_prefix)
      : where_(std::move(where)),
        data_(data),
        size_(size),
        archive_(archive),
        archive_prefix_(std::move(archive_prefix)) {}

  // Runs data.pkl to its STOP opcode and returns the value it produced.
  absl::StatusOr<ValuePtr> Run();

 private:
  absl::Status Error(const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(where_, ": ", what));
  }
  absl::Status ErrorAt(const std::string& what) const {
    return Error(absl::StrCat(what, " at offset ", op_offset_));
  }
  absl::StatusOr<const uint8_t*> Read(size_t n);
  absl::StatusOr<uint64_t> ReadUnsigned(int bytes);
  absl::StatusOr<std::string> ReadLine();
  absl::Status Push(ValuePtr value) {
    stack_.push_back(std::move(value));
    return absl::OkStatus();
  }
  absl::StatusOr<ValuePtr> Pop();
  absl::StatusOr<ValuePtr> Top();
  absl::StatusOr<std::vector<ValuePtr>> PopToMark();
  // Makes `child` part of `parent` (sealing it) after checking depth.
  absl::Status Adopt(Value& parent, ValuePtr child);
  absl::Status MakeTuple(std::vector<ValuePtr> items);
  absl::Status Append(std::vector<ValuePtr> items);    // Onto the list on top.
  absl::Status SetItems(std::vector<ValuePtr> items);  // Into the dict on top.
  absl::Status Global();
  absl::Status PersistentLoad();
  absl::Status Reduce();
  absl::Status Build();
  absl::Status Step(uint8_t opcode, bool* stop);

  const std::string where_;
  const uint8_t* const data_;
  const size_t size_;
  const ZipArchive& archive_;
  const std::string archive_prefix_;
  size_t pos_ = 0;
  size_t op_offset_ = 0;
  std::vector<ValuePtr> stack_;
  std::vector<size_t> marks_;  // Stack sizes at each MARK.
  std::unordered_map<uint64_t, ValuePtr> memo_;
};

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
  } else if (global->text != kOrderedDict && global->text != kRebuildTensor) {
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

// Reads a tuple of Python ints into `out`.
bool IntTuple(const Value& value, std::vector<int64_t>* out) {
  if (value.kind != Value::Kind::kTuple) return false;
  for (const ValuePtr& item : value.items) {
    if (item->kind != Value::Kind::kInt) return false;
    out->push_back(item->integer);
  }
  return true;
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

// BUILD on a dict sets instance attributes (state_dict()'s `_metadata`),
// which carry no tensors: checked for type, then ignored.
absl::Status Unpickler::Build() {
  MOH_ASSIGN_OR_RETURN(ValuePtr state, Pop());
  MOH_ASSIGN_OR_RETURN(ValuePtr target, Top());
  if (target->kind != Value::Kind::kDict ||
      (state->kind != Value::Kind::kDict &&
       state->kind != Value::Kind::kNone)) {
    return ErrorAt("BUILD is only supported on a dict with a dict state");
  }
  return absl::OkStatus();
}

absl::Status Unpickler::Step(uint8_t opcode, bool* stop) {
  using Kind = Value::Kind;
  auto scalar = [](Kind kind, int64_t integer) {
    auto value = std::make_shared<Value>(kind);
    value->integer = integer;
    return value;
  };
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
    case '}':  // EMPTY_DICT
      return Push(std::make_shared<Value>(Kind::kDict));
    case ']':  // EMPTY_LIST
      return Push(std::make_shared<Value>(Kind::kList));
    case ')':  // EMPTY_TUPLE
      return MakeTuple({});
    case '(':  // MARK
      marks_.push_back(stack_.size());
      return absl::OkStatus();
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
    case 'c':  // GLOBAL
      return Global();
    case 'Q':  // BINPERSID
      return PersistentLoad();
    case 'R':  // REDUCE
      return Reduce();
    case 'b':  // BUILD
      return Build();
    default:
      return ErrorAt(
          absl::StrFormat("unsupported pickle opcode 0x%02x", opcode));
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

// Turns the unpickled top-level dict into named tensors over `file`.
absl::Status CollectTensors(const std::string& where, const Value& root,
                            const std::shared_ptr<MappedFile>& file,
                            TensorStore& store) {
  const std::string& path = file->path();
  if (root.kind != Value::Kind::kDict) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": top-level object is not a dict of tensors"));
  }
  for (size_t i = 0; i + 1 < root.items.size(); i += 2) {
    const Value& key = *root.items[i];
    const Value& value = *root.items[i + 1];
    if (key.kind != Value::Kind::kString) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": a top-level key is not a string"));
    }
    const std::string prefix = absl::StrCat(path, ": tensor '", key.text, "'");
    if (value.kind != Value::Kind::kTensor) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, " is not a tensor"));
    }
    const Value& storage = *value.items[0];
    const size_t element_size = c10::elementSize(storage.dtype);
    absl::StatusOr<size_t> extent = StridedExtent(value.sizes, value.strides);
    if (!extent.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, ": ", extent.status().message()));
    }
    uint64_t end = 0;  // In bytes from the storage start.
    if (*extent > 0 &&
        (value.integer < 0 ||
         __builtin_add_overflow(static_cast<uint64_t>(value.integer), *extent,
                                &end) ||
         __builtin_mul_overflow(end, element_size, &end) ||
         end > storage.bytes)) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, " (storage offset ", value.integer, ", ",
                       *extent, " elements) exceeds its storage '",
                       storage.text, "' of ", storage.bytes, " bytes"));
    }
    const uint64_t offset = *extent > 0
                                ? storage.begin + value.integer * element_size
                                : storage.begin;
    MOH_ASSIGN_OR_RETURN(at::Tensor tensor,
                         TensorFromMappedFile(file, offset, value.sizes,
                                              value.strides, storage.dtype));
    MOH_RETURN_IF_ERROR(store.Insert(key.text, std::move(tensor), path));
  }
  return absl::OkStatus();
}

// The "<archive>/" prefix of the single "<archive>/data.pkl" entry.
absl::StatusOr<std::string> ArchivePrefix(const std::string& path,
                                          const ZipArchive& archive) {
  std::vector<std::string> prefixes;
  for (const auto& [name, entry] : archive.entries()) {
    const size_t slash = name.find('/');
    if (slash != std::string::npos && name.substr(slash + 1) == "data.pkl") {
      prefixes.push_back(name.substr(0, slash + 1));
    }
  }
  if (prefixes.size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": expected one '<archive>/data.pkl' entry, found ",
                     prefixes.size(), " (not a torch.save checkpoint?)"));
  }
  return prefixes[0];
}

}  // namespace

absl::StatusOr<TensorStore> ReadTorchBinFile(const std::string& path) {
  MOH_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> file,
                       MappedFile::Open(path));
  MOH_ASSIGN_OR_RETURN(ZipArchive archive, ZipArchive::Read(*file));
  MOH_ASSIGN_OR_RETURN(std::string prefix, ArchivePrefix(path, archive));
  const std::string pkl_name = prefix + "data.pkl";
  MOH_ASSIGN_OR_RETURN(ZipArchive::Entry pkl, archive.StoredEntry(pkl_name));
  // torch >= 2.1 records the byte order of the storages; older files are
  // little-endian.
  if (archive.entries().count(prefix + "byteorder") != 0) {
    MOH_ASSIGN_OR_RETURN(ZipArchive::Entry order,
                         archive.StoredEntry(prefix + "byteorder"));
    const std::string_view value(
        reinterpret_cast<const char*>(file->data()) + order.data_offset,
        order.size);
    if (value != "little") {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": storages are not little-endian (byteorder entry)"));
    }
  }
  Unpickler unpickler(absl::StrCat(path, "/", pkl_name),
                      file->data() + pkl.data_offset, pkl.size, archive,
                      prefix);
  MOH_ASSIGN_OR_RETURN(ValuePtr root, unpickler.Run());
  TensorStore store(path);
  MOH_RETURN_IF_ERROR(
      CollectTensors(absl::StrCat(path, "/", pkl_name), *root, file, store));
  return store;
}

}  // namespace moh
