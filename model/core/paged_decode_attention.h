// Decode attention over the paged KV cache in place on CUDA
// (model/kernels/cuda_paged_decode.cu), for LlamaModel::DenseHeads: one
// query per row, every row's keys read through its block table. Builds
// against a CPU LibTorch have no such kernel: PagedDecodeServes is false
// there.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace moh {

struct PagedDecodeInputs {
  at::Tensor queries;      // [B, H, D], rotated, on CUDA
  at::Tensor key_cache;    // [blocks, block_size, KV, D] (a view of the
  at::Tensor value_cache;  // layer's cache: heads [0, KV) of it)
  at::Tensor block_table;  // [B, n] int64
  at::Tensor positions;    // [B] or [B, 1] int64: keys j <= position
  at::Tensor row_len;      // [B] int64: and j < row_len
  int64_t kv_len = 0;      // keys the longest row reads (host value)
  double scale = 1.0;
  // [B, H] in the queries' type (the last dimension contiguous), or
  // undefined: MoH's gates, which PagedDecode applies (each head's output
  // times its gate); a (row, KV group) whose gates are all 0 reads no key
  // (the work list).
  at::Tensor gates;
  // Keys per thread block, in [1, kPagedDecodeSplit]; 0: the kernel's
  // choice for the batch (PagedDecodeSplitKeys). Tests set it.
  int split_keys = 0;
};

// Whether PagedDecode takes these inputs: a CUDA build, queries on CUDA in
// the caches' type (float32, bfloat16 or float16), a supported shape
// (PagedDecodeShapeSupported), caches whose last dimension is contiguous,
// and gates (if given) [B, H] in that type with the last dimension
// contiguous.
bool PagedDecodeServes(const PagedDecodeInputs& in);

// [B, H, D]: head h attends with KV head h / (H / KV) to the first
// min(position + 1, row_len) keys of its row (times its gate where gates
// are given).
at::Tensor PagedDecode(const PagedDecodeInputs& in);

}  // namespace moh
