// LlamaModel's loading: the checkpoint's tensors into layers (official
// names and shapes; every tensor must be used) and the RoPE tables.
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/checkpoint/checkpoint.h"
#include "model/core/llama_model.h"

namespace moh {

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(
    const std::string& dir, const DeviceOptions& device_options) {
  MOH_ASSIGN_OR_RETURN(ModelConfig config,
                       LoadModelConfig(dir, ModelFamily::kLlama));
  MOH_ASSIGN_OR_RETURN(at::TensorOptions options,
                       ResolveTensorOptions(device_options));
  return Load(dir, config.llama, options);
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(
    const std::string& dir, const LlamaConfig& config,
    const at::TensorOptions& options) {
  MOH_ASSIGN_OR_RETURN(TensorStore store, LoadCheckpoint(dir));
  return FromTensors(config, store, options);
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::FromTensors(
    const LlamaConfig& config, TensorStore& store,
    const at::TensorOptions& options) {
  std::unique_ptr<LlamaModel> model(new LlamaModel(config, options));
  const int64_t c = config.hidden_size;
  const int64_t d = config.head_dim;
  const int64_t q_dim = config.num_heads * d;
  const int64_t kv_dim = config.num_kv_heads * d;
  auto take = [&](const std::string& name, std::vector<int64_t> shape) {
    return store.Take(name, shape, options);
  };
  MOH_ASSIGN_OR_RETURN(model->embed_tokens_, take("model.embed_tokens.weight",
                                                  {config.vocab_size, c}));
  MOH_ASSIGN_OR_RETURN(model->final_norm_, take("model.norm.weight", {c}));
  if (config.tie_word_embeddings) {
    model->lm_head_ = model->embed_tokens_;
  } else {
    MOH_ASSIGN_OR_RETURN(model->lm_head_,
                         take("lm_head.weight", {config.vocab_size, c}));
  }
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    Layer layer;
    MOH_ASSIGN_OR_RETURN(layer.input_norm,
                         take(p + "input_layernorm.weight", {c}));
    MOH_ASSIGN_OR_RETURN(layer.post_norm,
                         take(p + "post_attention_layernorm.weight", {c}));
    MOH_ASSIGN_OR_RETURN(layer.q_proj,
                         take(p + "self_attn.q_proj.weight", {q_dim, c}));
    MOH_ASSIGN_OR_RETURN(layer.k_proj,
                         take(p + "self_attn.k_proj.weight", {kv_dim, c}));
    MOH_ASSIGN_OR_RETURN(layer.v_proj,
                         take(p + "self_attn.v_proj.weight", {kv_dim, c}));
    MOH_ASSIGN_OR_RETURN(layer.o_proj,
                         take(p + "self_attn.o_proj.weight", {c, q_dim}));
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
                         take(p + "mlp.gate_proj.weight", {inter, c}));
    MOH_ASSIGN_OR_RETURN(layer.up_proj,
                         take(p + "mlp.up_proj.weight", {inter, c}));
    MOH_ASSIGN_OR_RETURN(layer.down_proj,
                         take(p + "mlp.down_proj.weight", {c, inter}));
    MOH_ASSIGN_OR_RETURN(
        layer.router, MohRouter::Load(config.moh.router, config.moh.layers[l],
                                      c, p + "self_attn.", store, options));
    model->layers_.push_back(std::move(layer));
  }
  MOH_RETURN_IF_ERROR(store.CheckAllTaken());

  // RoPE tables, computed as the official LlamaRotaryEmbedding does.
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor inv_freq =
      1.0 / at::pow(config.rope_theta,
                    at::arange(0, d, 2, f32.dtype(at::kLong)).to(at::kFloat) /
                        static_cast<double>(d));
  at::Tensor t = at::arange(config.max_position_embeddings, f32);
  at::Tensor freqs = at::outer(t, inv_freq);
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  model->rope_cos_ = emb.cos().to(options.device());
  model->rope_sin_ = emb.sin().to(options.device());
  return model;
}

absl::Status LlamaModel::set_linear_weights(absl::string_view name,
                                            absl::string_view field) {
  if (name.empty() || name == "auto") return absl::OkStatus();
  if (name == "int8") {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": \"int8\" weights are not implemented yet; use \"bfloat16\""));
  }
  if (name != "bfloat16") {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " must be \"\", \"auto\" or \"bfloat16\", got \"", name, "\""));
  }
  if (!options_.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field,
        ": bfloat16 weights under float32 activations are for the CPU; "
        "on CUDA set dtype: \"bfloat16\""));
  }
  if (at::typeMetaToScalarType(options_.dtype()) != at::kFloat) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": bfloat16 weights need dtype float32, got ",
                     DtypeName(at::typeMetaToScalarType(options_.dtype()))));
  }
  auto narrow = [](at::Tensor& w) {
    if (w.defined()) w = w.to(at::kBFloat16).contiguous();
  };
  const bool tied = lm_head_.is_same(embed_tokens_);
  narrow(lm_head_);
  if (tied) embed_tokens_ = lm_head_;
  for (Layer& layer : layers_) {
    for (at::Tensor* w :
         {&layer.q_proj, &layer.k_proj, &layer.v_proj, &layer.o_proj,
          &layer.gate_proj, &layer.up_proj, &layer.down_proj}) {
      narrow(*w);
    }
  }
  linear_weights_ = std::string(name);
#ifdef __GLIBC__
  // ConfigureCpuAllocator keeps freed heap in the process for activations;
  // the float32 weights just freed would stay resident (the bench model: 259
  // MiB either way before this), so give their pages back now.
  malloc_trim(0);
#endif
  return absl::OkStatus();
}

}  // namespace moh
