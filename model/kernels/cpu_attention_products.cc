#include "model/kernels/cpu_attention_products.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "model/kernels/cpu_kernels_avx2.h"
#include "model/kernels/cpu_streamed_rows.h"

namespace moh {
namespace {

using kernels_internal::DecodeScoresAvx2;
using kernels_internal::DecodeValuesAvx2;
using kernels_internal::PackTransposed;
using kernels_internal::StreamRows;
using kernels_internal::TransposedWidth;
using kernels_internal::UseAvx2;
using kernels_internal::UseAvx512;
using kernels_internal::ValuesProductAvx2;
using kernels_internal::WidenBfloat16Avx2;

// y[0, R) x [0, 16 NV) (row stride ldy; the last vector masked by `tail`)
// (+)= x [R, k] (row stride ldx) V [k, 16 NV] (row stride ldv): each value of
// x broadcast from memory against NV vectors of V's row, R NV accumulators.
template <int R, int NV>
__attribute__((target("avx512f"))) void ProductTile(const float *x, int64_t ldx,
                                                    int64_t k, const float *v,
                                                    int64_t ldv, __mmask16 tail,
                                                    float *y, int64_t ldy,
                                                    bool accumulate) {
  __m512 acc[R][NV];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < k; ++p) {
    __m512 vv[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) {
      vv[c] = c + 1 < NV ? _mm512_loadu_ps(v + p * ldv + 16 * c)
                         : _mm512_maskz_loadu_ps(tail, v + p * ldv + 16 * c);
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + p]);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) {
        acc[r][c] = _mm512_fmadd_ps(xv, vv[c], acc[r][c]);
      }
    }
  }
  // Unrolled: see BlockKernel (cpu_linear.cc).
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    float *row = y + r * ldy;
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) {
      const __mmask16 mask = c + 1 < NV ? __mmask16(0xFFFF) : tail;
      __m512 out = acc[r][c];
      if (accumulate) {
        out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(mask, row + 16 * c));
      }
      _mm512_mask_storeu_ps(row + 16 * c, mask, out);
    }
  }
}

using ProductTileFn = void (*)(const float *, int64_t, int64_t, const float *,
                               int64_t, __mmask16, float *, int64_t, bool);

// Rows of x per ProductTile (R NV <= 24 accumulators), and the tile for
// `rows` <= kProductRows rows and `vectors` <= 4 vectors of columns.
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

ProductTileFn ProductTileFor(int64_t rows, int64_t vectors) {
  switch (vectors) {
    case 1:
      return ProductTileFor<1>(rows);
    case 2:
      return ProductTileFor<2>(rows);
    case 3:
      return ProductTileFor<3>(rows);
    default:
      return ProductTileFor<4>(rows);
  }
}

