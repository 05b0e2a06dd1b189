#include "model/tokenizer/tokenizer.h"

#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "base/status_macros.h"
#include "model/tokenizer/tokenizer_pipeline.h"

namespace moh {

using tokenizer_internal::AppendLossyUtf8;
using tokenizer_internal::ByteLevelBytes;
using tokenizer_internal::DecoderSpec;
using tokenizer_internal::IsValidUtf8;
using tokenizer_internal::kReplacementChar;
using tokenizer_internal::TokenizerPipeline;

struct Tokenizer::Impl : TokenizerPipeline {};

namespace {

// The byte of a "<0xXX>" token, as HF's ByteFallback decoder reads it.
std::optional<char> ParseByteToken(std::string_view t) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>' ||
      hex(t[3]) < 0 || hex(t[4]) < 0) {
    return std::nullopt;
  }
  return static_cast<char>(hex(t[3]) * 16 + hex(t[4]));
}

}  // namespace

// --------------------------------------------------------------- Tokenizer --

Tokenizer::Tokenizer(std::unique_ptr<const Impl> impl)
    : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromFile(
    const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read tokenizer ", path));
  }
  std::stringstream contents;
  contents << in.rdbuf();
  return FromJson(contents.str(), path);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(
    std::string_view json, std::string_view source_name) {
  auto impl = std::make_unique<Impl>();
  const absl::Status status =
      tokenizer_internal::LoadTokenizerJson(json, impl.get());
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(absl::string_view(source_name.data(), source_name.size()),
                     ": ", status.message()));
  }
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text,
                                       bool add_special_tokens) const {
  if (IsValidUtf8(text)) {
    return impl_->Encode(text, add_special_tokens);
  }
  std::string valid;
  AppendLossyUtf8(text, /*final=*/true, &valid);
  return impl_->Encode(valid, add_special_tokens);
}

absl::StatusOr<std::string> Tokenizer::Decode(absl::Span<const int32_t> ids,
                                              bool skip_special_tokens) const {
  IncrementalDecoder decoder(*this, skip_special_tokens);
  std::string text;
  for (int32_t id : ids) {
    MOH_ASSIGN_OR_RETURN(const std::string chunk, decoder.Push(id));
    text += chunk;
  }
  return text + decoder.Flush();
}

int32_t Tokenizer::vocab_size() const {
  return static_cast<int32_t>(impl_->id_kind.size());
}

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  const std::string key(token);
  if (auto it = impl_->added_ids.find(key); it != impl_->added_ids.end()) {
    return it->second;
  }
  if (auto it = impl_->vocab.find(key); it != impl_->vocab.end()) {
    return it->second;
  }
  return std::nullopt;
}

std::optional<std::string> Tokenizer::IdToToken(int32_t id) const {
  const std::string* token = impl_->TokenOf(id);
  return token ? std::optional<std::string>(*token) : std::nullopt;
}

bool Tokenizer::IsSpecial(int32_t id) const {
  return impl_->TokenOf(id) != nullptr &&
         impl_->id_kind[id] == TokenizerPipeline::kSpecial;
}

std::optional<std::string> Tokenizer::TokenBytes(int32_t id) const {
  const std::string* token = impl_->TokenOf(id);
  if (token == nullptr) return std::nullopt;
  if (impl_->id_kind[id] == TokenizerPipeline::kSpecial) return std::string();
  const DecoderSpec& spec = impl_->decoder;
  std::string text = *token;
  for (const DecoderSpec::TokenStep& step : spec.token_steps) {
    text = absl::StrReplaceAll(text,
                               {{step.from, step.metaspace ? " " : step.to}});
  }
  switch (spec.bytes) {
    case DecoderSpec::Bytes::kByteLevel:
      return ByteLevelBytes(text);
    case DecoderSpec::Bytes::kByteFallback:
      if (const std::optional<char> byte = ParseByteToken(text)) {
        return std::string(1, *byte);
      }
      return text;
    case DecoderSpec::Bytes::kNone:
      break;
  }
  return text;
}

std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos_id; }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos_id; }

// ------------------------------------------------------ IncrementalDecoder --

