// Hugging Face `tokenizer.json` tokenizer for BPE models, without LibTorch.
//
// Supported (anything else is rejected at load time with
// absl::InvalidArgumentError naming the field and its value):
//   model:          BPE (vocab, merges as "a b" strings or [a, b] pairs,
//                   unk_token, fuse_unk, byte_fallback, ignore_merges).
//   added_tokens:   special and non-special; lstrip, rstrip, single_word,
//                   normalized. Leftmost-longest matching, as HF does.
//   normalizer:     null, Sequence, Prepend, Replace (String pattern).
//   pre_tokenizer:  null, Sequence, ByteLevel (GPT-2 regex when use_regex),
//                   Split (Regex run verbatim with PCRE2 in UTF+UCP mode, or
//                   String; any behavior; invert), Metaspace (prepend_scheme
//                   first/always/never or legacy add_prefix_space; split).
//   post_processor: null, ByteLevel (no-op on ids), TemplateProcessing
//                   (single template only), Sequence of those.
//   decoder:        null (tokens joined by spaces), ByteLevel, Metaspace, or a
//                   Sequence of per-token Replace (String pattern)/Metaspace
//                   steps, then ByteFallback, then Fuse, then Strip.
//
// Results match the Rust `tokenizers` library for valid UTF-8 input. Invalid
// UTF-8 passed to Encode is first replaced by U+FFFD per maximal invalid
// subsequence (HF only accepts valid strings).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moh {

// Immutable after construction; every const method is thread-safe.
class Tokenizer {
 public:
  // Reads and parses `path`. NotFound when the file cannot be read;
  // InvalidArgument naming the file (and the field) when it is malformed or
  // uses an unsupported feature.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromFile(
      const std::string& path);
  // As FromFile, for the contents of a tokenizer.json. `source_name` prefixes
  // every error message.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(
      std::string_view json, std::string_view source_name);

  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;
  ~Tokenizer();

  // Token ids of `text`. Added tokens found in the text (e.g.
  // "<|eot_id|>") always map to their ids; `add_special_tokens` applies the
  // post-processor template (e.g. prepends BOS). Never fails.
  std::vector<int32_t> Encode(std::string_view text,
                              bool add_special_tokens) const;

  // Text of `ids` through the file's decoder. With `skip_special_tokens`,
  // added tokens marked special are dropped first. Invalid UTF-8 produced by
  // byte tokens becomes U+FFFD as in HF. InvalidArgument when an id is not in
  // the vocabulary (negative, >= vocab_size(), or a gap in the ids).
  absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids,
                                     bool skip_special_tokens) const;

  // Max id + 1 over the model vocabulary and the added tokens.
  int32_t vocab_size() const;
  // Id of a vocabulary entry or added token, in its raw form (e.g. "Ġthe",
  // "▁the", "<0x0A>", "<s>").
  std::optional<int32_t> TokenToId(std::string_view token) const;
  // Raw token string of `id`; nullopt when the id is not in the vocabulary.
  std::optional<std::string> IdToToken(int32_t id) const;
  // True when `id` is an added token marked "special".
  bool IsSpecial(int32_t id) const;
  // The bytes `id` adds to decoded text after other tokens, through the
  // decoder's per-token steps and its byte stage (ByteLevel's byte map, a
  // <0xXX> token's byte), not necessarily valid UTF-8: what a grammar engine
  // matches. Empty for special tokens; nullopt when the id is not in the
  // vocabulary. Ignores the whole-text steps (Strip, joining with spaces).
  std::optional<std::string> TokenBytes(int32_t id) const;

  // Beginning/end-of-sequence ids. BOS: the first SpecialToken of the
  // TemplateProcessing single template when it precedes the sequence,
  // otherwise the first special token present among <|begin_of_text|>, <s>,
  // <bos>, <|startoftext|>. EOS: the first special token present among
  // <|end_of_text|>, <|eot_id|>, </s>, <eos>, <|endoftext|>, <|im_end|>.
  // Callers should prefer ids from the model's config when it has them.
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;

 private:
  friend class IncrementalDecoder;
  struct Impl;
  explicit Tokenizer(std::unique_ptr<const Impl> impl);
  std::unique_ptr<const Impl> impl_;
};

// Streaming detokenizer for one sequence: fed one id at a time, returns the
// newly completed text. Never returns part of a UTF-8 character: bytes of an
// incomplete character (e.g. an emoji split over byte tokens) are held until
// the character completes. For byte-fallback (<0xXX>) decoders a run of byte
// tokens is held until a non-byte token or Flush, because HF decides the
// whole run's validity at once. The concatenation of all Push results and
// Flush equals Tokenizer::Decode of all pushed ids.
//
// Not thread-safe; `tokenizer` must outlive the decoder.
class IncrementalDecoder {
 public:
  IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens);
  IncrementalDecoder(IncrementalDecoder&&) noexcept;
  IncrementalDecoder& operator=(IncrementalDecoder&&) noexcept;
  ~IncrementalDecoder();

  // Text completed by `id` (possibly empty). InvalidArgument for an id
  // outside the vocabulary; the decoder state is then unchanged.
  absl::StatusOr<std::string> Push(int32_t id);
  // Text still held back, with incomplete UTF-8 replaced by U+FFFD. Resets
  // the decoder to the start of a new sequence.
  std::string Flush();

 private:
  struct State;
  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  std::unique_ptr<State> state_;
};

}  // namespace moh
