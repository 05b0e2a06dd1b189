#include "model/checkpoint/checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "base/status_macros.h"
#include "model/checkpoint/safetensors_reader.h"
#include "model/checkpoint/torch_bin_reader.h"

namespace moh {
namespace {

namespace fs = std::filesystem;

std::string FormatShape(at::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Debian's Abseil does not alias absl::string_view to std::string_view.
absl::string_view AsAbsl(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

bool IsRegularFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (dir.empty() || dir.back() == '/') return dir + name;
  return absl::StrCat(dir, "/", name);
}

// A shard name from an index must name a file in the checkpoint directory.
bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos &&
         name.find('\\') == std::string::npos &&
         name.find("..") == std::string::npos && name != ".";
}

using FileReader =
    std::function<absl::StatusOr<TensorStore>(const std::string& path)>;

// Reads `index_name` in `dir` ({"weight_map": {tensor: shard file}}), then
// every shard with `read_file`, checking that index and shards agree.
absl::StatusOr<TensorStore> LoadShardedCheckpoint(const std::string& dir,
                                                  const std::string& index_name,
                                                  const FileReader& read_file) {
  const std::string index_path = JoinPath(dir, index_name);
  MOH_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> index_file,
                       MappedFile::Open(index_path));
  const char* text = reinterpret_cast<const char*>(index_file->data());
  nlohmann::json index = nlohmann::json::parse(
      text, text + index_file->size(), nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded() || !index.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(index_path, ": not a valid JSON object"));
  }
  auto weight_map = index.find("weight_map");
  if (weight_map == index.end() || !weight_map->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(index_path, ": missing \"weight_map\" object"));
  }
  std::map<std::string, std::string> shard_of;  // tensor -> shard file name
  std::map<std::string, std::vector<std::string>> tensors_of;  // shard -> names
  for (const auto& [name, shard] : weight_map->items()) {
    if (!shard.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": weight_map entry for tensor '", name,
                       "' is not a string"));
    }
    const std::string& shard_name = shard.get_ref<const std::string&>();
    if (!IsPlainFileName(shard_name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          index_path, ": shard file name '", shard_name, "' for tensor '", name,
          "' must be a plain file name in the checkpoint directory"));
    }
    shard_of[name] = shard_name;
    tensors_of[shard_name].push_back(name);
  }

  TensorStore result(dir);
  for (const auto& [shard_name, names] : tensors_of) {
    const std::string shard_path = JoinPath(dir, shard_name);
    if (!IsRegularFile(shard_path)) {
      return absl::NotFoundError(absl::StrCat(
          index_path, ": shard file ", shard_path, " (holding tensor '",
          names.front(), "') does not exist"));
    }
    MOH_ASSIGN_OR_RETURN(TensorStore shard, read_file(shard_path));
    for (const std::string& name : shard.Names()) {
      auto it = shard_of.find(name);
      if (it == shard_of.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            shard_path, ": tensor '", name, "' is not listed in ", index_path));
      }
      if (it->second != shard_name) {
        return absl::InvalidArgumentError(absl::StrCat(
            shard_path, ": tensor '", name, "' is listed for shard ",
            it->second, " in ", index_path));
      }
    }
    for (const std::string& name : names) {
      if (!shard.Contains(name)) {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path, ": tensor '", name, "' is mapped to ",
                         shard_path, ", which does not contain it"));
      }
    }
    MOH_RETURN_IF_ERROR(result.MergeFrom(std::move(shard)));
  }
  return result;
}

}  // namespace

absl::Status TensorStore::Insert(std::string name, at::Tensor tensor,
                                 std::string source_file) {
  auto it = entries_.find(name);
  if (it != entries_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "' appears twice: in ",
                     it->second.source_file, " and in ", source_file));
  }
  entries_.emplace(std::move(name),
                   Entry{std::move(tensor), std::move(source_file)});
  return absl::OkStatus();
}

absl::Status TensorStore::MergeFrom(TensorStore other) {
  for (auto& [name, entry] : other.entries_) {
    MOH_RETURN_IF_ERROR(
        Insert(name, std::move(entry.tensor), std::move(entry.source_file)));
  }
  return absl::OkStatus();
}

