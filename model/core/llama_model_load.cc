// LlamaModel's loading: the checkpoint's tensors into layers (official
// names and shapes; every tensor must be used) and the RoPE tables.
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/checkpoint/checkpoint.h"
#include "model/core/linear_weight_format.h"
#include "model/core/llama_model.h"

namespace moh {

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(
    const std::string& dir, const DeviceOptions& device_options) {
  MOH_ASSIGN_OR_RETURN(ModelConfig config,
                       LoadModelConfig(dir, ModelFamily::kLlama));
  MOH_ASSIGN_OR_RETURN(at::TensorOptions options,
                       ResolveTensorOptions(device_options));
  // Before the checkpoint is read: a wrong setting fails fast.
  MOH_ASSIGN_OR_RETURN(WeightFormat weights,
                       ResolveWeightFormat(device_options.weights, options));
  // A pre-quantized checkpoint stays int8 where int8 weights can run (the
  // CPU under float32 activations) unless the setting asks otherwise;
  // elsewhere it is widened to the model's dtype.
  if (config.llama.prequantized != PrequantizedLayout::kNone &&
      weights == WeightFormat::kAsLoaded &&
      ResolveWeightFormat("int8", options).ok()) {
    weights = WeightFormat::kInt8;
  }
  return Load(dir, config.llama, options, weights);
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(
    const std::string& dir, const LlamaConfig& config,
    const at::TensorOptions& options, WeightFormat weights) {
  MOH_ASSIGN_OR_RETURN(TensorStore store, LoadCheckpoint(dir));
  return FromTensors(config, store, options, weights);
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::FromTensors(
    const LlamaConfig& config, TensorStore& store,
    const at::TensorOptions& options, WeightFormat weights) {
  MOH_RETURN_IF_ERROR(CheckWeightFormat(weights, options));
  std::unique_ptr<LlamaModel> model(new LlamaModel(config, options));
  model->linear_weights_ = weights;
  const int64_t c = config.hidden_size;
  const int64_t d = config.head_dim;
  const int64_t q_dim = config.num_heads * d;
  const int64_t kv_dim = config.num_kv_heads * d;
  // Only linear weights may be int8 (pre-quantized): anything else read as
  // a float would be its raw integers.
  auto take = [&](const std::string& name,
                  std::vector<int64_t> shape) -> absl::StatusOr<at::Tensor> {
    MOH_ASSIGN_OR_RETURN(at::Tensor stored, store.Get(name));
    if (stored.scalar_type() == at::kChar) {
      return TensorError(store, name,
                         "is int8; only linear weights may be stored "
                         "pre-quantized");
    }
    return store.Take(name, shape, options);
  };
  auto take_linear =
      [&](const std::string& name,
          std::vector<int64_t> shape) -> absl::StatusOr<LinearWeight> {
    MOH_ASSIGN_OR_RETURN(at::Tensor stored, store.Get(name));
    if (stored.scalar_type() == at::kChar) {
      return TakePrequantizedLinear(store, name, shape, config.prequantized,
                                    options, weights);
    }
    return TakeConvertedLinear(store, name, std::move(shape), options, weights);
  };
  if (config.tie_word_embeddings) {
    MOH_ASSIGN_OR_RETURN(
        model->embed_tokens_,
        take_linear("model.embed_tokens.weight", {config.vocab_size, c}));
    model->lm_head_ = model->embed_tokens_;
  } else {
    MOH_ASSIGN_OR_RETURN(model->embed_tokens_, take("model.embed_tokens.weight",
                                                    {config.vocab_size, c}));
    MOH_ASSIGN_OR_RETURN(model->lm_head_,
                         take_linear("lm_head.weight", {config.vocab_size, c}));
  }
  MOH_ASSIGN_OR_RETURN(model->final_norm_, take("model.norm.weight", {c}));
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    Layer layer;
    MOH_ASSIGN_OR_RETURN(layer.input_norm,
                         take(p + "input_layernorm.weight", {c}));
    MOH_ASSIGN_OR_RETURN(layer.post_norm,
                         take(p + "post_attention_layernorm.weight", {c}));
    MOH_ASSIGN_OR_RETURN(
        layer.q_proj, take_linear(p + "self_attn.q_proj.weight", {q_dim, c}));
    MOH_ASSIGN_OR_RETURN(
        layer.k_proj, take_linear(p + "self_attn.k_proj.weight", {kv_dim, c}));
    MOH_ASSIGN_OR_RETURN(
        layer.v_proj, take_linear(p + "self_attn.v_proj.weight", {kv_dim, c}));
    MOH_ASSIGN_OR_RETURN(
        layer.o_proj, take_linear(p + "self_attn.o_proj.weight", {c, q_dim}));
    if (config.attention_bias) {
      MOH_ASSIGN_OR_RETURN(layer.q_bias,
                           take(p + "self_attn.q_proj.bias", {q_dim}));
      MOH_ASSIGN_OR_RETURN(layer.k_bias,
                           take(p + "self_attn.k_proj.bias", {kv_dim}));
      MOH_ASSIGN_OR_RETURN(layer.v_bias,
                           take(p + "self_attn.v_proj.bias", {kv_dim}));
      MOH_ASSIGN_OR_RETURN(layer.o_bias,
                           take(p + "self_attn.o_proj.bias", {c}));
    }
    const int64_t inter = config.intermediate_size;
    MOH_ASSIGN_OR_RETURN(layer.gate_proj,
                         take_linear(p + "mlp.gate_proj.weight", {inter, c}));
    MOH_ASSIGN_OR_RETURN(layer.up_proj,
                         take_linear(p + "mlp.up_proj.weight", {inter, c}));
    MOH_ASSIGN_OR_RETURN(layer.down_proj,
                         take_linear(p + "mlp.down_proj.weight", {c, inter}));
    // Keys, values, then queries: the first shared heads' queries with the
    // keys and values are one range of rows (SharedHeadsAttention).
    layer.kvq_proj = StackRows({&layer.k_proj, &layer.v_proj, &layer.q_proj});
    layer.kv_proj = layer.kvq_proj.defined()
                        ? layer.kvq_proj.Rows(0, 2 * kv_dim)
                        : StackRows({&layer.k_proj, &layer.v_proj});
    if (layer.kvq_proj.defined() && config.attention_bias) {
      layer.kvq_bias = at::cat({layer.k_bias, layer.v_bias, layer.q_bias});
      layer.kv_bias = layer.kvq_bias.narrow(0, 0, 2 * kv_dim);
      layer.q_bias = layer.kvq_bias.narrow(0, 2 * kv_dim, q_dim);
    } else if (layer.kv_proj.defined() && config.attention_bias) {
      layer.kv_bias = at::cat({layer.k_bias, layer.v_bias});
    }
    if (layer.kv_bias.defined()) {
      layer.k_bias = layer.kv_bias.narrow(0, 0, kv_dim);
      layer.v_bias = layer.kv_bias.narrow(0, kv_dim, kv_dim);
    }
    layer.gate_up_proj = StackRows({&layer.gate_proj, &layer.up_proj});
    MOH_ASSIGN_OR_RETURN(
        layer.router, MohRouter::Load(config.moh.router, config.moh.layers[l],
                                      c, p + "self_attn.", store, options));
    model->layers_.push_back(std::move(layer));
  }
  MOH_RETURN_IF_ERROR(store.CheckAllTaken());
  ReleaseConversionHeap(weights);

  // RoPE tables, computed as the official LlamaRotaryEmbedding does.
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor inv_freq =
      1.0 / at::pow(config.rope_theta,
                    at::arange(0, d, 2, f32.dtype(at::kLong)).to(at::kFloat) /
                        static_cast<double>(d));
  at::Tensor t = at::arange(config.max_position_embeddings, f32);
  at::Tensor freqs = at::outer(t, inv_freq);
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  // In the model's dtype, as the official code rounds them before use
  // (float32 for the CPU's loops).
  model->rope_cos_ = emb.cos().to(options);
  model->rope_sin_ = emb.sin().to(options);
  return model;
}

}  // namespace moh
