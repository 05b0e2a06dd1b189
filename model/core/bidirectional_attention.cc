#include "model/core/bidirectional_attention.h"

#include <cmath>

#include "model/core/linear.h"

namespace moh {

at::Tensor BidirectionalAttention(const BidirectionalAttentionWeights& w,
                                  const MohRouter& router, const at::Tensor& x,
                                  const at::Tensor& top_k,
                                  const TopKBounds& bounds, AttentionMode mode,
                                  at::Tensor* gates) {
  const int64_t rows = x.size(0), tokens = x.size(1), c = x.size(2);
  const int64_t heads = router.layer().num_heads, n = rows * tokens;
  const int64_t width = w.qkv_w.size(0) / 3;  // H * D
  const int64_t d = width / heads;
  at::Tensor x_flat = x.reshape({n, c});
  *gates = router.Gates(x_flat, at::Tensor(), top_k, bounds.max)
               .view({rows, tokens, -1});
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));

  if (UseHeadSparse(mode, router, bounds.min, x.options())) {
    // Keys and values for every token; queries only where selected.
    at::Tensor kv = Linear(
        x, w.qkv_w.Rows(width, 2 * width),
        w.qkv_b.defined() ? w.qkv_b.narrow(0, width, 2 * width) : at::Tensor());
    kv = kv.view({rows, tokens, 2, heads, d});
    HeadSparseAttentionInputs in;
    in.x = x_flat;
    in.gates = gates->reshape({n, heads});
    in.q_weight = w.qkv_w.Rows(0, width);
    if (w.qkv_b.defined()) in.q_bias = w.qkv_b.narrow(0, 0, width);
    in.key_cache = kv.select(2, 0);    // [B, N, H, D]
    in.value_cache = kv.select(2, 1);  // [B, N, H, D]
    const at::TensorOptions longs =
        at::TensorOptions().dtype(at::kLong).device(x.device());
    in.block_table = at::arange(rows, longs).unsqueeze(1);
    in.token_row = at::arange(rows, longs).repeat_interleave(tokens);
    // Every token sees every token of its row.
    in.token_pos = at::full({n}, tokens - 1, longs);
    in.row_len = at::full({rows}, tokens, longs);
    in.o_weight = w.proj_w;
    in.o_bias = w.proj_b;
    in.scale = scale;
    return HeadSparseAttention(in, mode == AttentionMode::kHeadSparseAten)
        .view({rows, tokens, c});
  }

  at::Tensor qkv = Linear(x, w.qkv_w, w.qkv_b);
  qkv = qkv.view({rows, tokens, 3, heads, d}).permute({2, 0, 3, 1, 4});
  at::Tensor q = qkv[0], k = qkv[1], v = qkv[2];  // [B, H, N, D]
  at::Tensor scores = at::matmul(q * scale, k.transpose(-2, -1));
  at::Tensor attn = at::matmul(at::softmax(scores, -1), v);  // [B, H, N, D]
  attn = attn.transpose(1, 2) * gates->unsqueeze(-1);        // [B, N, H, D]
  return Linear(attn.reshape({rows, tokens, width}), w.proj_w, w.proj_b);
}

}  // namespace moh
