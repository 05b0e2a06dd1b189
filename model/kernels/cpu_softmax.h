// The pair kernel's row softmax and the MLP's SwiGLU in AVX-512 or AVX2
// (ActiveIsa(), cpu_isa.h):
// the scalar loop around libm's
// expf was a third of a head-sparse 2048-token prefill (perf of
// moh_attention_bench).
#pragma once

#include <cstdint>

namespace moh {

// The softmax of scores[i][0, visible[i]) for `rows` rows of `cols` (both
// row-major, stride cols; probs may be scores, in place), unnormalized:
// probs[i][j] = e^(scores[i][j] - max_i) for j < visible[i], 0 beyond, and
// inverse_sums[i] = 1 / the row's sum, so that a caller multiplying the
// probabilities by a matrix scales its few result columns instead of every
// probability. exp is a degree-6 polynomial on [-ln2/2, ln2/2] scaled by a
// power of two (within 2 units in the last place of float). Returns false
// (doing nothing) under CpuIsa::kPortable.
bool SoftmaxRows(const float *scores, float *probs, int64_t rows, int64_t cols,
                 const int64_t *visible, float *inverse_sums);

// The SwiGLU product of `rows` rows of x [rows, 2n] (row stride ldx): gate
// values g = x[i][0, n), up values u = x[i][n, 2n), out[i][j] = silu(g) * u
// (out contiguous [rows, n]), silu(g) = g / (1 + e^-g) with SoftmaxRows'
// exp. Rows split on the intra-op pool when there are many. Returns false
// (doing nothing) under CpuIsa::kPortable.
bool SiluMulRows(const float *x, int64_t ldx, int64_t rows, int64_t n,
                 float *out);

}  // namespace moh
