// Step-level continuous batching for GenerateImage: the diffusion family's
// executor under the engine loop (engine_loop.h), as the language family's.
// A request is a sequence of sampler steps (the planner sees no prompt and
// `steps` outputs); each loop iteration runs ONE DiT forward over every
// running request, whatever its step, class, guidance and ratio (guided
// requests take two rows: the class and the null class). Requests join at
// the next step and leave when sampled; the image is then decoded (VAE, or
// the pixels themselves), encoded as PNG and delivered. A VAE decode runs on
// the model's decode thread (moh-vae-<model>) while the loop steps on.
//
// Each request samples with its own generator (dit_sampler.h), so its image
// does not depend on the batch.
//
// Threading: Submit/Cancel/StopAccepting/counters are thread-safe. Observer
// callbacks run on the loop thread, except OnFinished and a decode's
// OnError, which run on the decode thread with a VAE; none may block.
// Idle() is false until every sampled image has been delivered.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "model/core/dit_model.h"
#include "model/core/vae_decoder.h"
#include "model/generation/diffusion.h"
#include "service/config/config_limits.h"
#include "service/metrics/metrics.h"
#include "service/servable/servable_types.h"

namespace moh {

// One GenerateImage request, checked by Submit.
struct ImageJob {
  int64_t class_id = 0;
  uint64_t seed = 0;
  int32_t steps = 0;  // 0: the model's default_steps
  // Unset: the model's default_guidance.
  std::optional<float> guidance;
  float ratio = 0.0f;      // 0: the model's default
  float min_ratio = 0.0f;  // adaptive floor; 0 = never lowered
  absl::Time deadline = absl::InfiniteFuture();
};

class DiffusionExecutor {
 public:
  struct Options {
    std::string model_name;
    // Model rows each step computes at most: a guided request takes two
    // (its class and the null class), an unguided one one. A request is
    // admitted when its rows fit beside the running ones'.
    int32_t max_running = config_limits::kMaxRunning.default_value;
    int32_t max_queued_requests =
        config_limits::kGenerationMaxQueuedRequests.default_value;
    int32_t adaptive_queue_depth = config_limits::kAdaptiveQueueDepthOff;
    // As LanguageExecutor::Options::on_device_lost.
    std::function<void(const absl::Status&)> on_device_lost;
  };

  // `model` and `vae` (null: pixel space) outlive the executor.
  static absl::StatusOr<std::unique_ptr<DiffusionExecutor>> Create(
      const Options& options, const DitModel& model, const VaeDecoder* vae,
      ModelMetrics* metrics);
  ~DiffusionExecutor();

  // Checks `job` (INVALID_ARGUMENT naming the field and its range), draws
  // its initial noise and queues it.
  absl::StatusOr<uint64_t> Submit(const ImageJob& job,
                                  std::shared_ptr<ImageObserver> observer);
  void Cancel(uint64_t id);
  void StopAccepting();
  bool Idle() const;
  int64_t num_running() const;
  int64_t num_waiting() const;

 private:
  class Impl;
  explicit DiffusionExecutor(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moh
