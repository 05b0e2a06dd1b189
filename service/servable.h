// What a loaded model can do for the front doors, after TensorFlow Serving's
// servables: one implementation per model family (language_servable.h,
// vision_servable.h, diffusion_servable.h), created by that family's loader;
// HostedModel (hosted_model.h) keeps only the lifecycle around it. The gRPC
// handlers (inference_service.cc) and the OpenAI-compatible HTTP API
// (openai_http_generation.cc) convert their wire format into the calls below
// and back; every check of a field against the model happens in the servable
// or below, with messages that name the API field.
//
// Adding a family: a Servable subclass, its loader in LoadServable
// (hosted_model.cc), and a Task for its RPC.
// Thread-safe.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "model/core/model_config.h"
#include "model/generation/sampler.h"
#include "model/tokenizer/chat_template.h"
#include "moh/v1/inference.pb.h"
#include "service/continuous_batch_scheduler.h"
#include "service/image_scheduler.h"
#include "service/metrics.h"

namespace moh {

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
  int32_t n = 1;         // samples (GenerationJob::n)
  int32_t priority = 0;  // GenerationJob::priority
};

struct GenerateImageCall {
  std::optional<int64_t> class_index;
  std::optional<std::string> class_label;
  std::optional<uint64_t> seed;  // unset: random
  int32_t steps = 0;             // 0: the model's default
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

// The kinds of work a request asks for: how a request without a model name
// finds a model that serves it.
enum class Task { kGenerate, kClassifyImage, kClassifyText, kGenerateImage };
Task TaskOf(const ClassifyCall& call);
const char* TaskName(Task task);  // "Generate", "Classify of an image", ...

class Servable {
 public:
  // `name`: the model's; `family`: as ListModels shows it ("llama", "vit").
  Servable(std::string name, std::string family)
      : name_(std::move(name)), family_(std::move(family)) {}
  virtual ~Servable() = default;

  const std::string& name() const { return name_; }
  const std::string& family() const { return family_; }

  // The family's part of ListModels: heads per layer (DescribeMoh), ratios,
  // maximum sequence length, labels.
  virtual void Describe(v1::ModelInfo* info) const = 0;
  virtual bool Serves(Task task) const = 0;
  // The MoH layout: heads of each attention layer (the rows of a routing
  // table).
  virtual const MohConfig& moh() const = 0;
  virtual ModelMetrics* metrics() const = 0;

  // Starts generation; the observer then gets the output. Errors as
  // ContinuousBatchScheduler::Submit, plus INVALID_ARGUMENT for input that
  // does not fit this model. Families that do not generate: NotServedError.
  virtual absl::StatusOr<uint64_t> Generate(
      GenerateCall call, std::shared_ptr<GenerationObserver> observer);
  virtual void CancelGenerate(uint64_t id);
  // The prompt of a conversation, by the model's chat template
  // (tokenizer_config.json), ending with the assistant's turn opened when
  // `add_generation_prompt`. INVALID_ARGUMENT when the model has no usable
  // template, or the template refuses the conversation (its message).
  virtual absl::StatusOr<std::string> ChatPrompt(
      const std::vector<ChatMessage>& messages,
      bool add_generation_prompt) const;
  // The text of token `id` decoded alone (special tokens included; invalid
  // UTF-8 replaced), for log-probabilities; empty without a tokenizer or for
  // an unknown id.
  virtual std::string TokenText(int32_t id) const;
  // Queues a classification; `done` is called exactly once, later, on a
  // batcher thread — unless this returns an error, then never.
  virtual absl::Status Classify(ClassifyCall call, ClassifyDone done);
  // Starts generating an image; the observer then gets progress and the
  // result. Families that do not generate images: NotServedError.
  virtual absl::StatusOr<uint64_t> GenerateImage(
      GenerateImageCall call, std::shared_ptr<ImageObserver> observer);
  virtual void CancelGenerateImage(uint64_t id);

  // Drain: new work gets UNAVAILABLE; work already accepted completes.
  virtual void StopAccepting() = 0;
  // Nothing accepted is still running or waiting.
  virtual bool Idle() const = 0;

 private:
  const std::string name_, family_;
};

// The MoH part of ListModels: router, heads per layer, default and lowest
// ratios.
void DescribeMoh(const MohConfig& moh, v1::ModelInfo* info);

// Heads of each layer of `moh`.
std::vector<int32_t> LayerHeads(const MohConfig& moh);

// The one status for a request a model's family does not serve:
// INVALID_ARGUMENT naming `field` (the request field that chose the model or
// the input), the model, the task it was asked and what to do `instead`.
absl::Status NotServedError(absl::string_view field, absl::string_view model,
                            absl::string_view family, Task task,
                            absl::string_view instead);

// Classify's input fields: exactly one input, top_n >= 0. INVALID_ARGUMENT
// naming the field.
absl::Status CheckClassifyCall(const ClassifyCall& call);

}  // namespace moh
