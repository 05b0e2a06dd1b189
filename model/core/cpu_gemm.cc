#include "model/core/cpu_gemm.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

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

namespace {

// Rows of x and of W one tile of SkinnyLinear computes: kTileM x kTileN dot
// products in 8 accumulators, with W's kTileN rows and one x row in
// registers (11 of AVX2's 16), so the loads (2 + 4 per 8 columns) stay
// under the FMAs (8).
constexpr int64_t kTileM = 4;
constexpr int64_t kTileN = 2;
// W rows per parallel task, and the multiply-adds below which one thread
// does it all (waking the pool costs microseconds).
constexpr int64_t kRowsPerTask = 64;
constexpr int64_t kMinParallelMacs = 1 << 18;

__attribute__((target("avx2,fma"))) inline float HorizontalSum(__m256 v) {
  const __m128 half =
      _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

// y[i][j] for i < M rows of x, j < N rows of W (M <= kTileM, N <= kTileN).
template <int M, int N>
__attribute__((target("avx2,fma"))) void Tile(const float *x, int64_t k,
                                              const float *w, int64_t ldw,
                                              float *y, int64_t ldy) {
  __m256 acc[M][N];
#pragma GCC unroll 4
  for (int i = 0; i < M; ++i) {
#pragma GCC unroll 2
    for (int j = 0; j < N; ++j) acc[i][j] = _mm256_setzero_ps();
  }
  const int64_t body = k & ~int64_t{7};
  for (int64_t p = 0; p < body; p += 8) {
    __m256 wv[N];
#pragma GCC unroll 2
    for (int j = 0; j < N; ++j) wv[j] = _mm256_loadu_ps(w + j * ldw + p);
#pragma GCC unroll 4
    for (int i = 0; i < M; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * k + p);
#pragma GCC unroll 2
      for (int j = 0; j < N; ++j) {
        acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; ++j) {
      float sum = HorizontalSum(acc[i][j]);
      for (int64_t p = body; p < k; ++p) sum += x[i * k + p] * w[j * ldw + p];
      y[i * ldy + j] = sum;
    }
  }
}

using TileFn = void (*)(const float *, int64_t, const float *, int64_t, float *,
                        int64_t);

template <int N>
TileFn TileFor(int64_t rows) {
  switch (rows) {
    case 1:
      return &Tile<1, N>;
    case 2:
      return &Tile<2, N>;
    case 3:
      return &Tile<3, N>;
    default:
      return &Tile<4, N>;
  }
}

// W rows [first, last): every row of x against each pair of them.
void SkinnyRows(const float *x, int64_t m, int64_t k, const float *w,
                int64_t ldw, int64_t n, int64_t first, int64_t last, float *y) {
  for (int64_t j = first; j < last; j += kTileN) {
    const int64_t cols = std::min(kTileN, last - j);
    for (int64_t i = 0; i < m; i += kTileM) {
      const int64_t rows = std::min(kTileM, m - i);
      const TileFn tile =
          cols == kTileN ? TileFor<kTileN>(rows) : TileFor<1>(rows);
      tile(x + i * k, k, w + j * ldw, ldw, y + i * n + j, n);
    }
  }
}

bool HasAvx2Fma() {
  static const bool has =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

}  // namespace

bool SkinnyLinear(const float *x, int64_t m, int64_t k, const float *w,
                  int64_t ldw, int64_t n, const float *bias, float *y) {
  if (!HasAvx2Fma() || m < 1 || m > kMaxSkinnyRows) return false;
  const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  auto run = [&](int64_t begin, int64_t end) {
    SkinnyRows(x, m, k, w, ldw, n, begin * kRowsPerTask,
               std::min(n, end * kRowsPerTask), y);
  };
  if (m * k * n < kMinParallelMacs || at::get_num_threads() < 2) {
    run(0, tasks);
  } else {
    at::parallel_for(0, tasks, 1, run);
  }
  if (bias != nullptr) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) y[i * n + j] += bias[j];
    }
  }
  return true;
}

}  // namespace moh
