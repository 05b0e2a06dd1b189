// Directory of a ZIP archive held in a memory-mapped file.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "model/checkpoint/mapped_file.h"

namespace moh {

// The central directory of a ZIP archive (PKWARE APPNOTE), as far as reading
// torch.save archives needs: ZIP64 records and extra fields are supported;
// encrypted entries and multi-disk archives are not. Nothing is decompressed:
// only STORED entries can be read. Immutable, thread-safe, copyable.
class ZipArchive {
 public:
  struct Entry {
    uint64_t data_offset = 0;  // Of the entry's bytes in the file.
    uint64_t size = 0;         // Compressed size (== size when STORED).
    uint16_t method = 0;       // 0 = STORED.
  };

  // Parses the directory of `file`, checking that every entry's local header
  // and bytes lie inside the file. INVALID_ARGUMENT naming the file (and the
  // entry) if it is not a well-formed archive, e.g. truncated.
  static absl::StatusOr<ZipArchive> Read(const MappedFile& file);

  const std::map<std::string, Entry>& entries() const { return entries_; }

  // Entry `name`, whose bytes are file.data()[data_offset, data_offset +
  // size). INVALID_ARGUMENT naming file and entry if it is absent or not
  // STORED.
  absl::StatusOr<Entry> StoredEntry(const std::string& name) const;

 private:
  ZipArchive(std::string path, std::map<std::string, Entry> entries)
      : path_(std::move(path)), entries_(std::move(entries)) {}

  std::string path_;
  std::map<std::string, Entry> entries_;
};

}  // namespace moh
