#include "model/core/vit_model.h"

#include <c10/core/InferenceMode.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/checkpoint/checkpoint.h"
#include "model/core/head_sparse_attention.h"
#include "model/core/linear_weight_format.h"

namespace moh {

absl::StatusOr<std::unique_ptr<VitModel>> VitModel::Load(
    const std::string& dir, const DeviceOptions& device_options) {
  MOH_ASSIGN_OR_RETURN(ModelConfig config,
                       LoadModelConfig(dir, ModelFamily::kVit));
  MOH_ASSIGN_OR_RETURN(at::TensorOptions options,
                       ResolveTensorOptions(device_options));
  // Before the checkpoint is read: a wrong setting fails fast.
  MOH_ASSIGN_OR_RETURN(WeightFormat weights,
                       ResolveWeightFormat(device_options.weights, options));
  return Load(dir, config.vit, options, weights);
}

absl::StatusOr<std::unique_ptr<VitModel>> VitModel::Load(
    const std::string& dir, const VitConfig& config,
    const at::TensorOptions& options, WeightFormat weights) {
  MOH_RETURN_IF_ERROR(CheckWeightFormat(weights, options));
  MOH_ASSIGN_OR_RETURN(TensorStore store, LoadCheckpoint(dir));
  std::unique_ptr<VitModel> model(new VitModel(config, options));
  model->linear_weights_ = weights;
  const int64_t c = config.hidden_size;
  const int64_t inter = config.intermediate_size;
  auto take = [&](const std::string& name, std::vector<int64_t> shape) {
    return store.Take(name, shape, options);
  };
  auto take_linear = [&](const std::string& name, std::vector<int64_t> shape) {
    return TakeConvertedLinear(store, name, std::move(shape), options, weights);
  };
  const int64_t p = config.patch_size;
  MOH_ASSIGN_OR_RETURN(model->patch_w_, take("patch_embed.proj.weight",
                                             {c, config.num_channels, p, p}));
  MOH_ASSIGN_OR_RETURN(model->patch_b_, take("patch_embed.proj.bias", {c}));
  MOH_ASSIGN_OR_RETURN(model->cls_token_, take("cls_token", {1, 1, c}));
  MOH_ASSIGN_OR_RETURN(model->pos_embed_,
                       take("pos_embed", {1, 1 + config.num_patches(), c}));
  MOH_ASSIGN_OR_RETURN(model->norm_w_, take("norm.weight", {c}));
  MOH_ASSIGN_OR_RETURN(model->norm_b_, take("norm.bias", {c}));
  const int64_t classes = config.labels.size();
  MOH_ASSIGN_OR_RETURN(model->head_w_,
                       take_linear("head.weight", {classes, c}));
  MOH_ASSIGN_OR_RETURN(model->head_b_, take("head.bias", {classes}));
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const std::string pre = absl::StrCat("blocks.", l, ".");
    Block b;
    MOH_ASSIGN_OR_RETURN(b.norm1_w, take(pre + "norm1.weight", {c}));
    MOH_ASSIGN_OR_RETURN(b.norm1_b, take(pre + "norm1.bias", {c}));
    MOH_ASSIGN_OR_RETURN(b.attn.qkv_w,
                         take_linear(pre + "attn.qkv.weight", {3 * c, c}));
    if (config.qkv_bias) {
      MOH_ASSIGN_OR_RETURN(b.attn.qkv_b, take(pre + "attn.qkv.bias", {3 * c}));
    }
    MOH_ASSIGN_OR_RETURN(b.attn.proj_w,
                         take_linear(pre + "attn.proj.weight", {c, c}));
    MOH_ASSIGN_OR_RETURN(b.attn.proj_b, take(pre + "attn.proj.bias", {c}));
    MOH_ASSIGN_OR_RETURN(b.norm2_w, take(pre + "norm2.weight", {c}));
    MOH_ASSIGN_OR_RETURN(b.norm2_b, take(pre + "norm2.bias", {c}));
    MOH_ASSIGN_OR_RETURN(b.fc1_w,
                         take_linear(pre + "mlp.fc1.weight", {inter, c}));
    MOH_ASSIGN_OR_RETURN(b.fc1_b, take(pre + "mlp.fc1.bias", {inter}));
    MOH_ASSIGN_OR_RETURN(b.fc2_w,
                         take_linear(pre + "mlp.fc2.weight", {c, inter}));
    MOH_ASSIGN_OR_RETURN(b.fc2_b, take(pre + "mlp.fc2.bias", {c}));
    MOH_ASSIGN_OR_RETURN(
        b.router, MohRouter::Load(config.moh.router, config.moh.layers[l], c,
                                  pre + "attn.", store, options));
    model->blocks_.push_back(std::move(b));
  }
  MOH_RETURN_IF_ERROR(store.CheckAllTaken());
  ReleaseConversionHeap(weights);
  return model;
}

ImagePreprocessing VitModel::preprocessing() const {
  ImagePreprocessing p;
  p.image_size = config().image_size;
  p.resize_size = 0;
  p.num_channels = config().num_channels;
  return p;
}

std::vector<int64_t> VitModel::LayerTokens() const {
  return std::vector<int64_t>(config().num_layers, 1 + config().num_patches());
}

at::Tensor VitModel::LayerNorm(const at::Tensor& x, const at::Tensor& w,
                               const at::Tensor& b) const {
  return at::layer_norm(x, {x.size(-1)}, w, b, config().layer_norm_eps);
}

absl::StatusOr<ClassifierOutput> VitModel::ForwardWithTopK(
    const at::Tensor& pixels, const std::vector<LayerTopK>& row_top_k,
    bool record_gates) const {
  return RunForward(
      "VitModel::Forward", pixels, row_top_k,
      [&](const UploadedTopK& top_k) -> absl::StatusOr<ClassifierOutput> {
        const int64_t rows = pixels.size(0);
        at::Tensor x =
            at::conv2d(context().Upload(pixels).to(options()), patch_w_,
                       patch_b_, {config().patch_size, config().patch_size});
        x = x.flatten(2).transpose(1, 2);  // [B, N, C]
        x = at::cat({cls_token_.expand({rows, 1, -1}), x}, 1) + pos_embed_;
        at::Tensor valid =
            at::ones({rows, x.size(1)},
                     at::TensorOptions().dtype(at::kBool).device(x.device()));
        std::vector<at::Tensor> counts, gates_per_layer;
        for (size_t l = 0; l < blocks_.size(); ++l) {
          const Block& block = blocks_[l];
          at::Tensor gates;
          x = x +
              BidirectionalAttention(block.attn, block.router,
                                     LayerNorm(x, block.norm1_w, block.norm1_b),
                                     top_k.layer(l), top_k.bounds(l),
                                     attention_mode(), &gates);
          at::Tensor hidden =
              at::gelu(Linear(LayerNorm(x, block.norm2_w, block.norm2_b),
                              block.fc1_w, block.fc1_b));
          x = x + Linear(hidden, block.fc2_w, block.fc2_b);
          counts.push_back(HeadTokenCounts(gates, valid));
          if (record_gates) gates_per_layer.push_back(gates.to(at::kFloat));
        }
        x = LayerNorm(x, norm_w_, norm_b_);
        // One copy to the host and one wait for the whole batch's results.
        return DownloadClassifierOutput(
            context(), Linear(x.select(1, 0), head_w_, head_b_).to(at::kFloat),
            at::stack(counts, 1), gates_per_layer);
      });
}

}  // namespace moh
