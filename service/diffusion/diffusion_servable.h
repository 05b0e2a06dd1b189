// The image-generation family: GenerateImage on a MoH-DiT (and its VAE
// decoder, for latent models), with step-level continuous batching
// (diffusion_executor.h).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "model/core/dit_model.h"
#include "model/core/vae_decoder.h"
#include "moh/v1/server_config.pb.h"
#include "service/diffusion/diffusion_executor.h"
#include "service/metrics/metrics.h"
#include "service/servable/servable.h"

namespace moh {

class DiffusionServable : public Servable {
 public:
  // Loads the DiT of `config.model_dir()` (and its `vae`, relative to it) on
  // `device`, and starts the executor (generation.max_running requests at
  // once, generation.max_queued_requests waiting, adaptive.queue_depth).
  static absl::StatusOr<std::unique_ptr<DiffusionServable>> Load(
      const v1::ModelConfig& config, const DeviceOptions& device,
      Metrics* metrics);
  ~DiffusionServable() override;

  void Describe(v1::ModelInfo* info) const override;
  bool Serves(Task task) const override { return task == Task::kGenerateImage; }
  const MohConfig& moh() const override { return model_->config().moh; }
  ModelMetrics* metrics() const override { return metrics_; }
  absl::StatusOr<uint64_t> GenerateImage(
      GenerateImageCall call, std::shared_ptr<ImageObserver> observer) override;
  void CancelGenerateImage(uint64_t id) override;
  void StopAccepting() override;
  bool Idle() const override;

  // One forward of one row (and a VAE decode).
  absl::Status Warmup() const;

 private:
  DiffusionServable(const std::string& name, std::unique_ptr<DitModel> model,
                    std::unique_ptr<VaeDecoder> vae, ModelMetrics* metrics);

  const std::unique_ptr<DitModel> model_;
  const std::unique_ptr<VaeDecoder> vae_;
  ModelMetrics* const metrics_;
  std::unique_ptr<DiffusionExecutor> executor_;  // last: stopped first
};

}  // namespace moh
