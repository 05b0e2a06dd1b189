// Prompt chunks' attention on CUDA without padding or masks (issue 30,
// item 2): the step's queries as they lie ([N, H, D], row after row), each
// row's keys and values packed after the row before's (one gather from the
// paged cache a layer), and FlashAttention-2 over the ragged batch through
// LibTorch's own entry point (`at::_flash_attention_forward` with
// cumulative sequence lengths: a maintained kernel, GQA without repeating
// the KV heads). Its causal mask is aligned bottom-right: query i of a row
// of t queries over L keys sees keys j <= L - t + i, which is the chunked
// prefill's rule (the chunk's queries are the row's last t positions).
//
// DenseAttention, which it replaces there, pads every row to the widest
// and builds a [B, G * T, L] mask chunk by chunk: run 7's profile of a 4k
// prompt at batch 1 spent 12% of the prefill in the elementwise kernels
// around it and 22% in masked attention, 9 calls a layer.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace moh {

// Where each row's keys lie, packed: PackedKeys' host side.
struct PackedKeyLayout {
  // Key k of the packed order at index[k] of the cache viewed as
  // [blocks * block_size, KV, D]: row 0's L_0 keys, then row 1's, ...
  std::vector<int64_t> index;
  std::vector<int32_t> cum_q, cum_k;  // [B + 1]: prefix sums of t_r, L_r
  int64_t max_q = 0, max_k = 0;       // the largest t_r and L_r
};

// For rows of num_tokens[r] new tokens after start_positions[r] cached ones
// (L_r = start + t_r keys each), whose position p lies in block
// block_tables[r][p / block_size] (or, block_tables empty, in block
// slots[r]). Pure: no tensors.
PackedKeyLayout PackKeyLayout(
    const std::vector<int32_t>& num_tokens,
    const std::vector<int32_t>& start_positions,
    const std::vector<std::vector<int32_t>>& block_tables,
    const std::vector<int32_t>& slots, int64_t block_size);

// The layout's tensors on the queries' device (made once a step).
struct PackedKeys {
  at::Tensor index;         // [K] int64
  at::Tensor cum_q, cum_k;  // [B + 1] int32
  int64_t max_q = 0, max_k = 0;
};
PackedKeys ToDevice(const PackedKeyLayout& layout, const at::Device& device);

struct VarlenAttentionInputs {
  at::Tensor queries;  // [N, H, D], rotated; rows' tokens in turn
  // [blocks, block_size, KV, D] (views of the layer's caches: a KV-head
  // prefix too); H a multiple of KV.
  at::Tensor key_cache, value_cache;
  PackedKeys keys;
  double scale = 1.0;
};

// Whether VarlenAttention takes these: CUDA (compute capability 8.0 or
// later) in a build against a CUDA LibTorch, bfloat16 or float16 queries, a
// head_dim that is a multiple of 8 up to 256, H a multiple of the caches'
// KV heads.
bool VarlenAttentionServes(const at::Tensor& queries,
                           const at::Tensor& key_cache);

// [N, H, D]: head h attends with KV head h / (H / KV), causally
// (bottom-right) over its row's packed keys. Only where
// VarlenAttentionServes.
at::Tensor VarlenAttention(const VarlenAttentionInputs& in);

}  // namespace moh
