// Every-head causal attention over a KV cache with a bounded workspace.
//
// The plain formulation materializes scores [B, H, T, L] for a batch padded to
// its widest row: a 64-row step with a 2048-token prompt chunk on an 8B shape
// needs tens of GB. Here queries are processed in chunks of rows x T' so that
// one chunk's scores (float32) and mask stay under a byte budget, and with
// LibTorch 2.x each chunk goes through at::scaled_dot_product_attention
// (flash / memory-efficient kernels on CUDA, a fused kernel on CPU), which
// need not materialize the scores at all. Same results as one unchunked
// softmax(QK^T)V up to float rounding: every query row's softmax is complete
// within its chunk.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "model/core/kv_cache.h"

namespace moh {

struct DenseAttentionInputs {
  at::Tensor queries;      // [B, T, H, D], already rotated
  at::Tensor key_cache;    // [blocks, block_size, KV, D] (kv_cache.h)
  at::Tensor value_cache;  // [blocks, block_size, KV, D]
  at::Tensor block_table;  // [B, n] int64: each row's blocks
  // Rows stored narrow (kv_cache.h): read through its views; their KV heads
  // beyond the narrow width read as zeros (their gates are 0). Empty: none.
  NarrowRows narrow;
  at::Tensor positions;    // [B, T] int64: key j visible iff j <= position
  at::Tensor row_len;      // [B] int64: and j < row_len
  int64_t kv_len = 0;      // keys the longest row reads (host value)
  // DenseVisible(positions, row_len, kv_len) when the caller keeps it for
  // several calls (the layers of one step); undefined: computed here, a
  // chunk at a time.
  at::Tensor visible;
  double scale = 1.0;
  // Upper bound in bytes for one chunk's scores and mask (> 0).
  int64_t workspace_bytes = int64_t{256} << 20;
};

// Queries per chunk: the largest T' in [1, T] whose workspace
// (B * H * T' * kv_len float32 scores plus a B * T' * kv_len mask) fits
// `workspace_bytes`; 1 when even a single query exceeds it (the smallest
// possible step: then the bound is B * H * kv_len * 4 bytes).
int64_t DenseAttentionQueryChunk(int64_t rows, int64_t heads, int64_t width,
                                 int64_t kv_len, int64_t workspace_bytes);

// [B, T, kv_len] bool: which keys each query sees (j <= its position and
// j < its row's length).
at::Tensor DenseVisible(const at::Tensor& positions, const at::Tensor& row_len,
                        int64_t kv_len);

// Returns [B, T, H, D]: head h attends with KV head h / (H / KV).
at::Tensor DenseAttention(const DenseAttentionInputs& in);

}  // namespace moh
