// Reader for PyTorch zip checkpoints (torch.save, e.g. pytorch_model.bin, or
// a release's training container *.pth).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "model/checkpoint/checkpoint.h"
#include "model/checkpoint/mapped_file.h"

namespace moh {

// Maps the torch.save zip archive at `path` (STORED entries; ZIP64 supported)
// and returns the tensors of its state dict (a dict or OrderedDict of name ->
// tensor): the top-level dict, or the one under the first of
// `options.container_keys` in a training container (see CheckpointOptions;
// "module." prefixes stripped as it says). data.pkl is read by a restricted
// unpickler that executes nothing: it accepts only the opcodes torch.save
// emits and only the globals collections.OrderedDict,
// torch._utils._rebuild_tensor_v2, torch.{Float,Half,BFloat16,Long,Int}Storage
// and argparse.Namespace (an inert placeholder: model/checkpoint/
// torch_unpickler.h); anything else is refused, wherever it is in the file.
// Tensors alias the mapping (no copy) and may share storage (views); tensors
// outside the state dict (an optimizer's) are never mapped.
// Errors name `path` (and the tensor where known): INVALID_ARGUMENT for a
// malformed or refused file, or one that is neither a state dict nor a
// container holding one of the keys (listing its top-level keys); NOT_FOUND if
// it does not exist. The store's description() is `path`.
absl::StatusOr<TensorStore> ReadTorchBinFile(
    const std::string& path, const CheckpointOptions& options = {});
// As ReadTorchBinFile, for a file already mapped (or held in memory:
// MappedFile::FromBytes); errors and description() name file->path().
absl::StatusOr<TensorStore> ReadTorchBin(std::shared_ptr<MappedFile> file,
                                         const CheckpointOptions& options = {});

// Plain fields of the run arguments a training container saved under "args"
// (an argparse.Namespace, or a dict), read as data: nothing is constructed or
// called. Only string and integer fields; floats, bools, None, lists and
// others are left out.
struct SavedArgs {
  std::map<std::string, std::string> strings;
  std::map<std::string, int64_t> integers;
};

// A torch.save file read whole: its state dict and what the container around
// it says.
struct TorchBinContents {
  TensorStore tensors;  // As ReadTorchBin returns them.
  // The container key the state dict came from ("model", "ema"); empty when
  // the top-level dict is the state dict.
  std::string container_key;
  // The container's "args"; empty without a container or an "args" entry.
  SavedArgs args;
};
// As ReadTorchBin, with the container key and the saved arguments.
absl::StatusOr<TorchBinContents> ReadTorchBinContents(
    std::shared_ptr<MappedFile> file, const CheckpointOptions& options = {});

}  // namespace moh
