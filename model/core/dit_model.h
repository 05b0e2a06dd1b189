// MoH-DiT (MoH-DiT/models.py): a class-conditional diffusion transformer
// whose attention is MoH. Patch embedding plus the fixed 2D sin-cos position
// embedding (stored in the checkpoint), timestep embedding (256 frequencies,
// cos then sin, through an MLP) plus class embedding (row num_classes: the
// null class of classifier-free guidance), blocks with adaLN-Zero modulation
// (the router reads the modulated, normalized token), tanh-GELU MLP, the
// final adaLN layer and unpatchify. Heads and head_dim are per block.
//
// Its linear weights (timestep MLP, adaLN modulations, qkv, proj, fc1, fc2,
// the final layer) are held as DeviceOptions::weights asks (LinearWeight: as
// loaded, bfloat16 or int8 with a scale per row, under float32 activations
// on the CPU) and multiplied through Linear; the patch embedding, the class
// table and the routers stay as loaded.
//
// Rows are independent: each has its own timestep, class and routed K, so
// requests at different steps and ratios share one forward. Classifier-free
// guidance is the caller's (the sampler pairs a conditional and a null-class
// row of one request).
//
// Thread-compatible: a loaded model is immutable; Forward may run
// concurrently.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/checkpoint/checkpoint.h"
#include "model/core/activation.h"
#include "model/core/bidirectional_attention.h"
#include "model/core/device_context.h"
#include "model/core/linear.h"
#include "model/core/model_config.h"
#include "model/core/moh_router.h"
#include "model/core/runtime.h"

namespace moh {

struct DitOutput {
  at::Tensor out;  // float32 [B, out_channels, S, S] on the model's device
  // int64 CPU [B, L, H]: tokens each head served (H the most heads of any
  // block; zeros past a block's heads).
  at::Tensor head_token_counts;
};

class DitModel {
 public:
  // Reads `dir`/config.json and the checkpoint: safetensors, or a release
  // training container ({"model", "ema", "opt", "args"}) whose "ema" weights
  // are served, as the official download code does.
  static absl::StatusOr<std::unique_ptr<DitModel>> Load(
      const std::string& dir, const DeviceOptions& device_options);
  // `weights`: how the linear weights are held (kAsLoaded, or a format
  // ResolveWeightFormat accepts for `options`).
  static absl::StatusOr<std::unique_ptr<DitModel>> FromStore(
      TensorStore& store, const DitConfig& config,
      const at::TensorOptions& options,
      WeightFormat weights = WeightFormat::kAsLoaded);

  // x: [B, C, S, S] noisy inputs; timesteps: [B] (the original diffusion
  // timesteps, float); classes: [B] int64 in [0, num_classes] (num_classes:
  // the null class); top_k: routed K of every block per row.
  absl::StatusOr<DitOutput> Forward(const at::Tensor& x,
                                    const at::Tensor& timesteps,
                                    const at::Tensor& classes,
                                    const std::vector<LayerTopK>& top_k) const;

  const DitConfig& config() const { return config_; }
  const at::TensorOptions& options() const { return options_; }
  // How the linear weights are held.
  WeightFormat linear_weights() const { return linear_weights_; }
  // See AttentionMode (head_sparse_attention.h). Set before use.
  void set_attention_mode(AttentionMode mode) { attention_mode_ = mode; }

 private:
  struct Block {
    LinearWeight ada_w;  // [6C, C]
    at::Tensor ada_b;    // [6C]
    BidirectionalAttentionWeights attn;
    MohRouter router;
    LinearWeight fc1_w, fc2_w;
    at::Tensor fc1_b, fc2_b;
  };

  DitModel(DitConfig config, at::TensorOptions options)
      : config_(std::move(config)),
        options_(options),
        context_(std::make_unique<DeviceContext>(options.device())) {}
  absl::Status CheckInputs(const at::Tensor& x, const at::Tensor& timesteps,
                           const at::Tensor& classes, size_t top_k_rows) const;

  DitConfig config_;
  at::TensorOptions options_;
  std::unique_ptr<DeviceContext> context_;
  at::Tensor patch_w_, patch_b_, pos_embed_;
  LinearWeight t_w0_, t_w2_;
  at::Tensor t_b0_, t_b2_, class_table_;
  std::vector<Block> blocks_;
  LinearWeight final_ada_w_, final_w_;
  at::Tensor final_ada_b_, final_b_;
  WeightFormat linear_weights_ = WeightFormat::kAsLoaded;
  AttentionMode attention_mode_ = AttentionMode::kAuto;
};

}  // namespace moh
