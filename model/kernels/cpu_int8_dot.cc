// Int8DotLinear (cpu_int8_dot.h): BlockedLinear's loop nest (cpu_linear.cc)
// over int8. x is quantized once into row panels, W's columns are packed a
// pass at a time by the task that owns them, and a 6 x 32 micro-kernel sums
// each block of 32 products in int32 (vpdpbusd) before scaling it into
// float32. x [512, 2048] times W [2048, 2048]^T on one AMD EPYC core
// (BM_Int8Prefill): 13.7 ms, against 53 ms widening W into BlockedLinear
// and 52 ms for float32 W.
//
// vpdpbusd multiplies unsigned by signed bytes. x goes in unsigned, as
// qx + 128, and W signed as it is stored, so the product carries an extra
// 128 * sum_{p in b} w[j, p], which depends on W's column and block only:
// it is computed as W's block is packed (once per pass, against every row
// of x) and its negation is the int32 accumulators' starting value, a load
// in place of a zeroing. Unsigned W (offset as it is packed) would instead
// need a correction per (row of x, block), 128 * sum_{p in b} qx[i, p],
// applied to every accumulator inside the kernel's loop.
#include "model/kernels/cpu_int8_dot.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "model/kernels/cpu_isa.h"
#include "model/kernels/cpu_streamed_rows.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

namespace moh {
namespace {

using kernels_internal::AlignedBuffer;
using kernels_internal::LaneMask16;

// The micro-kernel's tile: kRows rows of x against kCols columns of y (two
// zmm of 16 int32 each) keep 12 int32 and 12 float32 accumulators, 24 of
// the 32 zmm, beside two vectors of W and a broadcast of x.
constexpr int64_t kRows = 6;
constexpr int64_t kCols = 32;
constexpr int64_t kBlock = kInt8DotBlock;
// 4-byte groups (one vpdpbusd lane) in a block.
constexpr int64_t kQuads = kBlock / 4;
// Bytes of one packed block: x's panel and W's panel.
constexpr int64_t kXBlockBytes = kBlock * kRows;
constexpr int64_t kWBlockBytes = kBlock * kCols;
// Columns of y one task owns (as BlockedLinear's kChunkN), and the longest
// pass over k in blocks: 128 columns x 2048 bytes of packed W (256 KiB) stay
// in L2 while x's panels (12 KiB each) pass through L1.
constexpr int64_t kChunkCols = 4 * kCols;
constexpr int64_t kMaxPassBlocks = 2048 / kBlock;

// The four bytes at p in every int32 lane.
inline __m512i BroadcastQuad(const uint8_t *p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

}  // namespace
}  // namespace moh

namespace moh::kernels_internal {

void PackInt8XPanel(const float *x, int64_t k, int64_t rows, int64_t width,
                    int64_t blocks, uint8_t *out, float *scales) {
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t *block = out + b * kBlock * width;
    const int64_t p0 = b * kBlock;
    const int64_t len = std::min(kBlock, k - p0);
    const __mmask16 mask0 = LaneMask16(len), mask1 = LaneMask16(len - 16);
    for (int64_t r = 0; r < width; ++r) {
      alignas(32) uint8_t q[kBlock];
      float d = 0.0f;
      if (r < rows) {
        const float *row = x + r * k + p0;
        const __m512 v0 = _mm512_maskz_loadu_ps(mask0, row);
        const __m512 v1 = _mm512_maskz_loadu_ps(mask1, row + 16);
        const float largest = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        d = largest / 127.0f;
        const __m512 inverse = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        // cvtps rounds as MXCSR says: to nearest, ties to even.
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inverse));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inverse));
        _mm_store_si128(reinterpret_cast<__m128i *>(q),
                        _mm_xor_si128(_mm512_cvtepi32_epi8(q0), flip));
        _mm_store_si128(reinterpret_cast<__m128i *>(q + 16),
                        _mm_xor_si128(_mm512_cvtepi32_epi8(q1), flip));
      } else {
        std::memset(q, 0x80, sizeof q);
      }
      scales[b * width + r] = d;
      for (int64_t quad = 0; quad < kQuads; ++quad) {
        std::memcpy(block + (quad * width + r) * 4, q + quad * 4, 4);
      }
    }
  }
}

}  // namespace moh::kernels_internal

