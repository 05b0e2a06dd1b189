#include "model/kernels/cpu_streamed_rows.h"

#include <immintrin.h>

#include <algorithm>

namespace moh::kernels_internal {
namespace {

// out[q][i] = src[i][q] for i < count <= 16 rows and q < 16 columns (out's
// row stride ldo; its columns from count on are left as they are), in
// registers instead of 16 count scalar moves.
__attribute__((target("avx512f"))) void Transpose16(const InputRows &src,
                                                    int64_t count, float *out,
                                                    int64_t ldo) {
  __m512 a[16], t[16];
  for (int i = 0; i < 16; ++i) {
    a[i] = i < count ? _mm512_loadu_ps(RowAt(src, i)) : _mm512_setzero_ps();
  }
  Transpose16x16(a, t);
  const __mmask16 mask = LaneMask16(count);
  for (int q = 0; q < 16; ++q) _mm512_mask_storeu_ps(out + q * ldo, mask, t[q]);
}

// A tile's sums, acc[r][v] lane i = y^T[r][16 v + i], written (or added)
// as rows of y: y[16 v + i][0, R) for the tile's `rows` rows of x, one
// transpose of 16 x 16 per vector and a masked store of R floats per row
// (an R-float scalar loop per row had cost more than a 16-step product).
template <int R, int kVectors>
__attribute__((target("avx512f"))) void StoreTransposed(
    const __m512 (&acc)[R][kVectors], const OutputRows &y, int64_t rows) {
  static_assert(R <= 16);
  const __mmask16 mask = LaneMask16(R);
  // Unrolled, so that acc stays in registers (see BlockKernel, cpu_linear.cc).
#pragma GCC unroll 2
  for (int v = 0; v < kVectors; ++v) {
    if (16 * v >= rows) break;
    __m512 a[16], t[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      a[r] = r < R ? acc[r][v] : _mm512_setzero_ps();
    }
    Transpose16x16(a, t);
    const int64_t count = std::min<int64_t>(16, rows - 16 * v);
    for (int64_t i = 0; i < count; ++i) {
      float *row = RowAt(y, 16 * v + i);
      const __m512 sum =
          y.accumulate ? _mm512_add_ps(t[i], _mm512_maskz_loadu_ps(mask, row))
                       : t[i];
      _mm512_mask_storeu_ps(row, mask, sum);
    }
  }
}

// StreamedLinear above 16 rows of x: y^T = W x^T as outer products. x is
// packed transposed (xt [k][padded m], small); W is read in place, R rows at
// a time, each value broadcast from memory against two vectors of 16 rows of
// x (kVectors), so W streams from memory once, in row order, with no packing.
constexpr int kTwoVectors = 2;

template <int R, int kVectors = kTwoVectors>
__attribute__((target("avx512f"))) void StreamTile(
    const float *xt, int64_t ldx, int64_t k, const float *w, int64_t ldw,
    const OutputRows &y, int64_t rows, bool prefetch = false) {
  __m512 acc[R][kVectors];
#pragma GCC unroll 14
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < k; ++p) {
    if (prefetch && p % 16 == 0) {
#pragma GCC unroll 14
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char *>(w + (R + r) * ldw + p),
                     _MM_HINT_T1);
      }
    }
    __m512 xv[kVectors];
#pragma GCC unroll 2
    for (int v = 0; v < kVectors; ++v) {
      xv[v] = _mm512_loadu_ps(xt + p * ldx + 16 * v);
    }
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_set1_ps(w[r * ldw + p]);
#pragma GCC unroll 2
      for (int v = 0; v < kVectors; ++v) {
        acc[r][v] = _mm512_fmadd_ps(wv, xv[v], acc[r][v]);
      }
    }
  }
  if constexpr (R >= 4) {
    StoreTransposed<R, kVectors>(acc, y, rows);
  } else {
    alignas(64) float tile[R][16 * kVectors];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
      for (int v = 0; v < kVectors; ++v) {
        _mm512_store_ps(&tile[r][16 * v], acc[r][v]);
      }
    }
    StoreTileRows(tile, y, rows);
  }
}

// R rows of W (from w) against every 32-row block of x, so the tile's rows
// (R k floats, L1/L2) are read from memory once however many rows x has.
template <int R>
void StreamTileBlocks(const float *xt, int64_t ldx, int64_t m, int64_t k,
                      const float *w, int64_t ldw, const OutputRows &y) {
  for (int64_t i = 0; i < m; i += 16 * kTwoVectors) {
    const int64_t rows = std::min<int64_t>(16 * kTwoVectors, m - i);
    StreamTile<R>(xt + i, ldx, k, w, ldw, Skip(y, i, 0), rows);
  }
}

