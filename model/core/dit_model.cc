#include "model/core/dit_model.h"

#include <c10/core/InferenceMode.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/core/image_model_parts.h"
#include "model/core/linear_weight_format.h"

namespace moh {
namespace {

constexpr int64_t kFrequencies = 256;  // TimestepEmbedder's
constexpr double kMaxPeriod = 10000.0;
constexpr double kNormEps = 1e-6;

// x * (1 + scale) + shift, per row: x [B, N, C], shift and scale [B, C].
at::Tensor Modulate(const at::Tensor& x, const at::Tensor& shift,
                    const at::Tensor& scale) {
  return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1);
}

// LayerNorm without affine parameters (eps 1e-6), then Modulate.
at::Tensor NormModulate(const at::Tensor& x, const at::Tensor& shift,
                        const at::Tensor& scale) {
  return Modulate(at::layer_norm(x, {x.size(-1)}, {}, {}, kNormEps), shift,
                  scale);
}

// Sinusoidal timestep embedding [B, 256]: cos then sin of t * freqs, freqs
// exp(-ln(10000) * i / 128) in float32 (TimestepEmbedder.timestep_embedding).
at::Tensor TimestepFrequencies(const at::Tensor& t) {
  const int64_t half = kFrequencies / 2;
  at::Tensor freqs =
      at::exp(-std::log(kMaxPeriod) *
              at::arange(0, half, t.options().dtype(at::kFloat)) / half);
  at::Tensor args = t.to(at::kFloat).unsqueeze(1) * freqs.unsqueeze(0);
  return at::cat({at::cos(args), at::sin(args)}, -1);
}

}  // namespace

absl::StatusOr<std::unique_ptr<DitModel>> DitModel::Load(
    const std::string& dir, const DeviceOptions& device_options) {
  MOH_ASSIGN_OR_RETURN(ModelConfig config,
                       LoadModelConfig(dir, ModelFamily::kDit));
  MOH_ASSIGN_OR_RETURN(at::TensorOptions options,
                       ResolveTensorOptions(device_options));
  // Before the checkpoint is read: a wrong setting fails fast.
  MOH_ASSIGN_OR_RETURN(WeightFormat weights,
                       ResolveWeightFormat(device_options.weights, options));
  CheckpointOptions checkpoint;
  checkpoint.container_keys = {"ema", "model"};
  MOH_ASSIGN_OR_RETURN(TensorStore store, LoadCheckpoint(dir, checkpoint));
  return FromStore(store, config.dit, options, weights);
}