namespace moh {
namespace {

// W's rows [0, cols) (cols <= kCols), blocks [b0, b0 + blocks), packed into
// one panel: block b at out + b * kWBlockBytes holds [quad][column][4 bytes]
// (one zmm: 16 columns x 4 values of k), rows past `cols` and values past k
// zero; corr [b][kCols] is -128 times each column's sum over the block.
void PackWPanel(const int8_t *w, int64_t ldw, int64_t cols, int64_t k,
                int64_t b0, int64_t blocks, int8_t *out, int32_t *corr) {
  const __m512i u128 = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < blocks; ++b) {
    int8_t *block = out + b * kWBlockBytes;
    const int64_t p0 = (b0 + b) * kBlock;
    const int64_t len = std::min(kBlock, k - p0);
    for (int64_t c = 0; c < kCols; ++c) {
      int8_t v[kBlock] = {};
      if (c < cols) std::memcpy(v, w + c * ldw + p0, len);
      for (int64_t quad = 0; quad < kQuads; ++quad) {
        std::memcpy(block + (quad * kCols + c) * 4, v + quad * 4, 4);
      }
    }
    // The correction by the kernel's own arithmetic: 128 (unsigned) times
    // each packed value, summed per column.
    __m512i sum0 = _mm512_setzero_si512(), sum1 = _mm512_setzero_si512();
    for (int64_t quad = 0; quad < kQuads; ++quad) {
      const int8_t *wq = block + quad * kCols * 4;
      sum0 = _mm512_dpbusd_epi32(sum0, u128, _mm512_load_si512(wq));
      sum1 = _mm512_dpbusd_epi32(sum1, u128, _mm512_load_si512(wq + 64));
    }
    _mm512_store_si512(corr + b * kCols,
                       _mm512_sub_epi32(_mm512_setzero_si512(), sum0));
    _mm512_store_si512(corr + b * kCols + 16,
                       _mm512_sub_epi32(_mm512_setzero_si512(), sum1));
  }
}

// y rows [0, rows) x columns [0, cols) (at most kRows x kCols, row stride
// ldy) = sum over `blocks` blocks of x's panel (xq, its scales xs) times
// W's (wq, corr), times scale; plus what y holds when `accumulate` (a later
// pass over k), else plus bias (may be null). scale and bias point at the
// tile's first column.
void DotKernel(int64_t blocks, const uint8_t *xq, const float *xs,
               const int8_t *wq, const int32_t *corr, const float *scale,
               const float *bias, bool accumulate, float *y, int64_t ldy,
               int64_t rows, int64_t cols) {
  __m512 sum[kRows][2];
#pragma GCC unroll 6
  for (int i = 0; i < kRows; ++i) {
    sum[i][0] = _mm512_setzero_ps();
    sum[i][1] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t *xb = xq + b * kXBlockBytes;
    const int8_t *wb = wq + b * kWBlockBytes;
    const __m512i c0 = _mm512_load_si512(corr + b * kCols);
    const __m512i c1 = _mm512_load_si512(corr + b * kCols + 16);
    __m512i acc[kRows][2];
#pragma GCC unroll 6
    for (int i = 0; i < kRows; ++i) {
      acc[i][0] = c0;
      acc[i][1] = c1;
    }
#pragma GCC unroll 8
    for (int quad = 0; quad < kQuads; ++quad) {
      const __m512i w0 = _mm512_load_si512(wb + quad * kCols * 4);
      const __m512i w1 = _mm512_load_si512(wb + quad * kCols * 4 + 64);
#pragma GCC unroll 6
      for (int i = 0; i < kRows; ++i) {
        const __m512i xv = BroadcastQuad(xb + (quad * kRows + i) * 4);
        acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], xv, w0);
        acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], xv, w1);
      }
    }
    // The block's sums are exact in float32 (|sum| <= 32 * 127 * 127).
#pragma GCC unroll 6
    for (int i = 0; i < kRows; ++i) {
      const __m512 d = _mm512_set1_ps(xs[b * kRows + i]);
      sum[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][0]), d, sum[i][0]);
      sum[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][1]), d, sum[i][1]);
    }
  }
  const __mmask16 mask0 = LaneMask16(cols), mask1 = LaneMask16(cols - 16);
  const __m512 s0 = _mm512_maskz_loadu_ps(mask0, scale);
  const __m512 s1 = _mm512_maskz_loadu_ps(mask1, scale + 16);
  const __m512 a0 = bias != nullptr ? _mm512_maskz_loadu_ps(mask0, bias)
                                    : _mm512_setzero_ps();
  const __m512 a1 = bias != nullptr ? _mm512_maskz_loadu_ps(mask1, bias + 16)
                                    : _mm512_setzero_ps();
  // Unrolled so that sum is indexed by constants and stays in registers.
#pragma GCC unroll 6
  for (int i = 0; i < kRows; ++i) {
    if (i >= rows) break;
    float *row = y + i * ldy;
    const __m512 add0 = accumulate ? _mm512_maskz_loadu_ps(mask0, row) : a0;
    const __m512 add1 =
        accumulate ? _mm512_maskz_loadu_ps(mask1, row + 16) : a1;
    _mm512_mask_storeu_ps(row, mask0, _mm512_fmadd_ps(sum[i][0], s0, add0));
    _mm512_mask_storeu_ps(row + 16, mask1,
                          _mm512_fmadd_ps(sum[i][1], s1, add1));
  }
}

