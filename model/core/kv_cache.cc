#include "model/core/kv_cache.h"

namespace moh {

int64_t KvCache::BytesPerToken(int64_t num_layers, int64_t num_kv_heads,
                               int64_t head_dim,
                               const at::TensorOptions& options) {
  const int64_t element_size =
      c10::elementSize(at::typeMetaToScalarType(options.dtype()));
  return 2 * num_layers * num_kv_heads * head_dim * element_size;
}

KvCache::KvCache(int64_t num_layers, int64_t num_slots, int64_t max_seq_len,
                 int64_t num_kv_heads, int64_t head_dim,
                 const at::TensorOptions& options)
    : num_slots_(num_slots),
      max_seq_len_(max_seq_len),
      bytes_per_token_(
          BytesPerToken(num_layers, num_kv_heads, head_dim, options)) {
  for (int64_t l = 0; l < num_layers; ++l) {
    keys_.push_back(
        at::zeros({num_slots, max_seq_len, num_kv_heads, head_dim}, options));
    values_.push_back(at::zeros_like(keys_.back()));
  }
}

}  // namespace moh
