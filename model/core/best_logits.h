// What a generation step reduces each row's logits to where they lie (the
// model's device), so that it downloads a few values per row instead of
// whole [V] rows (LlamaModel::Forward with DecoderBatch::top_logits): the
// row's best logits, and the sums a draw needs beyond them
// (SequenceOutput::PlanReduction says which, per row).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace moh {

// The `k` best of each row of `logits` ([B, V], any device and floating
// dtype) among its first `limit` entries, in the Sampler's order of
// preference: higher value first, then lower id; NaN counts as -inf and
// -0 as +0. Returns {values float32 [B, k], ids int64 [B, k]} on the
// logits' device. Exact: the order is total (each value and id make one
// int64 key), so ties never leave the choice to the top-k kernel.
std::pair<at::Tensor, at::Tensor> BestLogits(const at::Tensor& logits,
                                             int64_t limit, int64_t k);

// What a row's draw needs of its logits besides the best ones, as the
// Sampler computes it from the whole row (sampler.h): its weights are
// exp((x - max) / temperature) in float32, 0 below max + min_p_offset (the
// Sampler's min-p cut), summed in float64.
struct RowReduction {
  float temperature = 1.0f;  // > 0 and finite
  // temperature * log(min_p) as the Sampler computes it (Sampler::MinPOffset);
  // -inf: no cut.
  float min_p_offset = -std::numeric_limits<float>::infinity();
  // In [0, 1): draw a token by inverse CDF over the weights in id order, at
  // uniform * their sum (the Sampler's draw without top-k or top-p); < 0:
  // none.
  double uniform = -1.0;
};

// The columns of RowStats' result, one row per row of logits.
enum RowStat : int64_t {
  kLogPartition,  // log sum exp(x) in float64 (the log-probabilities'), or
                  // the max where it is not finite
  kWeightSum,     // the weights' sum
  kDrawId,        // the drawn id: the first whose cumulative weight exceeds
  kDrawTarget,    // uniform * the weights' sum
  kDrawBelow,     // the cumulative weight before the drawn id
  kDrawUpTo,      // the cumulative weight up to and with it
  kDrawLogit,     // its logit (float32, NaN as -inf)
  kDrawRank,      // 1 + the ids BestLogits puts before it
  kRowStats,
};

// RowStats' sums of each row of `logits` ([B, V], any device and floating
// dtype; its first `limit` entries, NaN as -inf) for `params` (float64
// [B, 3] on the logits' device: each row's RowReduction as temperature,
// min_p_offset, uniform; RowReductionParams makes it). Returns float64
// [B, kRowStats] on the logits' device. The sums are taken in another order
// than the Sampler's, so they lie within kRowSumTolerance of its (relative):
// the Sampler certifies a decision from them or asks for the whole row.
at::Tensor RowStats(const at::Tensor& logits, int64_t limit,
                    const at::Tensor& params);

// BestLogits and, where `params` is defined, RowStats of the same logits,
// cleaning them and building their order once (what a step that needs both
// asks for).
struct ReducedLogits {
  at::Tensor values, ids;  // BestLogits'
  at::Tensor stats;        // RowStats', or undefined
};
ReducedLogits ReduceLogits(const at::Tensor& logits, int64_t limit, int64_t k,
                           const at::Tensor& params);

// `reductions` as RowStats' params (CPU).
at::Tensor RowReductionParams(const std::vector<RowReduction>& reductions);

// Relative bound on how far a sum RowStats returns lies from the Sampler's
// own over the same logits: each float32 weight within a few units in the
// last place of the other's exp (CUDA's expf is within 2, glibc's and
// Sleef's within 1), float64 rounding far below.
inline constexpr double kRowSumTolerance = 1e-6;

}  // namespace moh
