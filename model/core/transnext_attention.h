// The CPU pair kernel of TransNeXt's attention (transnext_model.h): for each
// selected (token, head) pair, the L2-normalized query against its 3x3 window
// (aggregated attention; any odd window) and the pooled keys (or every token:
// full attention), one softmax over both, the window's values weighted by the
// attention plus the learnable tokens and bias, the pooled values by theirs,
// times the pair's gate. Keys and values are complete (any token may select a
// head its neighbour skipped); queries exist only for the listed pairs.
#pragma once

#include <ATen/ATen.h>

namespace moh {

struct TransNextPairInputs {
  int64_t rows = 0, tokens = 0, heads = 0, head_dim = 0;  // B, N, H, D
  // Raw query projections (bias added), one row of D per pair: [pairs, D]
  // listed by pair_token / pair_head, or [B * N, H * D] for every pair when
  // pair_token is undefined.
  at::Tensor queries;
  at::Tensor pair_token, pair_head;  // [pairs] int64: token in [0, B * N)
  at::Tensor gates;                  // [B * N, H]
  at::Tensor query_embedding;        // [H, D]
  at::Tensor scale;                  // [H, N]
  // Global keys (L2-normalized) and values: [B, P, H * D] each, rows may be
  // strided (the last dimension contiguous).
  at::Tensor keys, values;
  at::Tensor bias;  // [H, N, P]
  // Aggregated attention only (undefined for full attention): the tokens'
  // keys (normalized) and values [B, N, H * D], each token's window of W
  // positions [N, W] int64 (-1: outside the grid) and the window's biases.
  at::Tensor local_keys, local_values, neighbours;
  at::Tensor local_bias;        // [H, W]
  at::Tensor learnable_tokens;  // [H, D, W]
  at::Tensor learnable_bias;    // [H, W]
};

// [B * N, H * D] float32: each pair's gated output at its head's columns,
// zeros for pairs not listed. All inputs float32 on CPU.
at::Tensor TransNextPairAttentionCpu(const TransNextPairInputs& in);

}  // namespace moh
