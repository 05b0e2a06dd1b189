// One MoH attention layer (a single-layer MoH-LLaMA with a tiny MLP and
// vocabulary, so attention dominates) at activation ratios 0.5 ... 1.0.
//
// Prefill: one 512-token prompt. Decode: 16 sequences with 512 cached tokens
// each, one new token per sequence. The head-sparse kernels that make lower
// ratios cheaper are a later issue; this measures today's cost per ratio.
//
//   build/bench/moh_attention_bench --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "model/llama_model.h"
#include "model/runtime.h"

namespace moh {
namespace {

constexpr int64_t kHidden = 1024, kHeads = 16, kKvHeads = 4, kShared = 4;
constexpr int64_t kPrompt = 512, kDecodeRows = 16;

std::unique_ptr<LlamaModel> MakeLayer() {
  LlamaConfig c;
  c.vocab_size = 16;
  c.hidden_size = kHidden;
  c.intermediate_size = 16;
  c.num_layers = 1;
  c.num_heads = kHeads;
  c.num_kv_heads = kKvHeads;
  c.head_dim = kHidden / kHeads;
  c.max_position_embeddings = 1024;
  c.moh.router = RouterKind::kLearned;
  c.moh.layers = {MohLayerConfig{kHeads, kShared, (kHeads - kShared) / 2}};
  const int64_t d = c.head_dim;
  at::manual_seed(0);
  TensorStore store;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    (void)store.Insert(name, at::randn(shape) * 0.05, "random");
  };
  add("model.embed_tokens.weight", {c.vocab_size, kHidden});
  add("lm_head.weight", {c.vocab_size, kHidden});
  add("model.norm.weight", {kHidden});
  const std::string p = "model.layers.0.";
  add(p + "input_layernorm.weight", {kHidden});
  add(p + "post_attention_layernorm.weight", {kHidden});
  add(p + "self_attn.q_proj.weight", {kHeads * d, kHidden});
  add(p + "self_attn.k_proj.weight", {kKvHeads * d, kHidden});
  add(p + "self_attn.v_proj.weight", {kKvHeads * d, kHidden});
  add(p + "self_attn.o_proj.weight", {kHidden, kHeads * d});
  add(p + "self_attn.wg.weight", {kHeads - kShared, kHidden});
  add(p + "self_attn.wg_0.weight", {2, kHidden});
  add(p + "self_attn.wg_1.weight", {kShared, kHidden});
  add(p + "mlp.gate_proj.weight", {c.intermediate_size, kHidden});
  add(p + "mlp.up_proj.weight", {c.intermediate_size, kHidden});
  add(p + "mlp.down_proj.weight", {kHidden, c.intermediate_size});
  auto model =
      LlamaModel::FromTensors(c, store, at::TensorOptions().dtype(at::kFloat));
  if (!model.ok()) {
    fprintf(stderr, "%s\n", std::string(model.status().message()).c_str());
    std::abort();
  }
  return std::move(*model);
}

// The layer, computing every head (sparse = 0) or only the selected (token,
// head) pairs (sparse = 1).
const LlamaModel& Layer(const benchmark::State& state) {
  static LlamaModel* model = MakeLayer().release();
  model->set_attention_mode(state.range(1) == 0 ? AttentionMode::kDense
                                                : AttentionMode::kAuto);
  return *model;
}

float RatioArg(const benchmark::State& state) {
  return state.range(0) / 1000.0f;
}

void BM_AttentionPrefill(benchmark::State& state) {
  const LlamaModel& model = Layer(state);
  KvCache cache = model.CreateKvCache(1, kPrompt);
  DecoderBatch batch;
  batch.token_ids = at::randint(16, {1, kPrompt}, at::kLong);
  batch.num_tokens = {static_cast<int32_t>(kPrompt)};
  batch.slots = {0};
  batch.start_positions = {0};
  batch.ratios = {RatioArg(state)};
  for (auto _ : state) {
    auto out = model.Forward(batch, cache);
    benchmark::DoNotOptimize(out);
  }
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(kPrompt),
                         benchmark::Counter::kIsIterationInvariantRate);
}

void BM_AttentionDecode(benchmark::State& state) {
  const LlamaModel& model = Layer(state);
  KvCache cache = model.CreateKvCache(kDecodeRows, kPrompt + 1);
  DecoderBatch batch;
  batch.token_ids = at::randint(16, {kDecodeRows, 1}, at::kLong);
  for (int64_t b = 0; b < kDecodeRows; ++b) {
    batch.num_tokens.push_back(1);
    batch.slots.push_back(b);
    batch.start_positions.push_back(kPrompt);
    batch.ratios.push_back(RatioArg(state));
  }
  for (auto _ : state) {
    auto out = model.Forward(batch, cache);
    benchmark::DoNotOptimize(out);
  }
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(kDecodeRows),
                         benchmark::Counter::kIsIterationInvariantRate);
}

// Ratios in thousandths (0.5 ... 1.0) x {dense, head-sparse}.
#define MOH_RATIOS                \
  ->ArgNames({"ratio", "sparse"}) \
      ->ArgsProduct({{500, 625, 750, 875, 1000}, {0, 1}})
BENCHMARK(BM_AttentionPrefill) MOH_RATIOS->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AttentionDecode) MOH_RATIOS->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace moh

int main(int argc, char** argv) {
  // MOH_BENCH_THREADS=N pins LibTorch's thread count (default: every core).
  const char* threads = std::getenv("MOH_BENCH_THREADS");
  moh::ConfigureCpuThreads(threads != nullptr ? std::atoi(threads) : 0);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
