// MoH-ViT image classifier in the timm layout (patch_embed.proj, cls_token,
// pos_embed, blocks.N.{norm1, attn.{qkv, proj, wg, wg_0, wg_1}, norm2,
// mlp.{fc1, fc2}}, norm, head) with the learned MoH router; GELU is exact (erf)
// and the class token feeds the head.
//
// Thread-compatible: a loaded model is immutable; Forward() may run
// concurrently.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/core/device_context.h"
#include "model/core/head_sparse_attention.h"
#include "model/core/model_config.h"
#include "model/core/moh_router.h"
#include "model/core/runtime.h"

namespace moh {

struct ClassifierOutput {
  at::Tensor logits;             // float32 CPU [B, num_classes]
  at::Tensor head_token_counts;  // int64 CPU [B, L, H]
  std::vector<at::Tensor>
      gates;  // when recorded: per layer float32 CPU [B, N, H]
};

class VitModel {
 public:
  static absl::StatusOr<std::unique_ptr<VitModel>> Load(
      const std::string& dir, const DeviceOptions& device_options);
  static absl::StatusOr<std::unique_ptr<VitModel>> Load(
      const std::string& dir, const VitConfig& config,
      const at::TensorOptions& options);

  // pixels: [B, C, S, S] float, already normalized with image_mean/image_std
  // (see NormalizePixels); ratios: one per row, <= 0 means the trained default.
  absl::StatusOr<ClassifierOutput> Forward(const at::Tensor& pixels,
                                           const std::vector<float>& ratios,
                                           bool record_gates = false) const;
  // The same with the routed K of every layer per row, as resolved at
  // admission (Activation::top_k).
  absl::StatusOr<ClassifierOutput> ForwardWithTopK(
      const at::Tensor& pixels, const std::vector<LayerTopK>& top_k,
      bool record_gates = false) const;

  // (pixels in [0, 1] - image_mean) / image_std, per channel; pixels [B, C, S,
  // S].
  at::Tensor NormalizePixels(const at::Tensor& pixels) const;

  const VitConfig& config() const { return config_; }
  // See AttentionMode (head_sparse_attention.h). Set before use.
  void set_attention_mode(AttentionMode mode) { attention_mode_ = mode; }
  const at::TensorOptions& options() const { return options_; }

 private:
  struct Block {
    at::Tensor norm1_w, norm1_b, qkv_w, qkv_b, proj_w, proj_b;
    at::Tensor norm2_w, norm2_b, fc1_w, fc1_b, fc2_w, fc2_b;
    MohRouter router;
  };

  VitModel(VitConfig config, at::TensorOptions options)
      : config_(std::move(config)),
        options_(options),
        context_(std::make_unique<DeviceContext>(options.device())) {}
  // pixels is [B, C, S, S] with B >= 1.
  absl::Status CheckPixels(const at::Tensor& pixels) const;
  at::Tensor LayerNorm(const at::Tensor& x, const at::Tensor& w,
                       const at::Tensor& b) const;
  // top_k: [B * N] int64 on the device, routed heads per token.
  at::Tensor Attention(const Block& block, const at::Tensor& x,
                       const at::Tensor& top_k, const TopKBounds& bounds,
                       at::Tensor* gates) const;

  VitConfig config_;
  at::TensorOptions options_;
  std::unique_ptr<DeviceContext> context_;
  at::Tensor patch_w_, patch_b_, cls_token_, pos_embed_;
  at::Tensor norm_w_, norm_b_, head_w_, head_b_;
  std::vector<Block> blocks_;
  AttentionMode attention_mode_ = AttentionMode::kAuto;
};

}  // namespace moh
