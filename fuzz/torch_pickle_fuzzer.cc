// Fuzzes the restricted unpickler (model/checkpoint/torch_unpickler.h) and
// the tensors built from what it returns: the input is a data.pkl, wrapped
// into a well-formed torch.save archive whose storages data/0 .. data/3 hold
// 256 bytes each, then read by ReadTorchBin. Seeds are data.pkl files that
// torch.save wrote (fuzz/make_corpus.py).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fuzz/checkpoint_check.h"
#include "fuzz/fuzz_check.h"
#include "model/checkpoint/mapped_file.h"
#include "model/checkpoint/torch_bin_reader.h"

namespace {

void PutLittleEndian(std::string* out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i)
    out->push_back(static_cast<char>(value >> (8 * i)));
}

// A zip archive of STORED entries (no CRCs: the reader does not check them).
std::string StoredZip(
    const std::vector<std::pair<std::string, std::string>>& entries) {
  std::string zip, directory;
  for (const auto& [name, bytes] : entries) {
    const uint64_t local = zip.size();
    PutLittleEndian(&zip, 0x04034b50, 4);  // local file header
    PutLittleEndian(&zip, 20, 2);          // version needed
    PutLittleEndian(&zip, 0, 2);           // flags
    PutLittleEndian(&zip, 0, 2);           // method: STORED
    PutLittleEndian(&zip, 0, 4);           // time, date
    PutLittleEndian(&zip, 0, 4);           // crc
    PutLittleEndian(&zip, bytes.size(), 4);
    PutLittleEndian(&zip, bytes.size(), 4);
    PutLittleEndian(&zip, name.size(), 2);
    PutLittleEndian(&zip, 0, 2);  // extra
    zip += name;
    zip += bytes;
    PutLittleEndian(&directory, 0x02014b50, 4);  // central directory entry
    PutLittleEndian(&directory, 20, 2);          // version made by
    PutLittleEndian(&directory, 20, 2);          // version needed
    PutLittleEndian(&directory, 0, 2);           // flags
    PutLittleEndian(&directory, 0, 2);           // method
    PutLittleEndian(&directory, 0, 4);           // time, date
    PutLittleEndian(&directory, 0, 4);           // crc
    PutLittleEndian(&directory, bytes.size(), 4);
    PutLittleEndian(&directory, bytes.size(), 4);
    PutLittleEndian(&directory, name.size(), 2);
    PutLittleEndian(&directory, 0, 2);  // extra
    PutLittleEndian(&directory, 0, 2);  // comment
    PutLittleEndian(&directory, 0, 2);  // disk
    PutLittleEndian(&directory, 0, 2);  // internal attributes
    PutLittleEndian(&directory, 0, 4);  // external attributes
    PutLittleEndian(&directory, local, 4);
    directory += name;
  }
  const uint64_t directory_offset = zip.size();
  zip += directory;
  PutLittleEndian(&zip, 0x06054b50, 4);  // end of central directory
  PutLittleEndian(&zip, 0, 4);           // disks
  PutLittleEndian(&zip, entries.size(), 2);
  PutLittleEndian(&zip, entries.size(), 2);
  PutLittleEndian(&zip, directory.size(), 4);
  PutLittleEndian(&zip, directory_offset, 4);
  PutLittleEndian(&zip, 0, 2);  // comment
  return zip;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::pair<std::string, std::string>> entries = {
      {"archive/data.pkl", std::string(moh::fuzz::AsText(data, size))},
      {"archive/byteorder", "little"},
      {"archive/version", "3\n"}};
  for (int i = 0; i < 4; ++i) {
    entries.emplace_back("archive/data/" + std::to_string(i),
                         std::string(256, static_cast<char>(i + 1)));
  }
  std::shared_ptr<moh::MappedFile> file =
      moh::MappedFile::FromBytes("fuzz/pytorch_model.bin", StoredZip(entries));
  moh::fuzz::CheckReaderResult(moh::ReadTorchBin(file), *file);
  return 0;
}
