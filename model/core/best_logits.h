// The best logits of each row, taken where the logits lie: what a
// generation step downloads instead of whole [V] rows (LlamaModel::Forward
// with DecoderBatch::top_logits) for the rows whose draw they decide
// (SequenceOutput::TopLogitsNeeded).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>

namespace moh {

// The `k` best of each row of `logits` ([B, V], any device and floating
// dtype) among its first `limit` entries, in the Sampler's order of
// preference: higher value first, then lower id; NaN counts as -inf and
// -0 as +0. Returns {values float32 [B, k], ids int64 [B, k]} on the
// logits' device. Exact: the order is total (each value and id make one
// int64 key), so ties never leave the choice to the top-k kernel.
std::pair<at::Tensor, at::Tensor> BestLogits(const at::Tensor& logits,
                                             int64_t limit, int64_t k);

}  // namespace moh
