// Named CPU tensors read from Hugging Face style checkpoint directories.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/checkpoint/mapped_file.h"

namespace moh {

// Named CPU tensors read from checkpoint files. A tensor may alias read-only
// mmap memory (kept alive by the tensor's deleter holding the
// shared_ptr<MappedFile>); never write to it: use Take for a private copy.
// Movable, not copyable. Not thread-safe (Take marks tensors as taken).
class TensorStore {
 public:
  TensorStore() = default;
  // `description` names the checkpoint in messages (a directory or a file).
  explicit TensorStore(std::string description)
      : description_(std::move(description)) {}
  TensorStore(TensorStore&&) = default;
  TensorStore& operator=(TensorStore&&) = default;
  TensorStore(const TensorStore&) = delete;
  TensorStore& operator=(const TensorStore&) = delete;

  // Adds `tensor`, read from `source_file`. INVALID_ARGUMENT naming both files
  // if `name` is already present.
  absl::Status Insert(std::string name, at::Tensor tensor,
                      std::string source_file);
  // Moves every tensor of `other` into this store (Insert for each; stops at
  // the first duplicate). Taken marks of `other` are dropped.
  absl::Status MergeFrom(TensorStore other);

  bool Contains(std::string_view name) const;
  std::vector<std::string> Names() const;  // Sorted.
  size_t size() const { return entries_.size(); }

  // The file `name` was read from, or NOT_FOUND as Get.
  absl::StatusOr<std::string> SourceFile(std::string_view name) const;

  // The raw tensor as stored (dtype as in the file, possibly aliasing the
  // mmap, possibly non-contiguous) or NOT_FOUND
  // "checkpoint <description>: tensor '<name>' is missing".
  absl::StatusOr<at::Tensor> Get(std::string_view name) const;

  // The tensor checked against `shape` (INVALID_ARGUMENT
  // "<file>: tensor '<name>' has shape [a, b], expected [c, d]"), converted to
  // `dtype`, contiguous and owning its memory (always a copy; never aliases
  // the mmap). Marks the tensor as taken. NOT_FOUND as Get.
  absl::StatusOr<at::Tensor> Take(std::string_view name, at::IntArrayRef shape,
                                  at::ScalarType dtype);
  // As above, converted to `options` (dtype and device) in one copy: weights
  // go straight from the mapping to, e.g., the GPU.
  absl::StatusOr<at::Tensor> Take(std::string_view name, at::IntArrayRef shape,
                                  const at::TensorOptions& options);

  // INVALID_ARGUMENT naming every tensor never taken
  // ("unexpected tensor '<name>' in <file>", joined by "; "), else OK.
  absl::Status CheckAllTaken() const;
  // Marks every tensor whose name starts with `prefix` as taken without
  // reading it (weights a model does not use, e.g. a VAE's encoder).
  void Discard(std::string_view prefix);

  const std::string& description() const { return description_; }
  void set_description(std::string description) {
    description_ = std::move(description);
  }

 private:
  struct Entry {
    at::Tensor tensor;
    std::string source_file;
  };
  const Entry* Find(std::string_view name) const;
  absl::Status MissingError(std::string_view name) const;

  std::string description_;
  std::map<std::string, Entry, std::less<>> entries_;
  std::set<std::string, std::less<>> taken_;
};

// A tensor viewing `file` bytes from `byte_offset` with `sizes`, `strides`
// (in elements) and `dtype`; the tensor's deleter keeps `file` mapped. The
// caller must have checked that every element lies inside the file;
// INVALID_ARGUMENT if the extent does not fit (checked again here) or
// LibTorch refuses.
absl::StatusOr<at::Tensor> TensorFromMappedFile(
    const std::shared_ptr<MappedFile>& file, size_t byte_offset,
    at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype);

// Number of elements spanned by a strided view (1 + sum (size-1)*stride, 0 if
// any size is 0), or INVALID_ARGUMENT for negative sizes/strides or overflow.
absl::StatusOr<size_t> StridedExtent(at::IntArrayRef sizes,
                                     at::IntArrayRef strides);

// How torch.save files (.bin, .pth) are read.
struct CheckpointOptions {
  // A file whose top-level dict is not name -> tensor is a training
  // container (MoH-ViT's {"model", "optimizer", "lr_scheduler", "epoch",
  // "scaler", "args", "max_accuracy"}, MoH-DiT's {"model", "ema", "opt",
  // "args"}): its state dict is the dict under the first of these keys that
  // the container holds; nothing else of the container becomes a tensor. A
  // top-level dict holding one of these keys with a dict value is read as a
  // container, never as a state dict. MoH-DiT serves its EMA weights:
  // {"ema", "model"}.
  std::vector<std::string> container_keys = {"model"};
  // A state dict whose names all begin with "module." (saved from a
  // DistributedDataParallel wrapper) loses that prefix. Never applied to the
  // shards of an index, whose names must match the index.
  bool strip_module_prefix = true;
};

// Reads the checkpoint in directory `dir`, choosing in this order:
// model.safetensors; model.safetensors.index.json (+ shards);
// pytorch_model.bin; pytorch_model.bin.index.json (+ shards); the one *.pth
// or *.pt file in `dir` (a release checkpoint, often a training container:
// see CheckpointOptions). NOT_FOUND naming the directory and the file names
// tried if none exists; INVALID_ARGUMENT listing them if `dir` holds several
// *.pth/*.pt files and none of the names before. The store's description() is
// `dir`; every tensor's source file is the path it came from. Malformed files
// and indexes: INVALID_ARGUMENT naming the file (and tensor); a shard listed in
// an index but absent: NOT_FOUND naming shard and a tensor; a torch.save file
// that is neither a state dict nor a container holding one of
// `options.container_keys`: INVALID_ARGUMENT naming the file and listing its
// top-level keys.
absl::StatusOr<TensorStore> LoadCheckpoint(
    const std::string& dir, const CheckpointOptions& options = {});

}  // namespace moh
