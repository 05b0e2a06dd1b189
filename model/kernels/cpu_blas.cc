#include "model/kernels/cpu_blas.h"

// The Fortran BLAS single-precision product every BLAS exports (LibTorch's
// own wrapper is not exported). Column-major: C = alpha op(A) op(B) + beta C.
extern "C" void sgemm_(const char *transa, const char *transb, const int *m,
                       const int *n, const int *k, const float *alpha,
                       const float *a, const int *lda, const float *b,
                       const int *ldb, const float *beta, float *c,
                       const int *ldc);
// And its matrix-vector product: y = alpha op(A) x + beta y.
extern "C" void sgemv_(const char *trans, const int *m, const int *n,
                       const float *alpha, const float *a, const int *lda,
                       const float *x, const int *incx, const float *beta,
                       float *y, const int *incy);

namespace moh {
namespace {

// Up to this many columns of B, C = op(A) B is computed as one
// matrix-vector product per column: a decode step's few queries per KV head
// would otherwise pay sgemm's packing of A (the keys or values) every call,
// several times the product itself (callgrind: 2.2 M of 19 M instructions
// of a 24 M-parameter model's decode step).
constexpr int64_t kMaxGemvColumns = 4;

}  // namespace

void Gemm(bool transpose_a, int64_t m, int64_t n, int64_t k, float alpha,
          const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
          float *c, int64_t ldc) {
  const char ta = transpose_a ? 'T' : 'N', tb = 'N';
  const int im = static_cast<int>(m), in = static_cast<int>(n),
            ik = static_cast<int>(k), ilda = static_cast<int>(lda),
            ildb = static_cast<int>(ldb), ildc = static_cast<int>(ldc);
  if (n <= kMaxGemvColumns) {
    // A as stored: [k, m] when transposed, else [m, k].
    const int rows = transpose_a ? ik : im, cols = transpose_a ? im : ik;
    const int one = 1;
    for (int64_t j = 0; j < n; ++j) {
      sgemv_(&ta, &rows, &cols, &alpha, a, &ilda, b + j * ldb, &one, &beta,
             c + j * ldc, &one);
    }
    return;
  }
  sgemm_(&ta, &tb, &im, &in, &ik, &alpha, a, &ilda, b, &ildb, &beta, c, &ildc);
}

}  // namespace moh
