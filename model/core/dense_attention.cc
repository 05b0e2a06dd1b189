#include "model/core/dense_attention.h"

#include <torch/version.h>

#include <algorithm>
#include <limits>

#include "model/core/kv_cache.h"

namespace moh {

int64_t DenseAttentionQueryChunk(int64_t rows, int64_t heads, int64_t width,
                                 int64_t kv_len, int64_t workspace_bytes) {
  // float32 scores for every head plus a one-byte mask, per query.
  const int64_t per_query = rows * kv_len * (heads * 4 + 1);
  if (per_query <= 0) return std::max<int64_t>(width, 1);
  return std::clamp<int64_t>(workspace_bytes / per_query, 1,
                             std::max<int64_t>(width, 1));
}

namespace {

// [B, KV, L, D] keys or values of each row, in `dtype` (the queries'; the
// cache may hold a narrower type).
at::Tensor Gather(const at::Tensor& cache, const at::Tensor& narrow_cache,
                  const at::Tensor& block_table, const at::Tensor& narrow_rows,
                  int64_t kv_len, at::ScalarType dtype) {
  return GatherRows(cache, narrow_cache, block_table, narrow_rows, kv_len)
      .to(dtype)
      .permute({0, 2, 1, 3});
}

// One chunk: q [B, KV, G, t, D] against keys/values [B, KV, L, D].
at::Tensor ChunkAttention(const at::Tensor& q, const at::Tensor& keys,
                          const at::Tensor& values, const at::Tensor& visible,
                          double scale) {
  const int64_t rows = q.size(0), kv_heads = q.size(1), group = q.size(2);
  const int64_t width = q.size(3), d = q.size(4), kv_len = keys.size(2);
#if TORCH_VERSION_MAJOR >= 2
  // Grouped heads share their KV head: fold the group into the query axis
  // so that keys and values are read as they are, without repeat_kv. With
  // one query per row (decode) its mask broadcasts over the group as it is;
  // with more, each query's mask is repeated for the group's heads.
  const at::Tensor mask = width == 1
                              ? visible.view({rows, 1, 1, kv_len})
                              : visible.unsqueeze(1)
                                    .unsqueeze(2)
                                    .expand({rows, 1, group, width, kv_len})
                                    .reshape({rows, 1, group * width, kv_len});
  at::Tensor out = at::scaled_dot_product_attention(
      q.reshape({rows, kv_heads, group * width, d}), keys, values, mask,
      /*dropout_p=*/0.0, /*is_causal=*/false, scale);
  return out.view({rows, kv_heads, group, width, d});
#else
  at::Tensor scores = at::matmul(q.reshape({rows, kv_heads, group * width, d}),
                                 keys.transpose(2, 3))
                          .view({rows, kv_heads, group, width, kv_len})
                          .to(at::kFloat) *
                      scale;
  scores.masked_fill_(visible.logical_not().view({rows, 1, 1, width, kv_len}),
                      -std::numeric_limits<float>::infinity());
  at::Tensor probs = at::softmax(scores, -1).to(values.scalar_type());
  return at::matmul(probs.view({rows, kv_heads, group * width, kv_len}), values)
      .view({rows, kv_heads, group, width, d});
#endif
}

}  // namespace

at::Tensor DenseVisible(const at::Tensor& positions, const at::Tensor& row_len,
                        int64_t kv_len) {
  const int64_t rows = positions.size(0);
  at::Tensor j = at::arange(kv_len, positions.options()).view({1, 1, kv_len});
  return (j <= positions.unsqueeze(2)) & (j < row_len.view({rows, 1, 1}));
}

at::Tensor DenseAttention(const DenseAttentionInputs& in) {
  const int64_t rows = in.queries.size(0), width = in.queries.size(1);
  const int64_t heads = in.queries.size(2), d = in.queries.size(3);
  const int64_t kv_heads = in.key_cache.size(2), group = heads / kv_heads;
  const at::ScalarType dtype = in.queries.scalar_type();
  const at::Tensor keys =
      Gather(in.key_cache, in.narrow.key_cache, in.block_table, in.narrow.rows,
             in.kv_len, dtype);
  const at::Tensor values =
      Gather(in.value_cache, in.narrow.value_cache, in.block_table,
             in.narrow.rows, in.kv_len, dtype);
  // [B, KV, G, T, D]: head h = kv * G + g.
  const at::Tensor q = in.queries.permute({0, 2, 1, 3})
                           .reshape({rows, kv_heads, group, width, d});
  const int64_t chunk = DenseAttentionQueryChunk(rows, heads, width, in.kv_len,
                                                 in.workspace_bytes);
  at::Tensor out = at::empty({rows, width, heads, d}, in.queries.options());
  for (int64_t t0 = 0; t0 < width; t0 += chunk) {
    const int64_t t = std::min(chunk, width - t0);
    at::Tensor attn = ChunkAttention(
        q.narrow(3, t0, t), keys, values,
        in.visible.defined() ? in.visible.narrow(1, t0, t)
                             : DenseVisible(in.positions.narrow(1, t0, t),
                                            in.row_len, in.kv_len),
        in.scale);  // [B, KV, G, t, D]
    out.narrow(1, t0, t).copy_(
        attn.permute({0, 3, 1, 2, 4}).reshape({rows, t, heads, d}));
  }
  return out;
}

}  // namespace moh
