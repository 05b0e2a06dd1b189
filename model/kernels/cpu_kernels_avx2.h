// Internal to model/kernels: the AVX2 + FMA paths of the linear products
// (cpu_linear_avx2.cc) and of the attention products
// (cpu_attention_products_avx2.cc), which the public kernels call when
// ActiveIsa() (cpu_isa.h) is kAvx2. Each has the contract of the AVX-512
// code it stands for, named beside it; all are tuned for 16 ymm registers.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "model/kernels/cpu_linear.h"

namespace moh::kernels_internal {

// Lanes [0, count) of 8 set (none for count <= 0, all from 8): the mask of
// AVX2's masked loads and stores.
__attribute__((target("avx2,fma"))) inline __m256i Head8(int64_t count) {
  return _mm256_cmpgt_epi32(
      _mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(count, 0, 8))),
      _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The first `count` floats at `from` (zeros beyond), and v's first `count`
// lanes stored to `to`: a plain load for a whole vector, a masked one
// otherwise; the store in 256-, 128-, 64- and 32-bit pieces, never masked,
// since AMD's Zen cores run a masked store as a long microcoded sequence.
__attribute__((target("avx2,fma"))) inline __m256 LoadHead8(const float *from,
                                                            int64_t count) {
  return count >= 8 ? _mm256_loadu_ps(from)
                    : _mm256_maskload_ps(from, Head8(count));
}
__attribute__((target("avx2,fma"))) inline void StoreHead8(float *to, __m256 v,
                                                           int64_t count) {
  if (count >= 8) {
    _mm256_storeu_ps(to, v);
    return;
  }
  __m128 part = _mm256_castps256_ps128(v);
  if (count >= 4) {
    _mm_storeu_ps(to, part);
    part = _mm256_extractf128_ps(v, 1);
    to += 4;
    count -= 4;
  }
  if (count >= 2) {
    _mm_storel_pi(reinterpret_cast<__m64 *>(to), part);
    part = _mm_movehl_ps(part, part);
    to += 2;
    count -= 2;
  }
  if (count >= 1) _mm_store_ss(to, part);
}

// The largest of v's 8 lanes.
__attribute__((target("avx2,fma"))) inline float HorizontalMax8(__m256 v) {
  const __m128 half =
      _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

// The sum of v's 8 lanes.
__attribute__((target("avx2,fma"))) inline float HorizontalSum8(__m256 v) {
  const __m128 half =
      _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

// t[q] = column q of the 8 x 8 matrix whose rows are a[0..7].
__attribute__((target("avx2,fma"))) inline void Transpose8x8(
    const __m256 (&a)[8], __m256 (&t)[8]) {
  // Pairs of rows interleaved, then pairs of pairs: s[4 g + c] holds, in
  // 128-bit lane L, column 4 L + c of rows 4 g .. 4 g + 3.
  __m256 s[8];
#pragma GCC unroll 2
  for (int g = 0; g < 2; ++g) {
    const __m256 *r = a + 4 * g;
    const __m256 lo01 = _mm256_unpacklo_ps(r[0], r[1]);
    const __m256 hi01 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 lo23 = _mm256_unpacklo_ps(r[2], r[3]);
    const __m256 hi23 = _mm256_unpackhi_ps(r[2], r[3]);
    s[4 * g + 0] = _mm256_shuffle_ps(lo01, lo23, 0x44);
    s[4 * g + 1] = _mm256_shuffle_ps(lo01, lo23, 0xEE);
    s[4 * g + 2] = _mm256_shuffle_ps(hi01, hi23, 0x44);
    s[4 * g + 3] = _mm256_shuffle_ps(hi01, hi23, 0xEE);
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x20);
    t[4 + c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x31);
  }
}

// RowLinear's dot products: y[j] = W[j] . x for W rows [first, last), eight
// rows at a time, one accumulator each (eight FMA chains and eight weight
// streams in flight), the remainder four and one at a time.
void RowAgainstRowsAvx2(const float *x, int64_t k, const float *w, int64_t ldw,
                        int64_t first, int64_t last, float *y);

// BlockedLinear's micro-kernel for AVX2: a kBlockMAvx2 x kBlockNAvx2 tile of
// y in 12 accumulators (two loads of packed W and 6 broadcasts of x per step
// of k), with BlockKernel's contract (cpu_linear.cc).
inline constexpr int64_t kBlockMAvx2 = 6;
inline constexpr int64_t kBlockNAvx2 = 16;
template <bool kDirect>
void BlockKernelAvx2(int64_t depth, const float *xp, const float *const *x_rows,
                     const float *wp, const OutputRows &y, int64_t rows,
                     int64_t cols, bool accumulate);

// ValuesProduct (cpu_attention_products.h) on AVX2: 6 rows of p by 16
// columns at a time.
void ValuesProductAvx2(const float *p, int64_t ldp, int64_t m, int64_t k,
                       const float *values, int64_t ldv, int64_t n, float *y,
                       int64_t ldy, bool accumulate);

// The decode products over a cache's rows (Float32Scores, Bfloat16Values,
// ...) on AVX2, T float or uint16_t (bfloat16 bits); d a multiple of 16.
template <typename T>
void DecodeScoresAvx2(const float *q, int64_t m, int64_t d, float scale,
                      const T *const *keys, int64_t n, float *y, int64_t ldy);
template <typename T>
void DecodeValuesAvx2(const float *p, int64_t ldp, int64_t m,
                      const T *const *values, int64_t n, int64_t d, float *y,
                      int64_t ldy);

// WidenBfloat16 on AVX2: 8 values at a time.
void WidenBfloat16Avx2(const uint16_t *from, int64_t n, float *to);

}  // namespace moh::kernels_internal
