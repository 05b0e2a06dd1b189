// Fuzzes encoding and decoding (model/tokenizer/tokenizer.h) on the
// repository's tokenizers: the demo model's (models/demo-lm) and the test
// data's ByteLevel and Metaspace ones (tests/testdata). The first input byte
// picks the tokenizer and the flags, the bytes up to the next 0xFF are the
// text to encode, the rest are 16-bit ids to decode (some outside the
// vocabulary). Checked: encoded ids are in the vocabulary and decode; decoded
// text is valid UTF-8; IncrementalDecoder, fed the same ids, returns pieces of
// valid UTF-8 whose concatenation equals Decode, refusing the ids Decode does.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz/fuzz_check.h"
#include "model/tokenizer/tokenizer.h"

namespace {

const std::vector<std::unique_ptr<moh::Tokenizer>>& Tokenizers() {
  static const auto* tokenizers = [] {
    auto* loaded = new std::vector<std::unique_ptr<moh::Tokenizer>>;
    for (const char* path : {"/models/demo-lm/tokenizer.json",
                             "/tests/testdata/tokenizer_bytelevel.json",
                             "/tests/testdata/tokenizer_metaspace.json"}) {
      absl::StatusOr<std::unique_ptr<moh::Tokenizer>> tokenizer =
          moh::Tokenizer::FromFile(absl::StrCat(MOH_SOURCE_DIR, path));
      MOH_FUZZ_CHECK(tokenizer.ok(), tokenizer.status().ToString());
      loaded->push_back(std::move(*tokenizer));
    }
    return loaded;
  }();
  return *tokenizers;
}

void CheckDecode(const moh::Tokenizer& t, const std::vector<int32_t>& ids,
                 bool skip_special) {
  std::vector<int32_t> known;
  for (int32_t id : ids) {
    if (t.IdToToken(id)) known.push_back(id);
  }
  absl::StatusOr<std::string> all = t.Decode(ids, skip_special);
  MOH_FUZZ_CHECK(all.ok() == (known.size() == ids.size()),
                 absl::StrCat("Decode: ", all.status().ToString()));
  absl::StatusOr<std::string> text = t.Decode(known, skip_special);
  MOH_FUZZ_CHECK(text.ok(), text.status().ToString());
  MOH_FUZZ_CHECK(moh::fuzz::IsValidUtf8(*text), "Decode gave invalid UTF-8");

  moh::IncrementalDecoder decoder(t, skip_special);
  std::string pieces;
  for (int32_t id : ids) {
    absl::StatusOr<std::string> piece = decoder.Push(id);
    MOH_FUZZ_CHECK(piece.ok() == t.IdToToken(id).has_value(),
                   absl::StrCat("Push(", id, "): ", piece.status().ToString()));
    if (!piece.ok()) continue;
    MOH_FUZZ_CHECK(moh::fuzz::IsValidUtf8(*piece),
                   absl::StrCat("Push(", id, ") gave invalid UTF-8"));
    pieces += *piece;
  }
  const std::string rest = decoder.Flush();
  MOH_FUZZ_CHECK(moh::fuzz::IsValidUtf8(rest), "Flush gave invalid UTF-8");
  pieces += rest;
  MOH_FUZZ_CHECK(pieces == *text, absl::StrCat("incremental \"", pieces,
                                               "\" != Decode \"", *text, "\""));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const auto& tokenizers = Tokenizers();
  const moh::Tokenizer& t = *tokenizers[data[0] % tokenizers.size()];
  const bool add_special = (data[0] >> 4) & 1;
  const bool skip_special = (data[0] >> 5) & 1;
  std::string_view rest = moh::fuzz::AsText(data + 1, size - 1);
  const size_t split = std::min(rest.find('\xff'), rest.size());
  const std::string_view text = rest.substr(0, split);
  rest.remove_prefix(std::min(split + 1, rest.size()));

  const std::vector<int32_t> encoded = t.Encode(text, add_special);
  for (int32_t id : encoded) {
    MOH_FUZZ_CHECK(t.IdToToken(id).has_value(),
                   absl::StrCat("Encode gave id ", id,
                                " outside the "
                                "vocabulary of ",
                                t.vocab_size()));
  }
  CheckDecode(t, encoded, skip_special);

  // Ids cover the vocabulary and a few beyond it on either side.
  std::vector<int32_t> ids;
  for (size_t i = 0; i + 1 < rest.size(); i += 2) {
    const int raw = static_cast<uint8_t>(rest[i]) |
                    (static_cast<uint8_t>(rest[i + 1]) << 8);
    ids.push_back(raw % (t.vocab_size() + 4) - 2);
  }
  CheckDecode(t, ids, skip_special);
  return 0;
}
