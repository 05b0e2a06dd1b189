// Internals of moh::Tokenizer (model/tokenizer.h): the parsed tokenizer.json
// pipeline, its Encode steps (tokenizer_pipeline.cc), and the UTF-8/regex
// helpers they share with the decoder (tokenizer_text.cc).
// Not part of the public API; only model/tokenizer*.cc include it.
#pragma once

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/utf8.h"

namespace moh {
namespace tokenizer_internal {

// base/utf8.h's, under the names the tokenizer has always used.
using ::moh::AppendLossyUtf8;
using ::moh::IsValidUtf8;
using ::moh::kReplacementChar;
using ::moh::NextUtf8;
// Code point at the start of non-empty `s`, U+FFFD if invalid; sets `*len`
// to the bytes it spans (>= 1).
char32_t DecodeUtf8(std::string_view s, int* len);
// Code point ending at `pos` (> 0) of valid UTF-8 `s`; sets `*begin` to
// its first byte.
char32_t CharBefore(std::string_view s, size_t pos, size_t* begin);
// Unicode White_Space, which is what `\s` means to HF's Rust regexes.
bool IsSpace(char32_t c);
// What `\w` means to HF's Rust regexes (Unicode word characters).
bool IsWordChar(char32_t c);
// GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the
// others to U+0100 upwards in byte order. The UTF-8 of the character `byte`
// maps to.
const std::string& ByteLevelChar(uint8_t byte);
// The bytes a ByteLevel decoder gives for `token`: its characters mapped
// back through GPT-2's bytes_to_unicode, or its UTF-8 itself if any is
// unmapped.
std::string ByteLevelBytes(std::string_view token);

// A PCRE2 pattern compiled in UTF + UCP mode. Matching is thread-safe.
class Regex {
 public:
  // InvalidArgument with PCRE2's message when `pattern` does not compile.
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(
      absl::string_view pattern);
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex();

  // Non-overlapping matches left to right as [begin, end) byte offsets.
  // `text` must be valid UTF-8. A match failing on a resource limit ends the
  // search (the rest of the text counts as unmatched).
  std::vector<std::pair<size_t, size_t>> FindAll(std::string_view text) const;

 private:
  explicit Regex(pcre2_code* code) : code_(code) {}
  pcre2_code* code_;
};

struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
  bool normalized = false;
};

// Leftmost-longest literal matching of added-token patterns.
class AddedTokenMatcher {
 public:
  void Add(std::string pattern, int token_index);
  // First match at or after `from`: {begin, end, token index}.
  std::optional<std::tuple<size_t, size_t, int>> Find(std::string_view text,
                                                      size_t from) const;

 private:
  // Per first byte, longest pattern first.
  std::array<std::vector<std::pair<std::string, int>>, 256> buckets_;
};

// A piece of input text; `at_start` when it begins at offset 0 of the input
// (Metaspace's prepend_scheme "first" depends on it).
struct Segment {
  std::string_view text;
  int32_t id = -1;  // >= 0 for an added token.
  bool at_start = false;
};
struct Piece {
  std::string text;
  bool at_start = false;
};

struct NormalizerStep {
  bool prepend = false;  // Prepend `to`; else Replace `from` with `to`.
  std::string from, to;
};

enum class SplitBehavior {
  kRemoved,
  kIsolated,
  kMergedWithPrevious,
  kMergedWithNext,
  kContiguous
};

struct PreTokenizerStep {
  enum class Kind { kByteLevel, kSplit, kMetaspace } kind;
  std::unique_ptr<Regex> regex;   // ByteLevel with use_regex, Split Regex.
  std::string literal;            // Split String pattern; Metaspace char.
  bool add_prefix_space = false;  // ByteLevel.
  SplitBehavior behavior = SplitBehavior::kIsolated;  // Split.
  bool invert = false;                                // Split.
  enum class Prepend { kAlways, kFirst, kNever } prepend = Prepend::kAlways;
  bool split = true;  // Metaspace.
};

// The supported decoder chains, flattened: per-token text steps, then an
// optional byte stage, then fusion and an optional whole-text Strip.
struct DecoderSpec {
  struct TokenStep {
    bool metaspace = false;    // Else Replace.
    bool strip_first = false;  // Metaspace: drop replacement in token 0.
    std::string from, to;
  };
  std::vector<TokenStep> token_steps;
  enum class Bytes { kNone, kByteFallback, kByteLevel } bytes = Bytes::kNone;
  bool join_with_space = false;  // No decoder: HF joins tokens with " ".
  std::string strip_content;
  size_t strip_start = 0, strip_stop = 0;
};

// Everything a loaded tokenizer.json holds, and the Encode steps over it.
// Immutable once loaded; const methods are thread-safe.
struct TokenizerPipeline {
  // BPE model.
  std::unordered_map<std::string, int32_t> vocab;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;
  std::optional<int32_t> unk_id;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  std::array<int32_t, 256> byte_ids{};  // <0xXX> ids, -1 when missing.
  // Id tables over [0, vocab_size).
  std::vector<std::string> id_to_token;
  enum Kind : uint8_t { kMissing, kModel, kAdded, kSpecial };
  std::vector<uint8_t> id_kind;
  // Added tokens.
  std::vector<AddedToken> added;
  std::unordered_map<std::string, int32_t> added_ids;
  AddedTokenMatcher raw_matcher, normalized_matcher;
  // Pipeline.
  std::vector<NormalizerStep> normalizer;
  std::vector<PreTokenizerStep> pre_tokenizer;
  std::vector<int32_t> prefix_ids, suffix_ids;
  DecoderSpec decoder;
  std::optional<int32_t> bos_id, eos_id;

  // Tokenizer::Encode for valid UTF-8 `text`.
  std::vector<int32_t> Encode(std::string_view text,
                              bool add_special_tokens) const;

  static uint64_t PairKey(int32_t a, int32_t b) {
    return (uint64_t{static_cast<uint32_t>(a)} << 32) |
           static_cast<uint32_t>(b);
  }

  std::string Normalize(std::string_view text) const;

  // HF AddedVocabulary::find_matches.
  void SplitOnAdded(std::string_view text, bool at_start,
                    const AddedTokenMatcher& matcher,
                    std::vector<Segment>* out) const;

  std::vector<Piece> PreTokenize(const Segment& segment) const;

  const std::pair<int32_t, int32_t>* FindMerge(int32_t a, int32_t b) const {
    auto it = merges.find(PairKey(a, b));
    return it == merges.end() ? nullptr : &it->second;
  }

  // HF BPE::merge_word + Word::merge_all: lowest rank first, leftmost on
  // ties.
  void EncodeWord(const std::string& word, std::vector<int32_t>* ids) const;

  const std::string* TokenOf(int32_t id) const {
    if (id < 0 || static_cast<size_t>(id) >= id_kind.size() ||
        id_kind[id] == kMissing) {
      return nullptr;
    }
    return &id_to_token[id];
  }
};

// Fills an empty `pipeline` from the text of a tokenizer.json (defined in
// tokenizer_loader.cc). InvalidArgument naming the field and value when the
// file is malformed or uses an unsupported feature.
absl::Status LoadTokenizerJson(std::string_view json_text,
                               TokenizerPipeline* pipeline);

}  // namespace tokenizer_internal
}  // namespace moh
