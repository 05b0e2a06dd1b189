// The attention products' AVX2 + FMA paths (cpu_kernels_avx2.h), chosen by
// cpu_attention_products.cc when ActiveIsa() is kAvx2: the same loops as
// the AVX-512 ones, cut for 16 ymm registers of 8 floats.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "model/kernels/cpu_kernels_avx2.h"

namespace moh::kernels_internal {
namespace {

// y[0, R) x [0, 8 NV) (row stride ldy; the last vector's first `last`
// lanes, 1 <= last <= 8)
// (+)= x [R, k] (row stride ldx) V [k, 8 NV] (row stride ldv): each value of
// x broadcast against NV vectors of V's row, R NV <= 12 accumulators.
template <int R, int NV>
__attribute__((target("avx2,fma"))) void ProductTile(
    const float *x, int64_t ldx, int64_t k, const float *v, int64_t ldv,
    int64_t last, float *y, int64_t ldy, bool accumulate) {
  __m256 acc[R][NV];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (int64_t p = 0; p < k; ++p) {
    __m256 vv[NV];
#pragma GCC unroll 2
    for (int c = 0; c < NV; ++c) {
      vv[c] = c + 1 < NV ? _mm256_loadu_ps(v + p * ldv + 8 * c)
                         : LoadHead8(v + p * ldv + 8 * c, last);
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + p);
#pragma GCC unroll 2
      for (int c = 0; c < NV; ++c) {
        acc[r][c] = _mm256_fmadd_ps(xv, vv[c], acc[r][c]);
      }
    }
  }
  // Unrolled: see BlockKernel (cpu_linear.cc).
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    float *row = y + r * ldy;
#pragma GCC unroll 2
    for (int c = 0; c < NV; ++c) {
      const int64_t count = c + 1 < NV ? 8 : last;
      __m256 out = acc[r][c];
      if (accumulate) out = _mm256_add_ps(out, LoadHead8(row + 8 * c, count));
      StoreHead8(row + 8 * c, out, count);
    }
  }
}

using ProductTileFn = void (*)(const float *, int64_t, int64_t, const float *,
                               int64_t, int64_t, float *, int64_t, bool);

// Rows of x per ProductTile (6 x 2 vectors: 12 accumulators, 2 of V and a
// broadcast in the 16 registers).
constexpr int64_t kProductRows = 6;

template <int NV>
ProductTileFn ProductTileFor(int64_t rows) {
  switch (rows) {
    case 1:
      return &ProductTile<1, NV>;
    case 2:
      return &ProductTile<2, NV>;
    case 3:
      return &ProductTile<3, NV>;
    case 4:
      return &ProductTile<4, NV>;
    case 5:
      return &ProductTile<5, NV>;
    default:
      return &ProductTile<6, NV>;
  }
}

// 8 values of a cached row: float32, or bfloat16 (their bits) widened.
__attribute__((target("avx2,fma"))) inline __m256 LoadRow8(const float *from) {
  return _mm256_loadu_ps(from);
}
__attribute__((target("avx2,fma"))) inline __m256 LoadRow8(
    const uint16_t *from) {
  const __m256i wide = _mm256_cvtepu16_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i *>(from)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Lane k of the result: the sum of v[k]'s 8 lanes (three rounds of
// horizontal adds and one of 128-bit lanes for all 8).
__attribute__((target("avx2,fma"))) inline __m256 SumEachOf8(const __m256 *v) {
  const __m256 g0 =
      _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 g1 =
      _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20),
                       _mm256_permute2f128_ps(g0, g1, 0x31));
}

void ValuesProduct(const float *p, int64_t ldp, int64_t m, int64_t k,
                   const float *values, int64_t ldv, int64_t n, float *y,
                   int64_t ldy, bool accumulate) {
  for (int64_t c0 = 0; c0 < n; c0 += 16) {
    const int64_t cols = std::min<int64_t>(16, n - c0);
    const int64_t vectors = (cols + 7) / 8;
    const int64_t last = cols - 8 * (vectors - 1);
    for (int64_t i = 0; i < m; i += kProductRows) {
      const int64_t rows = std::min(kProductRows, m - i);
      const ProductTileFn tile =
          vectors == 2 ? ProductTileFor<2>(rows) : ProductTileFor<1>(rows);
      tile(p + i * ldp, ldp, k, values + c0, ldv, last, y + i * ldy + c0, ldy,
           accumulate);
    }
  }
}