bool TensorStore::Contains(std::string_view name) const {
  return Find(name) != nullptr;
}

std::vector<std::string> TensorStore::Names() const {
  std::vector<std::string> names;
  names.reserve(entries_.size());
  for (const auto& [name, entry] : entries_) names.push_back(name);
  return names;
}

const TensorStore::Entry* TensorStore::Find(std::string_view name) const {
  auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : &it->second;
}

absl::Status TensorStore::MissingError(std::string_view name) const {
  return absl::NotFoundError(absl::StrCat(
      "checkpoint ", description_, ": tensor '", AsAbsl(name), "' is missing"));
}

absl::StatusOr<std::string> TensorStore::SourceFile(
    std::string_view name) const {
  const Entry* entry = Find(name);
  if (entry == nullptr) return MissingError(name);
  return entry->source_file;
}

absl::StatusOr<at::Tensor> TensorStore::Get(std::string_view name) const {
  const Entry* entry = Find(name);
  if (entry == nullptr) return MissingError(name);
  return entry->tensor;
}

absl::StatusOr<at::Tensor> TensorStore::Take(std::string_view name,
                                             at::IntArrayRef shape,
                                             at::ScalarType dtype) {
  return Take(name, shape, at::TensorOptions().dtype(dtype));
}

absl::StatusOr<at::Tensor> TensorStore::Take(std::string_view name,
                                             at::IntArrayRef shape,
                                             const at::TensorOptions& options) {
  const Entry* entry = Find(name);
  if (entry == nullptr) return MissingError(name);
  if (!entry->tensor.sizes().equals(shape)) {
    return absl::InvalidArgumentError(absl::StrCat(
        entry->source_file, ": tensor '", AsAbsl(name), "' has shape ",
        FormatShape(entry->tensor.sizes()), ", expected ", FormatShape(shape)));
  }
  at::Tensor copy;
  try {
    // A fresh buffer: the result never aliases the (read-only) mapping.
    copy = at::empty(shape, options);
    copy.copy_(entry->tensor);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat(
        entry->source_file, ": cannot convert tensor '", AsAbsl(name), "' to ",
        c10::toString(at::typeMetaToScalarType(options.dtype())), " on ",
        options.device().str(), ": ", e.what_without_backtrace()));
  }
  taken_.emplace(name);
  return copy;
}

void TensorStore::Discard(std::string_view prefix) {
  for (auto it = entries_.lower_bound(prefix);
       it != entries_.end() && it->first.compare(0, prefix.size(), prefix) == 0;
       ++it) {
    taken_.insert(it->first);
  }
}

absl::Status TensorStore::CheckAllTaken() const {
  std::vector<std::string> extra;
  for (const auto& [name, entry] : entries_) {
    if (taken_.count(name) == 0) {
      extra.push_back(absl::StrCat("unexpected tensor '", name, "' in ",
                                   entry.source_file));
    }
  }
  if (extra.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrJoin(extra, "; "));
}

absl::StatusOr<size_t> StridedExtent(at::IntArrayRef sizes,
                                     at::IntArrayRef strides) {
  if (sizes.size() != strides.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape ", FormatShape(sizes), " and strides ",
                     FormatShape(strides), " differ in rank"));
  }
  size_t extent = 1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0 || strides[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("negative size or stride in shape ", FormatShape(sizes),
                       " strides ", FormatShape(strides)));
    }
    if (sizes[i] == 0) return 0;
    size_t step;
    if (__builtin_mul_overflow(static_cast<size_t>(sizes[i] - 1),
                               static_cast<size_t>(strides[i]), &step) ||
        __builtin_add_overflow(extent, step, &extent)) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", FormatShape(sizes), " overflows"));
    }
  }
  return extent;
}

