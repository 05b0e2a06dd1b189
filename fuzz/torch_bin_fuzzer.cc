// Fuzzes the torch.save reader (model/checkpoint/torch_bin_reader.h) on whole
// files: the zip directory (model/checkpoint/zip_archive.h, ZIP64 included),
// the restricted unpickler on data.pkl and the tensors built over the
// storages. torch_pickle_fuzzer reaches the unpickler more directly.
#include <cstddef>
#include <cstdint>

#include "fuzz/checkpoint_check.h"
#include "fuzz/fuzz_check.h"
#include "model/checkpoint/mapped_file.h"
#include "model/checkpoint/torch_bin_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::shared_ptr<moh::MappedFile> file = moh::MappedFile::FromBytes(
      "fuzz/pytorch_model.bin", moh::fuzz::AsText(data, size));
  moh::fuzz::CheckReaderResult(moh::ReadTorchBin(file), *file);
  return 0;
}
