// What a loaded model can do for the front doors, after TensorFlow Serving's
// servables: one implementation per model family (language_servable.h,
// vision_servable.h, diffusion_servable.h), created by that family's loader;
// HostedModel (hosted_model.h) keeps only the lifecycle around it. The gRPC
// handlers (inference_service.cc) and the OpenAI-compatible HTTP API
// (openai_http_generation.cc) convert their wire format into the calls below
// and back; every check of a field against the model happens in the servable
// or below, with messages that name the API field. The calls, results and
// observers are servable_types.h's.
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
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "model/core/model_config.h"
#include "model/generation/sampler.h"
#include "model/tokenizer/chat_template.h"
#include "moh/v1/inference.pb.h"
#include "service/metrics/metrics.h"
#include "service/servable/servable_types.h"

namespace moh {

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
  // LanguageExecutor::Submit, plus INVALID_ARGUMENT for input that
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
  // The tokenizer endpoints (TokenizeCall's comment). Tokenize:
  // INVALID_ARGUMENT for a prompt over the size Generate takes; Detokenize:
  // INVALID_ARGUMENT naming "tokens[i]" for an id outside the vocabulary;
  // special tokens are kept. Families without a tokenizer: NoTokenizerError.
  virtual absl::StatusOr<TokenizeResult> Tokenize(
      const TokenizeCall& call) const;
  virtual absl::StatusOr<std::string> Detokenize(
      const std::vector<int32_t>& tokens) const;
  virtual absl::StatusOr<TokenizerInfo> DescribeTokenizer() const;
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

  // OK, or (UNAVAILABLE) why the model's device can run nothing more: a
  // step failed and left it lost (DeviceLost, model/core/device_context.h).
  // The model's owner then reports it FAILED and the server NOT_SERVING.
  absl::Status device_lost() const;

 protected:
  // Records the loss (the first one reported), from any thread.
  void MarkDeviceLost(const absl::Status& status);
  // A forward on `device` failed with `error`: the error to report. Where it
  // was LibTorch's (INTERNAL) and left the device lost (DeviceLost), that
  // loss, as UNAVAILABLE naming the model, logged and recorded
  // (MarkDeviceLost).
  absl::Status ForwardFailed(const at::Device& device, absl::Status error);

 private:
  const std::string name_, family_;
  mutable absl::Mutex lost_mu_;
  absl::Status lost_ ABSL_GUARDED_BY(lost_mu_);
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

// The status of a tokenizer request to a model without a tokenizer:
// FieldError "model '<model>' (<family>) has no tokenizer; ...".
absl::Status NoTokenizerError(absl::string_view model,
                              absl::string_view family);

// Classify's input fields: exactly one input, top_n >= 0. INVALID_ARGUMENT
// naming the field.
absl::Status CheckClassifyCall(const ClassifyCall& call);

}  // namespace moh
