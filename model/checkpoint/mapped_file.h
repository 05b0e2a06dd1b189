// Read-only memory mapping of a whole file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace moh {

// Maps a whole file read-only (PROT_READ, MAP_PRIVATE) for the lifetime of the
// object and unmaps it on destruction. Writing through data() is undefined
// (it faults). An empty file maps to data() == nullptr, size() == 0.
// Thread-safe: the object is immutable after Open or FromBytes.
class MappedFile {
 public:
  // Errors: NOT_FOUND if `path` does not exist, INVALID_ARGUMENT if it is not a
  // regular file, otherwise the errno of open/fstat/mmap as a status; every
  // message names `path`.
  static absl::StatusOr<std::shared_ptr<MappedFile>> Open(
      const std::string& path);
  // A private heap copy of `bytes`, named `path` in messages, for readers fed
  // from memory (fuzzers, tests): exactly bytes.size() bytes, so a read past
  // the end is caught by AddressSanitizer. data() == nullptr when empty.
  static std::shared_ptr<MappedFile> FromBytes(std::string path,
                                               std::string_view bytes);

  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}

  std::string path_;
  const uint8_t* data_;
  size_t size_;
  std::unique_ptr<uint8_t[]> copy_;  // FromBytes: owns data_ (not mapped).
};

}  // namespace moh
