#include "model/core/best_logits.h"

#include <limits>
#include <tuple>

namespace moh {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Logits [0, limit) in float32, NaN as -inf; adding +0 turns -0 into +0,
// which the Sampler finds equal.
at::Tensor Cleaned(const at::Tensor& logits, int64_t limit) {
  at::Tensor x = logits.narrow(-1, 0, limit).to(at::kFloat);
  return x.masked_fill(x.isnan(), -kInf) + 0.0;
}

// One int64 per entry of `x` (Cleaned) that orders as the Sampler prefers:
// an int32 that orders as the float does above (a negative float's
// magnitude bits are flipped, so that a larger magnitude is a smaller
// integer), the id's complement below (2^32 - 1 - id: a lower id wins a
// tie). Unique per row, so top-k and counts over it are exact.
constexpr int64_t kIdSpan = int64_t{1} << 32;
at::Tensor OrderKeys(const at::Tensor& x) {
  const at::Tensor bits = x.view(at::kInt);
  const at::Tensor order =
      at::where(bits < 0, at::bitwise_xor(bits, 0x7FFFFFFF), bits);
  const at::Tensor ids = at::arange(x.size(-1), x.options().dtype(at::kLong));
  return order.to(at::kLong) * kIdSpan + ((kIdSpan - 1) - ids);
}

// The best k of x (Cleaned) by keys (OrderKeys(x)).
std::pair<at::Tensor, at::Tensor> Best(const at::Tensor& x,
                                       const at::Tensor& keys, int64_t k) {
  const at::Tensor top =
      std::get<0>(keys.topk(k, -1, /*largest=*/true, /*sorted=*/true));
  const at::Tensor ids = (kIdSpan - 1) - at::remainder(top, kIdSpan);
  return {x.gather(-1, ids), ids};
}

// RowStats of x (Cleaned, its first `limit` entries) and its keys.
at::Tensor Stats(const at::Tensor& x, const at::Tensor& keys, int64_t limit,
                 const at::Tensor& params) {
  const at::Tensor max = std::get<0>(x.max(-1, /*keepdim=*/true));
  const at::Tensor finite = max.isfinite();
  // Where the max is not finite the Sampler draws nothing (its best id);
  // 0 keeps the sums below free of inf - inf.
  const at::Tensor base = at::where(finite, max, at::zeros_like(max));
  // log sum exp in float64, as ComputeLogprobs sums it.
  const at::Tensor base64 = base.to(at::kDouble);
  const at::Tensor log_z = at::where(
      finite, base64 + (x.to(at::kDouble) - base64).exp().sum(-1, true).log(),
      max.to(at::kDouble));
  // The weights as the Sampler makes them: float32 (x - max) / T, its exp,
  // 0 below the min-p cut max + offset (float32 sums: the same rounding).
  const at::Tensor temperature = params.narrow(1, 0, 1).to(at::kFloat);
  const at::Tensor offset = params.narrow(1, 1, 1).to(at::kFloat);
  const at::Tensor uniform = params.narrow(1, 2, 1).clamp_min(0.0);
  const at::Tensor weights = ((x - base) / temperature)
                                 .exp()
                                 .masked_fill(x < base + offset, 0.0f)
                                 .to(at::kDouble);
  const at::Tensor sum = weights.sum(-1, true);
  // The draw: the first id whose cumulative weight exceeds the target.
  const at::Tensor cumulative = weights.cumsum(-1);
  const at::Tensor target = uniform * sum;
  const at::Tensor id =
      at::searchsorted(cumulative, target, /*out_int32=*/false, /*right=*/true)
          .clamp_max(limit - 1);
  const at::Tensor up_to = cumulative.gather(-1, id);
  const at::Tensor below =
      at::where(id > 0, cumulative.gather(-1, (id - 1).clamp_min(0)),
                at::zeros_like(up_to));
  const at::Tensor rank =
      (keys > keys.gather(-1, id)).sum(-1, true).to(at::kDouble) + 1.0;
  return at::cat({log_z, sum, id.to(at::kDouble), target, below, up_to,
                  x.gather(-1, id).to(at::kDouble), rank},
                 1);
}

}  // namespace

ReducedLogits ReduceLogits(const at::Tensor& logits, int64_t limit, int64_t k,
                           const at::Tensor& params) {
  const at::Tensor x = Cleaned(logits, limit);
  const at::Tensor keys = OrderKeys(x);
  ReducedLogits out;
  std::tie(out.values, out.ids) = Best(x, keys, k);
  if (params.defined()) out.stats = Stats(x, keys, limit, params);
  return out;
}

std::pair<at::Tensor, at::Tensor> BestLogits(const at::Tensor& logits,
                                             int64_t limit, int64_t k) {
  ReducedLogits reduced = ReduceLogits(logits, limit, k, at::Tensor());
  return {reduced.values, reduced.ids};
}

at::Tensor RowStats(const at::Tensor& logits, int64_t limit,
                    const at::Tensor& params) {
  const at::Tensor x = Cleaned(logits, limit);
  return Stats(x, OrderKeys(x), limit, params);
}

at::Tensor RowReductionParams(const std::vector<RowReduction>& reductions) {
  at::Tensor params =
      at::empty({static_cast<int64_t>(reductions.size()), 3}, at::kDouble);
  double* data = params.data_ptr<double>();
  for (const RowReduction& r : reductions) {
    *data++ = r.temperature;
    *data++ = r.min_p_offset;
    *data++ = r.uniform;
  }
  return params;
}

}  // namespace moh
