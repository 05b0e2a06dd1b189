#include "model/llama_model.h"

#include <cmath>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "model/checkpoint.h"
#include "model/head_sparse_attention.h"
#include "model/status_macros.h"

namespace moh {
namespace {

at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight,
                  const at::Tensor& bias) {
  return bias.defined() ? at::linear(x, weight, bias) : at::linear(x, weight);
}

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

at::Tensor HostLongs(const std::vector<int32_t>& values) {
  return at::tensor(std::vector<int64_t>(values.begin(), values.end()),
                    at::kLong);
}

}  // namespace

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(
    const std::string& dir, const DeviceOptions& device_options) {
  MOH_ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));
  if (config.family != ModelFamily::kLlama) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, "/config.json: not a LLaMA-style decoder"));
  }
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

KvCache LlamaModel::CreateKvCache(int64_t num_slots,
                                  int64_t max_seq_len) const {
  return KvCache(
      config_.num_layers, num_slots,
      std::min<int64_t>(max_seq_len, config_.max_position_embeddings),
      config_.num_kv_heads, config_.head_dim, options_);
}

absl::Status LlamaModel::Validate(const DecoderBatch& batch,
                                  const KvCache& cache) const {
  const at::Tensor& ids = batch.token_ids;
  if (!ids.defined() || ids.dim() != 2 || ids.size(0) < 1 || ids.size(1) < 1) {
    return absl::InvalidArgumentError(
        "token_ids must be a [B, T] tensor, B, T >= 1");
  }
  if (ids.scalar_type() != at::kLong) {
    return absl::InvalidArgumentError("token_ids must be int64");
  }
  const size_t rows = ids.size(0);
  const int64_t width = ids.size(1);
  if (batch.num_tokens.size() != rows || batch.slots.size() != rows ||
      batch.start_positions.size() != rows || batch.ratios.size() != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens, slots, start_positions and ratios need one "
                     "entry per row (",
                     rows, ")"));
  }
  std::set<int32_t> seen_slots;
  for (size_t b = 0; b < rows; ++b) {
    if (batch.num_tokens[b] < 1 || batch.num_tokens[b] > width) {
      return absl::InvalidArgumentError(
          absl::StrCat("num_tokens[", b, "] must be in [1, ", width, "], got ",
                       batch.num_tokens[b]));
    }
    if (batch.slots[b] < 0 || batch.slots[b] >= cache.num_slots()) {
      return absl::InvalidArgumentError(
          absl::StrCat("slots[", b, "] must be in [0, ", cache.num_slots(),
                       "), got ", batch.slots[b]));
    }
    if (!seen_slots.insert(batch.slots[b]).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("slots[", b, "] = ", batch.slots[b], " is used twice"));
    }
    const int64_t end = int64_t{batch.start_positions[b]} + batch.num_tokens[b];
    if (batch.start_positions[b] < 0 || end > cache.max_seq_len()) {
      return absl::InvalidArgumentError(
          absl::StrCat("row ", b, ": positions [", batch.start_positions[b],
                       ", ", end, ") must lie in [0, ", cache.max_seq_len(),
                       ") (max sequence length)"));
    }
    const float r = batch.ratios[b];
    if (!(r <= 1.0f)) {  // also rejects NaN
      return absl::InvalidArgumentError(
          absl::StrCat("ratios[", b,
                       "] must be in (0, 1] or <= 0 for the default, got ", r));
    }
  }
  const int64_t lo = ids.min().item<int64_t>();
  const int64_t hi = ids.max().item<int64_t>();
  if (lo < 0 || hi >= config_.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("token_ids must be in [0, ", config_.vocab_size, "), got ",
                     lo < 0 ? lo : hi));
  }
  return absl::OkStatus();
}

absl::StatusOr<DecoderOutput> LlamaModel::Forward(const DecoderBatch& batch,
                                                  KvCache& cache) const {
  MOH_RETURN_IF_ERROR(Validate(batch, cache));
  return CatchTorchErrors("LlamaModel::Forward",
                          [&]() { return ForwardUnchecked(batch, cache); });
}

at::Tensor LlamaModel::RmsNorm(const at::Tensor& x,
                               const at::Tensor& weight) const {
  at::Tensor h = x.to(at::kFloat);
  at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(variance + config_.rms_norm_eps);
  return weight * h.to(x.scalar_type());
}

