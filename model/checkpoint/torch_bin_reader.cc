#include "model/checkpoint/torch_bin_reader.h"

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/abbreviate.h"
#include "base/status_macros.h"
#include "model/checkpoint/torch_unpickler.h"
#include "model/checkpoint/zip_archive.h"

namespace moh {
namespace {

using pickle::Value;
using pickle::ValuePtr;

constexpr char kModulePrefix[] = "module.";
constexpr size_t kModulePrefixLength = sizeof(kModulePrefix) - 1;
constexpr size_t kMaxListedKeys = 20;

// A dict key for messages: 'text' (abbreviated) for strings, the number for
// ints.
std::string KeyText(const Value& key) {
  switch (key.kind) {
    case Value::Kind::kString:
      return absl::StrCat("'", Abbreviate(key.text), "'");
    case Value::Kind::kInt:
      return absl::StrCat(key.integer);
    default:
      return "(not a string)";
  }
}

// The value under string key `key` of `dict` (the last one, as in Python),
// or nullptr.
const Value* Lookup(const Value& dict, std::string_view key) {
  const Value* found = nullptr;
  for (size_t i = 0; i + 1 < dict.items.size(); i += 2) {
    const Value& k = *dict.items[i];
    if (k.kind == Value::Kind::kString && k.text == key) {
      found = dict.items[i + 1].get();
    }
  }
  return found;
}

// Why `dict` is not a state dict (name -> tensor), or "" if it is one.
std::string NotAStateDict(const Value& dict) {
  for (size_t i = 0; i + 1 < dict.items.size(); i += 2) {
    const Value& key = *dict.items[i];
    if (key.kind != Value::Kind::kString) {
      return absl::StrCat("key ", KeyText(key), " is not a string");
    }
    if (dict.items[i + 1]->kind != Value::Kind::kTensor) {
      return absl::StrCat("entry ", KeyText(key), " is not a tensor");
    }
  }
  return "";
}

// The state dict in `root`: the dict under the first container key it holds,
// else `root` itself if it maps names to tensors. Sets `container_key`.
absl::StatusOr<const Value*> FindStateDict(const std::string& where,
                                           const Value& root,
                                           const CheckpointOptions& options,
                                           std::string* container_key) {
  if (root.kind != Value::Kind::kDict) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": top-level object is not a dict"));
  }
  for (const std::string& key : options.container_keys) {
    const Value* value = Lookup(root, key);
    if (value == nullptr || value->kind != Value::Kind::kDict) continue;
    const std::string why = NotAStateDict(*value);
    if (!why.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": container entry '", key, "' is not a state dict: ", why));
    }
    *container_key = key;
    return value;
  }
  const std::string why = NotAStateDict(root);
  if (why.empty()) return &root;
  std::vector<std::string> keys;
  for (size_t i = 0; i + 1 < root.items.size(); i += 2) {
    if (keys.size() == kMaxListedKeys) {
      keys.push_back("...");
      break;
    }
    keys.push_back(KeyText(*root.items[i]));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(where, ": neither a state dict (", why,
                   ") nor a training container with a dict under '",
                   absl::StrJoin(options.container_keys, "', '"),
                   "' (top-level keys: ", absl::StrJoin(keys, ", "), ")"));
}

// Turns `state_dict` (checked by FindStateDict) into named tensors over
// `file`.
absl::Status CollectTensors(const Value& state_dict,
                            const std::shared_ptr<MappedFile>& file,
                            bool strip_module_prefix, TensorStore& store) {
  const std::string& path = file->path();
  bool strip = strip_module_prefix && !state_dict.items.empty();
  for (size_t i = 0; strip && i + 1 < state_dict.items.size(); i += 2) {
    const std::string& name = state_dict.items[i]->text;
    strip = name.size() > kModulePrefixLength &&
            absl::StartsWith(name, kModulePrefix);
  }
  for (size_t i = 0; i + 1 < state_dict.items.size(); i += 2) {
    const std::string& key = state_dict.items[i]->text;
    const Value& value = *state_dict.items[i + 1];
    const std::string name = strip ? key.substr(kModulePrefixLength) : key;
    const std::string prefix = absl::StrCat(path, ": tensor '", name, "'");
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
    MOH_RETURN_IF_ERROR(store.Insert(name, std::move(tensor), path));
  }
  return absl::OkStatus();
}

// The string and integer fields of `args` (a Namespace's state or a dict).
SavedArgs ReadSavedArgs(const Value& args) {
  SavedArgs saved;
  const Value* fields = &args;
  if (args.kind == Value::Kind::kNamespace) {
    if (args.items.empty()) return saved;
    fields = args.items[0].get();
  }
  if (fields->kind != Value::Kind::kDict) return saved;
  for (size_t i = 0; i + 1 < fields->items.size(); i += 2) {
    const Value& key = *fields->items[i];
    const Value& value = *fields->items[i + 1];
    if (key.kind != Value::Kind::kString) continue;
    if (value.kind == Value::Kind::kString) {
      saved.strings[key.text] = value.text;
    } else if (value.kind == Value::Kind::kInt) {
      saved.integers[key.text] = value.integer;
    }
  }
  return saved;
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

absl::StatusOr<TensorStore> ReadTorchBinFile(const std::string& path,
                                             const CheckpointOptions& options) {
  MOH_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> file,
                       MappedFile::Open(path));
  return ReadTorchBin(std::move(file), options);
}

absl::StatusOr<TensorStore> ReadTorchBin(std::shared_ptr<MappedFile> file,
                                         const CheckpointOptions& options) {
  MOH_ASSIGN_OR_RETURN(TorchBinContents contents,
                       ReadTorchBinContents(std::move(file), options));
  return std::move(contents.tensors);
}

absl::StatusOr<TorchBinContents> ReadTorchBinContents(
    std::shared_ptr<MappedFile> file, const CheckpointOptions& options) {
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
  const std::string where = absl::StrCat(path, "/", pkl_name);
  pickle::Unpickler unpickler(where, file->data() + pkl.data_offset, pkl.size,
                              archive, prefix);
  MOH_ASSIGN_OR_RETURN(ValuePtr root, unpickler.Run());
  TorchBinContents contents{TensorStore(path), "", {}};
  MOH_ASSIGN_OR_RETURN(
      const Value* state_dict,
      FindStateDict(where, *root, options, &contents.container_key));
  MOH_RETURN_IF_ERROR(CollectTensors(
      *state_dict, file, options.strip_module_prefix, contents.tensors));
  if (!contents.container_key.empty()) {
    if (const Value* args = Lookup(*root, "args"); args != nullptr) {
      contents.args = ReadSavedArgs(*args);
    }
  }
  return contents;
}

}  // namespace moh
