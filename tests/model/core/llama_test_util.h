// Scenarios shared by the LLaMA model tests.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "model/checkpoint/checkpoint.h"
#include "model/core/llama_model.h"

namespace moh {

// A 150-token prompt prefilled in chunks of 50 (row 0, ratio ratios[0]) beside
// a row that decodes one token a step after a 3-token prompt (row 1,
// ratios[1]), in a fresh cache: the valid logits of each of the 3 steps,
// row 0's then row 1's. Seeded: the same tokens on every call.
inline absl::StatusOr<std::vector<at::Tensor>> ChunkedPromptBesideDecode(
    const LlamaModel& model, const std::vector<float>& ratios) {
  at::manual_seed(11);
  const at::Tensor prompt = at::randint(300, {2, 150}, at::kLong);
  KvCache cache = model.CreateKvCache(2, 160);
  std::vector<int32_t> start = {0, 0};
  std::vector<at::Tensor> logits;
  for (int chunk = 0; chunk < 3; ++chunk) {
    DecoderBatch batch;
    batch.all_logits = true;
    const int32_t row1 = chunk == 0 ? 3 : 1;
    batch.token_ids = prompt.narrow(1, chunk * 50, 50).clone();
    batch.num_tokens = {50, row1};
    batch.slots = {1, 0};
    batch.start_positions = start;
    batch.ratios = ratios;
    auto out = model.Forward(batch, cache);
    if (!out.ok()) return out.status();
    logits.push_back(
        at::cat({out->logits[0], out->logits[1].narrow(0, 0, row1)}));
    start[0] += 50;
    start[1] += row1;
  }
  return logits;
}

// A model whose shared heads fill whole KV groups in every layer (`shared`
// heads per layer, learned router, routed K half the rest; the ratio
// ceiling's narrow rows apply), small: 64 tokens, width 128.
inline LlamaConfig NarrowConfig(int32_t heads, int32_t kv_heads,
                                std::vector<int32_t> shared) {
  LlamaConfig config;
  config.vocab_size = 64;
  config.hidden_size = 128;
  config.intermediate_size = 96;
  config.num_layers = static_cast<int32_t>(shared.size());
  config.num_heads = heads;
  config.num_kv_heads = kv_heads;
  config.head_dim = config.hidden_size / heads;
  config.max_position_embeddings = 256;
  config.tie_word_embeddings = true;
  config.attention_bias = true;  // the narrowed projections keep their bias
  config.moh.router = RouterKind::kLearned;
  for (int32_t s : shared) {
    MohLayerConfig layer;
    layer.num_heads = heads;
    layer.shared_heads = s;
    layer.top_k = (heads - s) / 2;
    config.moh.layers.push_back(layer);
  }
  return config;
}

// The checkpoint in `dir` loaded once for each of `each` (device and
// dtype): a model per entry, in order, for tests that switch a path off in
// one and compare; empty, the test failed, when a load fails.
inline std::vector<std::unique_ptr<LlamaModel>> LoadEach(
    const std::string& dir, const std::vector<DeviceOptions>& each) {
  std::vector<std::unique_ptr<LlamaModel>> models;
  for (const DeviceOptions& options : each) {
    absl::StatusOr<std::unique_ptr<LlamaModel>> model =
        LlamaModel::Load(dir, options);
    if (!model.ok()) {
      ADD_FAILURE() << dir << " on " << options.device << ": "
                    << model.status();
      return {};
    }
    models.push_back(*std::move(model));
  }
  return models;
}

// Three rows' prompts of 9, 4 and 6 random token ids (below 300), each in
// 4 blocks of its own ({0-3}, {4-7}, {8-11}: 32 positions of 8), at ratios
// 1.0, 0.5 and 0.75.
inline DecoderBatch ThreeMixedPrompts() {
  DecoderBatch batch;
  batch.token_ids = at::randint(300, {3, 9}, at::kLong);
  batch.num_tokens = {9, 4, 6};
  batch.start_positions = {0, 0, 0};
  batch.block_tables = {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}};
  batch.ratios = {1.0f, 0.5f, 0.75f};
  return batch;
}

// `batch` moved on to its next decode step: every row past the tokens it
// had, one new random token id (below 300) each.
inline void NextTokenEach(DecoderBatch& batch) {
  const int64_t rows = batch.token_ids.size(0);
  for (int64_t r = 0; r < rows; ++r) {
    batch.start_positions[r] += batch.num_tokens[r];
  }
  batch.token_ids = at::randint(300, {rows, 1}, at::kLong);
  batch.num_tokens.assign(rows, 1);
}

// Random weights (seeded) for `config`, in `options` (float32 on the CPU by
// default); `poison_routed_kv`: the k/v projection rows of KV heads >=
// narrow width are NaN, so a row that computed them would fail.
inline std::unique_ptr<LlamaModel> NarrowRandomModel(
    const LlamaConfig& config, bool poison_routed_kv = false,
    const at::TensorOptions& options = at::kFloat) {
  at::manual_seed(5);
  TensorStore store("random");
  const int64_t c = config.hidden_size, d = config.head_dim;
  const int64_t q = config.num_heads * d, kv = config.num_kv_heads * d;
  auto add = [&](const std::string& name, std::vector<int64_t> shape,
                 double scale, double offset = 0.0) {
    EXPECT_TRUE(
        store.Insert(name, at::randn(shape) * scale + offset, "random").ok());
  };
  add("model.embed_tokens.weight", {config.vocab_size, c}, 1.0);
  add("model.norm.weight", {c}, 0.1, 1.0);
  const int64_t width = NarrowKvHeads(config);
  for (int32_t l = 0; l < config.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const MohLayerConfig& moh = config.moh.layers[l];
    add(p + "input_layernorm.weight", {c}, 0.1, 1.0);
    add(p + "post_attention_layernorm.weight", {c}, 0.1, 1.0);
    add(p + "self_attn.q_proj.weight", {q, c}, 0.15);
    add(p + "self_attn.o_proj.weight", {c, q}, 0.1);
    add(p + "self_attn.q_proj.bias", {q}, 0.1);
    add(p + "self_attn.o_proj.bias", {c}, 0.1);
    for (const char* name : {"k_proj", "v_proj"}) {
      at::Tensor w = at::randn({kv, c}) * 0.15;
      at::Tensor b = at::randn({kv}) * 0.1;
      if (poison_routed_kv) {
        w.narrow(0, width * d, kv - width * d).fill_(NAN);
        b.narrow(0, width * d, kv - width * d).fill_(NAN);
      }
      EXPECT_TRUE(
          store.Insert(p + "self_attn." + name + ".weight", w, "r").ok());
      EXPECT_TRUE(store.Insert(p + "self_attn." + name + ".bias", b, "r").ok());
    }
    add(p + "mlp.gate_proj.weight", {config.intermediate_size, c}, 0.1);
    add(p + "mlp.up_proj.weight", {config.intermediate_size, c}, 0.1);
    add(p + "mlp.down_proj.weight", {c, config.intermediate_size}, 0.1);
    add(p + "self_attn.wg.weight", {moh.routed_heads(), c}, 0.3);
    add(p + "self_attn.wg_0.weight", {2, c}, 0.3);
    add(p + "self_attn.wg_1.weight", {moh.shared_heads, c}, 0.3);
  }
  auto model = LlamaModel::FromTensors(config, store, options);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? std::move(*model) : nullptr;
}

}  // namespace moh
