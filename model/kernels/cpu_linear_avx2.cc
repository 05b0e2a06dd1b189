// RowLinear's and BlockedLinear's inner loops for AVX2 + FMA, chosen by
// cpu_linear.cc when ActiveIsa() is kAvx2.
#include <immintrin.h>

#include "model/kernels/cpu_kernels_avx2.h"
#include "model/kernels/cpu_streamed_rows.h"

namespace moh::kernels_internal {
namespace {

// y[j] = W[j] . x for R rows of W: two accumulators per row over 16 floats
// a step (a row's FMAs would otherwise wait on each other's 4-cycle
// latency), k's remainder through masked loads.
template <int R>
__attribute__((target("avx2,fma"))) void DotRows(const float *x, int64_t k,
                                                 const float *w, int64_t ldw,
                                                 float *y) {
  __m256 acc[R][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm256_setzero_ps();
    acc[r][1] = _mm256_setzero_ps();
  }
  const int64_t body = k & ~int64_t{15};
  for (int64_t p = 0; p < body; p += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + p);
    const __m256 x1 = _mm256_loadu_ps(x + p + 8);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      acc[r][0] =
          _mm256_fmadd_ps(_mm256_loadu_ps(w + r * ldw + p), x0, acc[r][0]);
      acc[r][1] =
          _mm256_fmadd_ps(_mm256_loadu_ps(w + r * ldw + p + 8), x1, acc[r][1]);
    }
  }
  for (int64_t p = body; p < k; p += 8) {
    const __m256i mask = Head8(k - p);
    const __m256 xv = _mm256_maskload_ps(x + p, mask);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm256_fmadd_ps(_mm256_maskload_ps(w + r * ldw + p, mask), xv,
                                  acc[r][0]);
    }
  }
  __m256 sum[4];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
    sum[r] = r < R ? _mm256_add_ps(acc[r][0], acc[r][1]) : _mm256_setzero_ps();
  }
  // [s0 s0 s1 s1 | ...] then [s0 s1 s2 s3 | ...]: the rows' sums, halved.
  const __m256 quads = _mm256_hadd_ps(_mm256_hadd_ps(sum[0], sum[1]),
                                      _mm256_hadd_ps(sum[2], sum[3]));
  alignas(16) float out[4];
  _mm_store_ps(out, _mm_add_ps(_mm256_castps256_ps128(quads),
                               _mm256_extractf128_ps(quads, 1)));
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) y[r] = out[r];
}

// y[j] = W[j] . x for eight rows of W, one accumulator each, 8 floats a
// step: eight weight streams in flight, where DotRows<4>'s four left the
// loads waiting on memory. W [1376, 512] read from memory (48 matrices in
// turn, one thread, a throwaway timing program, medians of 15): 265 -> 210
// us per product; 12 rows: 215.
__attribute__((target("avx2,fma"))) void DotRows8(const float *x, int64_t k,
                                                  const float *w, int64_t ldw,
                                                  float *y) {
  __m256 acc[8];
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
  int64_t p = 0;
  // A cache line of each row a step, the next 8 rows' same line prefetched
  // into L2 (DotRows in cpu_linear.cc says why).
  for (; p + 16 <= k; p += 16) {
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
      _mm_prefetch(reinterpret_cast<const char *>(w + (8 + r) * ldw + p),
                   _MM_HINT_T1);
    }
#pragma GCC unroll 2
    for (int64_t q = p; q < p + 16; q += 8) {
      const __m256 xv = _mm256_loadu_ps(x + q);
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) {
        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * ldw + q), xv, acc[r]);
      }
    }
  }
  for (; p + 8 <= k; p += 8) {
    const __m256 xv = _mm256_loadu_ps(x + p);
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * ldw + p), xv, acc[r]);
    }
  }
  if (p < k) {
    const __m256i mask = Head8(k - p);
    const __m256 xv = _mm256_maskload_ps(x + p, mask);
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_maskload_ps(w + r * ldw + p, mask), xv,
                               acc[r]);
    }
  }
  const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]),
                                   _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]),
                                   _mm256_hadd_ps(acc[6], acc[7]));
  _mm256_storeu_ps(y, _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20),
                                    _mm256_permute2f128_ps(lo, hi, 0x31)));
}

}  // namespace

void RowAgainstRowsAvx2(const float *x, int64_t k, const float *w, int64_t ldw,
                        int64_t first, int64_t last, float *y) {
  ForEachRowTile<8, 4>(first, last, [&](auto rows, int64_t j, bool) {
    if constexpr (rows == 8) {
      DotRows8(x, k, w + j * ldw, ldw, y + j);
    } else {
      DotRows<rows>(x, k, w + j * ldw, ldw, y + j);
    }
  });
}

namespace {

template <bool kDirect>
__attribute__((target("avx2,fma"))) void BlockKernel(
    int64_t depth, const float *xp, const float *const *x_rows, const float *wp,
    const OutputRows &y, int64_t rows, int64_t cols, bool accumulate) {
  constexpr int kM = kBlockMAvx2, kN = kBlockNAvx2;
  __m256 acc[kM][2];
#pragma GCC unroll 6
  for (int i = 0; i < kM; ++i) {
    acc[i][0] = _mm256_setzero_ps();
    acc[i][1] = _mm256_setzero_ps();
  }
  for (int64_t p = 0; p < depth; ++p) {
    const __m256 w0 = _mm256_load_ps(wp + p * kN);
    const __m256 w1 = _mm256_load_ps(wp + p * kN + 8);
    const float *xs = xp + p * kM;
#pragma GCC unroll 6
    for (int i = 0; i < kM; ++i) {
      const __m256 xv = _mm256_broadcast_ss(kDirect ? x_rows[i] + p : xs + i);
      acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
    }
  }
  // Unrolled: see BlockKernel (cpu_linear.cc).
#pragma GCC unroll 6
  for (int i = 0; i < kM; ++i) {
    if (i >= rows) break;
    float *row = RowAt(y, i);
    __m256 v0 = acc[i][0], v1 = acc[i][1];
    if (accumulate) {
      v0 = _mm256_add_ps(v0, LoadHead8(row, cols));
      v1 = _mm256_add_ps(v1, LoadHead8(row + 8, cols - 8));
    }
    StoreHead8(row, v0, cols);
    StoreHead8(row + 8, v1, cols - 8);
  }
}

}  // namespace

// GCC takes a target attribute on a template's definition but not its
// declaration for another function version: the attributed kernel sits
// behind this plain one.
template <bool kDirect>
void BlockKernelAvx2(int64_t depth, const float *xp, const float *const *x_rows,
                     const float *wp, const OutputRows &y, int64_t rows,
                     int64_t cols, bool accumulate) {
  BlockKernel<kDirect>(depth, xp, x_rows, wp, y, rows, cols, accumulate);
}

template void BlockKernelAvx2<true>(int64_t, const float *,
                                    const float *const *, const float *,
                                    const OutputRows &, int64_t, int64_t, bool);
template void BlockKernelAvx2<false>(int64_t, const float *,
                                     const float *const *, const float *,
                                     const OutputRows &, int64_t, int64_t,
                                     bool);

}  // namespace moh::kernels_internal
