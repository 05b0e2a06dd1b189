// MoH-ViT as released: TransNeXt (Dai Shi, arXiv 2311.17132) with MoH routing
// in every stage, in the official tensor layout (MoH-ViT/transnext.py,
// attention.py, attention_native.py): four stages of overlapping patch
// embedding, blocks of aggregated attention (stages 1-3: a local window with
// L2-normalized queries and keys, learnable tokens and bias, keys pooled to
// resolution / sr_ratio through the same kv projection, continuous position
// bias, one softmax over both) or full attention with CPB (stage 4), and a
// convolutional GLU; mean pooling and a linear head. Its linear weights (q,
// kv, proj, fc1, fc2, head) are held as DeviceOptions::weights asks
// (LinearWeight: as loaded, bfloat16 or int8 with a scale per row, under
// float32 activations on the CPU) and multiplied through Linear; convolutions,
// norms, the CPB MLP and the router stay as loaded.
//
// Every stage has a learned router on the attention input; its gates weight
// the heads before the output projection. Where a stage routes (top-K below
// its routed heads), the skipped (token, head) pairs are not computed: only
// the selected tokens of each head get a query projection and attention.
//
// Buffers the official model does not store (CPB coordinates and index, the
// sequence-length scale, the window's padding mask) are computed at load for
// the configured resolution, with the CPB MLP applied once (its output is a
// constant of the weights).
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
#include "model/core/image_model_parts.h"
#include "model/core/linear.h"
#include "model/core/moh_router.h"
#include "model/core/runtime.h"

namespace moh {

class TransNextModel : public ConfiguredImageClassifier<TransNextConfig> {
 public:
  static absl::StatusOr<std::unique_ptr<TransNextModel>> Load(
      const std::string& dir, const DeviceOptions& device_options);
  static absl::StatusOr<std::unique_ptr<TransNextModel>> Load(
      const std::string& dir, const TransNextConfig& config,
      const at::TensorOptions& options,
      WeightFormat weights = WeightFormat::kAsLoaded);
  // From tensors already read (e.g. a release container), with the official
  // names; every tensor must be used.
  static absl::StatusOr<std::unique_ptr<TransNextModel>> FromStore(
      TensorStore& store, const TransNextConfig& config,
      const at::TensorOptions& options,
      WeightFormat weights = WeightFormat::kAsLoaded);

  absl::StatusOr<ClassifierOutput> ForwardWithTopK(
      const at::Tensor& pixels, const std::vector<LayerTopK>& top_k,
      bool record_gates = false) const override;

  ImagePreprocessing preprocessing() const override;
  std::vector<int64_t> LayerTokens() const override;
  // How the linear weights are held.
  WeightFormat linear_weights() const override { return linear_weights_; }

 private:
  struct Attention {
    bool aggregated = false;
    LinearWeight q_w;   // [C, C]: aggregated q, or qkv's first third
    LinearWeight kv_w;  // [2C, C]: aggregated kv, or qkv's last two
    LinearWeight proj_w;
    at::Tensor q_b, kv_b, proj_b;
    at::Tensor query_embedding;  // [H, D]
    at::Tensor scale;  // [H, N]: softplus(temperature) * seq_length_scale
    at::Tensor bias;   // [H, N, P]: the CPB (P = pooled keys, or N)
    // Aggregated attention only.
    at::Tensor local_bias;        // [H, W] relative_pos_bias_local
    at::Tensor learnable_tokens;  // [H, D, W]
    at::Tensor learnable_bias;    // [H, W]
    at::Tensor sr_w, sr_b, norm_w, norm_b;
    MohRouter router;
  };
  struct Block {
    at::Tensor norm1_w, norm1_b, norm2_w, norm2_b;
    Attention attn;
    LinearWeight fc1_w, fc2_w;
    at::Tensor fc1_b, dw_w, dw_b, fc2_b;
  };
  struct Stage {
    int64_t resolution = 0, tokens = 0, pool = 0, pooled = 0;
    int64_t kernel = 0, stride = 0;
    at::Tensor embed_w, embed_b, embed_norm_w, embed_norm_b;
    std::vector<Block> blocks;
    at::Tensor norm_w, norm_b;
    // Aggregated attention: each token's window, row-major, -1 outside the
    // grid ([N, W] int64, host and device) and the padding mask.
    at::Tensor neighbours, neighbours_host, padding;
  };

  TransNextModel(TransNextConfig config, at::TensorOptions options)
      : ConfiguredImageClassifier(std::move(config), options) {}
  absl::Status LoadStage(TensorStore& store, int s);
  // A linear weight of the store in linear_weights_.
  absl::StatusOr<LinearWeight> TakeLinear(TensorStore& store,
                                          const std::string& name,
                                          std::vector<int64_t> shape) const;
  absl::StatusOr<Attention> LoadAttention(TensorStore& store, int s,
                                          const std::string& prefix,
                                          const MohLayerConfig& layer);
  at::Tensor Norm(const at::Tensor& x, const at::Tensor& w,
                  const at::Tensor& b) const;
  at::Tensor Mlp(const Block& block, const at::Tensor& x,
                 int64_t resolution) const;
  // x: [B, N, C] normalized block input; top_k [B * N] int64 on the device.
  at::Tensor AttentionForward(const Stage& stage, const Attention& attn,
                              const at::Tensor& x, const at::Tensor& top_k,
                              const TopKBounds& bounds,
                              at::Tensor* gates) const;
  // AttentionForward's steps. The keys and values a layer attends to:
  // L2-normalized global keys [B, P, H, D] and values [B, P, C] (pooled
  // features, or the tokens themselves), and for aggregated attention the
  // tokens' own for the window ([B, N, H, D], [B, N, C]).
  struct AttentionKeys {
    at::Tensor global_k, global_v, local_k, local_v;
  };
  AttentionKeys Keys(const Stage& stage, const Attention& attn,
                     const at::Tensor& x) const;
  // The CPU pair kernel (transnext_attention.h) on the (token, head) pairs
  // the gates [B * N, H] select; the output projection applied.
  at::Tensor PairAttention(const Stage& stage, const Attention& attn,
                           const at::Tensor& x, const at::Tensor& gates,
                           const AttentionKeys& keys,
                           const TopKBounds& bounds) const;
  // Every head, as the official code computes it, weighted by the gates
  // [B, N, H]; the output projection applied.
  at::Tensor DenseAttention(const Stage& stage, const Attention& attn,
                            const at::Tensor& x, const AttentionKeys& keys,
                            const at::Tensor& gates) const;

  std::vector<Stage> stages_;
  LinearWeight head_w_;
  at::Tensor head_b_;
  WeightFormat linear_weights_ = WeightFormat::kAsLoaded;
};

}  // namespace moh
