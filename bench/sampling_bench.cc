// The host's share of a draw at Llama 3's vocabulary (V = 128,256), per row
// and step, side by side in one run:
//   path 0, whole row: what a step that downloads the row's [V] float32
//     logits leaves to the host (SequenceOutput::Next: the Sampler over the
//     row, and log-probabilities over it when asked);
//   path 1, reduced: what is left once the step reduced the row where its
//     logits lie (SequenceOutput::NextFromReduced over ReduceLogits' best
//     logits and stats, best_logits.h; computed once here, since on a GPU
//     they run on the device);
//   path 2, reduced on the CPU: ReduceLogits in LibTorch's CPU ops (one
//     pass, as the model runs it), then path 1's host work: why a CPU server
//     keeps path 0 (MOH_REDUCE_LOGITS=1 takes this path).
// Modes: 0 temperature alone (drawn on the device), 1 top-p 0.9, 2 top-k 50
// with top-p 0.9, 3 greedy with 5 log-probabilities. The row is peaked as a
// language model's is: 20 ids hold most of the mass over Gaussian noise.
// Counters: `downloaded_bytes` per row (what the step copies to the host).
//   build/bench/moh_sampling_bench --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include <limits>
#include <optional>

#include "model/core/best_logits.h"
#include "model/generation/generator.h"

namespace moh {
namespace {

constexpr int64_t kVocab = 128256;

SamplingParams ModeParams(int64_t mode) {
  SamplingParams p;
  p.max_new_tokens = std::numeric_limits<int32_t>::max();
  p.seed = 11;
  p.temperature = mode == 3 ? 0.0f : 1.0f;
  if (mode == 1 || mode == 2) p.top_p = 0.9f;
  if (mode == 2) p.top_k = 50;
  if (mode == 3) p.logprobs = 5;
  return p;
}

at::Tensor PeakedRow() {
  at::manual_seed(4);
  at::Tensor row = at::randn({kVocab}) * 2.0;
  row.narrow(0, 1000, 20).add_(at::linspace(14.0, 10.0, 20));
  return row;
}

void BM_HostDraw(benchmark::State& state) {
  const int64_t mode = state.range(0);
  const int64_t path = state.range(1);
  const at::Tensor row = PeakedRow();
  SequenceOutput output(ModeParams(mode), {1}, nullptr, {});
  // What the step reduces to, as the executor plans it and the model
  // reduces it (one ReduceLogits pass).
  auto reduce = [&](const SequenceOutput::Reduction& plan) {
    const ReducedLogits reduced = ReduceLogits(
        row.unsqueeze(0), plan.limit, plan.best,
        plan.stats ? RowReductionParams({plan.row}) : at::Tensor());
    return std::make_tuple(
        reduced.values[0].contiguous(), reduced.ids[0].contiguous(),
        plan.stats ? reduced.stats[0].contiguous() : at::Tensor());
  };
  const std::optional<SequenceOutput::Reduction> first =
      output.PlanReduction(kVocab);
  if (!first) {
    state.SkipWithError("the mode is not reduced");
    return;
  }
  auto reduced = reduce(*first);
  int64_t whole_rows = 0;
  for (auto _ : state) {
    if (path == 0) {
      benchmark::DoNotOptimize(output.Next(row));
      continue;
    }
    const std::optional<SequenceOutput::Reduction> plan =
        output.PlanReduction(kVocab);
    if (path == 2) reduced = reduce(*plan);
    const auto& [values, ids, stats] = reduced;
    auto chunk = output.NextFromReduced(
        *plan, absl::MakeConstSpan(values.data_ptr<float>(), values.numel()),
        absl::MakeConstSpan(ids.data_ptr<int64_t>(), ids.numel()),
        stats.defined()
            ? absl::MakeConstSpan(stats.data_ptr<double>(), stats.numel())
            : absl::Span<const double>());
    if (chunk.ok() && !chunk->has_value()) {
      ++whole_rows;  // not decided: the row whole
      benchmark::DoNotOptimize(output.Next(row));
    }
    benchmark::DoNotOptimize(chunk);
  }
  const double bytes =
      path == 0 ? kVocab * 4.0
                : first->best * 12.0 + (first->stats ? kRowStats * 8.0 : 0.0);
  state.counters["downloaded_bytes"] = bytes;
  state.counters["whole_rows"] = benchmark::Counter(
      static_cast<double>(whole_rows), benchmark::Counter::kAvgIterations);
}
BENCHMARK(BM_HostDraw)
    ->ArgNames({"mode", "path"})
    ->ArgsProduct({{0, 1, 2, 3}, {0, 1, 2}})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace moh
