// StreamRows and PackPanel's transposes for AVX2 + FMA (16 ymm registers of
// 8 floats), chosen by cpu_streamed_rows.cc when ActiveIsa() is kAvx2.
#include <immintrin.h>

#include <algorithm>

#include "model/kernels/cpu_kernels_avx2.h"
#include "model/kernels/cpu_streamed_rows.h"

namespace moh::kernels_internal {
namespace {

// A tile's sums, acc[r][v] lane i = y^T[r][8 v + i], written (or added) as
// rows of y: y[8 v + i][0, R) for the tile's `rows` rows of x, by 8 x 8
// transposes (StoreTransposed in cpu_streamed_rows.cc on AVX2).
template <int R, int V>
__attribute__((target("avx2,fma"))) void StoreTransposed8(
    const __m256 (&acc)[R][V], const OutputRows &y, int64_t rows) {
  // Unrolled, so that acc stays in registers (see BlockKernel, cpu_linear.cc).
#pragma GCC unroll 2
  for (int v = 0; v < V; ++v) {
    if (8 * v >= rows) break;
    const int64_t count = std::min<int64_t>(8, rows - 8 * v);
#pragma GCC unroll 2
    for (int b = 0; b < (R + 7) / 8; ++b) {
      constexpr int kLast = R % 8 == 0 ? 8 : R % 8;
      const int n = 8 * (b + 1) <= R ? 8 : kLast;
      __m256 a[8], t[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        a[i] = 8 * b + i < R ? acc[8 * b + i][v] : _mm256_setzero_ps();
      }
      Transpose8x8(a, t);
      for (int64_t i = 0; i < count; ++i) {
        float *row = RowAt(y, 8 * v + i) + 8 * b;
        StoreHead8(row,
                   y.accumulate ? _mm256_add_ps(t[i], LoadHead8(row, n)) : t[i],
                   n);
      }
    }
  }
}

// y^T = W x^T for R rows of W against V vectors of 8 rows of x^T: R V
// accumulators, V loads of x^T and R broadcasts of W per step of k (AVX2
// has no broadcast operand, so each takes a register: 12 + 1 + 1, or
// 12 + 2 + 1, of the 16). With `prefetch`, each row's next line of the next
// R rows (the next tile's) is brought into L2 every 8 steps, as W streams.
template <int R, int V>
__attribute__((target("avx2,fma"))) void StreamTile(
    const float *xt, int64_t ldx, int64_t k, const float *w, int64_t ldw,
    const OutputRows &y, int64_t rows, bool prefetch) {
  __m256 acc[R][V];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  }
  for (int64_t p = 0; p < k; ++p) {
    if (prefetch && p % 16 == 0) {
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char *>(w + (R + r) * ldw + p),
                     _MM_HINT_T1);
      }
    }
    __m256 xv[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) xv[v] = _mm256_loadu_ps(xt + p * ldx + 8 * v);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_broadcast_ss(w + r * ldw + p);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) {
        acc[r][v] = _mm256_fmadd_ps(wv, xv[v], acc[r][v]);
      }
    }
  }
  if constexpr (R >= 4) {
    StoreTransposed8<R, V>(acc, y, rows);
  } else {
    alignas(32) float tile[R][8 * V];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) _mm256_store_ps(&tile[r][8 * v], acc[r][v]);
    }
    StoreTileRows(tile, y, rows);
  }
}

// R rows of W against every row of x, in blocks of 16 (two vectors; a
// block of at most 8, one): the tile's rows (R k floats) stay in L1/L2
// between blocks, so W streams from memory once however many rows x has.
// With `prefetch`, the first block brings the next R rows into L2.
template <int R>
void StreamTileRows(const float *xt, int64_t ldx, int64_t m, int64_t k,
                    const float *w, int64_t ldw, const OutputRows &y,
                    bool prefetch) {
  // ldx is a multiple of 16, so a block's padding lies inside the row.
  for (int64_t i = 0; i < m; i += 16) {
    const int64_t rows = std::min<int64_t>(16, m - i);
    const bool ahead = prefetch && i == 0;
    if (rows > 8) {
      StreamTile<R, 2>(xt + i, ldx, k, w, ldw, Skip(y, i, 0), rows, ahead);
    } else {
      StreamTile<R, 1>(xt + i, ldx, k, w, ldw, Skip(y, i, 0), rows, ahead);
    }
  }
}

// W rows [first, last): kTile at a time, the remainder kSmall and then one
// at a time.
template <int kTile, int kSmall>
void StreamRowRange(const float *xt, int64_t ldx, int64_t m, int64_t k,
                    const float *w, int64_t ldw, int64_t first, int64_t last,
                    const OutputRows &y) {
  ForEachRowTile<kTile, kSmall>(
      first, last, [&](auto rows, int64_t j, bool another) {
        StreamTileRows<rows>(xt, ldx, m, k, w + j * ldw, ldw, Skip(y, 0, j),
                             another);
      });
}

}  // namespace

void StreamRowsAvx2(const float *xt, int64_t ldx, int64_t m, int64_t k,
                    const float *w, int64_t ldw, int64_t first, int64_t last,
                    const OutputRows &y) {
  // Up to 8 rows of x, one vector against 12 rows of W; beyond, 6 rows of W
  // against two (and one for a last block of 8 or fewer).
  if (m <= 8) {
    StreamRowRange<12, 4>(xt, ldx, m, k, w, ldw, first, last, y);
  } else {
    StreamRowRange<6, 2>(xt, ldx, m, k, w, ldw, first, last, y);
  }
}

__attribute__((target("avx2,fma"))) void Transpose8Avx2(const InputRows &src,
                                                        int64_t count,
                                                        float *out,
                                                        int64_t ldo) {
  __m256 a[8], t[8];
  for (int i = 0; i < 8; ++i) {
    a[i] = i < count ? _mm256_loadu_ps(RowAt(src, i)) : _mm256_setzero_ps();
  }
  Transpose8x8(a, t);
  for (int q = 0; q < 8; ++q) StoreHead8(out + q * ldo, t[q], count);
}

}  // namespace moh::kernels_internal