absl::StatusOr<std::unique_ptr<DitModel>> DitModel::FromStore(
    TensorStore& store, const DitConfig& config,
    const at::TensorOptions& options, WeightFormat weights) {
  MOH_RETURN_IF_ERROR(CheckWeightFormat(weights, options));
  std::unique_ptr<DitModel> model(new DitModel(config, options));
  model->linear_weights_ = weights;
  auto take = [&](const std::string& name, std::vector<int64_t> shape) {
    return store.Take(name, shape, options);
  };
  auto take_linear = [&](const std::string& name, std::vector<int64_t> shape) {
    return TakeConvertedLinear(store, name, std::move(shape), options, weights);
  };
  const int64_t c = config.hidden_size, p = config.patch_size;
  MOH_ASSIGN_OR_RETURN(model->patch_w_, take("x_embedder.proj.weight",
                                             {c, config.in_channels, p, p}));
  MOH_ASSIGN_OR_RETURN(model->patch_b_, take("x_embedder.proj.bias", {c}));
  MOH_ASSIGN_OR_RETURN(model->pos_embed_,
                       take("pos_embed", {1, config.tokens(), c}));
  MOH_ASSIGN_OR_RETURN(
      model->t_w0_, take_linear("t_embedder.mlp.0.weight", {c, kFrequencies}));
  MOH_ASSIGN_OR_RETURN(model->t_b0_, take("t_embedder.mlp.0.bias", {c}));
  MOH_ASSIGN_OR_RETURN(model->t_w2_,
                       take_linear("t_embedder.mlp.2.weight", {c, c}));
  MOH_ASSIGN_OR_RETURN(model->t_b2_, take("t_embedder.mlp.2.bias", {c}));
  MOH_ASSIGN_OR_RETURN(
      model->class_table_,
      take("y_embedder.embedding_table.weight", {config.num_classes + 1, c}));
  const int64_t mlp = config.mlp_hidden();
  for (int32_t l = 0; l < config.depth; ++l) {
    const std::string pre = absl::StrCat("blocks.", l, ".");
    const int64_t width = int64_t{config.num_heads[l]} * config.head_dim[l];
    Block b;
    MOH_ASSIGN_OR_RETURN(
        b.ada_w, take_linear(pre + "adaLN_modulation.1.weight", {6 * c, c}));
    MOH_ASSIGN_OR_RETURN(b.ada_b,
                         take(pre + "adaLN_modulation.1.bias", {6 * c}));
    MOH_ASSIGN_OR_RETURN(b.attn.qkv_w,
                         take_linear(pre + "attn.qkv.weight", {3 * width, c}));
    MOH_ASSIGN_OR_RETURN(b.attn.qkv_b,
                         take(pre + "attn.qkv.bias", {3 * width}));
    MOH_ASSIGN_OR_RETURN(b.attn.proj_w,
                         take_linear(pre + "attn.proj.weight", {c, width}));
    MOH_ASSIGN_OR_RETURN(b.attn.proj_b, take(pre + "attn.proj.bias", {c}));
    MOH_ASSIGN_OR_RETURN(
        b.router, MohRouter::Load(RouterKind::kLearned, config.moh.layers[l], c,
                                  pre + "attn.", store, options));
    MOH_ASSIGN_OR_RETURN(b.fc1_w,
                         take_linear(pre + "mlp.fc1.weight", {mlp, c}));
    MOH_ASSIGN_OR_RETURN(b.fc1_b, take(pre + "mlp.fc1.bias", {mlp}));
    MOH_ASSIGN_OR_RETURN(b.fc2_w,
                         take_linear(pre + "mlp.fc2.weight", {c, mlp}));
    MOH_ASSIGN_OR_RETURN(b.fc2_b, take(pre + "mlp.fc2.bias", {c}));
    model->blocks_.push_back(std::move(b));
  }
  MOH_ASSIGN_OR_RETURN(
      model->final_ada_w_,
      take_linear("final_layer.adaLN_modulation.1.weight", {2 * c, c}));
  MOH_ASSIGN_OR_RETURN(model->final_ada_b_,
                       take("final_layer.adaLN_modulation.1.bias", {2 * c}));
  const int64_t out = p * p * config.out_channels();
  MOH_ASSIGN_OR_RETURN(model->final_w_,
                       take_linear("final_layer.linear.weight", {out, c}));
  MOH_ASSIGN_OR_RETURN(model->final_b_, take("final_layer.linear.bias", {out}));
  MOH_RETURN_IF_ERROR(store.CheckAllTaken());
  ReleaseConversionHeap(weights);
  return model;
}

