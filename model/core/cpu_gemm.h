// Single-precision matrix products on the CPU through the BLAS LibTorch links
// (OpenBLAS), called directly: the pair kernels' many small products would pay
// an ATen op's dispatch and allocation each.
#pragma once

#include <cstdint>

namespace moh {

// C [m, n] = alpha op(A) B + beta C, column-major; op(A) is [m, k] (A [k, m]
// when transposed), B [k, n]. Up to a few columns of B it runs as
// matrix-vector products (no packing of A).
void Gemm(bool transpose_a, int64_t m, int64_t n, int64_t k, float alpha,
          const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
          float *c, int64_t ldc);

// Largest row count SkinnyLinear takes. Measured on the bench model
// (bench/make_bench_lm.py, moh-generate, 2 threads, decode tokens/s against
// OpenBLAS's sgemm): 1.9x at 4 rows, 1.8x at 8, 2.0x at 12, but 0.92-0.96x
// at 16, where OpenBLAS starts to thread its sgemm and its packing is paid
// back. `moh_attention_bench --benchmark_filter=BM_Linear` times one
// projection both ways.
inline constexpr int64_t kMaxSkinnyRows = 12;

// y [m, n] = x [m, k] W^T (+ bias [n]) for row-major contiguous x and y and
// row-major W [n, k] with row stride ldw >= k (a slice of a wider weight's
// columns), with 1 <= m <= kMaxSkinnyRows: a decode step's few rows. It streams
// W once (each pair of its rows stays in L1 while every row of x passes),
// where OpenBLAS 0.3.21's sgemm first copies ("packs") the whole of W every
// call, which for a few rows costs as much as the product. AVX2 + FMA, chosen
// at run time; returns false (and does nothing) on a CPU without them. Threads
// split W's rows on the intra-op pool when the product is large enough.
bool SkinnyLinear(const float *x, int64_t m, int64_t k, const float *w,
                  int64_t ldw, int64_t n, const float *bias, float *y);

}  // namespace moh
