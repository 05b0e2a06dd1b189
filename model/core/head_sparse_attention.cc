#include "model/core/head_sparse_attention.h"

#include <limits>

#include "model/core/kv_cache.h"
#include "model/core/linear.h"

namespace moh {

bool CpuPairKernelApplies(const at::TensorOptions& options) {
  return options.device().is_cpu() && options.dtype() == at::kFloat;
}

bool CpuPairKernelReads(const at::Tensor& cache) {
  return cache.device().is_cpu() && (cache.scalar_type() == at::kFloat ||
                                     cache.scalar_type() == at::kBFloat16);
}

bool UseHeadSparse(AttentionMode mode, const MohRouter& router,
                   int64_t min_top_k, const at::TensorOptions& options) {
  switch (mode) {
    case AttentionMode::kDense:
      return false;
    case AttentionMode::kHeadSparse:
    case AttentionMode::kHeadSparseAten:
      return true;
    case AttentionMode::kAuto:
      break;
  }
  if (CpuPairKernelApplies(options)) return true;
  // Elsewhere (CUDA) the ATen pair path waits for the device several times
  // per layer (nonzero, item); dense attention with gates, as the official
  // code computes it, runs without a single host-device sync.
  if (!options.device().is_cpu()) return false;
  const MohLayerConfig& layer = router.layer();
  if (router.kind() == RouterKind::kDense || layer.routed_heads() == 0) {
    return false;
  }
  return min_top_k < layer.routed_heads();
}

at::Tensor HeadSparseAttention(const HeadSparseAttentionInputs& in,
                               bool aten_only) {
  if (!aten_only && CpuPairKernelApplies(in.x.options()) &&
      CpuPairKernelReads(in.key_cache) && CpuPairKernelReads(in.value_cache)) {
    return HeadSparseAttentionCpu(in);
  }
  const int64_t n = in.x.size(0);
  const int64_t heads = in.gates.size(1);
  const int64_t rows = in.block_table.size(0);
  const int64_t kv_heads = in.key_cache.size(2);
  const int64_t kv_len = in.row_len.max().item<int64_t>();
  const int64_t d = in.key_cache.size(3);
  const int64_t group = heads / kv_heads;
  const at::TensorOptions long_options = in.token_row.options();

  // Each row's keys and values as [B, KV, L, D], one contiguous copy: each
  // KV head's slice is then a strided batch of matrices that bmm reads.
  auto gather = [&](const at::Tensor& cache) {
    const at::Tensor& narrow_cache =
        &cache == &in.key_cache ? in.narrow.key_cache : in.narrow.value_cache;
    return GatherRows(cache, narrow_cache, in.block_table, in.narrow.rows,
                      kv_len)
        .to(in.x.scalar_type())
        .permute({0, 2, 1, 3})
        .contiguous();
  };
  const at::Tensor all_keys = gather(in.key_cache);
  const at::Tensor all_values = gather(in.value_cache);
  const at::Tensor selected = in.gates != 0;  // [N, H]
  at::Tensor out = at::zeros({n, in.o_weight.size(0)}, in.x.options());
  at::Tensor j = at::arange(kv_len, long_options).view({1, 1, kv_len});
  // The query heads sharing a KV head attend together: their keys and values
  // are read once for every selected (token, head) pair of the group.
  for (int64_t kv = 0; kv < kv_heads; ++kv) {
    // Selected pairs, ordered by token (so by row), then by head.
    at::Tensor pairs = selected.narrow(1, kv * group, group).nonzero();
    const int64_t count = pairs.size(0);
    if (count == 0) continue;
    at::Tensor token = pairs.select(1, 0).contiguous();
    at::Tensor local_head = pairs.select(1, 1).contiguous();
    at::Tensor pos = in.token_pos.index_select(0, token);
    // Queries of each pair, projected head by head (only selected tokens).
    at::Tensor q = at::empty({count, d}, in.x.options());
    std::vector<at::Tensor> members(group);
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = kv * group + g;
      members[g] = (local_head == g).nonzero().squeeze(1);
      if (members[g].size(0) == 0) continue;
      at::Tensor tokens = token.index_select(0, members[g]);
      at::Tensor qh;
      if (in.q_full.defined()) {
        qh = in.q_full.index_select(0, tokens).select(1, h);
      } else {
        const LinearWeight w = in.q_weight.Rows(h * d, d);
        at::Tensor x = in.x.index_select(0, tokens);
        // Linear: a bf16 or int8 weight under float32 x (weights) too.
        qh = in.q_bias.defined() ? Linear(x, w, in.q_bias.narrow(0, h * d, d))
                                 : Linear(x, w);
      }
      q.index_copy_(0, members[g], qh);
    }
    if (in.rotate) q = in.rotate(q, pos);

    // Pad each row's pairs into a [B, Tq, D] block: a pair's slot is its
    // index minus the index of its row's first pair.
    at::Tensor row = in.token_row.index_select(0, token);
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

    at::Tensor keys = all_keys.select(1, kv);      // [B, L, D]
    at::Tensor values = all_values.select(1, kv);  // [B, L, D]
    at::Tensor scores =
        at::bmm(queries, keys.transpose(1, 2)).to(at::kFloat) * in.scale;
    at::Tensor visible =
        (j <= query_pos.unsqueeze(2)) & (j < in.row_len.view({rows, 1, 1}));
    scores.masked_fill_(visible.logical_not(),
                        -std::numeric_limits<float>::infinity());
    at::Tensor probs = at::softmax(scores, -1).to(values.scalar_type());
    at::Tensor attn = at::bmm(probs, values).index({row, slot});  // [P, D]
    // Each head's pairs go through that head's columns of the output
    // projection, weighted by their gates.
    for (int64_t g = 0; g < group; ++g) {
      if (members[g].size(0) == 0) continue;
      const int64_t h = kv * group + g;
      at::Tensor tokens = token.index_select(0, members[g]);
      at::Tensor a = attn.index_select(0, members[g]) *
                     in.gates.index_select(0, tokens).select(1, h).unsqueeze(1);
      out.index_add_(0, tokens, Linear(a, in.o_weight.Columns(h * d, d)));
    }
  }
  if (in.o_bias.defined()) out += in.o_bias;
  return out;
}

}  // namespace moh
