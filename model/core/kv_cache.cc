#include "model/core/kv_cache.h"

namespace moh {

int64_t KvCache::BytesPerToken(int64_t num_layers, int64_t num_kv_heads,
                               int64_t head_dim,
                               const at::TensorOptions& options) {
  const int64_t element_size =
      c10::elementSize(at::typeMetaToScalarType(options.dtype()));
  return 2 * num_layers * num_kv_heads * head_dim * element_size;
}

KvCache::KvCache(int64_t num_layers, int64_t num_blocks, int64_t block_size,
                 int64_t num_kv_heads, int64_t head_dim,
                 const at::TensorOptions& options)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      bytes_per_token_(
          BytesPerToken(num_layers, num_kv_heads, head_dim, options)) {
  for (int64_t l = 0; l < num_layers; ++l) {
    keys_.push_back(
        at::zeros({num_blocks, block_size, num_kv_heads, head_dim}, options));
    values_.push_back(at::zeros_like(keys_.back()));
  }
}

at::Tensor GatherBlocks(const at::Tensor& cache, const at::Tensor& block_table,
                        int64_t kv_len) {
  const int64_t rows = block_table.size(0), block_size = cache.size(1);
  const int64_t blocks = (kv_len + block_size - 1) / block_size;
  if (blocks == 1) {  // one block per row (slots): copy only what is read
    return cache.narrow(1, 0, kv_len).index_select(0, block_table.select(1, 0));
  }
  return cache.index_select(0, block_table.narrow(1, 0, blocks).reshape({-1}))
      .view({rows, blocks * block_size, cache.size(2), cache.size(3)})
      .narrow(1, 0, kv_len);
}

at::Tensor NarrowView(const at::Tensor& cache, int64_t narrow_kv_heads) {
  const int64_t fold = cache.size(2) / narrow_kv_heads;
  return cache.view(
      {cache.size(0), cache.size(1) * fold, narrow_kv_heads, cache.size(3)});
}

at::Tensor GatherRows(const at::Tensor& cache, const at::Tensor& narrow_cache,
                      const at::Tensor& block_table,
                      const at::Tensor& narrow_rows, int64_t kv_len) {
  at::Tensor out = GatherBlocks(cache, block_table, kv_len);
  if (!narrow_rows.defined() || narrow_rows.numel() == 0) return out;
  // The narrow rows' entries above were read through the wide view (other
  // positions, or nothing of theirs): replaced here. Simple rather than
  // lean: this generic path serves tests, CPU bfloat16 and CUDA.
  const int64_t w = narrow_cache.size(2);
  at::Tensor narrow =
      GatherBlocks(narrow_cache, block_table.index_select(0, narrow_rows),
                   kv_len);  // [Bn, kv_len, w, D]
  if (w < cache.size(2)) {
    narrow = at::cat({narrow, at::zeros({narrow.size(0), kv_len,
                                         cache.size(2) - w, cache.size(3)},
                                        narrow.options())},
                     2);
  }
  return out.contiguous().index_copy_(0, narrow_rows, narrow);
}

}  // namespace moh
