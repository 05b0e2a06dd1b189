// Key/value cache of a decoder, organised in fixed-size blocks.
//
// The cache is `num_blocks` blocks of `block_size` token positions, holding
// keys and values of every layer. A sequence lives in a list of blocks, its
// block table: position p is at offset p % block_size of block
// table[p / block_size]. Two ways to use it:
//   - slots: one block per sequence, as long as the longest sequence
//     (block_size = max_seq_len): DecoderBatch::slots names the block;
//   - paged: small blocks allocated as sequences grow, several sequences may
//     read the same blocks (a shared prompt prefix); DecoderBatch::
//     block_tables names them. Which block belongs to whom is the caller's
//     bookkeeping (service/kv_block_pool.h).
// The cache stores tensors only. Memory is allocated once at construction,
// so admission control can reason in blocks and bytes_per_token without ever
// over-committing. Not thread-safe: one owner (the thread running the model)
// at a time.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace moh {

class KvCache {
 public:
  KvCache(int64_t num_layers, int64_t num_blocks, int64_t block_size,
          int64_t num_kv_heads, int64_t head_dim,
          const at::TensorOptions& options);

  // [num_blocks, block_size, num_kv_heads, head_dim] for `layer`.
  at::Tensor& keys(int64_t layer) { return keys_[layer]; }
  at::Tensor& values(int64_t layer) { return values_[layer]; }

  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_size() const { return block_size_; }
  // Bytes of keys and values one token position takes over all layers.
  int64_t bytes_per_token() const { return bytes_per_token_; }
  // The same, for a cache not yet allocated (memory planning).
  static int64_t BytesPerToken(int64_t num_layers, int64_t num_kv_heads,
                               int64_t head_dim,
                               const at::TensorOptions& options);
  int64_t total_bytes() const {
    return bytes_per_token_ * num_blocks_ * block_size_;
  }

 private:
  int64_t num_blocks_;
  int64_t block_size_;
  int64_t bytes_per_token_;
  std::vector<at::Tensor> keys_;
  std::vector<at::Tensor> values_;
};

// [B, kv_len, KV, D]: the first kv_len positions of each row of `cache`
// ([num_blocks, block_size, KV, D]) through `block_table` ([B, n] int64, n
// blocks per row, n * block_size >= kv_len), gathered into one tensor.
at::Tensor GatherBlocks(const at::Tensor& cache, const at::Tensor& block_table,
                        int64_t kv_len);

// The ratio ceiling: a sequence that can never read the routed KV heads
// (every layer at routed K = 0, its shared heads reading KV heads [0, w))
// stores only those w heads. A block's memory viewed as
// [block_size * fold, w, D] (fold = KV / w) then holds fold times as many of
// its positions: the same blocks, the same block ids, another view. Its
// position p is at offset p % (block_size * fold) of block
// table[p / (block_size * fold)] of that view.
//
// `cache` [blocks, block_size, KV, D] (contiguous) viewed so: [blocks,
// block_size * KV / w, w, D].
at::Tensor NarrowView(const at::Tensor& cache, int64_t narrow_kv_heads);

// The narrow rows of a step, for attention paths that read rows' caches.
struct NarrowRows {
  int64_t kv_heads = 0;               // w; 0: no row of the step is narrow
  at::Tensor key_cache, value_cache;  // NarrowView()s of the layer's caches
  at::Tensor rows;                    // [Bn] int64, the caches' device
  std::vector<uint8_t> is_narrow;     // [B], host: 1 for a narrow row
  bool any() const { return kv_heads > 0; }
};

// GatherBlocks over a step whose rows `narrow_rows` ([Bn] int64; undefined
// or empty: none) are stored narrow in `narrow_cache` (NarrowView of
// `cache`): [B, kv_len, KV, D], a narrow row's KV heads [w, KV) zeros (no
// head of such a row reads them). `block_table` has at least
// ceil(kv_len / block_size) entries per row.
at::Tensor GatherRows(const at::Tensor& cache, const at::Tensor& narrow_cache,
                      const at::Tensor& block_table,
                      const at::Tensor& narrow_rows, int64_t kv_len);

}  // namespace moh
