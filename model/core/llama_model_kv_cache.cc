// LlamaModel's KV cache: its element type, its size in positions, whether
// it fits the device's memory beside the weights, and how a step's keys and
// values are written into it (at full width, or narrow: the ratio ceiling).
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "model/core/fused_layer_ops.h"
#include "model/core/linear.h"
#include "model/core/llama_model.h"
#include "model/core/rope.h"

namespace moh {
namespace {

bool PlainIndex(const at::Tensor& t) {
  return t.is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous();
}

bool PlainCache(const at::Tensor& t) {
  return t.is_cpu() && t.is_contiguous() &&
         (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16);
}

// A cache tensor's storage (float32 or bfloat16, PlainCache) as rows the
// loops below write: float32 copied, bfloat16 rounded as .to() rounds.
struct CacheRows {
  explicit CacheRows(at::Tensor& cache)
      : wide(cache.scalar_type() == at::kFloat ? cache.data_ptr<float>()
                                               : nullptr),
        half(wide == nullptr ? cache.data_ptr<at::BFloat16>() : nullptr) {}

  // Writes `width` floats from `src` at element `at`.
  void Store(int64_t at, const float* src, int64_t width) const {
    if (wide != nullptr) {
      std::copy(src, src + width, wide + at);
      return;
    }
    for (int64_t j = 0; j < width; ++j) half[at + j] = at::BFloat16(src[j]);
  }

