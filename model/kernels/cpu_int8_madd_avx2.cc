// Int8MaddRowsLinear and Int8MaddLinear (cpu_int8_dot.h): Int8DotLinear's
// numerics on AVX2 + FMA, which has no vpdpbusd, for decode batches and
// prefills. In both, x is quantized per 32 values once, into int16; W's
// values are widened to int16 and multiplied in pairs by vpmaddwd into
// int32. Int8MaddLinear's loop nest is described where it begins, below.
//
// Int8MaddRowsLinear: W's rows are read in place and widened in registers
// (vpmovsxbw, 16 values a load). The products are exact for any int8 W
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
using kernels_internal::kMinParallelMacs;
using kernels_internal::LoadHead8;
using kernels_internal::StoreHead8;

constexpr int64_t kBlock = kInt8DotBlock;
// Values of x (rows times k) from which its quantization splits its rows
// over the intra-op pool.
constexpr int64_t kMinQuantizeParallelValues = 1 << 16;

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

// Int8MaddLinear: BlockedLinear's loop nest (as Int8DotLinear's) around a
// kPrefillRows x kPrefillCols micro-kernel. W's columns are packed a pass at a
// time, widened to int16, as [pair of k][column][2]: one ymm holds 8
// columns' pairs, against which each row of x broadcasts its pair (4 bytes
// of its quantized row, read in place). Per pair of k: 2 loads of W, a
// broadcast per row of x, and per row 2 vpmaddwd and 2 vpaddd into int32
// accumulators, scaled into float32 once per block: 16 multiply-adds a
// vpmaddwd, against 8 an FMA of the widened float32 path.
constexpr int64_t kPrefillRows = 4;
constexpr int64_t kPrefillCols = 16;
constexpr int64_t kPairs = kBlock / 2;
// int16 values of one packed block of W's panel.
constexpr int64_t kWBlockValues = kBlock * kPrefillCols;
// Columns of y one task owns, and the longest pass over k in blocks: 128
// columns x 1024 values of k in int16 (256 KiB) stay in L2 while x's rows
// pass through L1.
constexpr int64_t kChunkCols = 8 * kPrefillCols;
constexpr int64_t kMaxPassBlocks = 1024 / kBlock;

// W's rows [0, cols) (cols <= kPrefillCols), blocks [b0, b0 + blocks),
// packed into one panel: block b at out + b * kWBlockValues holds
// [pair][column][2] int16, rows past `cols` and values past k zero. Each
// group of 8 rows goes through 8 x 8 transposes of their pairs.
void PackWPanel(const int8_t *w, int64_t ldw, int64_t cols, int64_t k,
                int64_t b0, int64_t blocks, int16_t *out) {
  for (int64_t b = 0; b < blocks; ++b) {
    int16_t *block = out + b * kWBlockValues;
    const int64_t p0 = (b0 + b) * kBlock;
    const int64_t len = std::min(kBlock, k - p0);
    for (int64_t g = 0; g < kPrefillCols / 8; ++g) {
      __m256 lo[8], hi[8];
      for (int64_t c = 0; c < 8; ++c) {
        const int64_t col = 8 * g + c;
        alignas(32) int8_t padded[kBlock];
        const int8_t *from = w + col * ldw + p0;
        if (col >= cols || len < kBlock) {
          // Past W's rows, or its last block: nothing read past k.
          std::memset(padded, 0, sizeof padded);
          if (col < cols) std::memcpy(padded, from, len);
          from = padded;
        }
        lo[c] = _mm256_castsi256_ps(_mm256_cvtepi8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i *>(from))));
        hi[c] = _mm256_castsi256_ps(_mm256_cvtepi8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i *>(from + 16))));
      }
      // Row c of lo is column c's pairs 0-7 (32 bits each); its transpose's
      // row q, pair q of the 8 columns.
      __m256 tlo[8], thi[8];
      kernels_internal::Transpose8x8(lo, tlo);
      kernels_internal::Transpose8x8(hi, thi);
      for (int64_t q = 0; q < 8; ++q) {
        _mm256_store_ps(
            reinterpret_cast<float *>(block + (q * kPrefillCols + 8 * g) * 2),
            tlo[q]);
        _mm256_store_ps(reinterpret_cast<float *>(
                            block + ((q + 8) * kPrefillCols + 8 * g) * 2),
                        thi[q]);
      }
    }
  }
}

