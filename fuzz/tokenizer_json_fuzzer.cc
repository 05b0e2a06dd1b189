// Fuzzes tokenizer.json loading (model/tokenizer/tokenizer.h,
// Tokenizer::FromJson): the model, added tokens, normalizer, pre-tokenizer
// (PCRE2 patterns included), post-processor and decoder sections. A tokenizer
// that loads must encode a fixed text into ids that it can decode again.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz/fuzz_check.h"
#include "model/tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::StatusOr<std::unique_ptr<moh::Tokenizer>> tokenizer =
      moh::Tokenizer::FromJson(moh::fuzz::AsText(data, size),
                               "fuzz/tokenizer.json");
  if (!tokenizer.ok()) {
    moh::fuzz::CheckInvalidArgument(tokenizer.status());
    return 0;
  }
  const moh::Tokenizer& t = **tokenizer;
  for (bool special : {false, true}) {
    const std::vector<int32_t> ids = t.Encode(
        "Hello, world! <s> caf\xc3\xa9 \xe2\x96\x81 1234\n\t", special);
    for (int32_t id : ids) {
      MOH_FUZZ_CHECK(id >= 0 && id < t.vocab_size() && t.IdToToken(id),
                     absl::StrCat("Encode gave id ", id,
                                  " outside the "
                                  "vocabulary of ",
                                  t.vocab_size()));
    }
    absl::StatusOr<std::string> text = t.Decode(ids, !special);
    MOH_FUZZ_CHECK(text.ok(), text.status().ToString());
    MOH_FUZZ_CHECK(moh::fuzz::IsValidUtf8(*text), "Decode gave invalid UTF-8");
  }
  return 0;
}
