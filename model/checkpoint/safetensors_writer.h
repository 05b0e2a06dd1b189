// Writer for the safetensors format (https://huggingface.co/docs/safetensors),
// the counterpart of model/checkpoint/safetensors_reader.h.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "model/checkpoint/checkpoint.h"

namespace moh {

// Writes every tensor of `tensors` to `path` as one .safetensors file: the
// 8-byte little-endian header length, the JSON header ({"__metadata__":
// {"format": "pt"}, name: {dtype, shape, data_offsets}}) padded with spaces to
// a multiple of 8 bytes, then each tensor's bytes, row-major, in the dtype it
// has (F32, F16, BF16, I64, I32). Tensors are laid out by decreasing element
// size, then by name, so that each starts at an offset aligned for its type
// and ReadSafetensors maps it without a copy. Views are written as their
// elements, not their storage. Nothing in `tensors` is marked taken.
// The bytes go to "<path>.tmp", which is then renamed to `path`: `path` is
// never left half-written. Errors: INVALID_ARGUMENT naming the tensor for
// another dtype or a tensor not on the CPU; the errno of a failed write as a
// status naming the file.
absl::Status WriteSafetensorsFile(const std::string& path,
                                  const TensorStore& tensors);

}  // namespace moh
