// The CPU pair kernel's attention step (head_sparse_attention_cpu.cc): each
// head's queries, projected and rotated, attend over a paged KV cache and are
// replaced in place by their outputs. Internal to the pair kernel.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "model/core/head_sparse_attention.h"

namespace moh::head_sparse_internal {

// t as `type` (t itself when it is: .to() would still be a dispatch).
inline at::Tensor AsType(const at::Tensor &t, at::ScalarType type) {
  return t.scalar_type() == type ? t : t.to(type);
}

// One head's queries (later its attention outputs, in place): rows of a
// row-major matrix with leading dimension `ld`, for tokens tokens[0..count).
struct HeadRows {
  float *data = nullptr;
  int64_t ld = 0;
  const int64_t *tokens = nullptr;
  int64_t count = 0;
};

// Replaces each head's queries (rows_of[h], h < H; float32) by its attention
// over in.key_cache and in.value_cache (float32 or bfloat16), read through
// in.block_table, times the token's gate for the head (gate [N, H],
// row-major): each token sees its row's keys up to its position
// (in.token_row, in.token_pos, in.row_len), scores scaled by in.scale. Runs
// on the intra-op pool.
void PagedAttentionCpu(const HeadSparseAttentionInputs &in,
                       const std::vector<HeadRows> &rows_of, const float *gate);

}  // namespace moh::head_sparse_internal
