// The pair kernel's row softmax in AVX-512 or AVX2 (ActiveIsa(), cpu_isa.h):
// the scalar loop around libm's
// expf was a third of a head-sparse 2048-token prefill (perf of
// moh_attention_bench).
#pragma once

#include <cstdint>

namespace moh {

// probs[i][j] = softmax(scores[i][0, visible[i]))[j] for j < visible[i], 0
// beyond, for `rows` rows of `cols` (both row-major, stride cols). exp is a
// degree-6 polynomial on [-ln2/2, ln2/2] scaled by a power of two (within 2
// units in the last place of float). Returns false (doing nothing) under
// CpuIsa::kPortable.
bool SoftmaxRows(const float *scores, float *probs, int64_t rows, int64_t cols,
                 const int64_t *visible);

}  // namespace moh