// y rows [0, rows) x columns [0, cols) (at most kPrefillRows x kPrefillCols,
// row stride ldy) = sum over `blocks` blocks of x's rows (xq, row stride ldq,
// from the pass's first block; their scales xd, row stride ldd) times W's
// packed panel wq, times scale; plus what y holds when `accumulate` (a later
// pass over k), else plus bias (may be null). scale and bias point at the
// tile's first column. Rows of x past `rows` are read again from the last.
void MaddKernel(int64_t blocks, const int16_t *xq, int64_t ldq, const float *xd,
                int64_t ldd, const int16_t *wq, const float *scale,
                const float *bias, bool accumulate, float *y, int64_t ldy,
                int64_t rows, int64_t cols) {
  const int16_t *x_rows[kPrefillRows];
  const float *d_rows[kPrefillRows];
  for (int64_t i = 0; i < kPrefillRows; ++i) {
    x_rows[i] = xq + std::min(i, rows - 1) * ldq;
    d_rows[i] = xd + std::min(i, rows - 1) * ldd;
  }
  // The float32 sums live in memory: the int32 accumulators, W and x's
  // broadcast take the registers inside the block (in registers as well,
  // GCC spilled some of those every step).
  alignas(32) float sum[kPrefillRows][kPrefillCols] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const int16_t *wb = wq + b * kWBlockValues;
    __m256i acc[kPrefillRows][2];
#pragma GCC unroll 4
    for (int i = 0; i < kPrefillRows; ++i) {
      acc[i][0] = _mm256_setzero_si256();
      acc[i][1] = _mm256_setzero_si256();
    }
#pragma GCC unroll 2
    for (int q = 0; q < kPairs; ++q) {
      const __m256i w0 = _mm256_load_si256(
          reinterpret_cast<const __m256i *>(wb + q * kPrefillCols * 2));
      const __m256i w1 = _mm256_load_si256(
          reinterpret_cast<const __m256i *>(wb + q * kPrefillCols * 2 + 16));
#pragma GCC unroll 4
      for (int i = 0; i < kPrefillRows; ++i) {
        int32_t pair;
        std::memcpy(&pair, x_rows[i] + b * kBlock + 2 * q, sizeof pair);
        const __m256i xv = _mm256_set1_epi32(pair);
        acc[i][0] = _mm256_add_epi32(_mm256_madd_epi16(xv, w0), acc[i][0]);
        acc[i][1] = _mm256_add_epi32(_mm256_madd_epi16(xv, w1), acc[i][1]);
      }
    }
    // The block's sums are exact in float32 (|sum| <= 32 * 127 * 128).
#pragma GCC unroll 4
    for (int i = 0; i < kPrefillRows; ++i) {
      const __m256 d = _mm256_broadcast_ss(d_rows[i] + b);
      _mm256_store_ps(sum[i], _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][0]), d,
                                              _mm256_load_ps(sum[i])));
      _mm256_store_ps(sum[i] + 8,
                      _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][1]), d,
                                      _mm256_load_ps(sum[i] + 8)));
    }
  }
  const __m256 s0 = LoadHead8(scale, cols), s1 = LoadHead8(scale + 8, cols - 8);
  const __m256 a0 =
      bias != nullptr ? LoadHead8(bias, cols) : _mm256_setzero_ps();
  const __m256 a1 =
      bias != nullptr ? LoadHead8(bias + 8, cols - 8) : _mm256_setzero_ps();
  for (int64_t i = 0; i < rows; ++i) {
    float *row = y + i * ldy;
    const __m256 add0 = accumulate ? LoadHead8(row, cols) : a0;
    const __m256 add1 = accumulate ? LoadHead8(row + 8, cols - 8) : a1;
    StoreHead8(row, _mm256_fmadd_ps(_mm256_load_ps(sum[i]), s0, add0), cols);
    StoreHead8(row + 8, _mm256_fmadd_ps(_mm256_load_ps(sum[i] + 8), s1, add1),
               cols - 8);
  }
}

