// StreamRows and PackPanel's transposes for AVX2 + FMA (16 ymm registers of
// 8 floats), chosen by cpu_streamed_rows.cc when ActiveIsa() is kAvx2.
#include <immintrin.h>

#include <algorithm>

#include "model/kernels/cpu_kernels_avx2.h"
#include "model/kernels/cpu_streamed_rows.h"

namespace moh::kernels_internal {
namespace {

// y^T = W x^T for R rows of W against V vectors of 8 rows of x^T: R V
// accumulators, V loads of x^T and R broadcasts of W per step of k (AVX2
// has no broadcast operand, so each takes a register: 12 + 1 + 1, or
// 12 + 2 + 1, of the 16).
template <int R, int V>
__attribute__((target("avx2,fma"))) void StreamTile(const float *xt,
                                                    int64_t ldx, int64_t k,
                                                    const float *w, int64_t ldw,
                                                    const OutputRows &y,
                                                    int64_t rows) {
  __m256 acc[R][V];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  }
  for (int64_t p = 0; p < k; ++p) {
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
  alignas(32) float tile[R][8 * V];
  // Unrolled: see BlockKernel (cpu_linear.cc).
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) _mm256_store_ps(&tile[r][8 * v], acc[r][v]);
  }
  for (int64_t i = 0; i < rows; ++i) {
    float *row = RowAt(y, i);
    if (y.accumulate) {
      for (int r = 0; r < R; ++r) row[r] += tile[r][i];
    } else {
      for (int r = 0; r < R; ++r) row[r] = tile[r][i];
    }
  }
}

// W rows [first, last) against one block of up to 8 V rows of x: tiles of
// kTile W rows, the remainder in smaller ones.
template <int V>
void StreamBlock(const float *xb, int64_t ldx, int64_t rows, int64_t k,
                 const float *w, int64_t ldw, int64_t first, int64_t last,
                 const OutputRows &y) {
  constexpr int kTile = V == 1 ? 12 : 6;
  constexpr int kSmall = V == 1 ? 4 : 2;
  int64_t j = first;
  for (; j + kTile <= last; j += kTile) {
    StreamTile<kTile, V>(xb, ldx, k, w + j * ldw, ldw, Skip(y, 0, j), rows);
  }
  for (; j + kSmall <= last; j += kSmall) {
    StreamTile<kSmall, V>(xb, ldx, k, w + j * ldw, ldw, Skip(y, 0, j), rows);
  }
  for (; j < last; ++j) {
    StreamTile<1, V>(xb, ldx, k, w + j * ldw, ldw, Skip(y, 0, j), rows);
  }
}

}  // namespace

void StreamRowsAvx2(const float *xt, int64_t ldx, int64_t m, int64_t k,
                    const float *w, int64_t ldw, int64_t first, int64_t last,
                    const OutputRows &y) {
  // Blocks of 16 rows of x (ldx is a multiple of 16, so a block's padding
  // lies inside the row); a block of at most 8 takes the one-vector tiles.
  for (int64_t i = 0; i < m; i += 16) {
    const int64_t rows = std::min<int64_t>(16, m - i);
    if (rows > 8) {
      StreamBlock<2>(xt + i, ldx, rows, k, w, ldw, first, last, Skip(y, i, 0));
    } else {
      StreamBlock<1>(xt + i, ldx, rows, k, w, ldw, first, last, Skip(y, i, 0));
    }
  }
}

__attribute__((target("avx2,fma"))) void Transpose8Avx2(const InputRows &src,
                                                        int64_t count,
                                                        float *out,
                                                        int64_t ldo) {
  __m256 a[8];
  for (int i = 0; i < 8; ++i) {
    a[i] = i < count ? _mm256_loadu_ps(RowAt(src, i)) : _mm256_setzero_ps();
  }
  // Pairs of rows interleaved, then pairs of pairs: s[4 g + c] holds, in
  // 128-bit lane L, column 4 L + c of rows 4 g .. 4 g + 3.
  __m256 s[8];
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
  for (int c = 0; c < 4; ++c) {
    StoreHead8(out + c * ldo, _mm256_permute2f128_ps(s[c], s[4 + c], 0x20),
               count);
    StoreHead8(out + (4 + c) * ldo,
               _mm256_permute2f128_ps(s[c], s[4 + c], 0x31), count);
  }
}

}  // namespace moh::kernels_internal
