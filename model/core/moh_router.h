// The MoH head routers of SPEC §1, with the routed top-K given per token.
//
// A router turns the attention input of each token into one gate per head
// ([N, H], 0 = the head is not used by that token). Heads [0, S) are shared,
// heads [S, H) are routed; K may differ per token (each batch row brings its
// own activation ratio). With the trained K, the gates equal the official code:
//   learned    — MoH-DiT/MoH-ViT `MoHAttention.forward` (two-stage softmax
//   gates) query_norm — MoH-LLaMA3 `LlamaAttention.forward` (binary mask from
//   ||q_h||) dense      — every gate is 1.
// Thread-compatible: Gates() is const and may run concurrently.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "absl/status/statusor.h"
#include "model/checkpoint/checkpoint.h"
#include "model/core/activation.h"
#include "model/core/model_config.h"

namespace moh {

class MohRouter {
 public:
  // Takes the router weights of one layer from `store`: `<prefix>wg.weight`
  // [R, C] (when R > 0), `<prefix>wg_0.weight` [2, C] (when R > 0 and S > 0)
  // and
  // `<prefix>wg_1.weight` [S, C] (when S > 1), converted to `options`.
  static absl::StatusOr<MohRouter> Load(RouterKind kind,
                                        const MohLayerConfig& layer,
                                        int64_t hidden_size,
                                        const std::string& prefix,
                                        TensorStore& store,
                                        const at::TensorOptions& options);

  // x: router input [N, C] (the normalized attention input).
  // query: query projection before RoPE, [N, H, D] (used by query_norm only).
  // top_k: [N] int64, the routed K of each token, each in [0, R].
  // max_top_k: max over top_k (a host value, so no device sync is needed).
  // Returns gates [N, H] in x's dtype.
  at::Tensor Gates(const at::Tensor& x, const at::Tensor& query,
                   const at::Tensor& top_k, int64_t max_top_k) const;

  const MohLayerConfig& layer() const { return layer_; }
  RouterKind kind() const { return kind_; }

 private:
  at::Tensor LearnedGates(const at::Tensor& x, const at::Tensor& top_k,
                          int64_t max_top_k) const;
  // LearnedGates for float32 rows [n, C] (contiguous) on CPU.
  at::Tensor LearnedGatesLoop(const at::Tensor& x,
                              const at::Tensor& top_k) const;
  // The query-norm router decides in float32 whatever the queries' type:
  // rounding its norms and quotients to bfloat16 ties heads that float32
  // tells apart (the bf16 fixture: gates 0.1766 and 0.1848 both 0.1865), and
  // a tie is then settled by topk's arbitrary order, not by the model.
  at::Tensor QueryNormGates(const at::Tensor& query, const at::Tensor& top_k,
                            int64_t max_top_k) const;

  RouterKind kind_ = RouterKind::kDense;
  MohLayerConfig layer_;
  at::Tensor wg_;    // [R, C]
  at::Tensor wg_0_;  // [2, C]
  at::Tensor wg_1_;  // [S, C]
  // wg_, wg_0_ and wg_1_ stacked (those defined), when R > 0: the many-row
  // path's one product, a single pass over x.
  at::Tensor stacked_;
};

struct TopKBounds {
  int64_t min = 0, max = 0;
};
// Per-token routed K of layer `layer` for a batch whose row b has K
// `rows[b][layer]` (Activation::top_k) and `tokens_per_row` tokens: writes
// rows.size() * tokens_per_row values at `out` (host memory: a whole step's K
// are uploaded to the device at once) and returns their bounds.
TopKBounds PackLayerTopK(const std::vector<LayerTopK>& rows, size_t layer,
                         int64_t tokens_per_row, int64_t* out);

// Tokens each head served: counts nonzero gates of valid tokens.
// gates [B, T, H], valid [B, T] bool → [B, H] int64.
at::Tensor HeadTokenCounts(const at::Tensor& gates, const at::Tensor& valid);

}  // namespace moh
