// Int8DotRowsLinear (cpu_int8_dot.h): Bf16DotRowsLinear's outer products
// (cpu_bf16_dot_rows.cc) over int8. y^T = W x^T: x, small, is quantized
// and transposed once into groups of 4 values; W is read in place, a tile
// of rows at a time, and each row's 4 bytes are broadcast from memory
// (vpdpbusd's {1to16} operand) against one or two vectors of 16 rows of x,
// so W streams from memory once, in row order, neither widened nor packed.
//
// x enters vpdpbusd unsigned, as qx + 128, so each block's int32 sum
// carries 128 times the block's sum of W's row. A tile first sums its rows'
// blocks (vpsadbw, eight blocks of a row per round) into the starting
// values of its accumulators, from L2: its products brought them there,
// prefetching the next tile's rows a line per row every 64 values.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "model/kernels/cpu_int8_dot.h"
#include "model/kernels/cpu_isa.h"
#include "model/kernels/cpu_linear.h"
#include "model/kernels/cpu_streamed_rows.h"

namespace moh {
namespace {

using kernels_internal::AlignedBuffer;

constexpr int64_t kBlock = kInt8DotBlock;
// 4-value groups (one vpdpbusd lane) in a block.
constexpr int kQuads = kBlock / 4;
// Rows of W per tile. Up to 16 rows of x: 14 int32 and 14 float32
// accumulators and x's vector in 29 of the 32 zmm registers; beyond, two
// vectors of x against 7 rows (28 accumulators).
constexpr int kTileRows = 14;
constexpr int kWideTileRows = 7;

}  // namespace
}  // namespace moh

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
namespace moh {
namespace {

// out[b * stride] = -128 * sum_{p in block b} row[p] for b < blocks (the
// last block's values from k on count as 0).
void BlockCorrections(const int8_t *row, int64_t k, int64_t blocks,
                      int64_t stride, int32_t *out) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i zero = _mm512_setzero_si512();
  // The order vpsadbw's sums come out in below: blocks 0, 2, 1, 3, 4, 6, 5, 7.
  const __m256i order = _mm256_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7);
  const int64_t whole = k / kBlock;
  int64_t b = 0;
  for (; b + 8 <= whole; b += 8) {
    const int8_t *p = row + b * kBlock;
    __m512i s[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      // Each 64-bit lane: the sum of 8 values, each + 128 (unsigned).
      s[c] = _mm512_sad_epu8(
          _mm512_xor_si512(_mm512_loadu_si512(p + 64 * c), flip), zero);
    }
    // Lane pairs of chunks 0 and 1, 2 and 3: [a01 b01 | a23 b23 | ...].
    const __m512i t01 = _mm512_add_epi64(_mm512_unpacklo_epi64(s[0], s[1]),
                                         _mm512_unpackhi_epi64(s[0], s[1]));
    const __m512i t23 = _mm512_add_epi64(_mm512_unpacklo_epi64(s[2], s[3]),
                                         _mm512_unpackhi_epi64(s[2], s[3]));
    // 128-bit lanes 0 + 1 and 2 + 3 of each: a block's four lanes.
    const __m512i sums = _mm512_add_epi64(
        _mm512_shuffle_i64x2(t01, t23, _MM_SHUFFLE(2, 0, 2, 0)),
        _mm512_shuffle_i64x2(t01, t23, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m256i biased =
        _mm256_permutevar8x32_epi32(_mm512_cvtepi64_epi32(sums), order);
    // sum(w + 128) over 32 values is sum(w) + 4096: -128 sum(w) is
    // 128 * 4096 - 128 sum(w + 128).
    alignas(32) int32_t corrections[8];
    _mm256_store_si256(reinterpret_cast<__m256i *>(corrections),
                       _mm256_sub_epi32(_mm256_set1_epi32(128 * 4096),
                                        _mm256_slli_epi32(biased, 7)));
    for (int i = 0; i < 8; ++i) out[(b + i) * stride] = corrections[i];
  }
  for (; b < blocks; ++b) {
    const int64_t p0 = b * kBlock, p1 = std::min(k, p0 + kBlock);
    int32_t sum = 0;
    for (int64_t p = p0; p < p1; ++p) sum += row[p];
    out[b * stride] = -128 * sum;
  }
}

// The 4 bytes of W at p as an int32 broadcast (vpdpbusd's signed operand);
// an unaligned load, as ldw need not be a multiple of 4.
inline __m512i BroadcastQuad(const int8_t *p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return _mm512_set1_epi32(bits);
}

// tile[r][16 v + l] = sum over blocks b of d[l, b] times block b's int32 sum
// of (qx[l] + 128) w[r] (plus corr[b * R + r]), for W rows [0, R)
// (row stride ldw) and V vectors of 16 lanes of x's panel: xq's block b at
// xq + b * kBlock * ldx bytes, its scales at xd + b * ldx. With
// `prefetch`, every other block brings the same cache line of the next R
// rows (the next tile's) into L2, so that memory streams while this tile
// multiplies: prefetched all at once as the tile's sums are read, they
// queued behind one another and the products waited (cold W [2048, 2048],
// 16 rows of x, one thread: 6.3 GB/s).
template <int R, int V>
void DotTile(const uint8_t *xq, const float *xd, int64_t ldx, int64_t k,
             const int8_t *w, int64_t ldw, const int32_t *corr, int64_t blocks,
             bool prefetch, float (*tile)[32]) {
  __m512 sum[R][V];
#pragma GCC unroll 14
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) sum[r][v] = _mm512_setzero_ps();
  }
  __m512i acc[R][V];
  auto start = [&](int64_t b) {
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
      const __m512i c = _mm512_set1_epi32(corr[b * R + r]);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) acc[r][v] = c;
    }
  };
  // The group of 4 values at `quad` of block b, W's bytes from wq(r).
  auto group = [&](int64_t b, int quad, auto wq) {
    __m512i xv[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) {
      xv[v] =
          _mm512_load_si512(xq + b * kBlock * ldx + (quad * ldx + 16 * v) * 4);
    }
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
      const __m512i wv = wq(r);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) {
        acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], xv[v], wv);
      }
    }
  };
  // The block's sums are exact in float32 (|sum| < 2^24).
  auto fold = [&](int64_t b) {
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) {
        sum[r][v] =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][v]),
                            _mm512_load_ps(xd + b * ldx + 16 * v), sum[r][v]);
      }
    }
  };
  const int64_t whole = k / kBlock;
  for (int64_t b = 0; b < whole; ++b) {
    if (prefetch && b % 2 == 0) {
#pragma GCC unroll 14
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(
            reinterpret_cast<const char *>(w + (R + r) * ldw + b * kBlock),
            _MM_HINT_T1);
      }
    }
    start(b);
