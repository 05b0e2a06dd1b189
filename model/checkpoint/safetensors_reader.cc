#include "model/checkpoint/safetensors_reader.h"

#include <c10/util/strides.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace moh {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100 << 20;
constexpr char kMetadataKey[] = "__metadata__";

struct TensorEntry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin;
  uint64_t end;
};

constexpr std::pair<const char*, at::ScalarType> kDtypes[] = {
    {"F32", at::kFloat}, {"F16", at::kHalf}, {"BF16", at::kBFloat16},
    {"I64", at::kLong},  {"I32", at::kInt},  {"I8", at::kChar},
    {"U8", at::kByte},
};

bool DtypeFromName(const std::string& name, at::ScalarType* dtype) {
  for (const auto& [dtype_name, scalar_type] : kDtypes) {
    if (name == dtype_name) {
      *dtype = scalar_type;
      return true;
    }
  }
  return false;
}

// Reads one non-negative JSON integer (nlohmann parses those as unsigned).
bool GetUnsigned(const nlohmann::json& value, uint64_t* out) {
  if (!value.is_number_unsigned()) return false;
  *out = value.get<uint64_t>();
  return true;
}

// `shape` for messages. Nested values are not printed: dump() recurses, and
// a header of a few hundred KB of "[" would overflow the stack.
std::string ShapeText(const nlohmann::json& shape) {
  for (const nlohmann::json& dim : shape) {
    if (dim.is_structured()) return "a nested array or object";
  }
  return shape.dump();
}

// Validates one header entry; `data_size` is the size of the data area.
absl::StatusOr<TensorEntry> ParseEntry(const std::string& path,
                                       const std::string& name,
                                       const nlohmann::json& value,
                                       uint64_t data_size) {
  const std::string where = absl::StrCat(path, ": tensor '", name, "'");
  if (!value.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": header entry is not a JSON object"));
  }
  TensorEntry entry;
  entry.name = name;
  auto dtype = value.find("dtype");
  if (dtype == value.end() || !dtype->is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": \"dtype\" is missing or not a string"));
  }
  const std::string& dtype_name = dtype->get_ref<const std::string&>();
  if (!DtypeFromName(dtype_name, &entry.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unsupported dtype '", dtype_name, "' for tensor '", name, "' in ",
        path, " (supported: F32, F16, BF16, I64, I32, I8, U8)"));
  }
  auto shape = value.find("shape");
  if (shape == value.end() || !shape->is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": \"shape\" is missing or not an array"));
  }
  uint64_t numel = 1;
  for (const nlohmann::json& dim : *shape) {
    uint64_t d;
    if (!GetUnsigned(dim, &d) ||
        d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": \"shape\" must hold non-negative integers, got ",
          ShapeText(*shape)));
    }
    if (__builtin_mul_overflow(numel, d, &numel)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": shape ", ShapeText(*shape), " overflows"));
    }
    entry.shape.push_back(static_cast<int64_t>(d));
  }
  auto offsets = value.find("data_offsets");
  if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2 ||
      !GetUnsigned((*offsets)[0], &entry.begin) ||
      !GetUnsigned((*offsets)[1], &entry.end)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where,
        ": \"data_offsets\" must be [begin, end] non-negative integers"));
  }
  if (entry.begin > entry.end || entry.end > data_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": data_offsets [", entry.begin, ", ", entry.end,
        "] out of range of the data area (", data_size, " bytes)"));
  }
  uint64_t nbytes;
  if (__builtin_mul_overflow(numel, c10::elementSize(entry.dtype), &nbytes) ||
      entry.end - entry.begin != nbytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": data_offsets span ", entry.end - entry.begin,
                     " bytes but dtype ", dtype_name, " and shape ",
                     ShapeText(*shape), " need ", nbytes));
  }
  return entry;
}

// Parses the JSON header, rejecting duplicate top-level keys (which a plain
// parse would silently collapse).
absl::StatusOr<nlohmann::json> ParseHeader(const std::string& path,
                                           const char* begin, const char* end) {
  std::set<std::string> keys;
  std::string duplicate;
  auto callback = [&](int depth, nlohmann::json::parse_event_t event,
                      nlohmann::json& parsed) {
    if (event == nlohmann::json::parse_event_t::key && depth == 1 &&
        !keys.insert(parsed.get<std::string>()).second) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  nlohmann::json header =
      nlohmann::json::parse(begin, end, callback, /*allow_exceptions=*/false);
  if (header.is_discarded()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header is not valid JSON"));
  }
  if (!header.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header is not a JSON object"));
  }
  if (!duplicate.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": tensor '", duplicate, "' appears twice in the header"));
  }
  return header;
}

absl::Status CheckMetadata(const std::string& path,
                           const nlohmann::json& metadata) {
  bool ok = metadata.is_object();
  for (auto it = metadata.begin(); ok && it != metadata.end(); ++it) {
    ok = it->is_string();
  }
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      path, ": \"", kMetadataKey, "\" must map strings to strings"));
}

}  // namespace

const char* SafetensorsDtypeName(at::ScalarType dtype) {
  for (const auto& [name, scalar_type] : kDtypes) {
    if (dtype == scalar_type) return name;
  }
  return nullptr;
}

absl::StatusOr<TensorStore> ReadSafetensorsFile(const std::string& path) {
  MOH_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> file,
                       MappedFile::Open(path));
  return ReadSafetensors(std::move(file));
}

absl::StatusOr<TensorStore> ReadSafetensors(std::shared_ptr<MappedFile> file) {
  const std::string& path = file->path();
  if (file->size() < 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": truncated: ", file->size(),
                     " bytes, too short for the 8-byte header length"));
  }
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i)
    header_size = (header_size << 8) | file->data()[i];
  if (header_size > kMaxHeaderBytes || header_size > file->size() - 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": header length ", header_size, " exceeds the file size (",
        file->size(), " bytes) or the 100 MB limit"));
  }
  const char* header_begin = reinterpret_cast<const char*>(file->data()) + 8;
  MOH_ASSIGN_OR_RETURN(
      nlohmann::json header,
      ParseHeader(path, header_begin, header_begin + header_size));

  const uint64_t data_start = 8 + header_size;
  const uint64_t data_size = file->size() - data_start;
  std::vector<TensorEntry> entries;
  for (const auto& [name, value] : header.items()) {
    if (name == kMetadataKey) {
      MOH_RETURN_IF_ERROR(CheckMetadata(path, value));
      continue;
    }
    MOH_ASSIGN_OR_RETURN(TensorEntry entry,
                         ParseEntry(path, name, value, data_size));
    entries.push_back(std::move(entry));
  }

  std::sort(entries.begin(), entries.end(),
            [](const TensorEntry& a, const TensorEntry& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  for (size_t i = 1; i < entries.size(); ++i) {
    if (entries[i].begin < entries[i - 1].end) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": tensor '", entries[i].name, "' (bytes ", entries[i].begin,
          "..", entries[i].end, ") overlaps tensor '", entries[i - 1].name,
          "' (bytes ", entries[i - 1].begin, "..", entries[i - 1].end, ")"));
    }
  }

  TensorStore store(path);
  for (TensorEntry& entry : entries) {
    MOH_ASSIGN_OR_RETURN(
        at::Tensor tensor,
        TensorFromMappedFile(file, data_start + entry.begin, entry.shape,
                             c10::contiguous_strides(entry.shape),
                             entry.dtype));
    MOH_RETURN_IF_ERROR(
        store.Insert(std::move(entry.name), std::move(tensor), path));
  }
  return store;
}

}  // namespace moh
