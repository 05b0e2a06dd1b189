#include "model/head_sparse_attention.h"

#include <limits>

namespace moh {

bool UseHeadSparse(AttentionMode mode, const MohRouter& router,
                   const std::vector<float>& ratios) {
  switch (mode) {
    case AttentionMode::kDense:
      return false;
    case AttentionMode::kHeadSparse:
      return true;
    case AttentionMode::kAuto:
      break;
  }
  const MohLayerConfig& layer = router.layer();
  if (router.kind() == RouterKind::kDense || layer.routed_heads() == 0) {
    return false;
  }
  for (float ratio : ratios) {
    if (layer.TopKForRatio(ratio) < layer.routed_heads()) return true;
  }
  return false;
}

at::Tensor HeadSparseAttention(const HeadSparseAttentionInputs& in) {
  const int64_t n = in.x.size(0);
  const int64_t heads = in.gates.size(1);
  const int64_t rows = in.keys.size(0);
  const int64_t kv_heads = in.keys.size(1);
  const int64_t kv_len = in.keys.size(2);
  const int64_t d = in.keys.size(3);
  const int64_t group = heads / kv_heads;
  const at::TensorOptions long_options = in.token_row.options();

  at::Tensor out = at::zeros({n, in.o_weight.size(0)}, in.x.options());
  at::Tensor selected = (in.gates != 0).t().contiguous();  // [H, N]
  // Selected tokens per head, per row: sizes the padded query block.
  at::Tensor j = at::arange(kv_len, long_options).view({1, 1, kv_len});
  for (int64_t h = 0; h < heads; ++h) {
    at::Tensor idx = selected[h].nonzero().squeeze(1);  // ascending
    const int64_t count = idx.size(0);
    if (count == 0) continue;
    at::Tensor q;
    if (in.q_full.defined()) {
      q = in.q_full.index_select(0, idx).select(1, h);
    } else {
      at::Tensor w = in.q_weight.narrow(0, h * d, d);
      at::Tensor x = in.x.index_select(0, idx);
      q = in.q_bias.defined() ? at::linear(x, w, in.q_bias.narrow(0, h * d, d))
                              : at::linear(x, w);
    }
    at::Tensor pos = in.token_pos.index_select(0, idx);
    if (in.rotate) q = in.rotate(q, pos);

    // Pad each row's selected queries into a [B, Tq, D] block. Tokens of a
    // row are contiguous in idx, so a token's slot in its row is its index in
    // idx minus the index of the row's first token.
    at::Tensor row = in.token_row.index_select(0, idx);
    at::Tensor per_row = at::bincount(row, {}, rows);
    const int64_t width = per_row.max().item<int64_t>();
    at::Tensor first = at::cumsum(per_row, 0) - per_row;
    at::Tensor slot =
        at::arange(count, long_options) - first.index_select(0, row);
    at::Tensor queries = at::zeros({rows, width, d}, q.options());
    queries.index_put_({row, slot}, q);
    // Padding slots see key 0 only (no NaN); their results are never read.
    at::Tensor query_pos = at::zeros({rows, width}, long_options);
    query_pos.index_put_({row, slot}, pos);

    const int64_t kv = h / group;
    at::Tensor keys = in.keys.select(1, kv);      // [B, L, D]
    at::Tensor values = in.values.select(1, kv);  // [B, L, D]
    at::Tensor scores =
        at::bmm(queries, keys.transpose(1, 2)).to(at::kFloat) * in.scale;
    at::Tensor visible =
        (j <= query_pos.unsqueeze(2)) & (j < in.row_len.view({rows, 1, 1}));
    scores.masked_fill_(visible.logical_not(),
                        -std::numeric_limits<float>::infinity());
    at::Tensor probs = at::softmax(scores, -1).to(values.scalar_type());
    at::Tensor attn = at::bmm(probs, values).index({row, slot});  // [n_h, D]
    attn = attn * in.gates.index_select(0, idx).select(1, h).unsqueeze(1);
    out.index_add_(0, idx, at::linear(attn, in.o_weight.narrow(1, h * d, d)));
  }
  if (in.o_bias.defined()) out += in.o_bias;
  return out;
}

}  // namespace moh