// 16 values of a cached row: float32, or bfloat16 (their bits) widened.
__attribute__((target("avx512f"))) inline __m512 LoadRow16(const float *from) {
  return _mm512_loadu_ps(from);
}
__attribute__((target("avx512f"))) inline __m512 LoadRow16(
    const uint16_t *from) {
  const __m512i wide = _mm512_cvtepu16_epi32(
      _mm256_loadu_si256(reinterpret_cast<const __m256i *>(from)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

__attribute__((target("avx512f"))) void WidenBfloat16Avx512(
    const uint16_t *from, int64_t n, float *to) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(to + i, LoadRow16(from + i));
  for (; i < n; ++i) {
    const uint32_t bits = uint32_t{from[i]} << 16;
    std::memcpy(to + i, &bits, sizeof(bits));
  }
}

// [a0 + a1, a2 + a3, b0 + b1, b2 + b3] of a's and b's 128-bit lanes.
__attribute__((target("avx512f"))) inline __m512 FoldLanes(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Lane k of the result: the sum of v[k]'s 16 lanes. A transposing tree (45
// shuffles and adds for all 16) where one horizontal sum each costs 8
// dependent steps.
__attribute__((target("avx512f"))) inline __m512 SumEachOf16(const __m512 *v) {
  __m512 pairs[8];  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    pairs[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  }
  __m512 quads[4];  // per 128-bit lane: that lane's sum of 4 vectors
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const __m512d a = _mm512_castps_pd(pairs[2 * k]);
    const __m512d b = _mm512_castps_pd(pairs[2 * k + 1]);
    quads[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Twice: vector k's 4 lanes end in lane k.
  return FoldLanes(FoldLanes(quads[0], quads[1]),
                   FoldLanes(quads[2], quads[3]));
}

// y[i][t] = scale q_i . keys[t]: 16 keys at a time, one accumulator each,
// summed by SumEachOf16 (a block short of 16 repeats its first key, masked
// out at the store).
template <typename T>
__attribute__((target("avx512f"))) void DecodeScoresAvx512(
    const float *q, int64_t m, int64_t d, float scale, const T *const *keys,
    int64_t n, float *y, int64_t ldy) {
  const __m512 scaled = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int64_t count = std::min<int64_t>(16, n - t0);
    const T *rows[16];
    for (int64_t k = 0; k < 16; ++k) rows[k] = keys[t0 + (k < count ? k : 0)];
    const __mmask16 mask = __mmask16((1u << count) - 1);
    for (int64_t i = 0; i < m; ++i) {
      const float *qi = q + i * d;
      __m512 acc[16];
#pragma GCC unroll 16
      for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
      for (int64_t j = 0; j < d; j += 16) {
        const __m512 qv = _mm512_loadu_ps(qi + j);
#pragma GCC unroll 16
        for (int k = 0; k < 16; ++k) {
          acc[k] = _mm512_fmadd_ps(qv, LoadRow16(rows[k] + j), acc[k]);
        }
      }
      _mm512_mask_storeu_ps(y + i * ldy + t0, mask,
                            _mm512_mul_ps(scaled, SumEachOf16(acc)));
    }
  }
}

// y_i = sum over t of p[i][t] values[t], 64 columns at a time, 4 values
// at a time into 4 sets of accumulators (one set would chain every FMA on
// the one before).
template <typename T>
__attribute__((target("avx512f"))) void DecodeValuesAvx512(
    const float *p, int64_t ldp, int64_t m, const T *const *values, int64_t n,
    int64_t d, float *y, int64_t ldy) {
  for (int64_t i = 0; i < m; ++i) {
    const float *pi = p + i * ldp;
    for (int64_t j = 0; j < d; j += 64) {
      const int64_t vectors = std::min<int64_t>(4, (d - j) / 16);
      __m512 acc[4][4];
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) acc[u][v] = _mm512_setzero_ps();
      }
      int64_t t = 0;
      for (; t + 4 <= n; t += 4) {
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) {
          const __m512 weight = _mm512_set1_ps(pi[t + u]);
          const T *row = values[t + u] + j;
#pragma GCC unroll 4
          for (int v = 0; v < 4; ++v) {
            if (v < vectors) {
              acc[u][v] =
                  _mm512_fmadd_ps(weight, LoadRow16(row + 16 * v), acc[u][v]);
            }
          }
        }
      }
      for (; t < n; ++t) {
        const __m512 weight = _mm512_set1_ps(pi[t]);
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          if (v < vectors) {
            acc[0][v] = _mm512_fmadd_ps(
                weight, LoadRow16(values[t] + j + 16 * v), acc[0][v]);
          }
        }
      }
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        if (v < vectors) {
          _mm512_storeu_ps(y + i * ldy + j + 16 * v,
                           _mm512_add_ps(_mm512_add_ps(acc[0][v], acc[1][v]),
                                         _mm512_add_ps(acc[2][v], acc[3][v])));
        }
      }
    }
  }
}

