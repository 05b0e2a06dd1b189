// Reader for the safetensors format (https://huggingface.co/docs/safetensors).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "model/checkpoint/checkpoint.h"
#include "model/checkpoint/mapped_file.h"

namespace moh {

// Maps the .safetensors file at `path` and returns its tensors, which alias
// the mapping (no copy). Supported dtypes: F32, F16, BF16, I64, I32, I8, U8
// (pre-quantized weights). Every header field is validated (length, JSON types,
// offsets inside the data area, size == numel * element size, no overlaps);
// "__metadata__" is ignored. Errors name `path` and, where one is involved, the
// tensor: INVALID_ARGUMENT for a malformed file, NOT_FOUND if it does not
// exist. The store's description() is `path`.
absl::StatusOr<TensorStore> ReadSafetensorsFile(const std::string& path);
// As ReadSafetensorsFile, for a file already mapped (or held in memory:
// MappedFile::FromBytes); errors and description() name file->path().
absl::StatusOr<TensorStore> ReadSafetensors(std::shared_ptr<MappedFile> file);

// The safetensors name of `dtype` ("F32", "F16", "BF16", "I64", "I32", "I8",
// "U8"), or nullptr for a dtype the reader and writer do not support.
const char* SafetensorsDtypeName(at::ScalarType dtype);

}  // namespace moh
