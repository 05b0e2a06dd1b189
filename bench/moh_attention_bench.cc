// MoH attention at activation ratios 0.5 ... 1.0, computing every head
// (sparse:0, the official code's way) or only the selected (token, head) pairs
// (sparse:1), side by side in one run.
//   BM_Attention*: one attention-heavy layer (hidden 1024, 16 heads, 4 KV
//                  heads, 4 shared; tiny MLP and vocabulary).
//   BM_Model*:     a small whole MoH-LLaMA (4 layers, hidden 512, 8 heads,
//                  2 shared, SwiGLU 1376, vocabulary 4096).
// Prefill: one prompt (2048 tokens for the layer, 512 for the model). Decode:
// 16 sequences with 512 cached tokens each, one new token per sequence.
//   BM_Linear:     one float32 projection at decode row counts, LibTorch's
//                  at::linear (OpenBLAS) against moh::Linear.
//   BM_LowpLinearColdWeights: a 1 B layout's projections (W [2048, 2048] and
//                  [8192, 2048]) read from memory at decode and prefill row
//                  counts, float32 (moh::Linear) beside bf16 (Bf16Linear)
//                  and int8 (Int8Linear) weights.
//   BM_Bf16PrefillProduct: a 1 B layout's prefill product (x [512, 2048],
//                  W [2048, 2048] and [8192, 2048] in bf16): float32
//                  BlockedLinear, the float32-widening panel path,
//                  Bf16DotLinear (vdpbf16ps) and Bf16AmxLinear (AMX tiles)
//                  side by side, in GFLOP/s.
//   BM_QuantizeInt8Rows: a model load's per-row int8 quantization.
//   BM_Int8Prefill: a prefill's product with int8 weights: float32
//                  BlockedLinear, the widening panel path and Int8DotLinear
//                  (VNNI) side by side, at 1 and 2 threads.
// MOH_BENCH_THREADS=N pins the threads; MOH_CPU_ISA=avx2 (or portable) times
// the kernels' AVX2 paths (or LibTorch's) on an AVX-512 machine. The context
// prints the instruction set that ran (bench_main.cc).
//
//   build/bench/moh_attention_bench --benchmark_counters_tabular=true
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "model/core/linear.h"
#include "model/core/llama_model.h"
#include "model/core/runtime.h"
#include "model/kernels/cpu_bf16_dot.h"
#include "model/kernels/cpu_int8_dot.h"
#include "model/kernels/cpu_isa.h"
#include "model/kernels/cpu_linear.h"
#include "model/kernels/cpu_lowp_linear.h"

