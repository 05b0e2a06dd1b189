// MoH-ViT image classifier in the timm layout (patch_embed.proj, cls_token,
// pos_embed, blocks.N.{norm1, attn.{qkv, proj, wg, wg_0, wg_1}, norm2,
// mlp.{fc1, fc2}}, norm, head) with the learned MoH router; GELU is exact (erf)
// and the class token feeds the head. Its linear weights (qkv, proj, fc1,
// fc2, head) are held as DeviceOptions::weights asks (LinearWeight: as
// loaded, bfloat16 or int8 with a scale per row, under float32 activations
// on the CPU) and multiplied through Linear; the patch embedding, the norms
// and the router stay as loaded.
//
// Thread-compatible: a loaded model is immutable; Forward() may run
// concurrently.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/core/bidirectional_attention.h"
#include "model/core/head_sparse_attention.h"
#include "model/core/image_model_parts.h"
#include "model/core/linear.h"
#include "model/core/model_config.h"
#include "model/core/moh_router.h"
#include "model/core/runtime.h"

namespace moh {

class VitModel : public ConfiguredImageClassifier<VitConfig> {
 public:
  static absl::StatusOr<std::unique_ptr<VitModel>> Load(
      const std::string& dir, const DeviceOptions& device_options);
  static absl::StatusOr<std::unique_ptr<VitModel>> Load(
      const std::string& dir, const VitConfig& config,
      const at::TensorOptions& options,
      WeightFormat weights = WeightFormat::kAsLoaded);

  absl::StatusOr<ClassifierOutput> ForwardWithTopK(
      const at::Tensor& pixels, const std::vector<LayerTopK>& top_k,
      bool record_gates = false) const override;

  // Resized straight to the square (antialiased bilinear).
  ImagePreprocessing preprocessing() const override;
  // The class token and every patch, in every layer.
  std::vector<int64_t> LayerTokens() const override;
  // How the linear weights are held.
  WeightFormat linear_weights() const override { return linear_weights_; }

 private:
  struct Block {
    at::Tensor norm1_w, norm1_b;
    BidirectionalAttentionWeights attn;
    at::Tensor norm2_w, norm2_b, fc1_b, fc2_b;
    LinearWeight fc1_w, fc2_w;
    MohRouter router;
  };

  VitModel(VitConfig config, at::TensorOptions options)
      : ConfiguredImageClassifier(std::move(config), options) {}
  at::Tensor LayerNorm(const at::Tensor& x, const at::Tensor& w,
                       const at::Tensor& b) const;
  at::Tensor patch_w_, patch_b_, cls_token_, pos_embed_;
  at::Tensor norm_w_, norm_b_, head_b_;
  LinearWeight head_w_;
  std::vector<Block> blocks_;
  WeightFormat linear_weights_ = WeightFormat::kAsLoaded;
};

}  // namespace moh
