// One model the server hosts: its lifecycle (LOADING → READY | FAILED) and the
// serving machinery around it — the continuous-batching scheduler for
// Generate, and the dynamic batcher for Classify.
//
// Calls arrive already converted from the wire format (GenerateCall,
// ClassifyCall); every check of a field's range happens here or below, with
// messages that name the API field. Thread-safe.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "model/language_model.h"
#include "model/vit_model.h"
#include "moh/v1/inference.pb.h"
#include "moh/v1/server_config.pb.h"
#include "service/batcher.h"
#include "service/continuous_batch_scheduler.h"
#include "service/metrics.h"

namespace moh {

struct GenerateCall {
  std::optional<std::string> prompt;
  std::optional<std::vector<int32_t>> token_ids;
  SamplingParams sampling;  // max_new_tokens is ignored: see below
  // Tokens to generate; unset: the model's configured default.
  std::optional<int32_t> max_new_tokens;
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
  int64_t routed_tokens = 0;
  std::vector<int64_t> head_tokens;  // [num_layers * num_heads]
};

using ClassifyDone = std::function<void(absl::StatusOr<ClassifyResult>)>;

class HostedModel {
 public:
  enum class State { kLoading, kReady, kFailed };

  // `config` has its defaults filled (see server_config.h); `metrics` outlives
  // the model.
  HostedModel(v1::ModelConfig config, Metrics* metrics);
  ~HostedModel();

  // Loads weights and tokenizer, warms up, starts the batchers. Blocking; call
  // once. Leaves the model READY, or FAILED with the reason.
  void Load();

  const std::string& name() const { return config_.name(); }
  State state() const;
  v1::ModelInfo Info() const;
  bool is_language_model() const;
  // UNAVAILABLE while loading, FAILED_PRECONDITION after a failed load.
  absl::Status CheckReady() const;
  ModelMetrics* metrics() const;  // null until loaded
  // Attention layers (the rows of a routing table); 0 until loaded.
  int32_t num_layers() const;

  // Starts generation; the observer then gets the output. Errors as
  // ContinuousBatchScheduler::Submit, plus INVALID_ARGUMENT for input that does
  // not fit this model.
  absl::StatusOr<uint64_t> Generate(
      GenerateCall call, std::shared_ptr<GenerationObserver> observer);
  void CancelGenerate(uint64_t id);

  // Queues a classification; `done` is called exactly once, later, on a
  // batcher thread — unless this returns an error, then never.
  absl::Status Classify(ClassifyCall call, ClassifyDone done);

  // Drain: new work gets UNAVAILABLE; work already accepted completes.
  void StopAccepting();
  // Nothing accepted is still running or waiting.
  bool Idle() const;

 private:
  struct ClassifyTask {
    at::Tensor pixels;                 // [C, S, S] normalized (image models)
    std::vector<int32_t> context_ids;  // LM label scoring
    std::vector<std::vector<int32_t>> label_ids;  // LM label scoring
    std::vector<std::string> labels;
    int32_t top_n = 0;
    float ratio = 0.0f;
    absl::Time deadline;
    absl::Time enqueued;
    ClassifyDone done;
    size_t size() const { return 1; }
  };

  absl::Status LoadUnchecked();
  absl::Status Warmup();
  absl::StatusOr<ClassifyTask> PrepareClassify(ClassifyCall& call) const;
  float AdaptRatio(float ratio, float min_ratio, int64_t waiting) const;
  void ProcessClassifyBatch(std::vector<ClassifyTask> batch);
  void RunImageBatch(std::vector<ClassifyTask>& batch);
  void RunLabelScoring(ClassifyTask& task);
  void FinishClassify(ClassifyTask& task,
                      absl::StatusOr<ClassifyResult> result);

  const v1::ModelConfig config_;
  Metrics* const metrics_;

  mutable absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kLoading;
  std::string failure_reason_ ABSL_GUARDED_BY(mu_);
  bool accepting_ ABSL_GUARDED_BY(mu_) = true;
  int64_t classify_in_flight_ ABSL_GUARDED_BY(mu_) = 0;

  // Set once by Load() before the state becomes READY; immutable afterwards.
  ModelMetrics* model_metrics_ = nullptr;
  std::optional<LanguageModel> lm_;
  std::unique_ptr<VitModel> vit_;
  std::string device_, dtype_;
  std::unique_ptr<ContinuousBatchScheduler> scheduler_;
  std::unique_ptr<Batcher<ClassifyTask>> classify_batcher_;
};

const char* HostedModelStateName(HostedModel::State state);

}  // namespace moh
