#include "model/checkpoint/safetensors_writer.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/checkpoint/safetensors_reader.h"

namespace moh {
namespace {

struct Planned {
  std::string name;
  at::Tensor tensor;  // Contiguous.
  size_t bytes;
};

struct FileCloser {
  void operator()(std::FILE* file) const { std::fclose(file); }
};

absl::Status WriteError(const std::string& path) {
  return absl::ErrnoToStatus(errno, absl::StrCat("cannot write ", path));
}

// The tensors of `tensors` in file order: decreasing element size, then name.
absl::StatusOr<std::vector<Planned>> Plan(const std::string& path,
                                          const TensorStore& tensors) {
  std::vector<Planned> planned;
  for (const std::string& name : tensors.Names()) {
    MOH_ASSIGN_OR_RETURN(at::Tensor tensor, tensors.Get(name));
    const std::string where = absl::StrCat(path, ": tensor '", name, "'");
    if (name == "__metadata__") {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the name is reserved for the metadata"));
    }
    if (SafetensorsDtypeName(tensor.scalar_type()) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": unsupported dtype ", c10::toString(tensor.scalar_type()),
          " (supported: F32, F16, BF16, I64, I32, I8, U8)"));
    }
    if (!tensor.device().is_cpu()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " is not on the CPU"));
    }
    tensor = tensor.contiguous();
    const size_t bytes = tensor.numel() * tensor.element_size();
    planned.push_back({name, std::move(tensor), bytes});
  }
  std::stable_sort(planned.begin(), planned.end(),
                   [](const Planned& a, const Planned& b) {
                     return a.tensor.element_size() > b.tensor.element_size();
                   });
  return planned;
}

// The JSON header for `planned`, padded with spaces to a multiple of 8.
absl::StatusOr<std::string> Header(const std::string& path,
                                   const std::vector<Planned>& planned) {
  nlohmann::json header = nlohmann::json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const Planned& p : planned) {
    header[p.name] = {
        {"dtype", SafetensorsDtypeName(p.tensor.scalar_type())},
        {"shape", p.tensor.sizes().vec()},
        {"data_offsets", {offset, offset + p.bytes}},
    };
    offset += p.bytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": a tensor name is not valid UTF-8: ", e.what()));
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

absl::Status WriteAll(std::FILE* file, const std::string& path,
                      const void* data, size_t bytes) {
  if (bytes > 0 && std::fwrite(data, 1, bytes, file) != bytes) {
    return WriteError(path);
  }
  return absl::OkStatus();
}

absl::Status WriteFile(const std::string& path,
                       const std::vector<Planned>& planned,
                       const std::string& header) {
  std::unique_ptr<std::FILE, FileCloser> file(std::fopen(path.c_str(), "wb"));
  if (file == nullptr) return WriteError(path);
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) {
    length[i] =
        static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i));
  }
  MOH_RETURN_IF_ERROR(WriteAll(file.get(), path, length, sizeof(length)));
  MOH_RETURN_IF_ERROR(WriteAll(file.get(), path, header.data(), header.size()));
  for (const Planned& p : planned) {
    MOH_RETURN_IF_ERROR(
        WriteAll(file.get(), path, p.tensor.data_ptr(), p.bytes));
  }
  if (std::fclose(file.release()) != 0) return WriteError(path);
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteSafetensorsFile(const std::string& path,
                                  const TensorStore& tensors) {
  MOH_ASSIGN_OR_RETURN(std::vector<Planned> planned, Plan(path, tensors));
  MOH_ASSIGN_OR_RETURN(std::string header, Header(path, planned));
  const std::string temporary = path + ".tmp";
  absl::Status written = WriteFile(temporary, planned, header);
  if (written.ok() && std::rename(temporary.c_str(), path.c_str()) != 0) {
    written = absl::ErrnoToStatus(
        errno, absl::StrCat("cannot rename ", temporary, " to ", path));
  }
  if (!written.ok()) std::remove(temporary.c_str());
  return written;
}

}  // namespace moh