absl::StatusOr<DecoderOutput> LlamaModel::ForwardUnchecked(
    const DecoderBatch& batch, KvCache& cache) const {
  const at::Device device = options_.device();
  const int64_t rows = batch.token_ids.size(0);
  const int64_t width = batch.token_ids.size(1);
  at::Tensor ids = batch.token_ids.to(device);
  at::Tensor start = HostLongs(batch.start_positions).to(device);
  at::Tensor count = HostLongs(batch.num_tokens).to(device);
  at::Tensor t =
      at::arange(width, at::TensorOptions().dtype(at::kLong).device(device));
  at::Tensor valid = t.unsqueeze(0) < count.unsqueeze(1);  // [B, T]
  // Padding positions repeat the last valid one: in range, never written.
  at::Tensor positions =
      start.unsqueeze(1) + at::minimum(t.unsqueeze(0), count.unsqueeze(1) - 1);

  int64_t kv_len = 0;
  for (int64_t b = 0; b < rows; ++b) {
    kv_len = std::max<int64_t>(
        kv_len, int64_t{batch.start_positions[b]} + batch.num_tokens[b]);
  }
  // Where the valid tokens go in the cache: (slot, position) pairs.
  at::Tensor flat_valid = valid.flatten().nonzero().squeeze(1);
  at::Tensor slots = HostLongs(batch.slots).to(device);
  at::Tensor cache_index =
      at::stack({slots.unsqueeze(1)
                     .expand({rows, width})
                     .flatten()
                     .index_select(0, flat_valid),
                 positions.flatten().index_select(0, flat_valid), flat_valid});

  const Step step{batch, valid,       positions, start + count,
                  slots, cache_index, kv_len,    {}};
  DecoderOutput out;
  std::vector<at::Tensor> counts;
  at::Tensor h = at::embedding(embed_tokens_, ids);  // [B, T, C]
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    at::Tensor gates;
    h = h +
        Attention(l, layer, RmsNorm(h, layer.input_norm), step, cache, &gates);
    at::Tensor x = RmsNorm(h, layer.post_norm);
    h = h + at::linear(at::silu(at::linear(x, layer.gate_proj)) *
                           at::linear(x, layer.up_proj),
                       layer.down_proj);
    counts.push_back(HeadTokenCounts(gates, valid).cpu());
    if (batch.record_gates) out.gates.push_back(gates.to(at::kFloat).cpu());
  }
  if (!batch.all_logits) {
    at::Tensor last = (count - 1);
    h = h.index({at::arange(rows, t.options()), last});  // [B, C]
  }
  out.logits = at::linear(RmsNorm(h, final_norm_), lm_head_).to(at::kFloat);
  out.head_token_counts = at::stack(counts, 1);  // [B, L, H]
  return out;
}

at::Tensor LlamaModel::Rotate(const at::Tensor& x,
                              const at::Tensor& positions) const {
  // x [..., D] at positions [...] (one position per vector).
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(config_.head_dim);
  at::Tensor cos = rope_cos_.index_select(0, positions.flatten())
                       .view(shape)
                       .to(x.scalar_type());
  at::Tensor sin = rope_sin_.index_select(0, positions.flatten())
                       .view(shape)
                       .to(x.scalar_type());
  return x * cos + RotateHalf(x) * sin;
}

const at::Tensor& LlamaModel::AttentionMask(const Step& step) const {
  if (!step.attention_mask.defined()) {
    // Key j is visible to query (b, t) iff j <= position(b, t), j < end(b).
    const int64_t rows = step.positions.size(0);
    const int64_t width = step.positions.size(1);
    at::Tensor j = at::arange(step.kv_len, step.positions.options())
                       .view({1, 1, step.kv_len});
    at::Tensor visible = (j <= step.positions.unsqueeze(2)) &
                         (j < step.row_len.view({rows, 1, 1}));
    step.attention_mask =
        at::zeros({rows, width, step.kv_len}, options_.dtype(at::kFloat))
            .masked_fill_(visible.logical_not(),
                          -std::numeric_limits<float>::infinity());
  }
  return step.attention_mask;
}

