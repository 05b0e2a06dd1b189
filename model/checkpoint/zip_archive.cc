#include "model/checkpoint/zip_archive.h"

#include <algorithm>
#include <initializer_list>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace moh {
namespace {

uint64_t LoadLittleEndian(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

constexpr uint32_t kEocdSignature = 0x06054b50;
constexpr uint32_t kZip64LocatorSignature = 0x07064b50;
constexpr uint32_t kZip64EocdSignature = 0x06064b50;
constexpr uint32_t kCentralSignature = 0x02014b50;
constexpr uint32_t kLocalSignature = 0x04034b50;
constexpr size_t kEocdSize = 22, kZip64LocatorSize = 20, kZip64EocdSize = 56;
constexpr size_t kCentralSize = 46, kLocalSize = 30;

// True if [offset, offset + length) lies inside a file of `size` bytes.
bool InFile(uint64_t offset, uint64_t length, uint64_t size) {
  return offset <= size && length <= size - offset;
}

// Reads the ZIP64 extended-information extra field of a central directory
// entry: replaces each of `fields` that is saturated (0xFFFFFFFF) in order.
bool ApplyZip64Extra(const uint8_t* extra, size_t extra_size,
                     std::initializer_list<uint64_t*> fields) {
  for (size_t pos = 0; pos + 4 <= extra_size;) {
    const uint16_t id = LoadLittleEndian(extra + pos, 2);
    const uint16_t size = LoadLittleEndian(extra + pos + 2, 2);
    if (pos + 4 + size > extra_size) return false;
    if (id == 0x0001) {
      size_t used = 0;
      for (uint64_t* field : fields) {
        if (*field != 0xFFFFFFFF) continue;
        if (used + 8 > size) return false;
        *field = LoadLittleEndian(extra + pos + 4 + used, 8);
        used += 8;
      }
      return true;
    }
    pos += 4 + size;
  }
  for (uint64_t* field : fields) {
    if (*field == 0xFFFFFFFF) return false;
  }
  return true;
}

absl::Status FileError(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

// The offset of the end-of-central-directory record, which is followed by a
// comment < 64 KiB; -1 if there is none.
int64_t FindEocd(const uint8_t* data, uint64_t size) {
  int64_t eocd = -1;
  if (size >= kEocdSize) {
    const uint64_t last = size - kEocdSize;
    const int64_t lowest = last > 0xFFFF ? last - 0xFFFF : 0;
    for (int64_t pos = last; pos >= lowest; --pos) {
      if (LoadLittleEndian(data + pos, 4) == kEocdSignature &&
          pos + kEocdSize + LoadLittleEndian(data + pos + 20, 2) <= size) {
        eocd = pos;
        break;
      }
    }
  }
  return eocd;
}

// Where the central directory lies and how many entries it has, from the
// end-of-central-directory record at `eocd` (or its ZIP64 record).
struct CentralDirectory {
  uint64_t entries = 0, size = 0, offset = 0;
};

absl::StatusOr<CentralDirectory> LocateCentralDirectory(const std::string& path,
                                                        const uint8_t* data,
                                                        uint64_t size,
                                                        int64_t eocd) {
  uint64_t entries = LoadLittleEndian(data + eocd + 10, 2);
  uint64_t cd_size = LoadLittleEndian(data + eocd + 12, 4);
  uint64_t cd_offset = LoadLittleEndian(data + eocd + 16, 4);
  const bool zip64 = eocd >= static_cast<int64_t>(kZip64LocatorSize) &&
                     LoadLittleEndian(data + eocd - kZip64LocatorSize, 4) ==
                         kZip64LocatorSignature;
  if (zip64) {
    const uint64_t locator = eocd - kZip64LocatorSize;
    const uint64_t record = LoadLittleEndian(data + locator + 8, 8);
    if (!InFile(record, kZip64EocdSize, size) ||
        LoadLittleEndian(data + record, 4) != kZip64EocdSignature) {
      return FileError(path, "bad ZIP64 end of central directory record");
    }
    entries = LoadLittleEndian(data + record + 32, 8);
    cd_size = LoadLittleEndian(data + record + 40, 8);
    cd_offset = LoadLittleEndian(data + record + 48, 8);
  } else if (entries == 0xFFFF || cd_size == 0xFFFFFFFF ||
             cd_offset == 0xFFFFFFFF) {
    return FileError(path, "ZIP64 archive without a ZIP64 locator");
  }
  if (!InFile(cd_offset, cd_size, size) || entries > cd_size / kCentralSize) {
    return FileError(path, "central directory out of range (truncated file?)");
  }
  CentralDirectory cd;
  cd.entries = entries;
  cd.size = cd_size;
  cd.offset = cd_offset;
  return cd;
}

// The central directory's entries, each checked to lie inside the file.
using Directory = std::map<std::string, ZipArchive::Entry>;

absl::StatusOr<Directory> ReadEntries(const std::string& path,
                                      const uint8_t* data, uint64_t size,
                                      const CentralDirectory& cd) {
  auto error = [&](const std::string& what) { return FileError(path, what); };
  Directory directory;
  uint64_t pos = cd.offset;
  const uint64_t cd_end = cd.offset + cd.size;
  for (uint64_t i = 0; i < cd.entries; ++i) {
    if (!InFile(pos, kCentralSize, cd_end) ||
        LoadLittleEndian(data + pos, 4) != kCentralSignature) {
      return error(absl::StrCat("bad central directory entry ", i));
    }
    const uint64_t flags = LoadLittleEndian(data + pos + 8, 2);
    const uint16_t method = LoadLittleEndian(data + pos + 10, 2);
    uint64_t compressed = LoadLittleEndian(data + pos + 20, 4);
    uint64_t uncompressed = LoadLittleEndian(data + pos + 24, 4);
    const uint64_t name_size = LoadLittleEndian(data + pos + 28, 2);
    const uint64_t extra_size = LoadLittleEndian(data + pos + 30, 2);
    const uint64_t comment_size = LoadLittleEndian(data + pos + 32, 2);
    uint64_t local = LoadLittleEndian(data + pos + 42, 4);
    const uint64_t variable = name_size + extra_size + comment_size;
    if (!InFile(pos + kCentralSize, variable, cd_end)) {
      return error(absl::StrCat("bad central directory entry ", i));
    }
    std::string name(reinterpret_cast<const char*>(data) + pos + kCentralSize,
                     name_size);
    if (!ApplyZip64Extra(data + pos + kCentralSize + name_size, extra_size,
                         {&uncompressed, &compressed, &local})) {
      return error(absl::StrCat("entry '", name, "': bad ZIP64 extra field"));
    }
    if (flags & 1)
      return error(absl::StrCat("entry '", name, "' is encrypted"));
    if (!InFile(local, kLocalSize, size) ||
        LoadLittleEndian(data + local, 4) != kLocalSignature) {
      return error(absl::StrCat("entry '", name,
                                "': local header out of range (truncated?)"));
    }
    ZipArchive::Entry entry;
    entry.method = method;
    entry.size = uncompressed;
    entry.data_offset = local + kLocalSize +
                        LoadLittleEndian(data + local + 26, 2) +
                        LoadLittleEndian(data + local + 28, 2);
    if (!InFile(entry.data_offset, compressed, size)) {
      return error(absl::StrCat(
          "entry '", name, "' runs past the end of the file (truncated?)"));
    }
    if (method == 0 && compressed != uncompressed) {
      return error(
          absl::StrCat("entry '", name, "' is stored with inconsistent sizes"));
    }
    directory[name] = entry;
    pos += kCentralSize + variable;
  }
  return directory;
}

}  // namespace

absl::StatusOr<ZipArchive> ZipArchive::Read(const MappedFile& file) {
  const int64_t eocd = FindEocd(file.data(), file.size());
  if (eocd < 0) {
    return FileError(
        file.path(),
        "not a zip archive (no end of central directory record; truncated, "
        "or a legacy non-zip torch.save file?)");
  }
  MOH_ASSIGN_OR_RETURN(
      const CentralDirectory cd,
      LocateCentralDirectory(file.path(), file.data(), file.size(), eocd));
  MOH_ASSIGN_OR_RETURN(Directory directory,
                       ReadEntries(file.path(), file.data(), file.size(), cd));
  return ZipArchive(file.path(), std::move(directory));
}

absl::StatusOr<ZipArchive::Entry> ZipArchive::StoredEntry(
    const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": zip entry '", name, "' is missing"));
  }
  if (it->second.method != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        path_, ": zip entry '", name, "' is compressed (method ",
        it->second.method, "); only STORED entries are supported"));
  }
  return it->second;
}

}  // namespace moh