#pragma GCC unroll 8
    for (int quad = 0; quad < kQuads; ++quad) {
      group(b, quad, [&](int r) {
        return BroadcastQuad(w + r * ldw + b * kBlock + quad * 4);
      });
    }
    fold(b);
  }
  if (whole < blocks) {
    // The last block's values up to k; W's bytes past k are not read (they
    // could lie past W's end), x's there are 0 + 128 against a 0.
    const int64_t len = k - whole * kBlock;
    start(whole);
    for (int quad = 0; 4 * quad < len; ++quad) {
      const int64_t bytes = std::min<int64_t>(4, len - 4 * quad);
      group(whole, quad, [&](int r) {
        int32_t bits = 0;
        std::memcpy(&bits, w + r * ldw + whole * kBlock + quad * 4, bytes);
        return _mm512_set1_epi32(bits);
      });
    }
    fold(whole);
  }
#pragma GCC unroll 14
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) _mm512_store_ps(&tile[r][16 * v], sum[r][v]);
  }
}

// What every tile of one call shares: x's panel and the output.
struct RowsProblem {
  const uint8_t *xq;
  const float *xd;
  int64_t ldx, m, k, blocks;
  const int8_t *w;
  int64_t ldw, n;
  const float *scale, *bias;
  float *y;
};

