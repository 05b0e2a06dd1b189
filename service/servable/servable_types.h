// The servables' contract types (servable.h): the calls each front door
// builds, the results and the observers the families answer with, and the
// tasks a model serves. Here, apart from the interface and from the
// executors that produce them, so that a door, an executor and a test each
// include only this.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "model/generation/generator.h"
#include "model/generation/grammar.h"
#include "model/generation/sampler.h"

namespace moh {

// Bounds of GenerateCall::n and GenerateCall::priority.
inline constexpr int32_t kMaxSamples = 16;
inline constexpr int32_t kMaxPriority = 1000;

// Which sampling fields a request set. The others take the model's
// generation_config.json defaults when it has them (Hugging Face's reading:
// language_model.h), else keep the API's own defaults, already in
// GenerateCall::sampling (gRPC: greedy; the OpenAI API: temperature 1).
struct SamplingFieldsSet {
  bool temperature = false;
  bool top_k = false;
  bool top_p = false;
  bool min_p = false;
  bool repetition_penalty = false;
};

struct GenerateCall {
  std::optional<std::string> prompt;
  std::optional<std::vector<int32_t>> token_ids;
  // Tokenize `prompt` with the tokenizer's special tokens (BOS); false for a
  // prompt rendered by a chat template, which writes its own.
  bool add_special_tokens = true;
  SamplingParams sampling;  // max_new_tokens is ignored: see below
  SamplingFieldsSet sampling_set;
  // Tokens to generate; unset: the model's configured default.
  std::optional<int32_t> max_new_tokens;
  float ratio = 0.0f;
  float min_ratio = 0.0f;
  absl::Time deadline = absl::InfiniteFuture();
  int32_t n = 1;         // samples, [1, kMaxSamples]
  int32_t priority = 0;  // [-kMaxPriority, kMaxPriority]; higher first
  // Structured output: the grammar the output must follow (compiled by the
  // servable on the request worker; errors name its fields).
  ResponseFormat response_format;
};

struct GenerateImageCall {
  std::optional<int64_t> class_index;
  std::optional<std::string> class_label;
  std::optional<uint64_t> seed;   // unset: random
  int32_t steps = 0;              // 0: the model's default
  std::optional<float> guidance;  // unset: the model's default
  float ratio = 0.0f;
  float min_ratio = 0.0f;
  absl::Time deadline = absl::InfiniteFuture();
};

struct ClassifyCall {
  std::optional<std::string> image;  // encoded bytes
  std::optional<std::pair<std::vector<int64_t>, std::vector<float>>> pixels;
  std::optional<std::string> text;
  std::vector<std::string> labels;
  int32_t top_n = 0;
  float ratio = 0.0f;
  float min_ratio = 0.0f;
  absl::Time deadline = absl::InfiniteFuture();
  // Whether the client has gone (checked before computing); may be empty.
  std::function<bool()> cancelled;
};

struct ClassScoreResult {
  std::string label;
  int32_t index = 0;
  float score = 0.0f;
  double log_likelihood = 0.0;
};

struct ClassifyResult {
  std::vector<ClassScoreResult> classes;
  double effective_ratio = 1.0;
  float applied_ratio = 0.0f;
  int64_t routed_tokens = 0;  // per layer, when every layer routes as many
  // Tokens of each layer, when they differ (TransNeXt's stages); else empty.
  std::vector<int64_t> layer_tokens;
  // [num_layers * H], H the most heads of any layer (zeros past a layer's).
  std::vector<int64_t> head_tokens;
};

using ClassifyDone = std::function<void(absl::StatusOr<ClassifyResult>)>;

// The tokenizer endpoints (vLLM's /tokenize, /detokenize, /tokenizer_info):
// a model's tokenizer, as it tokenizes Generate's prompts.
struct TokenizeCall {
  std::string prompt;
  bool add_special_tokens = true;  // the post-processor's BOS
  bool token_strs = false;         // also each token's raw string
};

struct TokenizeResult {
  std::vector<int32_t> tokens;
  // When asked: each token's raw string ("Ġthe", "<0x0A>", ...).
  std::optional<std::vector<std::string>> token_strs;
  int32_t max_model_len = 0;  // the server's max_seq_len
};

// What a client needs to tokenize as the model does (tokenizer_config.json's
// fields; special tokens nullopt when the model has none). The EOS and BOS
// text encode, without special tokens, to the model's EOS and BOS ids.
struct TokenizerInfo {
  std::string tokenizer_class;
  std::optional<std::string> bos_token, eos_token, pad_token, unk_token;
  std::optional<std::string> chat_template;  // its source
  int64_t model_max_length = 0;
  int32_t vocab_size = 0;  // the tokenizer's: ids are in [0, vocab_size)
};

// The kinds of work a request asks for: how a request without a model name
// finds a model that serves it.
enum class Task { kGenerate, kClassifyImage, kClassifyText, kGenerateImage };
Task TaskOf(const ClassifyCall& call);
const char* TaskName(Task task);  // "Generate", "Classify of an image", ...

// What a job produced, delivered once at its end.
struct GenerationSummary {
  FinishReason finish_reason = FinishReason::kLength;
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
  double effective_ratio = 1.0;  // used (token, head) pairs / all pairs
  float applied_ratio = 0.0f;    // the ratio it ran at: the one asked for or
                                 // the model's trained default, after adaptive
                                 // lowering
  int64_t routed_tokens = 0;     // tokens processed (each once per layer)
  std::vector<int64_t> head_tokens;  // [num_layers * num_heads], row-major
  int32_t index = 0;  // the sample (GenerationJob::n) it summarises
  bool last = true;   // the job's last summary: its observer is done
};

// Receives one job's output. Either OnFinished is called once per sample
// (GenerationChunk::index and GenerationSummary::index say which; the last
// one has GenerationSummary::last), or OnError once, and nothing after it.
// Called, in order, on the executor's callback thread (callback_thread.h),
// after the step that produced the output; must not block.
class GenerationObserver {
 public:
  virtual ~GenerationObserver() = default;
  // New text (whole UTF-8 characters) and token ids since the last chunk.
  virtual void OnChunk(const GenerationChunk& chunk) = 0;
  // A sample ended normally, or was cancelled (finish_reason kCancelled).
  virtual void OnFinished(const GenerationSummary& summary) = 0;
  // DEADLINE_EXCEEDED (its deadline passed, possibly before any compute),
  // UNAVAILABLE (the executor shut down), INTERNAL (a model error). With
  // several samples, the first sample's error ends the job: the others are
  // cancelled and their output is dropped.
  virtual void OnError(const absl::Status& status) = 0;
};

struct ImageResult {
  // What it was asked, resolved: the class, the seed, the guidance scale.
  int64_t class_id = 0;
  uint64_t seed = 0;
  float guidance = 1.0f;
  std::string png;
  int32_t width = 0, height = 0;
  int32_t steps = 0;
  float applied_ratio = 0.0f;    // asked for or the trained default, lowered
  double effective_ratio = 1.0;  // used (token, head) pairs / all pairs
  int64_t routed_tokens = 0;     // tokens per block, over steps and rows
  std::vector<int64_t> head_tokens;  // [L * H], H the most heads of a block
  absl::Duration queued, sampling, decoding;
};

// Receives one request's output on the loop thread. OnProgress after every
// step; then exactly one of OnFinished / OnError.
class ImageObserver {
 public:
  virtual ~ImageObserver() = default;
  virtual void OnProgress(int32_t step, int32_t steps) = 0;
  virtual void OnFinished(const ImageResult& result) = 0;
  // CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE (shut down), INTERNAL.
  virtual void OnError(const absl::Status& status) = 0;
};

}  // namespace moh
