#include "model/checkpoint/torch_bin_reader.h"

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/checkpoint/torch_unpickler.h"
#include "model/checkpoint/zip_archive.h"

namespace moh {
namespace {

using pickle::Value;
using pickle::ValuePtr;

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
  return ReadTorchBin(std::move(file));
}

absl::StatusOr<TensorStore> ReadTorchBin(std::shared_ptr<MappedFile> file) {
  const std::string& path = file->path();
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
  pickle::Unpickler unpickler(absl::StrCat(path, "/", pkl_name),
                              file->data() + pkl.data_offset, pkl.size, archive,
                              prefix);
  MOH_ASSIGN_OR_RETURN(ValuePtr root, unpickler.Run());
  TensorStore store(path);
  MOH_RETURN_IF_ERROR(
      CollectTensors(absl::StrCat(path, "/", pkl_name), *root, file, store));
  return store;
}

}  // namespace moh