// 8 keys at a time, one accumulator each, summed by SumEachOf8 (a block
// short of 8 repeats its first key, masked out at the store).
template <typename T>
__attribute__((target("avx2,fma"))) void DecodeScores(const float *q, int64_t m,
                                                      int64_t d, float scale,
                                                      const T *const *keys,
                                                      int64_t n, float *y,
                                                      int64_t ldy) {
  const __m256 scaled = _mm256_set1_ps(scale);
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    const int64_t count = std::min<int64_t>(8, n - t0);
    const T *rows[8];
    for (int64_t k = 0; k < 8; ++k) rows[k] = keys[t0 + (k < count ? k : 0)];
    for (int64_t i = 0; i < m; ++i) {
      const float *qi = q + i * d;
      __m256 acc[8];
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_ps();
      for (int64_t j = 0; j < d; j += 8) {
        const __m256 qv = _mm256_loadu_ps(qi + j);
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          acc[k] = _mm256_fmadd_ps(qv, LoadRow8(rows[k] + j), acc[k]);
        }
      }
      StoreHead8(y + i * ldy + t0, _mm256_mul_ps(scaled, SumEachOf8(acc)),
                 count);
    }
  }
}

// y_i = sum over t of p[i][t] values[t], 32 columns at a time, 2 values at
// a time into 2 sets of 4 accumulators (8 FMA chains in flight).
template <typename T>
__attribute__((target("avx2,fma"))) void DecodeValues(const float *p,
                                                      int64_t ldp, int64_t m,
                                                      const T *const *values,
                                                      int64_t n, int64_t d,
                                                      float *y, int64_t ldy) {
  for (int64_t i = 0; i < m; ++i) {
    const float *pi = p + i * ldp;
    for (int64_t j = 0; j < d; j += 32) {
      const int64_t vectors = std::min<int64_t>(4, (d - j) / 8);
      __m256 acc[2][4];
#pragma GCC unroll 2
      for (int u = 0; u < 2; ++u) {
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) acc[u][v] = _mm256_setzero_ps();
      }
      int64_t t = 0;
      for (; t + 2 <= n; t += 2) {
#pragma GCC unroll 2
        for (int u = 0; u < 2; ++u) {
          const __m256 weight = _mm256_broadcast_ss(pi + t + u);
          const T *row = values[t + u] + j;
#pragma GCC unroll 4
          for (int v = 0; v < 4; ++v) {
            if (v < vectors) {
              acc[u][v] =
                  _mm256_fmadd_ps(weight, LoadRow8(row + 8 * v), acc[u][v]);
            }
          }
        }
      }
      if (t < n) {
        const __m256 weight = _mm256_broadcast_ss(pi + t);
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          if (v < vectors) {
            acc[0][v] = _mm256_fmadd_ps(weight, LoadRow8(values[t] + j + 8 * v),
                                        acc[0][v]);
          }
        }
      }
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        if (v < vectors) {
          _mm256_storeu_ps(y + i * ldy + j + 8 * v,
                           _mm256_add_ps(acc[0][v], acc[1][v]));
        }
      }
    }
  }
}

}  // namespace

void ValuesProductAvx2(const float *p, int64_t ldp, int64_t m, int64_t k,
                       const float *values, int64_t ldv, int64_t n, float *y,
                       int64_t ldy, bool accumulate) {
  ValuesProduct(p, ldp, m, k, values, ldv, n, y, ldy, accumulate);
}

// The attributed templates behind plain ones: see BlockKernelAvx2
// (cpu_linear_avx2.cc).
template <typename T>
void DecodeScoresAvx2(const float *q, int64_t m, int64_t d, float scale,
                      const T *const *keys, int64_t n, float *y, int64_t ldy) {
  DecodeScores(q, m, d, scale, keys, n, y, ldy);
}
template <typename T>
void DecodeValuesAvx2(const float *p, int64_t ldp, int64_t m,
                      const T *const *values, int64_t n, int64_t d, float *y,
                      int64_t ldy) {
  DecodeValues(p, ldp, m, values, n, d, y, ldy);
}

template void DecodeScoresAvx2<float>(const float *, int64_t, int64_t, float,
                                      const float *const *, int64_t, float *,
                                      int64_t);
template void DecodeScoresAvx2<uint16_t>(const float *, int64_t, int64_t, float,
                                         const uint16_t *const *, int64_t,
                                         float *, int64_t);
template void DecodeValuesAvx2<float>(const float *, int64_t, int64_t,
                                      const float *const *, int64_t, int64_t,
                                      float *, int64_t);
template void DecodeValuesAvx2<uint16_t>(const float *, int64_t, int64_t,
                                         const uint16_t *const *, int64_t,
                                         int64_t, float *, int64_t);

__attribute__((target("avx2,fma"))) void WidenBfloat16Avx2(const uint16_t *from,
                                                           int64_t n,
                                                           float *to) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(to + i, LoadRow8(from + i));
  for (; i < n; ++i) {
    const uint32_t bits = uint32_t{from[i]} << 16;
    std::memcpy(to + i, &bits, sizeof(bits));
  }
}

}  // namespace moh::kernels_internal
