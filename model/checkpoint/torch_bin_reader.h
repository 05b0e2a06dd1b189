// Reader for PyTorch zip checkpoints (torch.save, e.g. pytorch_model.bin).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "model/checkpoint/checkpoint.h"
#include "model/checkpoint/mapped_file.h"

namespace moh {

// Maps the torch.save zip archive at `path` (STORED entries; ZIP64 supported)
// and returns the tensors of its top-level dict (dict or OrderedDict of name
// -> tensor). data.pkl is read by a restricted unpickler that executes
// nothing: it accepts only the opcodes torch.save emits and only the globals
// collections.OrderedDict, torch._utils._rebuild_tensor_v2 and
// torch.{Float,Half,BFloat16,Long,Int}Storage; anything else is refused.
// Tensors alias the mapping (no copy) and may share storage (views).
// Errors name `path` (and the tensor where known): INVALID_ARGUMENT for a
// malformed or refused file, NOT_FOUND if it does not exist.
// The store's description() is `path`.
absl::StatusOr<TensorStore> ReadTorchBinFile(const std::string& path);
// As ReadTorchBinFile, for a file already mapped (or held in memory:
// MappedFile::FromBytes); errors and description() name file->path().
absl::StatusOr<TensorStore> ReadTorchBin(std::shared_ptr<MappedFile> file);

}  // namespace moh
