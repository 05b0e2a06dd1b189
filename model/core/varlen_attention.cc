#include "model/core/varlen_attention.h"

#include <algorithm>
#include <stdexcept>

#ifdef MOH_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/_flash_attention_forward.h>
#endif

namespace moh {

PackedKeyLayout PackKeyLayout(
    const std::vector<int32_t>& num_tokens,
    const std::vector<int32_t>& start_positions,
    const std::vector<std::vector<int32_t>>& block_tables,
    const std::vector<int32_t>& slots, int64_t block_size) {
  PackedKeyLayout layout;
  const size_t rows = num_tokens.size();
  const bool paged = !block_tables.empty();  // else a slot per row
  layout.cum_q.assign(1, 0);
  layout.cum_k.assign(1, 0);
  for (size_t r = 0; r < rows; ++r) {
    const int64_t t = num_tokens[r];
    const int64_t keys = start_positions[r] + t;
    for (int64_t p = 0; p < keys; ++p) {
      layout.index.push_back(
          paged ? block_tables[r][p / block_size] * block_size + p % block_size
                : slots[r] * block_size + p);
    }
    layout.cum_q.push_back(layout.cum_q.back() + static_cast<int32_t>(t));
    layout.cum_k.push_back(layout.cum_k.back() + static_cast<int32_t>(keys));
    layout.max_q = std::max(layout.max_q, t);
    layout.max_k = std::max(layout.max_k, keys);
  }
  return layout;
}

PackedKeys ToDevice(const PackedKeyLayout& layout, const at::Device& device) {
  auto upload = [&](const auto& values, at::ScalarType type) {
    return at::tensor(values, at::TensorOptions().dtype(type))
        .to(device, /*non_blocking=*/false);
  };
  return PackedKeys{upload(layout.index, at::kLong),
                    upload(layout.cum_q, at::kInt),
                    upload(layout.cum_k, at::kInt), layout.max_q, layout.max_k};
}

#ifdef MOH_CUDA_KERNELS

bool VarlenAttentionServes(const at::Tensor& queries,
                           const at::Tensor& key_cache) {
  if (!queries.is_cuda() || queries.dim() != 3 || key_cache.dim() != 4 ||
      (queries.scalar_type() != at::kBFloat16 &&
       queries.scalar_type() != at::kHalf)) {
    return false;
  }
  const int64_t heads = queries.size(1), d = queries.size(2);
  const int64_t kv_heads = key_cache.size(2);
  if (d % 8 != 0 || d > 256 || key_cache.size(3) != d ||
      heads % kv_heads != 0) {
    return false;
  }
  return at::cuda::getDeviceProperties(queries.device().index())->major >= 8;
}

at::Tensor VarlenAttention(const VarlenAttentionInputs& in) {
  const at::ScalarType type = in.queries.scalar_type();
  // [K, KV, D] each: the rows' keys one after another, in the queries'
  // type (the cache may hold another).
  auto packed = [&](const at::Tensor& cache) {
    return cache.flatten(0, 1).index_select(0, in.keys.index).to(type);
  };
  auto outputs = at::_flash_attention_forward(
      in.queries.contiguous(), packed(in.key_cache), packed(in.value_cache),
      in.keys.cum_q, in.keys.cum_k, in.keys.max_q, in.keys.max_k,
      /*dropout_p=*/0.0, /*is_causal=*/true, /*return_debug_mask=*/false,
      in.scale);
  return std::get<0>(outputs);
}

#else  // a CPU LibTorch: no FlashAttention

bool VarlenAttentionServes(const at::Tensor&, const at::Tensor&) {
  return false;
}

at::Tensor VarlenAttention(const VarlenAttentionInputs&) {
  throw std::logic_error("VarlenAttention: not in a CPU LibTorch build");
}

#endif

}  // namespace moh
