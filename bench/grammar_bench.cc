// The per-token cost of structured outputs (response_format, model/generation/
// grammar.h: xgrammar's mask, the sampler's -inf on disallowed ids, the
// matcher's advance), with and without a JSON schema, side by side in one
// run, on the demo language model (models/demo-lm: 768 tokens, 4 layers).
//   BM_Next:     SequenceOutput::Next alone on fixed random logits: the
//                sampling step of one row, constrained:0 or 1, greedy or
//                sampled (temperature 0 or 1).
//   BM_Generate: Generator (one prefill, then 64 decode steps) over `rows`
//                sequences, each constrained (a schema no row completes in
//                64 tokens, so that both sides decode as many) or not:
//                tokens/s with the model's forward included.
// The instruction set the kernels use is printed in the context
// (bench_main.cc). Measured
// (MOH_BENCH_THREADS=1, 2.6 GHz AVX-512F, 3 repetitions): Next 1.31 -> 4.41
// us greedy, 8.97 -> 11.49 us sampled; Generate 4.88k -> 4.26k tokens/s at
// one row, 9.68k -> 9.26k at eight.
//
//   build/bench/moh_grammar_bench --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include <optional>
#include <string>

#include "model/core/runtime.h"
#include "model/generation/generator.h"
#include "model/generation/grammar.h"
#include "model/generation/language_model.h"

namespace moh {
namespace {

constexpr const char* kSchema = R"({"type": "object", "properties": {
  "name": {"type": "string", "maxLength": 10},
  "age": {"type": "integer", "minimum": 0, "maximum": 120},
  "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
           "maxItems": 3},
  "ok": {"type": "boolean"}},
  "required": ["name", "age", "ok"], "additionalProperties": false})";

// Longer than BM_Generate's 64 tokens whatever the model writes: every row
// decodes as many tokens with or without the grammar.
constexpr const char* kLongSchema =
    R"({"type": "array", "items": {"type": "boolean"}, "minItems": 64})";
constexpr int32_t kGenerateTokens = 64;

struct Demo {
  LanguageModel lm;
  std::unique_ptr<GrammarCompiler> compiler;
  std::shared_ptr<const CompiledGrammar> grammar, long_grammar;
};

const Demo& GetDemo() {
  static const Demo* demo = [] {
    auto lm = LanguageModel::Load(std::string(MOH_MODELS_DIR) + "/demo-lm",
                                  DeviceOptions{"cpu", "float32"});
    if (!lm.ok()) std::abort();
    auto* d = new Demo{std::move(*lm), nullptr, nullptr, nullptr};
    auto compiler =
        GrammarCompiler::Create(*d->lm.tokenizer, d->lm.eos_ids, {});
    if (!compiler.ok()) std::abort();
    d->compiler = std::move(*compiler);
    auto grammar =
        d->compiler->Compile({ResponseFormat::Type::kJsonSchema, kSchema});
    auto long_grammar =
        d->compiler->Compile({ResponseFormat::Type::kJsonSchema, kLongSchema});
    if (!grammar.ok() || !long_grammar.ok()) std::abort();
    d->grammar = *grammar;
    d->long_grammar = *long_grammar;
    return d;
  }();
  return *demo;
}

SamplingParams Sampling(float temperature, int32_t max_new_tokens) {
  SamplingParams s;
  s.temperature = temperature;
  s.seed = 1;
  s.max_new_tokens = max_new_tokens;
  return s;
}

void BM_Next(benchmark::State& state) {
  const Demo& demo = GetDemo();
  const bool constrained = state.range(0) != 0;
  const SamplingParams sampling = Sampling(state.range(1), 1 << 20);
  at::manual_seed(0);
  const at::Tensor logits = at::randn({demo.lm.tokenizer->vocab_size()}) * 3;
  std::optional<SequenceOutput> output;
  for (auto _ : state) {
    if (!output || output->finish_reason()) {
      output.emplace(sampling, std::vector<int32_t>{1}, demo.lm.tokenizer.get(),
                     demo.lm.eos_ids, constrained ? demo.grammar : nullptr);
    }
    benchmark::DoNotOptimize(output->Next(logits));
  }
  state.counters["tokens/s"] = benchmark::Counter(
      static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Next)
    ->ArgNames({"constrained", "temperature"})
    ->ArgsProduct({{0, 1}, {0, 1}});

void BM_Generate(benchmark::State& state) {
  const Demo& demo = GetDemo();
  const bool constrained = state.range(0) != 0;
  const Generator generator(*demo.lm.model, demo.lm.tokenizer.get(),
                            demo.lm.eos_ids);
  std::vector<GenerationRequest> requests(state.range(1));
  for (size_t i = 0; i < requests.size(); ++i) {
    requests[i].prompt_ids = demo.lm.tokenizer->Encode("A person:", true);
    requests[i].sampling = Sampling(1.0f, kGenerateTokens);
    requests[i].sampling.seed = i;
    requests[i].sampling.ignore_eos = true;
    if (constrained) requests[i].grammar = demo.long_grammar;
  }
  int64_t tokens = 0;
  for (auto _ : state) {
    auto results = generator.Generate(requests);
    if (!results.ok()) state.SkipWithError("generation failed");
    for (const GenerationResult& r : *results) tokens += r.token_ids.size();
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(tokens),
                                                  benchmark::Counter::kIsRate);
  state.counters["tokens/seq"] =
      static_cast<double>(tokens) / state.iterations() / requests.size();
}
BENCHMARK(BM_Generate)
    ->ArgNames({"constrained", "rows"})
    ->ArgsProduct({{0, 1}, {1, 8}})
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace moh
