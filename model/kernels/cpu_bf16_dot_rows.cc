// Bf16DotRowsLinear: StreamRows' outer products (cpu_streamed_rows.cc) over
// pairs of k. y^T = W x^T: x, small, is rounded and transposed once; W is
// read in place, kTileRows rows at a time, and each row's 32-bit pair is
// broadcast from memory (vdpbf16ps's {1to16} operand) against one or two
// vectors of 16 rows of x, so W streams from memory once, in row order,
// neither widened nor packed.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "model/kernels/cpu_bf16_dot.h"
#include "model/kernels/cpu_isa.h"
#include "model/kernels/cpu_linear.h"
#include "model/kernels/cpu_streamed_rows.h"

namespace moh {
namespace {

using kernels_internal::AlignedBuffer;

// Rows of W per tile: 14 x 2 accumulators and two vectors of x in 30 of the
// 32 zmm registers, as StreamTile's.
constexpr int kTileRows = 14;

}  // namespace
}  // namespace moh

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16,avx512bw,avx512vl")
namespace moh {
namespace {

// y rows [0, rows) (rows <= 16 V) x columns [0, R) = packed x^T [pairs][ldx]
// (V vectors of 16 rows from xp on) times W rows [0, R) [k] (row stride
// ldw), plus bias [R] when not null. With `prefetch`, each cache line of
// the R rows' step also brings the same line of the next R rows (the next
// tile's) into L2, as LowpBlock does (cpu_lowp_rows_impl.h): a row's line
// lasts 16 steps, too few loads for out-of-order execution to keep enough
// misses in flight. Decode tokens/s on the 24 M bench model went 1.2-1.6x
// with it (batches 16 and 32, 1 and 2 threads).
template <int R, int V>
void DotTile(const float *xp, int64_t ldx, int64_t k, const uint16_t *w,
             int64_t ldw, float *y, int64_t ldy, int64_t rows,
             const float *bias, bool prefetch) {
  __m512 acc[R][V];
#pragma GCC unroll 14
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  const int64_t whole = k / 2;
  for (int64_t q = 0; q < whole; ++q) {
    if (prefetch && q % 16 == 0) {  // 16 pairs: 64 bytes of a row
#pragma GCC unroll 14
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char *>(w + (R + r) * ldw + 2 * q),
                     _MM_HINT_T1);
      }
    }
    __m512bh xv[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) {
      xv[v] =
          __m512bh(_mm512_castps_si512(_mm512_load_ps(xp + q * ldx + 16 * v)));
    }
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
      // W's pair need not be 32-bit aligned (an odd ldw): memcpy.
      int32_t bits;
      std::memcpy(&bits, w + r * ldw + 2 * q, sizeof bits);
      const __m512bh wv = __m512bh(_mm512_set1_epi32(bits));
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) {
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv[v], wv);
      }
    }
  }
  if (k % 2 != 0) {
    // The last pair holds W[., k - 1] alone: reading past it could meet
    // another row's Inf or NaN, or the end of W.
    __m512bh xv[V];
    for (int v = 0; v < V; ++v) {
      xv[v] = __m512bh(
          _mm512_castps_si512(_mm512_load_ps(xp + whole * ldx + 16 * v)));
    }
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = __m512bh(_mm512_set1_epi32(w[r * ldw + k - 1]));
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) {
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv[v], wv);
      }
    }
  }
  // acc[r][v]'s lane l is y[16 v + l, r]: through a tile in memory into
  // y's rows, as StreamTile writes. O(m R) moves against O(m R k) products.
  alignas(64) float tile[R][16 * V];
#pragma GCC unroll 14
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) _mm512_store_ps(&tile[r][16 * v], acc[r][v]);
  }
  for (int64_t i = 0; i < rows; ++i) {
    float *row = y + i * ldy;
    if (bias != nullptr) {
      for (int r = 0; r < R; ++r) row[r] = tile[r][i] + bias[r];
    } else {
      for (int r = 0; r < R; ++r) row[r] = tile[r][i];
    }
  }
}

// W rows [j, j + R) against every block of x's rows: two vectors (32 rows)
// at a time, the last 16 or fewer in one. The tile's rows of W (R k 2
// bytes) stay in L1/L2 between blocks, so only the first block prefetches.
template <int R>
void DotRows(const float *xp, int64_t ldx, int64_t m, int64_t k,
             const uint16_t *w, int64_t ldw, int64_t n, int64_t j,
             const float *bias, float *y) {
  const float *b = bias != nullptr ? bias + j : nullptr;
  for (int64_t i = 0; i < m; i += 32) {
    const int64_t rows = std::min<int64_t>(32, m - i);
    if (rows > 16) {
      DotTile<R, 2>(xp + i, ldx, k, w + j * ldw, ldw, y + i * n + j, n, rows, b,
                    i == 0);
    } else {
      DotTile<R, 1>(xp + i, ldx, k, w + j * ldw, ldw, y + i * n + j, n, rows, b,
                    i == 0);
    }
  }
}

}  // namespace
}  // namespace moh
#pragma GCC pop_options

namespace moh {

bool Bf16DotRowsLinear(const float *x, int64_t m, int64_t k, const uint16_t *w,
                       int64_t ldw, int64_t n, const float *bias, float *y) {
  if (!ActiveExtension(CpuExtension::kAvx512Bf16) || m < 1 ||
      m > kMaxStreamedRows || k < 1 || n < 1) {
    return false;
  }
  const int64_t k_pairs = (k + 1) / 2;
  // Whole vectors of 16 (m <= 16) or 32 rows, zero past m.
  const int64_t ldx = kernels_internal::TransposedWidth(m);
  thread_local AlignedBuffer rounded_buffer, x_buffer;
  float *rounded = rounded_buffer.Get(m * k_pairs);
  float *xp = x_buffer.Get(ldx * k_pairs);
  kernels_internal::RoundRowsBf16(x, m, k, k_pairs, rounded);
  kernels_internal::PackPanel({rounded, k_pairs}, m, k_pairs, ldx, xp);
  kernels_internal::ParallelRowTiles(
      n, kTileRows, m, k, [&](int64_t first, int64_t last) {
        kernels_internal::ForEachRowTile<kTileRows, 4>(
            first, last, [&](auto rows, int64_t j, bool) {
              DotRows<rows>(xp, ldx, m, k, w, ldw, n, j, bias, y);
            });
      });
  return true;
}

}  // namespace moh