absl::StatusOr<at::Tensor> TensorFromMappedFile(
    const std::shared_ptr<MappedFile>& file, size_t byte_offset,
    at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype) {
  MOH_ASSIGN_OR_RETURN(size_t extent, StridedExtent(sizes, strides));
  size_t bytes;
  const size_t element_size = c10::elementSize(dtype);
  if (__builtin_mul_overflow(extent, element_size, &bytes) ||
      byte_offset > file->size() || bytes > file->size() - byte_offset) {
    return absl::InvalidArgumentError(
        absl::StrCat(file->path(), ": tensor bytes at offset ", byte_offset,
                     " run past the end of the file"));
  }
  try {
    void* data = const_cast<uint8_t*>(file->data()) + byte_offset;
    if (bytes > 0 && reinterpret_cast<uintptr_t>(data) % element_size != 0) {
      // Misaligned for its type (safetensors does not align its tensors): a
      // copy, so that no kernel reads a misaligned element.
      at::Tensor copy = at::empty({static_cast<int64_t>(extent)},
                                  at::TensorOptions().dtype(dtype));
      std::memcpy(copy.data_ptr(), data, bytes);
      return copy.as_strided(sizes, strides);
    }
    // The deleter holds `file` so the mapping outlives every tensor on it.
    return at::from_blob(
        data, sizes, strides, [file](void*) {},
        at::TensorOptions().dtype(dtype).device(at::kCPU));
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        file->path(), ": cannot create tensor: ", e.what_without_backtrace()));
  }
}

// The regular files named *.pth or *.pt (torch.save's usual suffixes: the
// MoH-ViT release files, the MoH-DiT one) in `dir`, sorted; none if `dir`
// cannot be listed.
std::vector<std::string> PthFiles(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code error;
  for (fs::directory_iterator it(dir, error), end; !error && it != end;
       it.increment(error)) {
    const std::string name = it->path().filename().string();
    const bool torch_save = (name.size() > 4 && absl::EndsWith(name, ".pth")) ||
                            (name.size() > 3 && absl::EndsWith(name, ".pt"));
    if (torch_save && IsRegularFile(JoinPath(dir, name))) {
      names.push_back(name);
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

absl::StatusOr<TensorStore> LoadCheckpoint(const std::string& dir,
                                           const CheckpointOptions& options) {
  // Shards keep their names: they must match the index.
  CheckpointOptions shard_options = options;
  shard_options.strip_module_prefix = false;
  const FileReader read_bin = [&options](const std::string& path) {
    return ReadTorchBinFile(path, options);
  };
  const FileReader read_bin_shard = [&shard_options](const std::string& path) {
    return ReadTorchBinFile(path, shard_options);
  };
  const FileReader read_safetensors = [](const std::string& path) {
    return ReadSafetensorsFile(path);
  };
  struct Layout {
    const char* file_name;
    bool sharded;
    const FileReader& read_file;
  };
  const Layout layouts[] = {
      {"model.safetensors", false, read_safetensors},
      {"model.safetensors.index.json", true, read_safetensors},
      {"pytorch_model.bin", false, read_bin},
      {"pytorch_model.bin.index.json", true, read_bin_shard},
  };
  std::vector<std::string> tried;
  for (const Layout& layout : layouts) {
    const std::string path = JoinPath(dir, layout.file_name);
    tried.push_back(layout.file_name);
    if (!IsRegularFile(path)) continue;
    if (layout.sharded) {
      return LoadShardedCheckpoint(dir, layout.file_name, layout.read_file);
    }
    MOH_ASSIGN_OR_RETURN(TensorStore store, layout.read_file(path));
    store.set_description(dir);
    return store;
  }
  const std::vector<std::string> pth = PthFiles(dir);
  if (pth.size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint ", dir, ": ", pth.size(), " *.pth/*.pt files (",
        absl::StrJoin(pth, ", "), ") and none of ", absl::StrJoin(tried, ", "),
        "; keep exactly one"));
  }
  if (pth.size() == 1) {
    MOH_ASSIGN_OR_RETURN(TensorStore store,
                         read_bin(JoinPath(dir, pth.front())));
    store.set_description(dir);
    return store;
  }
  return absl::NotFoundError(absl::StrCat("checkpoint ", dir, ": none of ",
                                          absl::StrJoin(tried, ", "),
                                          " or a *.pth or *.pt file exists"));
}

}  // namespace moh