// W rows [j, j + R) against every block of x's rows: two vectors (32 rows)
// at a time when V is 2, the last 16 or fewer in one. The tile's rows of W
// (R k bytes) stay in L1/L2 between blocks of x. With `prefetch`, the
// first block of x's rows brings the next R rows into L2.
template <int R, int V>
void DotRows(const RowsProblem &p, int64_t j, bool prefetch, int32_t *corr) {
  const int8_t *w = p.w + j * p.ldw;
  for (int r = 0; r < R; ++r) {
    BlockCorrections(w + r * p.ldw, p.k, p.blocks, R, corr + r);
  }
  alignas(64) float tile[R][32];
  constexpr int64_t kStep = 16 * V;
  for (int64_t i = 0; i < p.m; i += kStep) {
    const int64_t rows = std::min(kStep, p.m - i);
    const uint8_t *xq = p.xq + i * 4;
    const float *xd = p.xd + i;
    const bool ahead = prefetch && i == 0;
    if (V == 2 && rows > 16) {
      DotTile<R, V>(xq, xd, p.ldx, p.k, w, p.ldw, corr, p.blocks, ahead, tile);
    } else {
      DotTile<R, 1>(xq, xd, p.ldx, p.k, w, p.ldw, corr, p.blocks, ahead, tile);
    }
    for (int64_t l = 0; l < rows; ++l) {
      float *row = p.y + (i + l) * p.n + j;
      for (int r = 0; r < R; ++r) {
        row[r] = tile[r][l] * p.scale[j + r] +
                 (p.bias != nullptr ? p.bias[j + r] : 0.0f);
      }
    }
  }
}

// W rows [first, last), R at a time while they last, then 4, then 1.
template <int R, int V>
void DotRowRange(const RowsProblem &p, int64_t first, int64_t last,
                 int32_t *corr) {
  kernels_internal::ForEachRowTile<R, 4>(
      first, last, [&](auto rows, int64_t j, bool another) {
        DotRows<rows, V>(p, j, another, corr);
      });
}

}  // namespace
}  // namespace moh
#pragma GCC pop_options

namespace moh {

bool Int8DotRowsLinear(const float *x, int64_t m, int64_t k, const int8_t *w,
                       int64_t ldw, int64_t n, const float *scale,
                       const float *bias, float *y) {
  if (!ActiveExtension(CpuExtension::kAvx512Vnni) || m < 1 ||
      m > kMaxStreamedRows || k < 1 || n < 1) {
    return false;
  }
  const int64_t blocks = (k + kBlock - 1) / kBlock;
  // Whole vectors of 16 (m <= 16) or 32 lanes, zero past m.
  const int64_t ldx = kernels_internal::TransposedWidth(m);
  thread_local AlignedBuffer xq_buffer, xd_buffer;
  uint8_t *xq = reinterpret_cast<uint8_t *>(
      xq_buffer.Get(blocks * kBlock * ldx / sizeof(float)));
  float *xd = xd_buffer.Get(blocks * ldx);
  kernels_internal::PackInt8XPanel(x, k, m, ldx, blocks, xq, xd);
  const RowsProblem problem{xq, xd,  ldx, m,     k,    blocks,
                            w,  ldw, n,   scale, bias, y};
  const bool wide = m > 16;
  const int64_t tile_rows = wide ? kWideTileRows : kTileRows;
  kernels_internal::ParallelRowTiles(
      n, tile_rows, m, k, [&](int64_t first, int64_t last) {
        thread_local AlignedBuffer corr_buffer;
        int32_t *corr =
            reinterpret_cast<int32_t *>(corr_buffer.Get(kTileRows * blocks));
        if (wide) {
          DotRowRange<kWideTileRows, 2>(problem, first, last, corr);
        } else {
          DotRowRange<kTileRows, 1>(problem, first, last, corr);
        }
      });
  return true;
}

}  // namespace moh
