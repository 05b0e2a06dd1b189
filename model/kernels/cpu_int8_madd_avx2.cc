// Int8MaddRowsLinear (cpu_int8_dot.h): Int8DotLinear's numerics on AVX2 +
// FMA, which has no vpdpbusd. x is quantized per 32 values once, into int16;
// W's rows are widened to int16 in registers (vpmovsxbw, 16 values a load)
// and multiplied in pairs by vpmaddwd into int32, exactly, for any int8 W
// (-128 included: vpmaddubsw's unsigned-times-signed form would need
// llama.cpp's sign trick, two more instructions, and would saturate at
// -128). Each block's int32 sums are converted and scaled by x's d into
// float32 accumulators: four instructions on the multiply ports per 32
// products where the few-row kernel's widening of W to float32 takes eight.
//
// A tile is R rows of W against M rows of x: R * M accumulators of 8 lanes
// (8 x 1 for one row of x, 4 x 2 beyond, in 16 ymm registers with W's two
// int16 vectors and the temporaries); every group of x's rows runs against
// the tile before the next, so W streams from memory once, and the next
// tile's rows are prefetched into L2 a line per row every other block, as
// the few-row kernel does (cpu_lowp_rows_impl.h).
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "model/kernels/cpu_int8_dot.h"
#include "model/kernels/cpu_isa.h"
#include "model/kernels/cpu_kernels_avx2.h"
#include "model/kernels/cpu_linear.h"
#include "model/kernels/cpu_streamed_rows.h"

namespace moh {
namespace {

using kernels_internal::AlignedBuffer;
using kernels_internal::HorizontalMax8;
using kernels_internal::HorizontalSum8;
using kernels_internal::LoadHead8;

constexpr int64_t kBlock = kInt8DotBlock;

// x quantized: q [rows][blocks * kBlock] int16 (zero past k), d [rows][blocks].
struct QuantizedRows {
  const int16_t *q;
  const float *d;
  int64_t blocks;
};

// What every tile of one call shares.
struct MaddProblem {
  QuantizedRows x;
  int64_t m, k;
  const int8_t *w;
  int64_t ldw, n;
  const float *scale, *bias;
  float *y;
};

}  // namespace
}  // namespace moh

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace moh {
namespace {

// One row of x [k] quantized as Int8DotLinear documents into q [blocks *
// kBlock] (int16, zero past k) and d [blocks].
void QuantizeRow(const float *row, int64_t k, int64_t blocks, int16_t *q,
                 float *d) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t p0 = b * kBlock;
    const int64_t len = std::min(kBlock, k - p0);
    __m256 v[4];
    for (int c = 0; c < 4; ++c) v[c] = LoadHead8(row + p0 + 8 * c, len - 8 * c);
    const float largest = HorizontalMax8(
        _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude),
                                    _mm256_and_ps(v[1], magnitude)),
                      _mm256_max_ps(_mm256_and_ps(v[2], magnitude),
                                    _mm256_and_ps(v[3], magnitude))));
    const float step = largest / 127.0f;
    d[b] = step;
    const __m256 inverse = _mm256_set1_ps(step != 0.0f ? 1.0f / step : 0.0f);
    // cvtps rounds as MXCSR says: to nearest, ties to even. packs works
    // within 128-bit lanes; the permutation puts the halves back in order.
    __m256i r[4];
    for (int c = 0; c < 4; ++c)
      r[c] = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], inverse));
    _mm256_storeu_si256(
        reinterpret_cast<__m256i *>(q + p0),
        _mm256_permute4x64_epi64(_mm256_packs_epi32(r[0], r[1]), 0xD8));
    _mm256_storeu_si256(
        reinterpret_cast<__m256i *>(q + p0 + 16),
        _mm256_permute4x64_epi64(_mm256_packs_epi32(r[2], r[3]), 0xD8));
  }
}

// out[i][r] = sum over blocks b of d[i, b] (sum_{p in b} qx[i, p] w[r, p])
// for W rows [0, R) (row stride ldw) and x rows [i0, i0 + M). With
// `prefetch`, every other block brings the same line of the next R rows
// into L2.
template <int R, int M>
void MaddTile(const MaddProblem &p, int64_t i0, const int8_t *w, bool prefetch,
              float (*out)[R]) {
  const int64_t ldq = p.x.blocks * kBlock;
  const int16_t *xq = p.x.q + i0 * ldq;
  const float *xd = p.x.d + i0 * p.x.blocks;
  __m256 acc[M][R];
#pragma GCC unroll 2
  for (int i = 0; i < M; ++i) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  }
  // Block b against W's 32 bytes of each row at row(r).
  auto block = [&](int64_t b, auto row) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int8_t *wp = row(r);
      const __m256i lo = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i *>(wp)));
      const __m256i hi = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i *>(wp + 16)));
