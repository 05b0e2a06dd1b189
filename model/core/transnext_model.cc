#include "model/core/transnext_model.h"

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/core/transnext_attention.h"

namespace moh {
namespace {

// nn.LayerNorm's default, used by OverlapPatchEmbed.norm and the pooled
// features' norm (the blocks use the config's eps).
constexpr double kDefaultLayerNormEps = 1e-5;
constexpr int64_t kCpbHidden = 512;

// L2 normalization along the last dimension, as F.normalize (eps 1e-12).
at::Tensor L2Normalize(const at::Tensor& x) {
  return x / at::clamp_min(at::norm(x, 2, {-1}, /*keepdim=*/true), 1e-12);
}

// The continuous position bias of one attention layer: [H, N, P] for a
// query grid of side `query` and a key grid of side `key` (pooled: each key
// coordinate is the mean of the query coordinates it pools, as
// adaptive_avg_pool1d computes it), coordinates scaled by the pretraining
// grid `pretrain`, log-spaced, through the layer's CPB MLP (float32, CPU).
// The official code applies the MLP to the unique coordinate pairs; here to
// every pair of unique per-axis values, the same numbers.
at::Tensor ContinuousPositionBias(int64_t query, int64_t key, int64_t pretrain,
                                  const at::Tensor& fc1_w,
                                  const at::Tensor& fc1_b,
                                  const at::Tensor& fc2_w,
                                  const at::Tensor& fc2_b) {
  at::Tensor axis_q = at::arange(query, at::kFloat);
  at::Tensor axis_k =
      at::adaptive_avg_pool1d(axis_q.view({1, 1, query}), {key}).view({key});
  at::Tensor relative =
      (axis_q.unsqueeze(1) - axis_k.unsqueeze(0)) / (pretrain - 1) * 8;
  auto [values, inverse, counts] = at::_unique2(
      relative.flatten(), /*sorted=*/true, /*return_inverse=*/true);
  const int64_t u = values.size(0);
  at::Tensor coords = at::stack({values.unsqueeze(1).expand({u, u}),
                                 values.unsqueeze(0).expand({u, u})},
                                -1)
                          .reshape({u * u, 2});
  coords = at::sign(coords) * at::log2(at::abs(coords) + 1.0) / std::log2(8.0);
  at::Tensor table = at::linear(at::relu(at::linear(coords, fc1_w, fc1_b)),
                                fc2_w, fc2_b);  // [u * u, H]
  // Pair (q = (qh, qw), k = (kh, kw)) reads row inv[qh, kh] * u + inv[qw, kw].
  at::Tensor inv = inverse.view({query, key});
  at::Tensor index =
      (inv.view({query, 1, key, 1}) * u + inv.view({1, query, 1, key}))
          .reshape({query * query, key * key});
  return table.t()
      .index_select(1, index.flatten())
      .view({-1, query * query, key * key})
      .contiguous();
}

// Each token's window of side x side positions on a resolution x resolution
// grid, in nn.Unfold's order (row-major offsets): [N, side^2] int64 token
// indices, -1 outside the grid (the official code's zero padding).
at::Tensor WindowNeighbours(int64_t resolution, int64_t side) {
  const int64_t r = resolution;
  at::Tensor window = at::empty({r * r, side * side}, at::kLong);
  int64_t* w = window.data_ptr<int64_t>();
  for (int64_t y = 0; y < r; ++y) {
    for (int64_t x = 0; x < r; ++x) {
      for (int64_t j = 0; j < side * side; ++j) {
        const int64_t ny = y + j / side - side / 2;
        const int64_t nx = x + j % side - side / 2;
        *w++ = ny < 0 || ny >= r || nx < 0 || nx >= r ? -1 : ny * r + nx;
      }
    }
  }
  return window;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TransNextModel>> TransNextModel::Load(
    const std::string& dir, const DeviceOptions& device_options) {
  MOH_ASSIGN_OR_RETURN(ModelConfig config,
                       LoadModelConfig(dir, ModelFamily::kTransNext));
  MOH_ASSIGN_OR_RETURN(at::TensorOptions options,
                       ResolveTensorOptions(device_options));
  return Load(dir, config.transnext, options);
}

absl::StatusOr<std::unique_ptr<TransNextModel>> TransNextModel::Load(
    const std::string& dir, const TransNextConfig& config,
    const at::TensorOptions& options) {
  MOH_ASSIGN_OR_RETURN(TensorStore store, LoadCheckpoint(dir));
  return FromStore(store, config, options);
}

absl::StatusOr<std::unique_ptr<TransNextModel>> TransNextModel::FromStore(
    TensorStore& store, const TransNextConfig& config,
    const at::TensorOptions& options) {
  std::unique_ptr<TransNextModel> model(new TransNextModel(config, options));
  return CatchTorchErrors(
      "TransNextModel::Load",
      [&]() -> absl::StatusOr<std::unique_ptr<TransNextModel>> {
        for (size_t s = 0; s < config.stages.size(); ++s) {
          MOH_RETURN_IF_ERROR(model->LoadStage(store, s));
        }
        const int64_t c = config.stages.back().embed_dim;
        const int64_t classes = config.labels.size();
        MOH_ASSIGN_OR_RETURN(model->head_w_,
                             store.Take("head.weight", {classes, c}, options));
        MOH_ASSIGN_OR_RETURN(model->head_b_,
                             store.Take("head.bias", {classes}, options));
        MOH_RETURN_IF_ERROR(store.CheckAllTaken());
        return std::move(model);
      });
}

absl::Status TransNextModel::LoadStage(TensorStore& store, int s) {
  const TransNextStage& sc = config_.stages[s];
  Stage stage;
  const int64_t c = sc.embed_dim;
  const int64_t in =
      s == 0 ? config_.num_channels : config_.stages[s - 1].embed_dim;
  stage.kernel = s == 0 ? config_.patch_size * 2 - 1 : 3;
  stage.stride = s == 0 ? config_.patch_size : 2;
  stage.resolution = config_.resolution(s);
  stage.tokens = stage.resolution * stage.resolution;
  const bool aggregated = sc.sr_ratio > 1;
  stage.pool = aggregated ? config_.pool_size(s) : stage.resolution;
  stage.pooled = stage.pool * stage.pool;
  auto take = [&](const std::string& name, std::vector<int64_t> shape) {
    return store.Take(name, shape, options_);
  };
  const std::string embed = absl::StrCat("patch_embed", s + 1, ".");
  MOH_ASSIGN_OR_RETURN(
      stage.embed_w,
      take(embed + "proj.weight", {c, in, stage.kernel, stage.kernel}));
  MOH_ASSIGN_OR_RETURN(stage.embed_b, take(embed + "proj.bias", {c}));
  MOH_ASSIGN_OR_RETURN(stage.embed_norm_w, take(embed + "norm.weight", {c}));
  MOH_ASSIGN_OR_RETURN(stage.embed_norm_b, take(embed + "norm.bias", {c}));
  if (aggregated) {
    at::Tensor window = WindowNeighbours(stage.resolution, config_.window_size);
    stage.neighbours_host = window;
    stage.neighbours = window.to(options_.device());
    stage.padding = stage.neighbours.lt(0);
  }
  int64_t first_layer = 0;
  for (int i = 0; i < s; ++i) first_layer += config_.stages[i].depth;
  const int64_t hidden = sc.glu_hidden();
  for (int64_t j = 0; j < sc.depth; ++j) {
    const std::string pre = absl::StrCat("block", s + 1, ".", j, ".");
    Block b;
    MOH_ASSIGN_OR_RETURN(b.norm1_w, take(pre + "norm1.weight", {c}));
    MOH_ASSIGN_OR_RETURN(b.norm1_b, take(pre + "norm1.bias", {c}));
    MOH_ASSIGN_OR_RETURN(b.attn,
                         LoadAttention(store, s, pre + "attn.",
                                       config_.moh.layers[first_layer + j]));
    MOH_ASSIGN_OR_RETURN(b.norm2_w, take(pre + "norm2.weight", {c}));
    MOH_ASSIGN_OR_RETURN(b.norm2_b, take(pre + "norm2.bias", {c}));
    MOH_ASSIGN_OR_RETURN(b.fc1_w,
                         take(pre + "mlp.fc1.weight", {2 * hidden, c}));
    MOH_ASSIGN_OR_RETURN(b.fc1_b, take(pre + "mlp.fc1.bias", {2 * hidden}));
    MOH_ASSIGN_OR_RETURN(
        b.dw_w, take(pre + "mlp.dwconv.dwconv.weight", {hidden, 1, 3, 3}));
    MOH_ASSIGN_OR_RETURN(b.dw_b,
                         take(pre + "mlp.dwconv.dwconv.bias", {hidden}));
    MOH_ASSIGN_OR_RETURN(b.fc2_w, take(pre + "mlp.fc2.weight", {c, hidden}));
    MOH_ASSIGN_OR_RETURN(b.fc2_b, take(pre + "mlp.fc2.bias", {c}));
    stage.blocks.push_back(std::move(b));
  }
  const std::string norm = absl::StrCat("norm", s + 1, ".");
  MOH_ASSIGN_OR_RETURN(stage.norm_w, take(norm + "weight", {c}));
  MOH_ASSIGN_OR_RETURN(stage.norm_b, take(norm + "bias", {c}));
  stages_.push_back(std::move(stage));
  return absl::OkStatus();
}

absl::StatusOr<TransNextModel::Attention> TransNextModel::LoadAttention(
    TensorStore& store, int s, const std::string& pre,
    const MohLayerConfig& layer) {
  const TransNextStage& sc = config_.stages[s];
  const int64_t c = sc.embed_dim, h = sc.num_heads, d = sc.head_dim();
  const int64_t resolution = config_.resolution(s);
  const int64_t tokens = resolution * resolution;
  const int64_t window = int64_t{config_.window_size} * config_.window_size;
  Attention a;
  a.aggregated = sc.sr_ratio > 1;
  auto take = [&](const std::string& name, std::vector<int64_t> shape) {
    return store.Take(name, shape, options_);
  };
  if (a.aggregated) {
    MOH_ASSIGN_OR_RETURN(a.q_w, take(pre + "q.weight", {c, c}));
    MOH_ASSIGN_OR_RETURN(a.kv_w, take(pre + "kv.weight", {2 * c, c}));
    if (config_.qkv_bias) {
      MOH_ASSIGN_OR_RETURN(a.q_b, take(pre + "q.bias", {c}));
      MOH_ASSIGN_OR_RETURN(a.kv_b, take(pre + "kv.bias", {2 * c}));
    }
    MOH_ASSIGN_OR_RETURN(a.sr_w, take(pre + "sr.weight", {c, c, 1, 1}));
    MOH_ASSIGN_OR_RETURN(a.sr_b, take(pre + "sr.bias", {c}));
    MOH_ASSIGN_OR_RETURN(a.norm_w, take(pre + "norm.weight", {c}));
    MOH_ASSIGN_OR_RETURN(a.norm_b, take(pre + "norm.bias", {c}));
    MOH_ASSIGN_OR_RETURN(at::Tensor local_bias,
                         take(pre + "relative_pos_bias_local", {h, window}));
    a.local_bias = local_bias;
    MOH_ASSIGN_OR_RETURN(a.learnable_tokens,
                         take(pre + "learnable_tokens", {h, d, window}));
    MOH_ASSIGN_OR_RETURN(at::Tensor learnable_bias,
                         take(pre + "learnable_bias", {h, 1, window}));
    a.learnable_bias = learnable_bias.view({h, window});
  } else {
    MOH_ASSIGN_OR_RETURN(at::Tensor qkv_w,
                         take(pre + "qkv.weight", {3 * c, c}));
    a.q_w = qkv_w.narrow(0, 0, c).contiguous();
    a.kv_w = qkv_w.narrow(0, c, 2 * c).contiguous();
    if (config_.qkv_bias) {
      MOH_ASSIGN_OR_RETURN(at::Tensor qkv_b, take(pre + "qkv.bias", {3 * c}));
      a.q_b = qkv_b.narrow(0, 0, c).contiguous();
      a.kv_b = qkv_b.narrow(0, c, 2 * c).contiguous();
    }
  }
  MOH_ASSIGN_OR_RETURN(a.proj_w, take(pre + "proj.weight", {c, c}));
  MOH_ASSIGN_OR_RETURN(a.proj_b, take(pre + "proj.bias", {c}));
  MOH_ASSIGN_OR_RETURN(at::Tensor embedding,
                       take(pre + "query_embedding", {h, 1, d}));
  a.query_embedding = embedding.view({h, d});
  // Constants of the weights and the resolution, computed in float32 on the
  // CPU as the official buffers are.
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat);
  MOH_ASSIGN_OR_RETURN(at::Tensor temperature,
                       store.Take(pre + "temperature", {h, 1, 1}, f32));
  at::Tensor seq_scale;
  if (a.aggregated) {
    // log(window positions inside the grid + pooled keys), per token.
    const int64_t pooled = int64_t{config_.pool_size(s)} * config_.pool_size(s);
    at::Tensor inside = WindowNeighbours(resolution, config_.window_size)
                            .ge(0)
                            .sum(1)
                            .to(at::kFloat);
    seq_scale = at::log(inside + static_cast<float>(pooled)).view({1, tokens});
  } else {
    seq_scale = at::full({1, tokens},
                         static_cast<float>(std::log(double(tokens))), f32);
  }
  a.scale = (at::softplus(temperature.view({h, 1})) * seq_scale)
                .to(options_)
                .contiguous();
  MOH_ASSIGN_OR_RETURN(at::Tensor fc1_w, store.Take(pre + "cpb_fc1.weight",
                                                    {kCpbHidden, 2}, f32));
  MOH_ASSIGN_OR_RETURN(at::Tensor fc1_b,
                       store.Take(pre + "cpb_fc1.bias", {kCpbHidden}, f32));
  MOH_ASSIGN_OR_RETURN(at::Tensor fc2_w, store.Take(pre + "cpb_fc2.weight",
                                                    {h, kCpbHidden}, f32));
  MOH_ASSIGN_OR_RETURN(at::Tensor fc2_b,
                       store.Take(pre + "cpb_fc2.bias", {h}, f32));
  const int64_t key =
      a.aggregated ? config_.pool_size(s) : config_.resolution(s);
  const int64_t pretrain = config_.pretrain_size >> (s + 2);
  a.bias = ContinuousPositionBias(resolution, key, pretrain, fc1_w, fc1_b,
                                  fc2_w, fc2_b)
               .to(options_);
  MOH_ASSIGN_OR_RETURN(a.router, MohRouter::Load(RouterKind::kLearned, layer, c,
                                                 pre, store, options_));
  return a;
}

ImagePreprocessing TransNextModel::preprocessing() const {
  ImagePreprocessing p;
  p.image_size = config_.image_size;
  p.resize_size = config_.resize_size;
  p.bicubic = true;
  p.num_channels = config_.num_channels;
  return p;
}

std::vector<int64_t> TransNextModel::LayerTokens() const {
  std::vector<int64_t> tokens;
  for (size_t s = 0; s < config_.stages.size(); ++s) {
    const int64_t r = config_.resolution(s);
    tokens.insert(tokens.end(), config_.stages[s].depth, r * r);
  }
  return tokens;
}

absl::Status TransNextModel::CheckPixels(const at::Tensor& pixels) const {
  const int64_t s = config_.image_size;
  if (!pixels.defined() || pixels.dim() != 4 || pixels.size(0) < 1 ||
      pixels.size(1) != config_.num_channels || pixels.size(2) != s ||
      pixels.size(3) != s) {
    return absl::InvalidArgumentError(
        absl::StrCat("pixels must have shape [B, ", config_.num_channels, ", ",
                     s, ", ", s, "], B >= 1"));
  }
  return absl::OkStatus();
}

at::Tensor TransNextModel::Norm(const at::Tensor& x, const at::Tensor& w,
                                const at::Tensor& b) const {
  return at::layer_norm(x, {x.size(-1)}, w, b, config_.layer_norm_eps);
}

at::Tensor TransNextModel::Mlp(const Block& block, const at::Tensor& x,
                               int64_t resolution) const {
  const int64_t rows = x.size(0), tokens = x.size(1);
  const int64_t hidden = block.dw_w.size(0);
  at::Tensor y = at::linear(x, block.fc1_w, block.fc1_b);
  at::Tensor gate = y.narrow(-1, 0, hidden)
                        .transpose(1, 2)
                        .reshape({rows, hidden, resolution, resolution});
  gate =
      at::conv2d(gate, block.dw_w, block.dw_b, {1, 1}, {1, 1}, {1, 1}, hidden)
          .flatten(2)
          .transpose(1, 2);
  return at::linear(at::gelu(gate) * y.narrow(-1, hidden, hidden), block.fc2_w,
                    block.fc2_b);
}

absl::StatusOr<ClassifierOutput> TransNextModel::ForwardWithTopK(
    const at::Tensor& pixels, const std::vector<LayerTopK>& row_top_k,
    bool record_gates) const {
  MOH_RETURN_IF_ERROR(CheckPixels(pixels));
  MOH_RETURN_IF_ERROR(
      ValidateTopK(config_.moh, row_top_k, pixels.size(0), "top_k"));
  const c10::InferenceMode inference;
  return CatchTorchErrors(
      "TransNextModel::Forward", [&]() -> absl::StatusOr<ClassifierOutput> {
        const std::unique_ptr<DeviceContext::Scope> scope = context_->Enter();
        const int64_t rows = pixels.size(0);
        const std::vector<int64_t> layer_tokens = LayerTokens();
        // Every layer's K per token, computed on the host, uploaded once.
        std::vector<int64_t> offsets;
        int64_t total = 0;
        for (int64_t n : layer_tokens) {
          offsets.push_back(total);
          total += rows * n;
        }
        std::vector<int64_t> top_k_host(total);
        std::vector<TopKBounds> bounds;
        for (size_t l = 0; l < layer_tokens.size(); ++l) {
          bounds.push_back(PackLayerTopK(row_top_k, l, layer_tokens[l],
                                         top_k_host.data() + offsets[l]));
        }
        const at::Tensor top_k = context_->Upload(
            at::from_blob(top_k_host.data(), {total}, at::kLong));
        int64_t max_heads = 0;
        for (const MohLayerConfig& l : config_.moh.layers) {
          max_heads = std::max<int64_t>(max_heads, l.num_heads);
        }

        at::Tensor x = context_->Upload(pixels).to(options_);
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
            x = x + AttentionForward(
                        stage, block.attn,
                        Norm(x, block.norm1_w, block.norm1_b),
                        top_k.narrow(0, offsets[l], rows * stage.tokens),
                        bounds[l], &gates);
            x = x + Mlp(block, Norm(x, block.norm2_w, block.norm2_b),
                        stage.resolution);
            at::Tensor c = HeadTokenCounts(gates, valid);  // [B, H]
            counts.push_back(
                at::constant_pad_nd(c, {0, max_heads - c.size(1)}));
            if (record_gates) gates_per_layer.push_back(gates.to(at::kFloat));
            ++l;
          }
          x = Norm(x, stage.norm_w, stage.norm_b);
          if (s + 1 < stages_.size()) {
            x = x.transpose(1, 2).reshape(
                {rows, -1, stage.resolution, stage.resolution});
          }
        }
        std::vector<at::Tensor> results = {
            at::linear(x.mean(1), head_w_, head_b_).to(at::kFloat),
            at::stack(counts, 1)};
        results.insert(results.end(), gates_per_layer.begin(),
                       gates_per_layer.end());
        results = context_->Download(results);
        ClassifierOutput out;
        out.logits = results[0];
        out.head_token_counts = results[1];
        out.gates.assign(results.begin() + 2, results.end());
        return out;
      });
}

