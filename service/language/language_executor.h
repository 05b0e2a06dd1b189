// Continuous (iteration-level) batching for Generate (SPEC §4): the language
// family's executor under the engine loop.
//
// The EngineLoop (engine_loop.h) owns the thread, the inbox and the metrics;
// its StepPlanner (step_planner.h) decides each step: who leaves (cancelled,
// past the deadline), who takes a KV-cache slot, who runs at the activation
// floor, and which rows run (a decode token for every generating sequence,
// then prompt chunks under prefill_token_budget). This file turns a plan into
// ONE model forward, samples, and streams new text to each job's observer.
// Rows with different activation ratios share one batch (K per row, resolved
// once at Submit).
//
// KV memory: a paged cache (kv_blocks blocks of kv_block_size positions); a
// sequence is admitted when the blocks it can need (prompt + max_new_tokens,
// less a cached prompt prefix) fit, and takes them as it grows, so admission
// never over-commits the cache. With prefix_caching, prompts that start the
// same way at the same activation share their whole blocks (step_planner.h).
//
// Adaptive activation: a job with 0 < min_ratio < ratio runs at min_ratio when,
// at its admission, more than `adaptive_queue_depth` jobs are waiting.
//
// Threading: Submit/Cancel/StopAccepting/counters are thread-safe. Observer
// callbacks run on the executor's callback thread (callback_thread.h), in
// order, after the step that produced their output (never on the loop
// thread); they must not block, and may call Cancel().
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "model/generation/generator.h"
#include "model/generation/grammar.h"
#include "model/generation/language_model.h"
#include "model/generation/sampler.h"
#include "service/config/config_limits.h"
#include "service/metrics/metrics.h"
#include "service/servable/servable_types.h"

namespace moh {

// One generation request as the executor sees it (already tokenized).
struct GenerationJob {
  std::vector<int32_t> prompt_ids;
  SamplingParams sampling;  // max_new_tokens already resolved (>= 1)
  float ratio = 0.0f;       // (0, 1], or 0 for the model's default
  float min_ratio = 0.0f;   // adaptive floor; 0 = never lowered
  absl::Time deadline = absl::InfiniteFuture();
  // Samples of the prompt, [1, kMaxSamples]: they share its prefill (with
  // prefix caching) and the activation; with a seed, sample i uses seed + i.
  int32_t n = 1;
  // [-kMaxPriority, kMaxPriority]; higher is admitted first.
  int32_t priority = 0;
  // Structured output: each sample's draws are masked by its own matcher of
  // this grammar (compiled for the model's tokenizer); null: unconstrained.
  std::shared_ptr<const CompiledGrammar> grammar;
};

class LanguageExecutor {
 public:
  // Defaults as an unconfigured server's (config_limits.h).
  struct Options {
    std::string model_name;  // for logs and thread names
    // KV-cache slots.
    int32_t max_running = config_limits::kMaxRunning.default_value;
    // Prompt + output per sequence; 0 = the model's maximum, capped.
    int32_t max_seq_len = config_limits::kMaxSeqLenUnset;
    // Positions per KV-cache block (capped at max_seq_len); blocks (0 =
    // max_running sequences of max_seq_len); prompt prefix sharing.
    int32_t kv_block_size = config_limits::kKvBlockSize.default_value;
    int32_t kv_blocks = config_limits::kKvBlocksAuto;
    bool prefix_caching = true;
    // Waiting jobs before RESOURCE_EXHAUSTED.
    int32_t max_queued_requests =
        config_limits::kGenerationMaxQueuedRequests.default_value;
    // Prompt tokens per step, >= 1.
    int32_t prefill_token_budget =
        config_limits::kPrefillTokenBudget.default_value;
    // 0 = adaptive activation off.
    int32_t adaptive_queue_depth = config_limits::kAdaptiveQueueDepthOff;
    // An idle loop's wait for more arrivals (EngineLoopOptions::idle_gather).
    absl::Duration idle_gather =
        absl::Microseconds(config_limits::kIdleGatherUs.default_value);
    // Called once (on the loop's thread) if a failed step left the model's
    // device lost: the executor has stopped, every job ended UNAVAILABLE with
    // `status`, and later Submit() calls get it. May be null.
    std::function<void(const absl::Status&)> on_device_lost;
  };

  // `model` must outlive the executor; `metrics` may be null.
  // INVALID_ARGUMENT naming a bad option and its range.
  static absl::StatusOr<std::unique_ptr<LanguageExecutor>> Create(
      const Options& options, const LanguageModel& model,
      ModelMetrics* metrics);
  // Stops the loop; jobs still queued or running get OnError(UNAVAILABLE).
  ~LanguageExecutor();

  // Validates `job` (INVALID_ARGUMENT naming the field and allowed range:
  // prompt length, token ids, prompt + max_new_tokens <= max_seq_len, sampling
  // params, ratio, min_ratio <= ratio, n, priority), then queues its samples
  // and returns its id.
  // Never blocks. RESOURCE_EXHAUSTED when max_queued_requests jobs are waiting;
  // UNAVAILABLE after StopAccepting(). Only on OK does the observer get called.
  absl::StatusOr<uint64_t> Submit(GenerationJob job,
                                  std::shared_ptr<GenerationObserver> observer);

  // Cancels job `id` if it is still queued or running: it leaves the batch at
  // the next step and its observer gets OnFinished(kCancelled) for each
  // sample still running. No-op for unknown or finished ids.
  void Cancel(uint64_t id);

  // Drain: later Submit() calls get UNAVAILABLE; queued and running jobs
  // continue to completion.
  void StopAccepting();

  int64_t num_running() const;  // sequences holding a slot
  int64_t num_waiting() const;  // queued, not yet admitted
  bool idle() const;            // nothing running or waiting (one lock)
  int32_t max_seq_len() const;
  // The options as resolved by Create (max_seq_len, kv_block_size, kv_blocks).
  const Options& options() const;

  class Impl;

 private:
  explicit LanguageExecutor(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moh
