// TransNextModel's loading: the checkpoint's tensors into stages, blocks and
// attention layers, and the constants computed from them at load (CPB table,
// window neighbours, sequence-length scale). The forward is in
// transnext_model.cc.
#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/core/linear_weight_format.h"
#include "model/core/transnext_model.h"

namespace moh {
namespace {

constexpr int64_t kCpbHidden = 512;

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
  // Before the checkpoint is read: a wrong setting fails fast.
  MOH_ASSIGN_OR_RETURN(WeightFormat weights,
                       ResolveWeightFormat(device_options.weights, options));
  return Load(dir, config.transnext, options, weights);
}

absl::StatusOr<std::unique_ptr<TransNextModel>> TransNextModel::Load(
    const std::string& dir, const TransNextConfig& config,
    const at::TensorOptions& options, WeightFormat weights) {
  MOH_ASSIGN_OR_RETURN(TensorStore store, LoadCheckpoint(dir));
  return FromStore(store, config, options, weights);
}

absl::StatusOr<std::unique_ptr<TransNextModel>> TransNextModel::FromStore(
    TensorStore& store, const TransNextConfig& config,
    const at::TensorOptions& options, WeightFormat weights) {
  MOH_RETURN_IF_ERROR(CheckWeightFormat(weights, options));
  std::unique_ptr<TransNextModel> model(new TransNextModel(config, options));
  model->linear_weights_ = weights;
  return CatchTorchErrors(
      "TransNextModel::Load",
      [&]() -> absl::StatusOr<std::unique_ptr<TransNextModel>> {
        for (size_t s = 0; s < config.stages.size(); ++s) {
          MOH_RETURN_IF_ERROR(model->LoadStage(store, s));
        }
        const int64_t c = config.stages.back().embed_dim;
        const int64_t classes = config.labels.size();
        MOH_ASSIGN_OR_RETURN(
            model->head_w_,
            model->TakeLinear(store, "head.weight", {classes, c}));
        MOH_ASSIGN_OR_RETURN(model->head_b_,
                             store.Take("head.bias", {classes}, options));
        MOH_RETURN_IF_ERROR(store.CheckAllTaken());
        ReleaseConversionHeap(model->linear_weights_);
        return std::move(model);
      });
}

absl::StatusOr<LinearWeight> TransNextModel::TakeLinear(
    TensorStore& store, const std::string& name,
    std::vector<int64_t> shape) const {
  return TakeConvertedLinear(store, name, std::move(shape), options(),
                             linear_weights_);
}

absl::Status TransNextModel::LoadStage(TensorStore& store, int s) {
  const TransNextStage& sc = config().stages[s];
  Stage stage;
  const int64_t c = sc.embed_dim;
  const int64_t in =
      s == 0 ? config().num_channels : config().stages[s - 1].embed_dim;
  stage.kernel = s == 0 ? config().patch_size * 2 - 1 : 3;
  stage.stride = s == 0 ? config().patch_size : 2;
  stage.resolution = config().resolution(s);
  stage.tokens = stage.resolution * stage.resolution;
  const bool aggregated = sc.sr_ratio > 1;
  stage.pool = aggregated ? config().pool_size(s) : stage.resolution;
  stage.pooled = stage.pool * stage.pool;
  auto take = [&](const std::string& name, std::vector<int64_t> shape) {
    return store.Take(name, shape, options());
  };
  const std::string embed = absl::StrCat("patch_embed", s + 1, ".");
  MOH_ASSIGN_OR_RETURN(
      stage.embed_w,
      take(embed + "proj.weight", {c, in, stage.kernel, stage.kernel}));
  MOH_ASSIGN_OR_RETURN(stage.embed_b, take(embed + "proj.bias", {c}));
  MOH_ASSIGN_OR_RETURN(stage.embed_norm_w, take(embed + "norm.weight", {c}));
  MOH_ASSIGN_OR_RETURN(stage.embed_norm_b, take(embed + "norm.bias", {c}));
  if (aggregated) {
    at::Tensor window =
        WindowNeighbours(stage.resolution, config().window_size);
    stage.neighbours_host = window;
    stage.neighbours = window.to(options().device());
    stage.padding = stage.neighbours.lt(0);
  }
  int64_t first_layer = 0;
  for (int i = 0; i < s; ++i) first_layer += config().stages[i].depth;
  const int64_t hidden = sc.glu_hidden();
  for (int64_t j = 0; j < sc.depth; ++j) {
    const std::string pre = absl::StrCat("block", s + 1, ".", j, ".");
    Block b;
    MOH_ASSIGN_OR_RETURN(b.norm1_w, take(pre + "norm1.weight", {c}));
    MOH_ASSIGN_OR_RETURN(b.norm1_b, take(pre + "norm1.bias", {c}));
    MOH_ASSIGN_OR_RETURN(b.attn,
                         LoadAttention(store, s, pre + "attn.",
                                       config().moh.layers[first_layer + j]));
    MOH_ASSIGN_OR_RETURN(b.norm2_w, take(pre + "norm2.weight", {c}));
    MOH_ASSIGN_OR_RETURN(b.norm2_b, take(pre + "norm2.bias", {c}));
    MOH_ASSIGN_OR_RETURN(
        b.fc1_w, TakeLinear(store, pre + "mlp.fc1.weight", {2 * hidden, c}));
    MOH_ASSIGN_OR_RETURN(b.fc1_b, take(pre + "mlp.fc1.bias", {2 * hidden}));
    MOH_ASSIGN_OR_RETURN(
        b.dw_w, take(pre + "mlp.dwconv.dwconv.weight", {hidden, 1, 3, 3}));
    MOH_ASSIGN_OR_RETURN(b.dw_b,
                         take(pre + "mlp.dwconv.dwconv.bias", {hidden}));
    MOH_ASSIGN_OR_RETURN(
        b.fc2_w, TakeLinear(store, pre + "mlp.fc2.weight", {c, hidden}));
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
  const TransNextStage& sc = config().stages[s];
  const int64_t c = sc.embed_dim, h = sc.num_heads, d = sc.head_dim();
  const int64_t resolution = config().resolution(s);
  const int64_t tokens = resolution * resolution;
  const int64_t window = int64_t{config().window_size} * config().window_size;
  Attention a;
  a.aggregated = sc.sr_ratio > 1;
  auto take = [&](const std::string& name, std::vector<int64_t> shape) {
    return store.Take(name, shape, options());
  };
  if (a.aggregated) {
    MOH_ASSIGN_OR_RETURN(a.q_w, TakeLinear(store, pre + "q.weight", {c, c}));
    MOH_ASSIGN_OR_RETURN(a.kv_w,
                         TakeLinear(store, pre + "kv.weight", {2 * c, c}));
    if (config().qkv_bias) {
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
    a.q_w = ConvertedLinearWeight(qkv_w.narrow(0, 0, c).contiguous(),
                                  linear_weights_);
    a.kv_w = ConvertedLinearWeight(qkv_w.narrow(0, c, 2 * c).contiguous(),
                                   linear_weights_);
    if (config().qkv_bias) {
      MOH_ASSIGN_OR_RETURN(at::Tensor qkv_b, take(pre + "qkv.bias", {3 * c}));
      a.q_b = qkv_b.narrow(0, 0, c).contiguous();
      a.kv_b = qkv_b.narrow(0, c, 2 * c).contiguous();
    }
  }
  MOH_ASSIGN_OR_RETURN(a.proj_w,
                       TakeLinear(store, pre + "proj.weight", {c, c}));
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
    const int64_t pooled =
        int64_t{config().pool_size(s)} * config().pool_size(s);
    at::Tensor inside = WindowNeighbours(resolution, config().window_size)
                            .ge(0)
                            .sum(1)
                            .to(at::kFloat);
    seq_scale = at::log(inside + static_cast<float>(pooled)).view({1, tokens});
  } else {
    seq_scale = at::full({1, tokens},
                         static_cast<float>(std::log(double(tokens))), f32);
  }
  a.scale = (at::softplus(temperature.view({h, 1})) * seq_scale)
                .to(options())
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
      a.aggregated ? config().pool_size(s) : config().resolution(s);
  const int64_t pretrain = config().pretrain_size >> (s + 2);
  a.bias = ContinuousPositionBias(resolution, key, pretrain, fc1_w, fc1_b,
                                  fc2_w, fc2_b)
               .to(options());
  MOH_ASSIGN_OR_RETURN(a.router, MohRouter::Load(RouterKind::kLearned, layer, c,
                                                 pre, store, options()));
  return a;
}

}  // namespace moh