struct IncrementalDecoder::State {
  int64_t tokens = 0;     // Tokens given to the decoder (after skipping).
  std::string pending;    // Bytes of an incomplete character / <0xXX> run.
  size_t strip_left = 0;  // Leading Strip content still to drop.
  std::string held;       // Trailing Strip content held back.

  // Ends a run of <0xXX> tokens: HF keeps it if it is valid UTF-8 and
  // otherwise emits one U+FFFD per byte.
  void EndByteRun(std::string* out) {
    if (IsValidUtf8(pending)) {
      out->append(pending);
    } else {
      for (size_t i = 0; i < pending.size(); ++i) out->append(kReplacementChar);
    }
    pending.clear();
  }

  // HF's Strip decoder applied to the fused text, as a stream.
  std::string Strip(const DecoderSpec& spec, std::string out, bool final) {
    const std::string& c = spec.strip_content;
    if (c.empty()) return out;
    while (strip_left > 0 && absl::StartsWith(out, c)) {
      out.erase(0, c.size());
      --strip_left;
    }
    if (!out.empty()) strip_left = 0;
    if (spec.strip_stop > 0) {
      out.insert(0, std::exchange(held, ""));
      size_t cut = 0;
      for (size_t n = 0; n < spec.strip_stop; ++n) {
        if (!absl::EndsWith(absl::string_view(out).substr(0, out.size() - cut),
                            c)) {
          break;
        }
        cut += c.size();
      }
      if (!final) held = out.substr(out.size() - cut);
      out.resize(out.size() - cut);
    }
    return out;
  }
};

IncrementalDecoder::IncrementalDecoder(const Tokenizer& tokenizer,
                                       bool skip_special_tokens)
    : tokenizer_(&tokenizer),
      skip_special_tokens_(skip_special_tokens),
      state_(std::make_unique<State>()) {
  state_->strip_left = tokenizer.impl_->decoder.strip_start;
}
IncrementalDecoder::IncrementalDecoder(IncrementalDecoder&&) noexcept = default;
IncrementalDecoder& IncrementalDecoder::operator=(
    IncrementalDecoder&&) noexcept = default;
IncrementalDecoder::~IncrementalDecoder() = default;

absl::StatusOr<std::string> IncrementalDecoder::Push(int32_t id) {
  const TokenizerPipeline& impl = *tokenizer_->impl_;
  const std::string* token = impl.TokenOf(id);
  if (token == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("token id ", id, " is not in the vocabulary (size ",
                     impl.id_kind.size(), ")"));
  }
  if (skip_special_tokens_ && impl.id_kind[id] == TokenizerPipeline::kSpecial)
    return "";
  const DecoderSpec& spec = impl.decoder;
  std::string text = *token;
  for (const DecoderSpec::TokenStep& step : spec.token_steps) {
    const bool drop = step.metaspace && step.strip_first && state_->tokens == 0;
    text = absl::StrReplaceAll(
        text, {{step.from, drop ? "" : (step.metaspace ? " " : step.to)}});
  }
  std::string out = spec.join_with_space && state_->tokens > 0 ? " " : "";
  ++state_->tokens;
  switch (spec.bytes) {
    case DecoderSpec::Bytes::kByteLevel:
      state_->pending += ByteLevelBytes(text);
      state_->pending.erase(0, AppendLossyUtf8(state_->pending, false, &out));
      break;
    case DecoderSpec::Bytes::kByteFallback:
      if (const std::optional<char> byte = ParseByteToken(text)) {
        state_->pending += *byte;
      } else {
        state_->EndByteRun(&out);
        out += text;
      }
      break;
    case DecoderSpec::Bytes::kNone:
      out += text;
      break;
  }
  return state_->Strip(spec, std::move(out), /*final=*/false);
}

std::string IncrementalDecoder::Flush() {
  const DecoderSpec& spec = tokenizer_->impl_->decoder;
  std::string out;
  if (spec.bytes == DecoderSpec::Bytes::kByteLevel) {
    AppendLossyUtf8(state_->pending, /*final=*/true, &out);
  } else {
    state_->EndByteRun(&out);
  }
  out = state_->Strip(spec, std::move(out), /*final=*/true);
  *state_ = State();
  state_->strip_left = spec.strip_start;
  return out;
}

}  // namespace moh
