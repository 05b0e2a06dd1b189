#include "model/core/transnext_model.h"

#include <c10/core/InferenceMode.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/core/transnext_attention.h"

namespace moh {
namespace {

// nn.LayerNorm's default, used by OverlapPatchEmbed.norm and the pooled
// features' norm (the blocks use the config's eps).
constexpr double kDefaultLayerNormEps = 1e-5;

// L2 normalization along the last dimension, as F.normalize (eps 1e-12).
at::Tensor L2Normalize(const at::Tensor& x) {
  return x / at::clamp_min(at::norm(x, 2, {-1}, /*keepdim=*/true), 1e-12);
}

}  // namespace

ImagePreprocessing TransNextModel::preprocessing() const {
  ImagePreprocessing p;
  p.image_size = config().image_size;
  p.resize_size = config().resize_size;
  p.bicubic = true;
  p.num_channels = config().num_channels;
  return p;
}

std::vector<int64_t> TransNextModel::LayerTokens() const {
  std::vector<int64_t> tokens;
  for (size_t s = 0; s < config().stages.size(); ++s) {
    const int64_t r = config().resolution(s);
    tokens.insert(tokens.end(), config().stages[s].depth, r * r);
  }
  return tokens;
}

at::Tensor TransNextModel::Norm(const at::Tensor& x, const at::Tensor& w,
                                const at::Tensor& b) const {
  return at::layer_norm(x, {x.size(-1)}, w, b, config().layer_norm_eps);
}

at::Tensor TransNextModel::Mlp(const Block& block, const at::Tensor& x,
                               int64_t resolution) const {
  const int64_t rows = x.size(0), tokens = x.size(1);
  const int64_t hidden = block.dw_w.size(0);
  at::Tensor y = Linear(x, block.fc1_w, block.fc1_b);
  at::Tensor gate = y.narrow(-1, 0, hidden)
                        .transpose(1, 2)
                        .reshape({rows, hidden, resolution, resolution});
  gate =
      at::conv2d(gate, block.dw_w, block.dw_b, {1, 1}, {1, 1}, {1, 1}, hidden)
          .flatten(2)
          .transpose(1, 2);
  return Linear(at::gelu(gate) * y.narrow(-1, hidden, hidden), block.fc2_w,
                block.fc2_b);
}

absl::StatusOr<ClassifierOutput> TransNextModel::ForwardWithTopK(
    const at::Tensor& pixels, const std::vector<LayerTopK>& row_top_k,
    bool record_gates) const {
  return RunForward(
      "TransNextModel::Forward", pixels, row_top_k,
      [&](const UploadedTopK& top_k) -> absl::StatusOr<ClassifierOutput> {
        const int64_t rows = pixels.size(0);
        const int64_t max_heads = MaxHeads(config().moh);

        at::Tensor x = context().Upload(pixels).to(options());
        std::vector<at::Tensor> counts, gates_per_layer;
        size_t l = 0;
        for (size_t s = 0; s < stages_.size(); ++s) {
          const Stage& stage = stages_[s];
          const int64_t pad = stage.kernel / 2;
          x = at::conv2d(x, stage.embed_w, stage.embed_b,
                         {stage.stride, stage.stride}, {pad, pad});
          x = at::layer_norm(x.flatten(2).transpose(1, 2), {x.size(1)},
                             stage.embed_norm_w, stage.embed_norm_b,
                             kDefaultLayerNormEps);
          at::Tensor valid =
              at::ones({rows, stage.tokens},
                       at::TensorOptions().dtype(at::kBool).device(x.device()));
          for (const Block& block : stage.blocks) {
            at::Tensor gates;
            x = x + AttentionForward(stage, block.attn,
                                     Norm(x, block.norm1_w, block.norm1_b),
                                     top_k.layer(l), top_k.bounds(l), &gates);
            x = x + Mlp(block, Norm(x, block.norm2_w, block.norm2_b),
                        stage.resolution);
            counts.push_back(PaddedHeadTokenCounts(gates, valid, max_heads));
            if (record_gates) gates_per_layer.push_back(gates.to(at::kFloat));
            ++l;
          }
          x = Norm(x, stage.norm_w, stage.norm_b);
          if (s + 1 < stages_.size()) {
            x = x.transpose(1, 2).reshape(
                {rows, -1, stage.resolution, stage.resolution});
          }
        }
        return DownloadClassifierOutput(
            context(), Linear(x.mean(1), head_w_, head_b_).to(at::kFloat),
            at::stack(counts, 1), gates_per_layer);
      });
}

at::Tensor TransNextModel::AttentionForward(const Stage& stage,
                                            const Attention& attn,
                                            const at::Tensor& x,
                                            const at::Tensor& top_k,
                                            const TopKBounds& bounds,
                                            at::Tensor* gates_out) const {
  const int64_t rows = x.size(0), tokens = x.size(1), c = x.size(2);
  const int64_t heads = attn.router.layer().num_heads;
  const int64_t n = rows * tokens;
  at::Tensor x_flat = x.reshape({n, c});
  at::Tensor gates = attn.router.Gates(x_flat, at::Tensor(), top_k, bounds.max);
  *gates_out = gates.view({rows, tokens, heads});
  const AttentionKeys keys = Keys(stage, attn, x);
  const bool kernel = attention_mode() != AttentionMode::kDense && x.is_cpu() &&
                      x.scalar_type() == at::kFloat;
  if (kernel) return PairAttention(stage, attn, x, gates, keys, bounds);
  return DenseAttention(stage, attn, x, keys, *gates_out);
}

TransNextModel::AttentionKeys TransNextModel::Keys(const Stage& stage,
                                                   const Attention& attn,
                                                   const at::Tensor& x) const {
  const int64_t rows = x.size(0), tokens = x.size(1), c = x.size(2);
  const int64_t heads = attn.router.layer().num_heads, d = c / heads;
  // Keys and values of every token: the window's (aggregated) and the
  // global ones (pooled features, or the tokens themselves).
  at::Tensor kv = Linear(x, attn.kv_w, attn.kv_b);  // [B, N, 2C]
  at::Tensor global_kv = kv;
  if (attn.aggregated) {
    at::Tensor pooled = x.transpose(1, 2).reshape(
        {rows, c, stage.resolution, stage.resolution});
    pooled = at::adaptive_avg_pool2d(
        at::gelu(at::conv2d(pooled, attn.sr_w, attn.sr_b)),
        {stage.pool, stage.pool});
    pooled =
        at::layer_norm(pooled.reshape({rows, c, stage.pooled}).transpose(1, 2),
                       {c}, attn.norm_w, attn.norm_b, kDefaultLayerNormEps);
    global_kv = Linear(pooled, attn.kv_w, attn.kv_b);  // [B, P, 2C]
  }
  const int64_t pooled = global_kv.size(1);
  AttentionKeys keys;
  keys.global_k =
      L2Normalize(global_kv.narrow(-1, 0, c).reshape({rows, pooled, heads, d}));
  keys.global_v = global_kv.narrow(-1, c, c);
  if (attn.aggregated) {
    keys.local_k =
        L2Normalize(kv.narrow(-1, 0, c).reshape({rows, tokens, heads, d}));
    keys.local_v = kv.narrow(-1, c, c);
  }
  return keys;
}

at::Tensor TransNextModel::PairAttention(const Stage& stage,
                                         const Attention& attn,
                                         const at::Tensor& x,
                                         const at::Tensor& gates,
                                         const AttentionKeys& keys,
                                         const TopKBounds& bounds) const {
  const int64_t rows = x.size(0), tokens = x.size(1), c = x.size(2);
  const int64_t heads = attn.router.layer().num_heads, d = c / heads;
  const int64_t pooled = keys.global_k.size(1);
  at::Tensor x_flat = x.reshape({rows * tokens, c});
  TransNextPairInputs in;
  in.rows = rows;
  in.tokens = tokens;
  in.heads = heads;
  in.head_dim = d;
  in.gates = gates;
  in.query_embedding = attn.query_embedding;
  in.scale = attn.scale;
  in.keys = keys.global_k.view({rows, pooled, c});
  in.values = keys.global_v;
  in.bias = attn.bias;
  if (attn.aggregated) {
    in.local_keys = keys.local_k.view({rows, tokens, c});
    in.local_values = keys.local_v;
    in.neighbours = stage.neighbours_host;
    in.local_bias = attn.local_bias;
    in.learnable_tokens = attn.learnable_tokens;
    in.learnable_bias = attn.learnable_bias;
  }
  const MohLayerConfig& layer = attn.router.layer();
  if (layer.routed_heads() > 0 && bounds.min < layer.routed_heads()) {
    // Some pairs are skipped: each head projects only its tokens' queries.
    std::vector<at::Tensor> queries, token_ids, head_ids;
    for (int64_t h = 0; h < heads; ++h) {
      at::Tensor selected = gates.select(1, h).ne(0).nonzero().view({-1});
      if (selected.numel() == 0) continue;
      queries.push_back(Linear(
          x_flat.index_select(0, selected), attn.q_w.Rows(h * d, d),
          attn.q_b.defined() ? attn.q_b.narrow(0, h * d, d) : at::Tensor()));
      token_ids.push_back(selected);
      head_ids.push_back(at::full_like(selected, h));
    }
    if (queries.empty()) {
      return Linear(at::zeros_like(x), attn.proj_w, attn.proj_b);
    }
    in.queries = at::cat(queries);
    in.pair_token = at::cat(token_ids);
    in.pair_head = at::cat(head_ids);
  } else {
    in.queries = Linear(x_flat, attn.q_w, attn.q_b);
  }
  return Linear(TransNextPairAttentionCpu(in).view({rows, tokens, c}),
                attn.proj_w, attn.proj_b);
}

at::Tensor TransNextModel::DenseAttention(const Stage& stage,
                                          const Attention& attn,
                                          const at::Tensor& x,
                                          const AttentionKeys& keys,
                                          const at::Tensor& gates) const {
  const int64_t rows = x.size(0), tokens = x.size(1), c = x.size(2);
  const int64_t heads = attn.router.layer().num_heads, d = c / heads;
  const int64_t pooled = keys.global_k.size(1);
  // Every head, as the official code computes it.
  at::Tensor q = Linear(x, attn.q_w, attn.q_b)
                     .view({rows, tokens, heads, d})
                     .permute({0, 2, 1, 3});  // [B, H, N, D]
  at::Tensor q_norm = L2Normalize(q);
  at::Tensor q_scaled = (q_norm + attn.query_embedding.view({heads, 1, d})) *
                        attn.scale.view({heads, tokens, 1});
  at::Tensor gk = keys.global_k.permute({0, 2, 1, 3});  // [B, H, P, D]
  at::Tensor gv =
      keys.global_v.reshape({rows, pooled, heads, d}).permute({0, 2, 1, 3});
  at::Tensor scores = at::matmul(q_scaled, gk.transpose(-2, -1)) + attn.bias;
  at::Tensor out;
  if (attn.aggregated) {
    // The window's keys and values: [B, H, N, W, D], zeros outside the grid.
    const int64_t window = stage.neighbours.size(1);
    at::Tensor index = stage.neighbours.clamp_min(0).view({-1});
    auto gather = [&](const at::Tensor& t) {  // t: [B, N, H, D]
      return t.index_select(1, index)
          .view({rows, tokens, window, heads, d})
          .masked_fill(stage.padding.view({1, tokens, window, 1, 1}), 0)
          .permute({0, 3, 1, 2, 4});
    };
    at::Tensor wk = gather(keys.local_k);
    at::Tensor wv = gather(keys.local_v.reshape({rows, tokens, heads, d}));
    at::Tensor local = at::matmul(wk, q_scaled.unsqueeze(-1)).squeeze(-1) +
                       attn.local_bias.view({heads, 1, window});
    local = local.masked_fill(stage.padding, -INFINITY);  // [B, H, N, W]
    at::Tensor attn_all = at::softmax(at::cat({local, scores}, -1), -1);
    at::Tensor a_local = attn_all.narrow(-1, 0, window);
    at::Tensor a_pool = attn_all.narrow(-1, window, pooled);
    at::Tensor w_local = at::matmul(q_norm, attn.learnable_tokens) +
                         attn.learnable_bias.view({heads, 1, window}) + a_local;
    out = at::matmul(w_local.unsqueeze(-2), wv).squeeze(-2) +
          at::matmul(a_pool, gv);
  } else {
    out = at::matmul(at::softmax(scores, -1), gv);
  }
  out = out.transpose(1, 2) * gates.unsqueeze(-1);  // [B, N, H, D]
  return Linear(out.reshape({rows, tokens, c}), attn.proj_w, attn.proj_b);
}

}  // namespace moh