absl::Status DitModel::CheckInputs(const at::Tensor& x,
                                   const at::Tensor& timesteps,
                                   const at::Tensor& classes,
                                   size_t top_k_rows) const {
  MOH_RETURN_IF_ERROR(
      CheckImageBatch(x, config_.in_channels, config_.input_size, "x"));
  const int64_t rows = x.size(0);
  if (!timesteps.defined() || timesteps.dim() != 1 ||
      timesteps.size(0) != rows || !classes.defined() || classes.dim() != 1 ||
      classes.size(0) != rows || top_k_rows != static_cast<size_t>(rows)) {
    return absl::InvalidArgumentError(
        "timesteps, classes and top_k need one entry per row of x");
  }
  at::Tensor c = classes.to(at::kLong).cpu();
  if (c.min().item<int64_t>() < 0 ||
      c.max().item<int64_t>() > config_.num_classes) {
    return absl::InvalidArgumentError(
        absl::StrCat("classes must be in [0, ", config_.num_classes, "] (",
                     config_.num_classes, ": the null class)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<DitOutput> DitModel::Forward(
    const at::Tensor& x_in, const at::Tensor& timesteps,
    const at::Tensor& classes, const std::vector<LayerTopK>& row_top_k) const {
  MOH_RETURN_IF_ERROR(CheckInputs(x_in, timesteps, classes, row_top_k.size()));
  MOH_RETURN_IF_ERROR(
      ValidateTopK(config_.moh, row_top_k, x_in.size(0), "top_k"));
  const c10::InferenceMode inference;
  return CatchTorchErrors(
      "DitModel::Forward", [&]() -> absl::StatusOr<DitOutput> {
        const std::unique_ptr<DeviceContext::Scope> scope = context_->Enter();
        const int64_t rows = x_in.size(0), tokens = config_.tokens();
        const int64_t c = config_.hidden_size, p = config_.patch_size;
        const UploadedTopK top_k(*context_, row_top_k,
                                 std::vector<int64_t>(blocks_.size(), tokens));
        const int64_t max_heads = MaxHeads(config_.moh);

        at::Tensor x = at::conv2d(context_->Upload(x_in).to(options_), patch_w_,
                                  patch_b_, {p, p});
        x = x.flatten(2).transpose(1, 2) + pos_embed_;  // [B, N, C]
        at::Tensor t = TimestepFrequencies(context_->Upload(timesteps))
                           .to(options_.dtype());
        t = Linear(at::silu(Linear(t, t_w0_, t_b0_)), t_w2_, t_b2_);
        at::Tensor cond = t + class_table_.index_select(
                                  0, context_->Upload(classes).to(at::kLong));
        at::Tensor cond_act = at::silu(cond);
        at::Tensor valid =
            at::ones({rows, tokens},
                     at::TensorOptions().dtype(at::kBool).device(x.device()));
        std::vector<at::Tensor> counts;
        for (size_t l = 0; l < blocks_.size(); ++l) {
          const Block& block = blocks_[l];
          std::vector<at::Tensor> mod =
              Linear(cond_act, block.ada_w, block.ada_b).chunk(6, 1);
          at::Tensor gates;
          at::Tensor h = NormModulate(x, mod[0], mod[1]);
          x = x + mod[2].unsqueeze(1) *
                      BidirectionalAttention(block.attn, block.router, h,
                                             top_k.layer(l), top_k.bounds(l),
                                             attention_mode_, &gates);
          h = NormModulate(x, mod[3], mod[4]);
          h = Linear(at::gelu(Linear(h, block.fc1_w, block.fc1_b), "tanh"),
                     block.fc2_w, block.fc2_b);
          x = x + mod[5].unsqueeze(1) * h;
          counts.push_back(PaddedHeadTokenCounts(gates, valid, max_heads));
        }
        std::vector<at::Tensor> final_mod =
            Linear(cond_act, final_ada_w_, final_ada_b_).chunk(2, 1);
        x = Linear(NormModulate(x, final_mod[0], final_mod[1]), final_w_,
                   final_b_);  // [B, N, p * p * out]
        // Unpatchify: [B, h, w, p, p, out] -> [B, out, h * p, w * p].
        const int64_t g = config_.grid(), out = config_.out_channels();
        x = x.reshape({rows, g, g, p, p, out})
                .permute({0, 5, 1, 3, 2, 4})
                .reshape({rows, out, g * p, g * p});
        DitOutput result;
        result.out = x.to(at::kFloat);
        result.head_token_counts = at::stack(counts, 1).cpu();
        return result;
      });
}

}  // namespace moh