// W rows [first, last) against x's 32-row blocks: tiles of 14 W rows, the
// remainder in smaller ones, each tile against every block before the next
// (with x's blocks outer, W streamed from memory once per 32 rows of x).
void StreamRowBlocks(const float *xt, int64_t ldx, int64_t m, int64_t k,
                     const float *w, int64_t ldw, int64_t first, int64_t last,
                     const OutputRows &y) {
  ForEachRowTile<14, 4>(first, last, [&](auto rows, int64_t j, bool) {
    StreamTileBlocks<rows>(xt, ldx, m, k, w + j * ldw, ldw, Skip(y, 0, j));
  });
}

// Up to 16 rows: one vector of x against kOneVectorTile rows of W, the
// next tile's lines prefetched into L2 as these stream (each row's line
// lasts 16 steps: too few loads for the hardware to keep enough misses in
// flight, as in the low-precision few-row kernel).
void StreamRowsOneVector(const float *xt, int64_t ldx, int64_t m, int64_t k,
                         const float *w, int64_t ldw, int64_t first,
                         int64_t last, const OutputRows &y) {
  ForEachRowTile<8, 4>(first, last, [&](auto rows, int64_t j, bool another) {
    // Only the 8-row tiles prefetch.
    StreamTile<rows, 1>(xt, ldx, k, w + j * ldw, ldw, Skip(y, 0, j), m,
                        rows == 8 && another);
  });
}

}  // namespace

void PackPanel(const InputRows &src, int64_t rows, int64_t depth, int64_t width,
               float *out) {
  // Steps of p (and rows) per in-register transpose; none (every step one
  // float at a time, below) where neither instruction set is active.
  const int64_t block = UseAvx512() ? 16 : 8;
  const int64_t block_depth = UseAvx2() ? depth / block * block : 0;
  for (int64_t r = 0; r < rows; r += block) {
    for (int64_t p = 0; p < block_depth; p += block) {
      const InputRows from = Skip(src, r, p);
      const int64_t count = std::min(block, rows - r);
      if (block == 16) {
        Transpose16(from, count, out + p * width + r, width);
      } else {
        Transpose8Avx2(from, count, out + p * width + r, width);
      }
    }
  }
  for (int64_t p = 0; p < depth; ++p) {
    float *to = out + p * width;
    if (p >= block_depth) {
      for (int64_t r = 0; r < rows; ++r) to[r] = RowAt(src, r)[p];
    }
    for (int64_t r = rows; r < width; ++r) to[r] = 0.0f;
  }
}

const float *PackTransposed(const InputRows &x, int64_t m, int64_t k,
                            float scale) {
  thread_local AlignedBuffer buffer;
  const int64_t ld = TransposedWidth(m);
  float *xt = buffer.Get(ld * k);
  PackPanel(x, m, k, ld, xt);
  if (scale != 1.0f) {
    for (int64_t i = 0; i < ld * k; ++i) xt[i] *= scale;
  }
  return xt;
}

void StreamRows(const float *xt, int64_t ldx, int64_t m, int64_t k,
                const float *w, int64_t ldw, int64_t first, int64_t last,
                const OutputRows &y) {
  // Up to 16 rows on AVX-512, one vector of x against 8 rows of W with the
  // next 8 rows prefetched. A one-vector tile of 28 rows (no prefetch) had
  // streamed more rows of W than the hardware prefetchers follow (a 1 B
  // layout's batch-16 decode 14.6 tokens/s against 43.7 with the AVX2 tiles,
  // 2 threads, AVX-512 EPYC), so the AVX2 tiles (two ymm of 8 rows of x
  // against 6 rows of W) ran here until this one, which needs half their
  // FMAs: on a Sapphire Rapids VM, moh-generate batch-16 decode tokens/s
  // (AVX2 tiles -> these) 24 M layout 1393 -> 2013 (2 threads), 867 -> 1300
  // (1), 1 B layout 64.3 -> 68.2 (2); one cold 1376 x 512 product at 16
  // rows, one thread, 499 -> 348 us.
  if (UseAvx512() && m <= 16) {
    StreamRowsOneVector(xt, ldx, m, k, w, ldw, first, last, y);
  } else if (!UseAvx512() || m <= 16) {
    StreamRowsAvx2(xt, ldx, m, k, w, ldw, first, last, y);
  } else {
    StreamRowBlocks(xt, ldx, m, k, w, ldw, first, last, y);
  }
}

}  // namespace moh::kernels_internal
