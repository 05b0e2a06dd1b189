// Building blocks the image models (ViT, TransNeXt, DiT) share: the input
// shape check, the per-token routed K of every layer uploaded once per
// forward, per-layer head counts padded to the widest layer, and what an image
// classifier keeps (config, device, attention mode) and hands back.
//
// Thread-compatible, as the models that use them.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/status_macros.h"
#include "model/core/activation.h"
#include "model/core/device_context.h"
#include "model/core/head_sparse_attention.h"
#include "model/core/image_classifier.h"
#include "model/core/model_config.h"
#include "model/core/moh_router.h"
#include "model/core/runtime.h"

namespace moh {

// OK when `images` is [B, channels, size, size] with B >= 1; else
// INVALID_ARGUMENT naming `name`.
absl::Status CheckImageBatch(const at::Tensor& images, int64_t channels,
                             int64_t size, const char* name);

// The routed K of every layer per token for a batch whose rows have
// `row_top_k` (validated: one K per layer each) and whose layer l routes
// `layer_tokens[l]` tokens per row: packed on the host (PackLayerTopK) and
// uploaded in one copy. Make it inside the context's scope; it must outlive
// the forward that reads it (on CPU the device tensor is its host buffer).
class UploadedTopK {
 public:
  UploadedTopK(const DeviceContext& context,
               const std::vector<LayerTopK>& row_top_k,
               const std::vector<int64_t>& layer_tokens);
  UploadedTopK(const UploadedTopK&) = delete;
  UploadedTopK& operator=(const UploadedTopK&) = delete;

  // Layer l's K: [B * layer_tokens[l]] int64 on the device.
  at::Tensor layer(size_t l) const {
    return device_.narrow(0, offsets_[l], sizes_[l]);
  }
  const TopKBounds& bounds(size_t l) const { return bounds_[l]; }

 private:
  std::vector<int64_t> host_;
  std::vector<int64_t> offsets_, sizes_;
  std::vector<TopKBounds> bounds_;
  at::Tensor device_;
};

// The most heads of any layer.
int64_t MaxHeads(const MohConfig& moh);

// HeadTokenCounts (gates [B, T, H], valid [B, T]) padded with zeros to
// `max_heads` heads: [B, max_heads] int64.
at::Tensor PaddedHeadTokenCounts(const at::Tensor& gates,
                                 const at::Tensor& valid, int64_t max_heads);

// The classifier's results copied to the host with one wait: logits (float32
// [B, classes]), counts ([B, L, H]) and, when recorded, each layer's gates
// (float32).
ClassifierOutput DownloadClassifierOutput(const DeviceContext& context,
                                          const at::Tensor& logits,
                                          const at::Tensor& counts,
                                          const std::vector<at::Tensor>& gates);

// What every image classifier family keeps: its config (which has moh,
// labels, image_size, num_channels, image_mean and image_std), tensor options
// and device context, and its attention mode.
template <typename Config>
class ConfiguredImageClassifier : public ImageClassifier {
 public:
  const MohConfig& moh() const override { return config_.moh; }
  const std::vector<std::string>& labels() const override {
    return config_.labels;
  }
  void set_attention_mode(AttentionMode mode) override {
    attention_mode_ = mode;
  }

  const Config& config() const { return config_; }
  const at::TensorOptions& options() const { return options_; }
  at::Device device() const override { return options_.device(); }

 protected:
  ConfiguredImageClassifier(Config config, at::TensorOptions options)
      : config_(std::move(config)),
        options_(options),
        context_(std::make_unique<DeviceContext>(options.device())) {}

  const std::vector<float>& image_mean() const override {
    return config_.image_mean;
  }
  const std::vector<float>& image_std() const override {
    return config_.image_std;
  }
  const DeviceContext& context() const { return *context_; }
  AttentionMode attention_mode() const { return attention_mode_; }
  // ForwardWithTopK's frame: checks pixels ([B, C, S, S], B >= 1) and
  // top_k, then runs `forward(top_k)` (every layer's K, UploadedTopK) with
  // autograd off, inside the model's device scope; LibTorch errors become
  // INTERNAL naming `what`.
  template <typename ForwardFn>
  absl::StatusOr<ClassifierOutput> RunForward(
      const char* what, const at::Tensor& pixels,
      const std::vector<LayerTopK>& row_top_k, ForwardFn forward) const {
    MOH_RETURN_IF_ERROR(CheckImageBatch(pixels, config_.num_channels,
                                        config_.image_size, "pixels"));
    MOH_RETURN_IF_ERROR(
        ValidateTopK(config_.moh, row_top_k, pixels.size(0), "top_k"));
    // No autograd: every op skips its autograd and view-tracking layers.
    const c10::InferenceMode inference;
    return CatchTorchErrors(what, [&]() -> absl::StatusOr<ClassifierOutput> {
      // The model's device and stream (CUDA) for everything the forward does.
      const std::unique_ptr<DeviceContext::Scope> scope = context_->Enter();
      // Every layer's K per token, computed on the host and uploaded once.
      const UploadedTopK top_k(*context_, row_top_k, LayerTokens());
      return forward(top_k);
    });
  }

 private:
  Config config_;
  at::TensorOptions options_;
  std::unique_ptr<DeviceContext> context_;
  AttentionMode attention_mode_ = AttentionMode::kAuto;
};

}  // namespace moh
