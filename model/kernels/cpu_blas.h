// The BLAS LibTorch links (OpenBLAS), called directly: the pair kernels'
// many small products would pay an ATen op's dispatch and allocation each.
#pragma once

#include <cstdint>

namespace moh {

// C [m, n] = alpha op(A) B + beta C, column-major; op(A) is [m, k] (A [k, m]
// when transposed), B [k, n]. Up to a few columns of B it runs as
// matrix-vector products (no packing of A).
void Gemm(bool transpose_a, int64_t m, int64_t n, int64_t k, float alpha,
          const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
          float *c, int64_t ldc);

}  // namespace moh