// y rows [i0, i1) x columns [n0, n1): one task of Int8MaddLinear. It packs
// its own columns of W, one pass of at most kMaxPassBlocks blocks at a time.
void MaddColumns(const MaddProblem &p, int64_t pass_blocks, int64_t i0,
                 int64_t i1, int64_t n0, int64_t n1) {
  thread_local AlignedBuffer w_buffer;
  const int64_t panels = (n1 - n0 + kPrefillCols - 1) / kPrefillCols;
  int16_t *wp = reinterpret_cast<int16_t *>(w_buffer.Get(
      panels * pass_blocks * kWBlockValues * sizeof(int16_t) / sizeof(float)));
  const int64_t ldq = p.x.blocks * kBlock;
  for (int64_t b0 = 0; b0 < p.x.blocks; b0 += pass_blocks) {
    const int64_t blocks = std::min(pass_blocks, p.x.blocks - b0);
    for (int64_t j = 0; j < panels; ++j) {
      const int64_t c0 = n0 + j * kPrefillCols;
      PackWPanel(p.w + c0 * p.ldw, p.ldw, std::min(kPrefillCols, n1 - c0), p.k,
                 b0, blocks, wp + j * blocks * kWBlockValues);
    }
    for (int64_t i = i0; i < i1; i += kPrefillRows) {
      for (int64_t j = 0; j < panels; ++j) {
        const int64_t c0 = n0 + j * kPrefillCols;
        MaddKernel(blocks, p.x.q + i * ldq + b0 * kBlock, ldq,
                   p.x.d + i * p.x.blocks + b0, p.x.blocks,
                   wp + j * blocks * kWBlockValues, p.scale + c0,
                   p.bias != nullptr ? p.bias + c0 : nullptr, b0 > 0,
                   p.y + i * p.n + c0, p.n, std::min(kPrefillRows, i1 - i),
                   std::min(kPrefillCols, n1 - c0));
      }
    }
  }
}

}  // namespace
}  // namespace moh
#pragma GCC pop_options

namespace moh {

namespace {

// x [m, k] quantized as Int8DotLinear documents into this thread's buffers,
// the rows split on the intra-op pool when there are enough of them.
QuantizedRows QuantizeRows(const float *x, int64_t m, int64_t k) {
  const int64_t blocks = (k + kBlock - 1) / kBlock;
  thread_local AlignedBuffer q_buffer, d_buffer;
  int16_t *q = reinterpret_cast<int16_t *>(
      q_buffer.Get(m * blocks * kBlock * sizeof(int16_t) / sizeof(float)));
  float *d = d_buffer.Get(m * blocks);
  kernels_internal::RunTasks(
      m, m * k >= kMinQuantizeParallelValues, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          QuantizeRow(x + i * k, k, blocks, q + i * blocks * kBlock,
                      d + i * blocks);
        }
      });
  return {q, d, blocks};
}

}  // namespace

bool Int8MaddRowsLinear(const float *x, int64_t m, int64_t k, const int8_t *w,
                        int64_t ldw, int64_t n, const float *scale,
                        const float *bias, float *y) {
  if (ActiveIsa() == CpuIsa::kPortable || m < 1 || m > kMaxStreamedRows ||
      k < 1 || n < 1) {
    return false;
  }
  const MaddProblem problem{
      QuantizeRows(x, m, k), m, k, w, ldw, n, scale, bias, y};
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

bool Int8MaddLinear(const float *x, int64_t m, int64_t k, const int8_t *w,
                    int64_t ldw, int64_t n, const float *scale,
                    const float *bias, float *y) {
  if (ActiveIsa() == CpuIsa::kPortable || m < 1 || k < 1 || n < 1) {
    return false;
  }
  const MaddProblem problem{
      QuantizeRows(x, m, k), m, k, w, ldw, n, scale, bias, y};
  const int64_t blocks = problem.x.blocks;
  const int64_t passes = (blocks + kMaxPassBlocks - 1) / kMaxPassBlocks;
  const int64_t pass_blocks = (blocks + passes - 1) / passes;
  kernels_internal::RunBlockTasks(
      m, kPrefillRows, n, kChunkCols, m * k * n >= kMinParallelMacs,
      [&](int64_t i0, int64_t i1, int64_t n0, int64_t n1) {
        MaddColumns(problem, pass_blocks, i0, i1, n0, n1);
      });
  return true;
}

}  // namespace moh
