#include "model/core/best_logits.h"

#include <limits>

namespace moh {

std::pair<at::Tensor, at::Tensor> BestLogits(const at::Tensor& logits,
                                             int64_t limit, int64_t k) {
  at::Tensor x = logits.narrow(-1, 0, limit).to(at::kFloat);
  // NaN as -inf; adding +0 turns -0 into +0, which the Sampler finds equal.
  x = x.masked_fill(x.isnan(), -std::numeric_limits<float>::infinity()) + 0.0;
  // An int32 that orders as the float does: a negative float's magnitude
  // bits are flipped, so that a larger magnitude is a smaller integer.
  const at::Tensor bits = x.view(at::kInt);
  const at::Tensor order =
      at::where(bits < 0, at::bitwise_xor(bits, 0x7FFFFFFF), bits);
  // The key: that integer above, the id's complement below (2^32 - 1 - id:
  // a lower id wins a tie). Unique per row, so top-k is exact.
  constexpr int64_t kIdSpan = int64_t{1} << 32;
  const at::Tensor ids_all =
      at::arange(limit, logits.options().dtype(at::kLong));
  const at::Tensor key =
      order.to(at::kLong) * kIdSpan + ((kIdSpan - 1) - ids_all);
  const at::Tensor top = std::get<0>(key.topk(k, -1, /*largest=*/true,
                                              /*sorted=*/true));
  const at::Tensor ids = (kIdSpan - 1) - at::remainder(top, kIdSpan);
  return {x.gather(-1, ids), ids};
}

}  // namespace moh