// The decode products on the active instruction set (d % 16 == 0 checked).
template <typename T>
void DecodeScores(const float *q, int64_t m, int64_t d, float scale,
                  const T *const *keys, int64_t n, float *y, int64_t ldy) {
  if (UseAvx512()) {
    DecodeScoresAvx512(q, m, d, scale, keys, n, y, ldy);
  } else {
    DecodeScoresAvx2(q, m, d, scale, keys, n, y, ldy);
  }
}
template <typename T>
void DecodeValues(const float *p, int64_t ldp, int64_t m,
                  const T *const *values, int64_t n, int64_t d, float *y,
                  int64_t ldy) {
  if (UseAvx512()) {
    DecodeValuesAvx512(p, ldp, m, values, n, d, y, ldy);
  } else {
    DecodeValuesAvx2(p, ldp, m, values, n, d, y, ldy);
  }
}

}  // namespace

bool ScoresProduct(const float *q, int64_t m, int64_t k, float scale,
                   const float *keys, int64_t ldk, int64_t n, float *y,
                   int64_t ldy) {
  if (!UseAvx2() || m < 1 || m > kMaxStreamedRows || k < 1 || n < 1) {
    return false;
  }
  const int64_t ldx = TransposedWidth(m);
  const float *xt = PackTransposed({q, k}, m, k, scale);
  StreamRows(xt, ldx, m, k, keys, ldk, 0, n, {y, ldy});
  return true;
}

bool ValuesProduct(const float *p, int64_t ldp, int64_t m, int64_t k,
                   const float *values, int64_t ldv, int64_t n, float *y,
                   int64_t ldy, bool accumulate) {
  if (!UseAvx2() || m < 1 || k < 1 || n < 1) return false;
  if (!UseAvx512()) {
    ValuesProductAvx2(p, ldp, m, k, values, ldv, n, y, ldy, accumulate);
    return true;
  }
  for (int64_t c0 = 0; c0 < n; c0 += 64) {
    const int64_t cols = std::min<int64_t>(64, n - c0);
    const int64_t vectors = (cols + 15) / 16;
    const int64_t last = cols - 16 * (vectors - 1);
    const __mmask16 tail =
        last == 16 ? __mmask16(0xFFFF) : __mmask16((1u << last) - 1);
    for (int64_t i = 0; i < m; i += kProductRows) {
      const int64_t rows = std::min(kProductRows, m - i);
      ProductTileFor(rows, vectors)(p + i * ldp, ldp, k, values + c0, ldv, tail,
                                    y + i * ldy + c0, ldy, accumulate);
    }
  }
  return true;
}

bool Bfloat16Scores(const float *q, int64_t m, int64_t d, float scale,
                    const uint16_t *const *keys, int64_t n, float *y,
                    int64_t ldy) {
  if (!UseAvx2() || d % 16 != 0) return false;
  DecodeScores(q, m, d, scale, keys, n, y, ldy);
  return true;
}

bool Bfloat16Values(const float *p, int64_t ldp, int64_t m,
                    const uint16_t *const *values, int64_t n, int64_t d,
                    float *y, int64_t ldy) {
  if (!UseAvx2() || d % 16 != 0) return false;
  DecodeValues(p, ldp, m, values, n, d, y, ldy);
  return true;
}

bool Float32Scores(const float *q, int64_t m, int64_t d, float scale,
                   const float *const *keys, int64_t n, float *y, int64_t ldy) {
  if (!UseAvx2() || d % 16 != 0) return false;
  DecodeScores(q, m, d, scale, keys, n, y, ldy);
  return true;
}

bool Float32Values(const float *p, int64_t ldp, int64_t m,
                   const float *const *values, int64_t n, int64_t d, float *y,
                   int64_t ldy) {
  if (!UseAvx2() || d % 16 != 0) return false;
  DecodeValues(p, ldp, m, values, n, d, y, ldy);
  return true;
}

bool WidenBfloat16(const uint16_t *from, int64_t n, float *to) {
  if (!UseAvx2()) return false;
  if (UseAvx512()) {
    WidenBfloat16Avx512(from, n, to);
  } else {
    WidenBfloat16Avx2(from, n, to);
  }
  return true;
}

}  // namespace moh