#pragma GCC unroll 2
      for (int i = 0; i < M; ++i) {
        const int16_t *xp = xq + i * ldq + b * kBlock;
        // Each lane: 4 products; a block's sum is exact in float32.
        const __m256i dot = _mm256_add_epi32(
            _mm256_madd_epi16(
                lo, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xp))),
            _mm256_madd_epi16(hi,
                              _mm256_loadu_si256(
                                  reinterpret_cast<const __m256i *>(xp + 16))));
        acc[i][r] = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(dot),
            _mm256_broadcast_ss(xd + i * p.x.blocks + b), acc[i][r]);
      }
    }
  };
  const int64_t whole = p.k / kBlock;
  for (int64_t b = 0; b < whole; ++b) {
    if (prefetch && b % 2 == 0) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(
            reinterpret_cast<const char *>(w + (R + r) * p.ldw + b * kBlock),
            _MM_HINT_T1);
      }
    }
    block(b, [&](int r) { return w + r * p.ldw + b * kBlock; });
  }
  if (whole < p.x.blocks) {
    // W's bytes past k are not read (they could lie past W's end).
    alignas(32) int8_t tail[R][kBlock] = {};
    const int64_t len = p.k - whole * kBlock;
    for (int r = 0; r < R; ++r) {
      std::memcpy(tail[r], w + r * p.ldw + whole * kBlock, len);
    }
    block(whole, [&](int r) { return &tail[r][0]; });
  }
#pragma GCC unroll 2
  for (int i = 0; i < M; ++i) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) out[i][r] = HorizontalSum8(acc[i][r]);
  }
}

// W rows [j, j + R) against every row of x, M rows at a time (then one).
template <int R, int M>
void MaddRows(const MaddProblem &p, int64_t j, bool prefetch) {
  const int8_t *w = p.w + j * p.ldw;
  float out[M][R];
  int64_t i = 0;
  auto store = [&](int rows) {
    for (int a = 0; a < rows; ++a) {
      float *row = p.y + (i + a) * p.n + j;
      for (int r = 0; r < R; ++r) {
        row[r] = out[a][r] * p.scale[j + r] +
                 (p.bias != nullptr ? p.bias[j + r] : 0.0f);
      }
    }
  };
  for (; i + M <= p.m; i += M) {
    MaddTile<R, M>(p, i, w, prefetch && i == 0, out);
    store(M);
  }
  if (M > 1 && i < p.m) {
    MaddTile<R, 1>(p, i, w, prefetch && i == 0, out);
    store(1);
  }
}

// W rows [first, last): R at a time while they last, then one.
template <int R, int M>
void MaddRowRange(const MaddProblem &p, int64_t first, int64_t last) {
  kernels_internal::ForEachRowTile<R, 1>(
      first, last, [&](auto rows, int64_t j, bool another) {
        MaddRows<rows, M>(p, j, another);
      });
}

}  // namespace
}  // namespace moh
#pragma GCC pop_options

namespace moh {

bool Int8MaddRowsLinear(const float *x, int64_t m, int64_t k, const int8_t *w,
                        int64_t ldw, int64_t n, const float *scale,
                        const float *bias, float *y) {
  if (ActiveIsa() == CpuIsa::kPortable || m < 1 || m > kMaxStreamedRows ||
      k < 1 || n < 1) {
    return false;
  }
  const int64_t blocks = (k + kBlock - 1) / kBlock;
  thread_local AlignedBuffer q_buffer, d_buffer;
  int16_t *q = reinterpret_cast<int16_t *>(
      q_buffer.Get(m * blocks * kBlock * sizeof(int16_t) / sizeof(float)));
  float *d = d_buffer.Get(m * blocks);
  for (int64_t i = 0; i < m; ++i) {
    QuantizeRow(x + i * k, k, blocks, q + i * blocks * kBlock, d + i * blocks);
  }
  const MaddProblem problem{{q, d, blocks}, m, k, w, ldw, n, scale, bias, y};
  // One row of x: 8 rows of W a tile; more: 4 against pairs of x's rows.
  const int64_t tile_rows = m == 1 ? 8 : 4;
  kernels_internal::ParallelRowTiles(
      n, tile_rows, m, k, [&](int64_t first, int64_t last) {
        if (m == 1) {
          MaddRowRange<8, 1>(problem, first, last);
        } else {
          MaddRowRange<4, 2>(problem, first, last);
        }
      });
  return true;
}

}  // namespace moh
