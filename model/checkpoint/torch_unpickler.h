// The restricted unpickler behind ReadTorchBinFile (model/torch_bin_reader.h):
// runs the data.pkl of a torch.save archive without executing anything. It
// builds only dicts, tuples, lists, scalars, strings, storages, tensors and
// inert argparse.Namespace placeholders, accepts only the opcodes torch.save
// emits, and calls nothing but the allowed constructors:
// collections.OrderedDict, torch._utils._rebuild_tensor_v2 and
// torch.{Float,Half,BFloat16,Long,Int}Storage. argparse.Namespace (the `args`
// of training containers) may be named by NEWOBJ with no arguments and given
// a dict state by BUILD; nothing is constructed: the value keeps that dict as
// data. Anything else (other globals, NEWOBJ of anything else, REDUCE of
// Namespace) is refused with INVALID_ARGUMENT naming data.pkl (and the
// opcode's offset).
//
// Storages are not read: a kStorage value holds the byte range of its archive
// entry, which the caller maps only for the tensors it uses (an optimizer's
// state in a training container is never mapped or copied).
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "model/checkpoint/zip_archive.h"

namespace moh {
namespace pickle {

struct Value;
using ValuePtr = std::shared_ptr<Value>;

// One object data.pkl built.
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
    kNamespace,  // argparse.Namespace: items holds its state dict, if BUILT.
  };
  explicit Value(Kind k) : kind(k) {}

  Kind kind;
  int64_t integer = 0;  // kBool, kInt; kTensor: storage offset (elements).
  double real = 0;      // kFloat
  std::string text;     // kString; kGlobal "module.name"; kStorage its key.
  // kTuple, kList; kDict: key, value, key, value, ...; kTensor: its storage;
  // kNamespace: its state (one kDict) once BUILD gave it one.
  std::vector<ValuePtr> items;
  at::ScalarType dtype = at::kFloat;    // Storage globals, kStorage.
  uint64_t begin = 0, bytes = 0;        // kStorage: byte range in the file.
  std::vector<int64_t> sizes, strides;  // kTensor.
  int depth = 0;                        // Nesting depth of containers.
  bool sealed = false;  // Contained in another value: no longer mutable.
};

// Runs one data.pkl, once. Not thread-safe.
class Unpickler {
 public:
  // `where` names data.pkl in messages; `data` (its bytes) and `archive` must
  // outlive the unpickler; `archive_prefix` is "<archive>/".
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
  absl::Status NewObj();
  absl::Status Build();
  // Step runs one opcode: the protocol and framing itself, the rest in
  // groups (scalars, containers, the memo) or the handlers above; any other
  // opcode is refused.
  absl::Status Step(uint8_t opcode, bool* stop);
  // NONE, booleans, integers, floats and strings.
  absl::Status ScalarOp(uint8_t opcode);
  // Empty dict, list and tuple, TUPLE(1-3), APPEND(S) and SETITEM(S).
  absl::Status ContainerOp(uint8_t opcode);
  // The memo's PUTs (and MEMOIZE) and GETs.
  absl::Status MemoOp(uint8_t opcode);
  absl::Status UnsupportedOpcode(uint8_t opcode) const;

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

}  // namespace pickle
}  // namespace moh