  float* const wide;
  at::BFloat16* const half;
};

// Writes rows [N, KV, D] (float32, contiguous) at (block[i], offset[i]) of
// `cache` [blocks, block_size, KV, D] (PlainCache): what index_put_ does,
// without its dispatches, index tensors and temporaries. False (nothing
// written) for other layouts.
bool WriteCacheLoop(at::Tensor& cache, const at::Tensor& block,
                    const at::Tensor& offset, const at::Tensor& rows) {
  if (!CpuFloat(rows) || !rows.is_contiguous() || !PlainCache(cache) ||
      !PlainIndex(block) || !PlainIndex(offset)) {
    return false;
  }
  const int64_t n = block.numel();
  const int64_t width = cache.size(2) * cache.size(3);  // KV * D
  const int64_t block_size = cache.size(1);
  const int64_t* blocks = block.data_ptr<int64_t>();
  const int64_t* offsets = offset.data_ptr<int64_t>();
  const float* from = rows.data_ptr<float>();
  const CacheRows out(cache);
  for (int64_t i = 0; i < n; ++i) {
    out.Store((blocks[i] * block_size + offsets[i]) * width, from + i * width,
              width);
  }
  return true;
}

// Stores `n` tokens' keys and values, the rows of `kv` [n, 2 * KV * D]
// (float32, rows contiguous: k_proj's outputs, then v_proj's), at
// (block[i], offset[i]) of `keys` and `values` [blocks, block_size, KV, D]
// (PlainCache, one type), each key head rotated on the way (RoPE at
// positions[i], tables [P, D]: RotateLoop's arithmetic): one pass over the
// product, no temporaries, no dispatches. False (nothing written) for other
// layouts.
bool StoreRotatedLoop(const at::Tensor& kv, const at::Tensor& positions,
                      const at::Tensor& block, const at::Tensor& offset,
                      const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& keys, at::Tensor& values) {
  if (!CpuFloat(kv) || kv.dim() != 2 || kv.stride(1) != 1 || !CpuFloat(cos) ||
      !CpuFloat(sin) || !cos.is_contiguous() || !sin.is_contiguous() ||
      !PlainIndex(positions) || !PlainIndex(block) || !PlainIndex(offset) ||
      !PlainCache(keys) || !PlainCache(values) ||
      keys.scalar_type() != values.scalar_type()) {
    return false;
  }
  const int64_t n = kv.size(0), ld = kv.stride(0);
  const int64_t heads = keys.size(2), d = keys.size(3);
  const int64_t width = heads * d, block_size = keys.size(1);
  const float* rows = kv.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* blocks = block.data_ptr<int64_t>();
  const int64_t* offsets = offset.data_ptr<int64_t>();
  const float* cos_table = cos.data_ptr<float>();
  const float* sin_table = sin.data_ptr<float>();
  const CacheRows key_out(keys), value_out(values);
  std::vector<float> rotated(
      key_out.wide != nullptr ? 0 : static_cast<size_t>(width));
  for (int64_t i = 0; i < n; ++i) {
    const float* k = rows + i * ld;
    const int64_t at = (blocks[i] * block_size + offsets[i]) * width;
    // Rotated where they are stored (float32), or on the way to bfloat16.
    float* key = key_out.wide != nullptr ? key_out.wide + at : rotated.data();
    std::copy(k, k + width, key);
    for (int64_t h = 0; h < heads; ++h) {
      RotateInPlace(key + h * d, cos_table + pos[i] * d, sin_table + pos[i] * d,
                    d);
    }
    if (key_out.wide == nullptr) key_out.Store(at, key, width);
    value_out.Store(at, k + width, width);
  }
  return true;
}

}  // namespace

int64_t NarrowKvHeads(const LlamaConfig& config) {
  const int64_t heads = config.num_heads, kv_heads = config.num_kv_heads;
  if (kv_heads <= 0 || heads % kv_heads != 0 || config.moh.layers.empty()) {
    return 0;
  }
  const int64_t group = heads / kv_heads;
  int64_t width = 0;
  for (const MohLayerConfig& layer : config.moh.layers) {
    // A layer without routed heads reads every KV head at any ratio; a
    // layer whose shared heads end inside a KV group reads that group.
    if (layer.routed_heads() <= 0 || layer.shared_heads <= 0 ||
        layer.shared_heads % group != 0) {
      return 0;
    }
    width = std::max<int64_t>(width, layer.shared_heads / group);
  }
  // A block's memory must hold a whole number of narrow positions.
  if (width >= kv_heads || kv_heads % width != 0) return 0;
  return width;
}

void LlamaModel::WriteKeysValues(int64_t layer_index, const Layer& layer,
                                 const at::Tensor& x, const Step& step,
                                 KvCache& cache, const at::Tensor& kv) const {
  const int64_t kv_heads = config_.num_kv_heads, d = config_.head_dim;
  // Projects (unless `projected`: every head's), rotates and stores the
  // first `heads` KV heads of `inputs`' tokens (at `positions`, into
  // (block, offset) of `keys` and `values`): only those rows of k_proj and
  // v_proj are computed.
  auto write = [&](const at::Tensor& inputs, const at::Tensor& positions,
                   const at::Tensor& block, const at::Tensor& offset,
                   int64_t heads, at::Tensor keys, at::Tensor values,
                   const at::Tensor& projected) {
    const int64_t n = inputs.size(0);
    auto rows = [&](const at::Tensor& t) {
      return !t.defined() || heads == kv_heads ? t : t.narrow(0, 0, heads * d);
    };
    auto weight_rows = [&](const LinearWeight& w) {
      return heads == kv_heads ? w : w.Rows(0, heads * d);
    };
    at::Tensor k, v;
    if (projected.defined() || (heads == kv_heads && layer.kv_proj.defined())) {
      // Every KV head: keys and values in one product.
      const at::Tensor both =
          projected.defined() ? projected
                              : Product(inputs, layer.kv_proj, layer.kv_bias);
      if (StoreRotatedLoop(both, positions, block, offset, rope_cos_, rope_sin_,
                           keys, values)) {
        return;
      }
      k = both.narrow(1, 0, heads * d);
      v = both.narrow(1, heads * d, heads * d);
    } else {
      k = Product(inputs, weight_rows(layer.k_proj), rows(layer.k_bias));
      v = Product(inputs, weight_rows(layer.v_proj), rows(layer.v_bias));
    }
    // On CUDA, rotated and stored by one kernel.
    if (cuda_fused_ops_ &&
        FusedRopeStoreKv(k.view({n, heads, d}), v.view({n, heads, d}),
                         positions, rope_cos_, rope_sin_, block, offset, keys,
                         values)) {
      return;
    }
    k = positions.is_same(step.token_pos)
            ? RotateTokens(k.view({n, heads, d}), step)
            : Rotate(k.view({n, heads, d}),
                     positions.unsqueeze(1).expand({n, heads}));
    const std::initializer_list<at::indexing::TensorIndex> where = {block,
                                                                    offset};
    // Rounded to the cache's type (a no-op when it is the model's).
    if (!WriteCacheLoop(keys, block, offset, k)) {
      keys.index_put_(where, k.to(keys.scalar_type()));
    }
    v = v.view({n, heads, d});
    if (!WriteCacheLoop(values, block, offset, v)) {
      values.index_put_(where, v.to(values.scalar_type()));
    }
  };
  at::Tensor& key_cache = cache.keys(layer_index);
  at::Tensor& value_cache = cache.values(layer_index);
  if (!step.narrow.any()) {
    write(x, step.token_pos, step.token_block, step.token_offset, kv_heads,
          key_cache, value_cache, kv);
    return;
  }
  const int64_t width = step.narrow.kv_heads;
  const at::Tensor narrow_keys = NarrowView(key_cache, width);
  const at::Tensor narrow_values = NarrowView(value_cache, width);
  if (step.wide_tokens.numel() == 0) {  // every row narrow: no copies
    write(x, step.token_pos, step.token_block, step.token_offset, width,
          narrow_keys, narrow_values, at::Tensor());
    return;
  }
  for (const bool narrow : {true, false}) {
    const at::Tensor& tokens = narrow ? step.narrow_tokens : step.wide_tokens;
    if (tokens.numel() == 0) continue;
    write(x.index_select(0, tokens), step.token_pos.index_select(0, tokens),
          step.token_block.index_select(0, tokens),
          step.token_offset.index_select(0, tokens), narrow ? width : kv_heads,
          narrow ? narrow_keys : key_cache,
          narrow ? narrow_values : value_cache, at::Tensor());
  }
}

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
