// LlamaModel's KV cache: its element type, its size in positions and
// whether it fits the device's memory beside the weights.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "model/core/llama_model.h"

namespace moh {

KvCache LlamaModel::CreateKvCache(int64_t num_blocks,
                                  int64_t block_size) const {
  // Zeroed on the model's stream, before any Forward that reads it.
  const std::unique_ptr<DeviceContext::Scope> scope = context_->Enter();
  return KvCache(config_.num_layers, num_blocks, CachePositions(block_size),
                 config_.num_kv_heads, config_.head_dim, kv_cache_options());
}

absl::Status LlamaModel::set_kv_cache_dtype(at::ScalarType dtype) {
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV cache dtype must be float32, bfloat16 or float16, "
                     "got ",
                     c10::toString(dtype)));
  }
  if (dtype == at::kHalf && !options_.device().is_cuda()) {
    return absl::InvalidArgumentError(
        "KV cache dtype float16 needs a CUDA device; on CPU use float32 or "
        "bfloat16");
  }
  kv_cache_dtype_ = dtype;
  return absl::OkStatus();
}

absl::Status LlamaModel::set_kv_cache_dtype(absl::string_view name,
                                            absl::string_view field) {
  MOH_ASSIGN_OR_RETURN(const at::ScalarType dtype,
                       ResolveKvCacheDtype(name, options_, field));
  return set_kv_cache_dtype(dtype);
}

int64_t LlamaModel::CachePositions(int64_t max_seq_len) const {
  return std::min<int64_t>(max_seq_len, config_.max_position_embeddings);
}

absl::Status LlamaModel::CheckMemoryFits(int64_t num_blocks,
                                         int64_t block_size) const {
  const at::Device device = options_.device();
  const int64_t capacity = DeviceMemoryCapacity(device);
  if (capacity < 0) return absl::OkStatus();
  int64_t in_use = 0;  // this model's weights and whatever else is resident
  for (const GpuMemoryStats& gpu : GpuMemory()) {
    if (gpu.device == device.index()) in_use = gpu.reserved_bytes;
  }
  const int64_t positions = CachePositions(block_size);
  const int64_t kv_bytes =
      num_blocks * positions *
      KvCache::BytesPerToken(config_.num_layers, config_.num_kv_heads,
                             config_.head_dim, kv_cache_options());
  const int64_t needed = in_use + kv_bytes + attention_workspace_bytes_;
  // 10% stays free for activations and the CUDA context's own allocations.
  if (needed <= capacity / 10 * 9) return absl::OkStatus();
  constexpr double kGiB = 1 << 30;
  return absl::ResourceExhaustedError(absl::StrFormat(
      "%s: %.2f GiB in use + KV cache of %d blocks x %d positions (%.2f GiB) + "
      "attention workspace (%.2f GiB) exceed 90%% of its %.2f GiB: lower "
      "generation.max_running, generation.max_seq_len or generation.kv_blocks",
      device.str(), in_use / kGiB, num_blocks, positions, kv_bytes / kGiB,
      attention_workspace_bytes_ / kGiB, capacity / kGiB));
}

}  // namespace moh
