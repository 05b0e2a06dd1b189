// Key/value cache of a decoder, organised in fixed slots.
//
// Each sequence in flight owns one slot (an index in [0, num_slots)) holding up
// to max_seq_len positions of keys and values for every layer. The cache stores
// tensors only; which slot belongs to whom and how many positions are filled is
// the caller's bookkeeping (DecoderBatch::slots / start_positions). Memory is
// allocated once at construction, so admission control can reason in slots and
// tokens (bytes_per_token) without ever over-committing.
// Not thread-safe: one owner (the thread running the model) at a time.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace moh {

class KvCache {
 public:
  KvCache(int64_t num_layers, int64_t num_slots, int64_t max_seq_len,
          int64_t num_kv_heads, int64_t head_dim,
          const at::TensorOptions& options);

  // [num_slots, max_seq_len, num_kv_heads, head_dim] for `layer`.
  at::Tensor& keys(int64_t layer) { return keys_[layer]; }
  at::Tensor& values(int64_t layer) { return values_[layer]; }

  int64_t num_slots() const { return num_slots_; }
  int64_t max_seq_len() const { return max_seq_len_; }
  // Bytes of keys and values one token position takes over all layers.
  int64_t bytes_per_token() const { return bytes_per_token_; }
  // The same, for a cache not yet allocated (memory planning).
  static int64_t BytesPerToken(int64_t num_layers, int64_t num_kv_heads,
                               int64_t head_dim,
                               const at::TensorOptions& options);
  int64_t total_bytes() const {
    return bytes_per_token_ * num_slots_ * max_seq_len_;
  }

 private:
  int64_t num_slots_;
  int64_t max_seq_len_;
  int64_t bytes_per_token_;
  std::vector<at::Tensor> keys_;
  std::vector<at::Tensor> values_;
};

}  // namespace moh
