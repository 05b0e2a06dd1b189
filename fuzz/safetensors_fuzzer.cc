// Fuzzes the safetensors reader (model/checkpoint/safetensors_reader.h) on
// whole files: the 8-byte header length, the JSON header (dtypes, shapes,
// offsets, overlaps, metadata) and the data area the tensors view.
#include <cstddef>
#include <cstdint>

#include "fuzz/checkpoint_check.h"
#include "fuzz/fuzz_check.h"
#include "model/checkpoint/mapped_file.h"
#include "model/checkpoint/safetensors_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::shared_ptr<moh::MappedFile> file = moh::MappedFile::FromBytes(
      "fuzz.safetensors", moh::fuzz::AsText(data, size));
  moh::fuzz::CheckReaderResult(moh::ReadSafetensors(file), *file);
  return 0;
}