namespace moh {
namespace {

constexpr int64_t kLayerPrompt = 2048, kPrompt = 512, kDecodeRows = 16;

struct Shape {
  int64_t layers, hidden, heads, kv_heads, shared, intermediate, vocab;
};
// Attention-heavy: one layer, a tiny MLP and vocabulary.
constexpr Shape kLayerShape = {1, 1024, 16, 4, 4, 16, 16};
// A small whole model (MLP and vocabulary included).
constexpr Shape kModelShape = {4, 512, 8, 8, 2, 1376, 4096};

std::unique_ptr<LlamaModel> MakeModel(const Shape& shape) {
  LlamaConfig c;
  c.vocab_size = shape.vocab;
  c.hidden_size = shape.hidden;
  c.intermediate_size = shape.intermediate;
  c.num_layers = shape.layers;
  c.num_heads = shape.heads;
  c.num_kv_heads = shape.kv_heads;
  c.head_dim = shape.hidden / shape.heads;
  c.max_position_embeddings = kLayerPrompt;
  c.moh.router = RouterKind::kLearned;
  const int64_t h = shape.heads, s = shape.shared, d = c.head_dim;
  c.moh.layers.assign(
      shape.layers,
      MohLayerConfig{static_cast<int32_t>(h), static_cast<int32_t>(s),
                     static_cast<int32_t>((h - s) / 2)});
  at::manual_seed(0);
  TensorStore store;
  auto add = [&](const std::string& name, std::vector<int64_t> dims) {
    (void)store.Insert(name, at::randn(dims) * 0.05, "random");
  };
  const int64_t hidden = shape.hidden, inter = shape.intermediate;
  add("model.embed_tokens.weight", {c.vocab_size, hidden});
  add("lm_head.weight", {c.vocab_size, hidden});
  add("model.norm.weight", {hidden});
  for (int64_t l = 0; l < shape.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {hidden});
    add(p + "post_attention_layernorm.weight", {hidden});
    add(p + "self_attn.q_proj.weight", {h * d, hidden});
    add(p + "self_attn.k_proj.weight", {shape.kv_heads * d, hidden});
    add(p + "self_attn.v_proj.weight", {shape.kv_heads * d, hidden});
    add(p + "self_attn.o_proj.weight", {hidden, h * d});
    add(p + "self_attn.wg.weight", {h - s, hidden});
    add(p + "self_attn.wg_0.weight", {2, hidden});
    add(p + "self_attn.wg_1.weight", {s, hidden});
    add(p + "mlp.gate_proj.weight", {inter, hidden});
    add(p + "mlp.up_proj.weight", {inter, hidden});
    add(p + "mlp.down_proj.weight", {hidden, inter});
  }
  auto model =
      LlamaModel::FromTensors(c, store, at::TensorOptions().dtype(at::kFloat));
  if (!model.ok()) {
    fprintf(stderr, "%s\n", std::string(model.status().message()).c_str());
    std::abort();
  }
  return std::move(*model);
}

// A model of `shape`, computing every head (sparse = 0) or only the selected
// (token, head) pairs (sparse = 1).
const LlamaModel& Model(const Shape& shape, const benchmark::State& state) {
  static LlamaModel* layer = MakeModel(kLayerShape).release();
  static LlamaModel* model = MakeModel(kModelShape).release();
  LlamaModel* m = &shape == &kLayerShape ? layer : model;
  m->set_attention_mode(state.range(1) == 0 ? AttentionMode::kDense
                                            : AttentionMode::kAuto);
  return *m;
}

float RatioArg(const benchmark::State& state) {
  return state.range(0) / 1000.0f;
}

// Times Forward of `batch`, which computes `tokens` tokens per call.
void RunForward(benchmark::State& state, const LlamaModel& model,
                const DecoderBatch& batch, KvCache& cache, int64_t tokens) {
  for (auto _ : state) {
    auto out = model.Forward(batch, cache);
    benchmark::DoNotOptimize(out);
  }
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(tokens),
                         benchmark::Counter::kIsIterationInvariantRate);
}

void Prefill(benchmark::State& state, const Shape& shape, int64_t prompt) {
  const LlamaModel& model = Model(shape, state);
  KvCache cache = model.CreateKvCache(1, prompt);
  DecoderBatch batch;
  batch.token_ids = at::randint(shape.vocab, {1, prompt}, at::kLong);
  batch.num_tokens = {static_cast<int32_t>(prompt)};
  batch.slots = {0};
  batch.start_positions = {0};
  batch.ratios = {RatioArg(state)};
  RunForward(state, model, batch, cache, prompt);
}

void Decode(benchmark::State& state, const Shape& shape) {
  const LlamaModel& model = Model(shape, state);
  KvCache cache = model.CreateKvCache(kDecodeRows, kPrompt + 1);
  DecoderBatch batch;
  batch.token_ids = at::randint(shape.vocab, {kDecodeRows, 1}, at::kLong);
  for (int64_t b = 0; b < kDecodeRows; ++b) {
    batch.num_tokens.push_back(1);
    batch.slots.push_back(b);
    batch.start_positions.push_back(kPrompt);
    batch.ratios.push_back(RatioArg(state));
  }
  RunForward(state, model, batch, cache, kDecodeRows);
}

// Ratios in thousandths (0.5 ... 1.0) x {dense, head-sparse}.
#define MOH_RATIOS                \
  ->ArgNames({"ratio", "sparse"}) \
      ->ArgsProduct({{500, 625, 750, 875, 1000}, {0, 1}})
void BM_AttentionPrefill(benchmark::State& s) {
  Prefill(s, kLayerShape, kLayerPrompt);
}
void BM_AttentionDecode(benchmark::State& s) { Decode(s, kLayerShape); }
void BM_ModelPrefill(benchmark::State& s) { Prefill(s, kModelShape, kPrompt); }
void BM_ModelDecode(benchmark::State& s) { Decode(s, kModelShape); }
BENCHMARK(BM_AttentionPrefill) MOH_RATIOS->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AttentionDecode) MOH_RATIOS->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ModelPrefill) MOH_RATIOS->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ModelDecode) MOH_RATIOS->Unit(benchmark::kMillisecond);

