// Checks on what a checkpoint reader returned from fuzzed bytes.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "fuzz/fuzz_check.h"
#include "model/checkpoint/checkpoint.h"
#include "model/checkpoint/mapped_file.h"

namespace moh {
namespace fuzz {

// Every tensor of `store` lies inside `file` (the readers promise views on
// the file's bytes and nothing beyond), or is the aligned copy of its own
// that TensorFromMappedFile makes of a tensor the file places misaligned for
// its type: checked from sizes and strides, then its first and last bytes
// are read, which AddressSanitizer checks against the exact-size copy behind
// MappedFile::FromBytes (or the copy's own allocation).
inline void CheckTensorsInFile(const TensorStore& store,
                               const MappedFile& file) {
  for (const std::string& name : store.Names()) {
    absl::StatusOr<at::Tensor> tensor = store.Get(name);
    MOH_FUZZ_CHECK(tensor.ok(), tensor.status().ToString());
    absl::StatusOr<size_t> extent =
        StridedExtent(tensor->sizes(), tensor->strides());
    MOH_FUZZ_CHECK(extent.ok(), extent.status().ToString());
    if (*extent == 0) continue;
    const auto* begin = static_cast<const uint8_t*>(tensor->data_ptr());
    const size_t bytes = *extent * tensor->element_size();
    const uintptr_t offset = reinterpret_cast<uintptr_t>(begin) -
                             reinterpret_cast<uintptr_t>(file.data());
    const bool in_file = begin >= file.data() && offset <= file.size() &&
                         bytes <= file.size() - offset;
    // A copy owns memory from LibTorch's CPU allocator, whose context is the
    // data itself (a view made by from_blob carries its deleter's).
    const c10::DataPtr& storage = tensor->storage().data_ptr();
    const bool own_aligned_copy =
        !in_file && storage.get_context() == storage.get() &&
        reinterpret_cast<uintptr_t>(begin) % tensor->element_size() == 0 &&
        tensor->storage().nbytes() >= bytes;
    MOH_FUZZ_CHECK(
        in_file || own_aligned_copy,
        absl::StrCat("tensor '", name, "' (", bytes, " bytes at offset ",
                     offset, ") lies outside the file of ", file.size(),
                     " bytes and is no aligned copy"));
    volatile uint8_t first = begin[0];
    volatile uint8_t last = begin[bytes - 1];
    (void)first;
    (void)last;
  }
}

// What a reader returned for `file`: INVALID_ARGUMENT, or tensors inside it.
inline void CheckReaderResult(const absl::StatusOr<TensorStore>& store,
                              const MappedFile& file) {
  if (!store.ok()) {
    CheckInvalidArgument(store.status());
    return;
  }
  CheckTensorsInFile(*store, file);
}

}  // namespace fuzz
}  // namespace moh