at::Tensor TransNextModel::AttentionForward(const Stage& stage,
                                            const Attention& attn,
                                            const at::Tensor& x,
                                            const at::Tensor& top_k,
                                            const TopKBounds& bounds,
                                            at::Tensor* gates_out) const {
  const int64_t rows = x.size(0), tokens = x.size(1), c = x.size(2);
  const int64_t heads = attn.router.layer().num_heads, d = c / heads;
  const int64_t n = rows * tokens;
  at::Tensor x_flat = x.reshape({n, c});
  at::Tensor gates = attn.router.Gates(x_flat, at::Tensor(), top_k, bounds.max);
  *gates_out = gates.view({rows, tokens, heads});

  // Keys and values of every token: the window's (aggregated) and the
  // global ones (pooled features, or the tokens themselves).
  at::Tensor kv = at::linear(x, attn.kv_w, attn.kv_b);  // [B, N, 2C]
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
    global_kv = at::linear(pooled, attn.kv_w, attn.kv_b);  // [B, P, 2C]
  }
  const int64_t pooled = global_kv.size(1);
  at::Tensor global_k =
      L2Normalize(global_kv.narrow(-1, 0, c).reshape({rows, pooled, heads, d}));
  at::Tensor global_v = global_kv.narrow(-1, c, c);
  at::Tensor local_k, local_v;
  if (attn.aggregated) {
    local_k =
        L2Normalize(kv.narrow(-1, 0, c).reshape({rows, tokens, heads, d}));
    local_v = kv.narrow(-1, c, c);
  }

  const bool kernel = attention_mode_ != AttentionMode::kDense && x.is_cpu() &&
                      x.scalar_type() == at::kFloat;
  if (kernel) {
    TransNextPairInputs in;
    in.rows = rows;
    in.tokens = tokens;
    in.heads = heads;
    in.head_dim = d;
    in.gates = gates;
    in.query_embedding = attn.query_embedding;
    in.scale = attn.scale;
    in.keys = global_k.view({rows, pooled, c});
    in.values = global_v;
    in.bias = attn.bias;
    if (attn.aggregated) {
      in.local_keys = local_k.view({rows, tokens, c});
      in.local_values = local_v;
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
        at::Tensor w = attn.q_w.narrow(0, h * d, d);
        at::Tensor xs = x_flat.index_select(0, selected);
        queries.push_back(
            attn.q_b.defined()
                ? at::addmm(attn.q_b.narrow(0, h * d, d), xs, w.t())
                : at::mm(xs, w.t()));
        token_ids.push_back(selected);
        head_ids.push_back(at::full_like(selected, h));
      }
      if (queries.empty()) {
        return at::linear(at::zeros_like(x), attn.proj_w, attn.proj_b);
      }
      in.queries = at::cat(queries);
      in.pair_token = at::cat(token_ids);
      in.pair_head = at::cat(head_ids);
    } else {
      in.queries = at::linear(x_flat, attn.q_w, attn.q_b);
    }
    return at::linear(TransNextPairAttentionCpu(in).view({rows, tokens, c}),
                      attn.proj_w, attn.proj_b);
  }

  // Every head, as the official code computes it.
  at::Tensor q = at::linear(x, attn.q_w, attn.q_b)
                     .view({rows, tokens, heads, d})
                     .permute({0, 2, 1, 3});  // [B, H, N, D]
  at::Tensor q_norm = L2Normalize(q);
  at::Tensor q_scaled = (q_norm + attn.query_embedding.view({heads, 1, d})) *
                        attn.scale.view({heads, tokens, 1});
  at::Tensor gk = global_k.permute({0, 2, 1, 3});  // [B, H, P, D]
  at::Tensor gv =
      global_v.reshape({rows, pooled, heads, d}).permute({0, 2, 1, 3});
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
    at::Tensor wk = gather(local_k);
    at::Tensor wv = gather(local_v.reshape({rows, tokens, heads, d}));
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
  out = out.transpose(1, 2) * gates_out->unsqueeze(-1);  // [B, N, H, D]
  return at::linear(out.reshape({rows, tokens, c}), attn.proj_w, attn.proj_b);
}

}  // namespace moh