// x quantized into panels of kRows rows: panel t's blocks at
// q + t * blocks * kXBlockBytes, its scales at d + t * blocks * kRows.
struct PackedX {
  const uint8_t *q;
  const float *d;
  int64_t blocks;
};

// How Int8DotLinear cuts k's blocks: `count` passes of `blocks` (the last
// shorter).
struct Passes {
  int64_t count, blocks;
};

// y rows [i0, i1) (i0 a multiple of kRows) x columns [n0, n1): one task.
// It packs its own columns of W, one pass at a time.
void DotColumns(const PackedX &x, const Passes &passes, int64_t k,
                const int8_t *w, int64_t ldw, int64_t n, const float *scale,
                const float *bias, int64_t i0, int64_t i1, int64_t n0,
                int64_t n1, float *y) {
  thread_local AlignedBuffer w_buffer, corr_buffer;
  const int64_t panels = (n1 - n0 + kCols - 1) / kCols;
  int8_t *wp = reinterpret_cast<int8_t *>(
      w_buffer.Get(panels * passes.blocks * kWBlockBytes / sizeof(float)));
  int32_t *corr = reinterpret_cast<int32_t *>(
      corr_buffer.Get(panels * passes.blocks * kCols));
  for (int64_t pass = 0; pass < passes.count; ++pass) {
    const int64_t b0 = pass * passes.blocks;
    const int64_t blocks = std::min(passes.blocks, x.blocks - b0);
    for (int64_t j = 0; j < panels; ++j) {
      const int64_t c0 = n0 + j * kCols;
      PackWPanel(w + c0 * ldw, ldw, std::min(kCols, n1 - c0), k, b0, blocks,
                 wp + j * blocks * kWBlockBytes, corr + j * blocks * kCols);
    }
    for (int64_t i = i0; i < i1; i += kRows) {
      const int64_t t = i / kRows;
      const uint8_t *xq = x.q + (t * x.blocks + b0) * kXBlockBytes;
      const float *xd = x.d + (t * x.blocks + b0) * kRows;
      for (int64_t j = 0; j < panels; ++j) {
        const int64_t c0 = n0 + j * kCols;
        DotKernel(blocks, xq, xd, wp + j * blocks * kWBlockBytes,
                  corr + j * blocks * kCols, scale + c0,
                  bias != nullptr ? bias + c0 : nullptr, pass > 0,
                  y + i * n + c0, n, std::min(kRows, i1 - i),
                  std::min(kCols, n1 - c0));
      }
    }
  }
}

}  // namespace
}  // namespace moh

// The dispatcher below is compiled for the baseline instruction set: it runs
// (and checks the CPU) before any of the kernels above.
#pragma GCC pop_options

namespace moh {

bool Int8DotLinear(const float *x, int64_t m, int64_t k, const int8_t *w,
                   int64_t ldw, int64_t n, const float *scale,
                   const float *bias, float *y) {
  if (!ActiveExtension(CpuExtension::kAvx512Vnni) || m < 1 || k < 1 || n < 1) {
    return false;
  }
  const int64_t blocks = (k + kBlock - 1) / kBlock;
  const int64_t panels = (m + kRows - 1) / kRows;
  // x, quantized once for every task into this thread's buffers.
  thread_local AlignedBuffer xq_buffer, xd_buffer;
  uint8_t *xq = reinterpret_cast<uint8_t *>(
      xq_buffer.Get(panels * blocks * kXBlockBytes / sizeof(float)));
  float *xd = xd_buffer.Get(panels * blocks * kRows);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      kernels_internal::PackInt8XPanel(
          x + t * kRows * k, k, std::min(kRows, m - t * kRows), kRows, blocks,
          xq + t * blocks * kXBlockBytes, xd + t * blocks * kRows);
    }
  });
  const int64_t count = (blocks + kMaxPassBlocks - 1) / kMaxPassBlocks;
  const Passes passes{count, (blocks + count - 1) / count};
  // As BlockedLinear's tasks (RunBlockTasks).
  const PackedX packed{xq, xd, blocks};
  kernels_internal::RunBlockTasks(
      m, kRows, n, kChunkCols, true,
      [&](int64_t i0, int64_t i1, int64_t n0, int64_t n1) {
        DotColumns(packed, passes, k, w, ldw, n, scale, bias, i0, i1, n0, n1,
                   y);
      });
  return true;
}

}  // namespace moh
