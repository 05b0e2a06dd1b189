// MoH multi-head self-attention over every token of each row (no mask): the
// attention of MoH-ViT (timm layout) and MoH-DiT. Queries, keys and values
// come from one qkv projection of H heads of D (H * D may differ from the
// width C, as in MoH-DiT-XL), the learned router's gates weight the heads
// before the output projection, as the official MoHAttention computes it.
// Where UseHeadSparse says so, only the selected (token, head) pairs are
// computed (head_sparse_attention.h).
#pragma once

#include <ATen/ATen.h>

#include "model/core/head_sparse_attention.h"
#include "model/core/linear.h"
#include "model/core/moh_router.h"

namespace moh {

// The projections' weights as the model holds them (linear.h: a tensor, or
// int8 with a scale per row), multiplied through Linear.
struct BidirectionalAttentionWeights {
  LinearWeight qkv_w;   // [3 * H * D, C]
  at::Tensor qkv_b;     // [3 * H * D] or undefined
  LinearWeight proj_w;  // [C, H * D]
  at::Tensor proj_b;    // [C]
};

// x: [B, N, C] attention input (also the router's); top_k: [B * N] int64 on
// x's device with `bounds`. Returns [B, N, C]; *gates gets [B, N, H].
at::Tensor BidirectionalAttention(const BidirectionalAttentionWeights& w,
                                  const MohRouter& router, const at::Tensor& x,
                                  const at::Tensor& top_k,
                                  const TopKBounds& bounds, AttentionMode mode,
                                  at::Tensor* gates);

}  // namespace moh