// One projection of the model's MLP shape (x [rows, 512] W^T, W [1376,
// 512]) at a decode step's row counts: LibTorch's at::linear (OpenBLAS) or
// moh::Linear (sgemv for one row, SkinnyLinear up to kMaxSkinnyRows).
void BM_Linear(benchmark::State& state) {
  const int64_t rows = state.range(0);
  const at::Tensor x = at::randn({rows, 512});
  const at::Tensor w = at::randn({1376, 512});
  const bool ours = state.range(1) != 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(ours ? Linear(x, w) : at::linear(x, w));
  }
  state.counters["rows"] = static_cast<double>(rows);
}
BENCHMARK(BM_Linear)
    ->ArgNames({"rows", "moh"})
    ->ArgsProduct({{1, 2, 4, 8, 12, 16, 32, 64, 128, 512}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

// The same projection with its weight drawn in turn from 48 matrices (132
// MB, more than the last-level cache): each call reads W from memory, as a
// decode step of a model larger than the cache does.
void BM_LinearColdWeights(benchmark::State& state) {
  const int64_t rows = state.range(0);
  const at::Tensor x = at::randn({rows, 512});
  std::vector<at::Tensor> weights;
  for (int i = 0; i < 48; ++i) weights.push_back(at::randn({1376, 512}));
  const bool ours = state.range(1) != 0;
  size_t next = 0;
  for (auto _ : state) {
    const at::Tensor& w = weights[next];
    next = (next + 1) % weights.size();
    benchmark::DoNotOptimize(ours ? Linear(x, w) : at::linear(x, w));
  }
  state.counters["rows"] = static_cast<double>(rows);
}
BENCHMARK(BM_LinearColdWeights)
    ->ArgNames({"rows", "moh"})
    ->ArgsProduct({{1, 8, 16, 32, 64, 128}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

// y = x W^T with W [n, k] of one weight type (0 float32 through
// moh::Linear, 1 bf16 through Bf16Linear, 2 int8 through Int8Linear, 3 int8
// in float32 arithmetic: up to 8 rows the few-row kernel, which widens W in
// registers, beyond them W widened into the float32 kernels (PanelLinear),
// 4 int8 through Int8MaddRowsLinear, the AVX2 integer path), drawn in turn
// from enough matrices (128 MiB of each type, 4x the last-level cache) that
// every call reads W from memory, as a decode step does. Types 2, 3 and 4
// side by side: the integer dot products (Int8DotRowsLinear on VNNI CPUs,
// Int8MaddRowsLinear on AVX2) against float32 arithmetic.
void BM_LowpLinearColdWeights(benchmark::State& state) {
  const int64_t rows = state.range(0), n = state.range(1), k = 2048;
  const int64_t type = state.range(2);
  if (type == 4 && rows > kMaxStreamedRows) {
    state.SkipWithError("Int8MaddRowsLinear takes decode batches");
    return;
  }
  const bool int8 = type >= 2;
  const int64_t bytes = n * k * (type == 0 ? 4 : type == 1 ? 2 : 1);
  const int64_t count = std::max<int64_t>(2, (int64_t{128} << 20) / bytes);
  const at::Tensor x = at::randn({rows, k});
  std::vector<at::Tensor> weights, scales;
  for (int64_t c = 0; c < count; ++c) {
    const at::Tensor w = at::randn({n, k});
    if (int8) {
      weights.push_back(at::empty({n, k}, at::kChar));
      scales.push_back(at::empty({n}));
      QuantizeInt8Rows(w.data_ptr<float>(), k, n, k,
                       weights.back().data_ptr<int8_t>(),
                       scales.back().data_ptr<float>());
    } else {
      weights.push_back(type == 1 ? w.to(at::kBFloat16) : w);
    }
  }
  at::Tensor y = at::empty({rows, n});
  size_t next = 0;
  for (auto _ : state) {
    const at::Tensor& w = weights[next];
    if (type == 0) {
      benchmark::DoNotOptimize(Linear(x, w));
    } else if (type == 1) {
      Bf16Linear(x.data_ptr<float>(), rows, k,
                 reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
                 k, n, nullptr, y.data_ptr<float>());
    } else if (type == 2) {
      Int8Linear(x.data_ptr<float>(), rows, k, w.data_ptr<int8_t>(), k, n,
                 scales[next].data_ptr<float>(), nullptr, y.data_ptr<float>());
    } else if (type == 4) {
      Int8MaddRowsLinear(x.data_ptr<float>(), rows, k, w.data_ptr<int8_t>(), k,
                         n, scales[next].data_ptr<float>(), nullptr,
                         y.data_ptr<float>());
    } else if (rows <= kMaxBf16StreamRows) {
      const auto few_rows = ActiveIsa() == CpuIsa::kAvx512
                                ? kernels_internal::Int8RowsAvx512
                                : kernels_internal::Int8RowsAvx2;
      at::parallel_for(0, n, 64, [&](int64_t j0, int64_t j1) {
        few_rows(x.data_ptr<float>(), rows, k, w.data_ptr<int8_t>(), k, n, j0,
                 j1, scales[next].data_ptr<float>(), nullptr,
                 y.data_ptr<float>());
      });
    } else {
      const int8_t* q = w.data_ptr<int8_t>();
      const float* sd = scales[next].data_ptr<float>();
      kernels_internal::PanelLinear(
          x.data_ptr<float>(), rows, k, n, nullptr,
          [&](int64_t j, int64_t count, int64_t p0, int64_t depth, float* out) {
            WidenInt8Rows(q + j * k + p0, k, count, depth, sd + j, out);
          },
          y.data_ptr<float>());
    }
    benchmark::ClobberMemory();
    next = (next + 1) % weights.size();
  }
  state.counters["rows"] = static_cast<double>(rows);
  // W's bytes read per second.
  state.counters["GB/s"] =
      benchmark::Counter(static_cast<double>(bytes) * 1e-9,
                         benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_LowpLinearColdWeights)
    ->ArgNames({"rows", "n", "type"})
    ->ArgsProduct({{1, 8, 16, 32, 512}, {2048, 8192}, {0, 1, 2, 3, 4}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// y = x W^T for a prefill's 512 rows (k 2048) with W [n, 2048] hot in
// cache as far as it fits, by path: 0 float32 BlockedLinear over W widened
// beforehand (the float32 model's product), 1 bf16 W widened block by block
// into BlockedLinear (Bf16Linear's prefill without AVX512_BF16), 2
// Bf16DotLinear (x rounded to bf16; skipped without AVX512_BF16), 3
// Bf16AmxLinear (the same numerics in AMX tiles; skipped without AMX-BF16).
void BM_Bf16PrefillProduct(benchmark::State& state) {
  const int64_t rows = 512, k = 2048, n = state.range(0);
  const int64_t path = state.range(1);
  if (path == 2 && !ActiveExtension(CpuExtension::kAvx512Bf16)) {
    state.SkipWithError("no AVX512_BF16");
    return;
  }
  if (path == 3 && !ActiveExtension(CpuExtension::kAmxBf16)) {
    state.SkipWithError("no AMX-BF16");
    return;
  }
  const at::Tensor x = at::randn({rows, k});
  const at::Tensor w = at::randn({n, k}).to(at::kBFloat16);
  const at::Tensor wide = w.to(at::kFloat);
  const auto* bits =
      reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  at::Tensor y = at::empty({rows, n});
  for (auto _ : state) {
    if (path == 0) {
      BlockedLinear(x.data_ptr<float>(), rows, k, wide.data_ptr<float>(), k, n,
                    nullptr, y.data_ptr<float>());
    } else if (path == 1) {
      kernels_internal::PanelLinear(
          x.data_ptr<float>(), rows, k, n, nullptr,
          [&](int64_t j, int64_t count, int64_t p0, int64_t depth, float* out) {
            WidenBf16Rows(bits + j * k + p0, k, count, depth, out);
          },
          y.data_ptr<float>());
    } else if (path == 2) {
      Bf16DotLinear(x.data_ptr<float>(), rows, k, bits, k, n, nullptr,
                    y.data_ptr<float>());
    } else {
      Bf16AmxLinear(x.data_ptr<float>(), rows, k, bits, k, n, nullptr,
                    y.data_ptr<float>());
    }
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2e-9 * static_cast<double>(rows * k * n),
                         benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Bf16PrefillProduct)
    ->ArgNames({"n", "path"})
    ->ArgsProduct({{2048, 8192}, {0, 1, 2, 3}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// QuantizeInt8Rows over a [8192, 2048] float32 W (an 8 B model holds about
// 500 of them).
void BM_QuantizeInt8Rows(benchmark::State& state) {
  const int64_t n = 8192, k = 2048;
  const at::Tensor w = at::randn({n, k});
  at::Tensor q = at::empty({n, k}, at::kChar);
  at::Tensor scale = at::empty({n});
  for (auto _ : state) {
    QuantizeInt8Rows(w.data_ptr<float>(), k, n, k, q.data_ptr<int8_t>(),
                     scale.data_ptr<float>());
    benchmark::ClobberMemory();
  }
  state.counters["weights/s"] =
      benchmark::Counter(static_cast<double>(n * k),
                         benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_QuantizeInt8Rows)->UseRealTime()->Unit(benchmark::kMillisecond);

// A prefill's product with a 1 B layout's projections (x [512, 2048] times
// W [n, 2048]^T, n 2048 or 8192) three ways ("path"): 0 float32 W through
// BlockedLinear; 1 int8 W widened block by block into it (PanelLinear, what
// Int8Linear runs without VNNI); 2 Int8DotLinear, x quantized per 32
// values into integer dot products. LibTorch's threads set to "threads"
// (MOH_BENCH_THREADS aside). GFLOP/s on an AMD EPYC (avx512+bf16+vnni),
// paths 0 / 1 / 2: n 2048, 1 thread 86 / 82 / 352, 2 threads 192 / 173 /
// 653; n 8192, 1 thread 95 / 88 / 340, 2 threads 202 / 176 / 658.
void BM_Int8Prefill(benchmark::State& state) {
  const int64_t m = 512, k = 2048, path = state.range(0), n = state.range(1);
  const int previous_threads = at::get_num_threads();
  at::set_num_threads(static_cast<int>(state.range(2)));
  const at::Tensor x = at::randn({m, k});
  const at::Tensor w = at::randn({n, k});
  at::Tensor q = at::empty({n, k}, at::kChar);
  at::Tensor scale = at::empty({n});
  QuantizeInt8Rows(w.data_ptr<float>(), k, n, k, q.data_ptr<int8_t>(),
                   scale.data_ptr<float>());
  const int8_t* qd = q.data_ptr<int8_t>();
  const float* sd = scale.data_ptr<float>();
  at::Tensor y = at::empty({m, n});
  bool ran = true;
  for (auto _ : state) {
    if (path == 0) {
      ran = BlockedLinear(x.data_ptr<float>(), m, k, w.data_ptr<float>(), k, n,
                          nullptr, y.data_ptr<float>());
    } else if (path == 1) {
      ran = kernels_internal::PanelLinear(
          x.data_ptr<float>(), m, k, n, nullptr,
          [&](int64_t j, int64_t rows, int64_t p0, int64_t depth, float* out) {
            WidenInt8Rows(qd + j * k + p0, k, rows, depth, sd + j, out);
          },
          y.data_ptr<float>());
    } else if (path == 2) {
      ran = Int8DotLinear(x.data_ptr<float>(), m, k, qd, k, n, sd, nullptr,
                          y.data_ptr<float>());
    } else {
      ran = Int8MaddLinear(x.data_ptr<float>(), m, k, qd, k, n, sd, nullptr,
                           y.data_ptr<float>());
    }
    benchmark::ClobberMemory();
  }
  at::set_num_threads(previous_threads);
  if (!ran) state.SkipWithError("refused under this instruction set");
  state.counters["GFLOP/s"] =
      benchmark::Counter(2e-9 * static_cast<double>(m * n * k),
                         benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Int8Prefill)
    ->ArgNames({"path", "n", "threads"})
    ->ArgsProduct({{0, 1, 2, 3}, {2048, 8192}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace moh