at::Tensor LlamaModel::Attention(int64_t layer_index, const Layer& layer,
                                 const at::Tensor& x, const Step& step,
                                 KvCache& cache, at::Tensor* gates) const {
  const int64_t rows = x.size(0), width = x.size(1), n = rows * width;
  const int64_t heads = config_.num_heads, kv_heads = config_.num_kv_heads;
  const int64_t d = config_.head_dim, group = heads / kv_heads;
  const bool sparse =
      UseHeadSparse(attention_mode_, layer.router, step.batch.ratios, options_);
  at::Tensor x_flat = x.reshape({n, -1});
  // The query-norm router reads every query; the learned one only x.
  at::Tensor q;
  if (!sparse || layer.router.kind() == RouterKind::kQueryNorm) {
    q = Linear(x, layer.q_proj, layer.q_bias).view({rows, width, heads, d});
  }
  int64_t max_top_k = 0;
  at::Tensor top_k = TopKPerToken(layer.router.layer(), step.batch.ratios,
                                  width, x.device(), &max_top_k);
  *gates = layer.router
               .Gates(x_flat, q.defined() ? q.view({n, heads, d}) : q, top_k,
                      max_top_k)
               .view({rows, width, heads});

  at::Tensor k = Linear(x, layer.k_proj, layer.k_bias);
  at::Tensor v = Linear(x, layer.v_proj, layer.v_bias);
  k = Rotate(k.view({rows, width, kv_heads, d}),
             step.positions.unsqueeze(2).expand({rows, width, kv_heads}));
  at::Tensor& key_cache = cache.keys(layer_index);
  at::Tensor& value_cache = cache.values(layer_index);
  at::Tensor token_index = step.cache_index[2];
  const std::initializer_list<at::indexing::TensorIndex> where = {
      step.cache_index[0], step.cache_index[1]};
  key_cache.index_put_(
      where, k.reshape({n, kv_heads, d}).index_select(0, token_index));
  value_cache.index_put_(
      where, v.reshape({n, kv_heads, d}).index_select(0, token_index));

  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  if (sparse) {
    HeadSparseAttentionInputs in;
    in.x = x_flat;
    // Padding tokens select nothing: they are never computed.
    in.gates = gates->reshape({n, heads}) *
               step.valid.reshape({n, 1}).to(gates->scalar_type());
    in.q_weight = layer.q_proj;
    in.q_bias = layer.q_bias;
    if (q.defined()) in.q_full = q.view({n, heads, d});
    in.rotate = [this](const at::Tensor& queries, const at::Tensor& positions) {
      return Rotate(queries, positions);
    };
    in.key_cache = key_cache;
    in.value_cache = value_cache;
    in.row_slot = step.slots;
    in.token_row =
        at::arange(rows, step.slots.options()).repeat_interleave(width);
    in.token_pos = step.positions.flatten();
    in.row_len = step.row_len;
    in.o_weight = layer.o_proj;
    in.o_bias = layer.o_bias;
    in.scale = scale;
    return HeadSparseAttention(
               in, attention_mode_ == AttentionMode::kHeadSparseAten)
        .view({rows, width, -1});
  }

  const int64_t kv_len = step.kv_len;
  at::Tensor keys = key_cache.narrow(1, 0, kv_len)
                        .index_select(0, step.slots)
                        .permute({0, 2, 1, 3});  // [B, KV, L, D]
  at::Tensor values = value_cache.narrow(1, 0, kv_len)
                          .index_select(0, step.slots)
                          .permute({0, 2, 1, 3});  // [B, KV, L, D]
  q = Rotate(q, step.positions.unsqueeze(2).expand({rows, width, heads}));
  // Head h reads key/value head h / group (repeat_kv).
  at::Tensor queries =
      q.permute({0, 2, 1, 3}).reshape({rows, kv_heads, group * width, d});
  at::Tensor scores = at::matmul(queries, keys.transpose(2, 3)) * scale;
  scores = scores.view({rows, kv_heads, group, width, kv_len}).to(at::kFloat) +
           AttentionMask(step).view({rows, 1, 1, width, kv_len});
  at::Tensor probs = at::softmax(scores, -1).to(x.scalar_type());
  at::Tensor attn =
      at::matmul(probs.view({rows, kv_heads, group * width, kv_len}), values)
          .view({rows, heads, width, d})
          .permute({0, 2, 1, 3});  // [B, T, H, D]
  attn = attn * gates->unsqueeze(-1);
  return Linear(attn.reshape({rows, width, heads * d}), layer.o_proj,
                layer.o_bias);
}

}  // namespace moh
