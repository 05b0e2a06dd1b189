// Bf16DotLinear: BlockedLinear's loop nest (cpu_linear.cc) over pairs of k.
// vdpbf16ps adds, in each float32 lane, the products of that lane's two
// bfloat16 values in both operands, so both sides are packed in 32-bit
// elements that each hold two consecutive values of k (the lower one in the
// low half): x as [pairs][kBlockM] micro-panels, broadcast one element (one
// row, one pair) at a time, and W as [pairs][kBlockN] blocks, one load being
// 16 columns by one pair. Packing either side is then BlockedLinear's
// 32-bit transpose (PackPanel), W's values moved as they are, never widened.
#include "model/kernels/cpu_bf16_dot.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "model/kernels/cpu_isa.h"
#include "model/kernels/cpu_streamed_rows.h"

namespace moh {
namespace {

using kernels_internal::AlignedBuffer;
using kernels_internal::kMinParallelMacs;
using kernels_internal::LaneMask16;
using kernels_internal::PackPanel;
using kernels_internal::RunTasks;

// The micro-kernel's tile of y: 14 rows by 32 columns in 28 of the 32 zmm
// registers, as BlockedLinear's, with each step taking a pair of k instead
// of one value.
constexpr int64_t kBlockM = 14;
constexpr int64_t kBlockN = 32;
// Longest pass over k, in pairs: a packed x micro-panel, 14 x 512 x 4
// bytes (28 KiB), stays in L1 while the W block under it, 512 pairs of
// kChunkN columns (256 KiB), streams from L2. The same bytes as
// BlockedLinear's 512 float32 steps, twice the depth.
constexpr int64_t kMaxPairs = 512;
// Columns of y one parallel task owns.
constexpr int64_t kChunkN = 4 * kBlockN;

// How k's pairs are cut: `count` passes of `pairs` (the last shorter).
struct Passes {
  int64_t count, pairs;
};
Passes CutPairs(int64_t k_pairs) {
  const int64_t count = (k_pairs + kMaxPairs - 1) / kMaxPairs;
  return {count, (k_pairs + count - 1) / count};
}

}  // namespace
}  // namespace moh

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16,avx512bw,avx512vl")
namespace moh {
namespace {

// y rows [0, rows) x columns [0, cols) (rows <= kBlockM, cols <= kBlockN)
// = (or +=, when `accumulate`) packed x [pairs][kBlockM] times packed W
// [pairs][kBlockN], plus bias [cols] when not null.
void DotKernel(int64_t pairs, const float *xp, const float *wp, float *y,
               int64_t ldy, int64_t rows, int64_t cols, bool accumulate,
               const float *bias) {
  __m512 acc[kBlockM][2];
#pragma GCC unroll 14
  for (int i = 0; i < kBlockM; ++i) {
    acc[i][0] = _mm512_setzero_ps();
    acc[i][1] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh w0 = __m512bh(_mm512_castps_si512(_mm512_load_ps(wp)));
    const __m512bh w1 = __m512bh(_mm512_castps_si512(_mm512_load_ps(wp + 16)));
#pragma GCC unroll 14
    for (int i = 0; i < kBlockM; ++i) {
      const __m512bh xv = __m512bh(_mm512_castps_si512(_mm512_set1_ps(xp[i])));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, w1);
    }
    xp += kBlockM;
    wp += kBlockN;
  }
  const __mmask16 mask0 = LaneMask16(cols), mask1 = LaneMask16(cols - 16);
  const __m512 b0 = bias != nullptr ? _mm512_maskz_loadu_ps(mask0, bias)
                                    : _mm512_setzero_ps();
  const __m512 b1 = bias != nullptr ? _mm512_maskz_loadu_ps(mask1, bias + 16)
                                    : _mm512_setzero_ps();
  // Unrolled so that acc is indexed by constants and stays in registers
  // (BlockKernel's note in cpu_linear.cc).
#pragma GCC unroll 14
  for (int i = 0; i < kBlockM; ++i) {
    if (i >= rows) break;
    float *row = y + i * ldy;
    __m512 v0 = _mm512_add_ps(acc[i][0], b0);
    __m512 v1 = _mm512_add_ps(acc[i][1], b1);
    if (accumulate) {
      v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(mask0, row));
      v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(mask1, row + 16));
    }
    _mm512_mask_storeu_ps(row, mask0, v0);
    _mm512_mask_storeu_ps(row + 16, mask1, v1);
  }
}

}  // namespace

namespace kernels_internal {

// rows of x [., k] rounded to bfloat16 (nearest, ties to even) into out
// [rows][k_pairs] (row stride k_pairs), pairs of k in each 32-bit element;
// an odd k's last pair has a zero above it.
void RoundRowsBf16(const float *x, int64_t rows, int64_t k, int64_t k_pairs,
                   float *out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float *from = x + r * k;
    float *to = out + r * k_pairs;
    for (int64_t p = 0; p < k; p += 32) {
      const int64_t left = std::min<int64_t>(32, k - p);
      const __mmask16 lo_mask = LaneMask16(left);
      const __mmask16 hi_mask = LaneMask16(left - 16);
      const __m512 lo = _mm512_maskz_loadu_ps(lo_mask, from + p);
      const __m512 hi = _mm512_maskz_loadu_ps(hi_mask, from + p + 16);
      // Values p .. p + 15 from `lo` into the low 16 bfloat16s, in order.
      const __m512bh both = _mm512_cvtne2ps_pbh(hi, lo);
      const int64_t pairs = (left + 1) / 2;
      const __mmask16 store_mask = LaneMask16(pairs);
      _mm512_mask_storeu_ps(to + p / 2, store_mask,
                            _mm512_castsi512_ps(__m512i(both)));
    }
  }
}

}  // namespace kernels_internal
}  // namespace moh
#pragma GCC pop_options

namespace moh {
namespace {

// W's rows [0, cols) (cols <= kBlockN), pairs [q0, q0 + pairs) of k, into
// out [pairs][kBlockN]: element [q][c] holds W[c][2 (q0 + q)] in its low
// half and W[c][2 (q0 + q) + 1] (zero past k) in its high half; columns
// from cols on are zero.
void PackWeights(const uint16_t *w, int64_t ldw, int64_t cols, int64_t k,
                 int64_t q0, int64_t pairs, float *out) {
  // Pairs inside k, and of those the ones PackPanel moves as float32 (whole
  // blocks of its 16 x 16 transposes), when W's pairs are 32-bit aligned.
  const int64_t whole = std::min(pairs, k / 2 - q0);
  const bool aligned = ldw % 2 == 0 && reinterpret_cast<uintptr_t>(w) % 4 == 0;
  const int64_t moved = aligned ? whole / 16 * 16 : 0;
  if (moved > 0) {
    PackPanel({reinterpret_cast<const float *>(w + 2 * q0), ldw / 2}, cols,
              moved, kBlockN, out);
  }
  for (int64_t q = moved; q < pairs; ++q) {
    const int64_t p = 2 * (q0 + q);
    float *to = out + q * kBlockN;
    for (int64_t c = 0; c < cols; ++c) {
      const uint16_t *from = w + c * ldw + p;
      const uint32_t bits =
          from[0] | (p + 1 < k ? uint32_t{from[1]} << 16 : uint32_t{0});
      std::memcpy(to + c, &bits, sizeof bits);
    }
    for (int64_t c = cols; c < kBlockN; ++c) to[c] = 0.0f;
  }
}

// What the tasks of one Bf16DotLinear share.
struct DotProblem {
  const float *xp;  // x packed: pass by pass, kBlockM-row panels
  int64_t k, k_pairs, padded_m;
  Passes passes;
  const uint16_t *w;
  int64_t ldw, n;
  const float *bias;
  float *y;
};

// y rows [m0, m1) x columns [n0, n1) (m0 a multiple of kBlockM): one task.
// It packs its own columns of W, one pass at a time.
void DotColumns(const DotProblem &d, int64_t m0, int64_t m1, int64_t n0,
                int64_t n1) {
  thread_local AlignedBuffer w_buffer;
  const int64_t cols = n1 - n0;
  float *wp = w_buffer.Get(kChunkN * d.passes.pairs);
  for (int64_t pass = 0; pass < d.passes.count; ++pass) {
    const int64_t q0 = pass * d.passes.pairs;
    const int64_t pairs = std::min(d.passes.pairs, d.k_pairs - q0);
    for (int64_t j = 0; j < cols; j += kBlockN) {
      PackWeights(d.w + (n0 + j) * d.ldw, d.ldw, std::min(kBlockN, cols - j),
                  d.k, q0, pairs, wp + j * pairs);
    }
    const float *x_pass = d.xp + q0 * d.padded_m;
    const bool last = pass + 1 == d.passes.count;
    for (int64_t i = m0; i < m1; i += kBlockM) {
      for (int64_t j = 0; j < cols; j += kBlockN) {
        const float *bias =
            last && d.bias != nullptr ? d.bias + n0 + j : nullptr;
        DotKernel(pairs, x_pass + i * pairs, wp + j * pairs,
                  d.y + i * d.n + n0 + j, d.n, std::min(kBlockM, m1 - i),
                  std::min(kBlockN, cols - j), pass > 0, bias);
      }
    }
  }
}

}  // namespace

bool Bf16DotLinear(const float *x, int64_t m, int64_t k, const uint16_t *w,
                   int64_t ldw, int64_t n, const float *bias, float *y) {
  if (!ActiveExtension(CpuExtension::kAvx512Bf16) || m < 1 || k < 1 || n < 1) {
    return false;
  }
  const int64_t k_pairs = (k + 1) / 2;
  const Passes passes = CutPairs(k_pairs);
  const int64_t panels = (m + kBlockM - 1) / kBlockM;
  const int64_t padded_m = panels * kBlockM;
  const int64_t threads =
      m * k * n >= kMinParallelMacs && !at::in_parallel_region()
          ? at::get_num_threads()
          : 1;
  thread_local AlignedBuffer x_buffer;
  float *xp = x_buffer.Get(padded_m * k_pairs);
  // x rounded and packed once for every task, a panel of rows at a time.
  RunTasks(panels, threads > 1, [&](int64_t begin, int64_t end) {
    thread_local AlignedBuffer rounded_buffer;
    float *rounded = rounded_buffer.Get(kBlockM * k_pairs);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t * kBlockM, rows = std::min(kBlockM, m - i);
      kernels_internal::RoundRowsBf16(x + i * k, rows, k, k_pairs, rounded);
      for (int64_t pass = 0; pass < passes.count; ++pass) {
        const int64_t q0 = pass * passes.pairs;
        const int64_t pairs = std::min(passes.pairs, k_pairs - q0);
        PackPanel({rounded + q0, k_pairs}, rows, pairs, kBlockM,
                  xp + q0 * padded_m + i * pairs);
      }
    }
  });
  // Threads split y's columns into chunks of kChunkN and, when those are
  // fewer than the threads, its rows into as many groups as make up the
  // difference (each group packs its own copy of W's chunk).
  const int64_t column_tasks = (n + kChunkN - 1) / kChunkN;
  const int64_t row_groups = std::min(
      panels,
      std::max<int64_t>(1, (threads + column_tasks - 1) / column_tasks));
  const DotProblem problem{xp, k,   k_pairs, padded_m, passes,
                           w,  ldw, n,       bias,     y};
  RunTasks(
      column_tasks * row_groups, threads > 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t group = t / column_tasks;
          const int64_t column = t % column_tasks;
          DotColumns(problem, group * panels / row_groups * kBlockM,
                     std::min(m, (group + 1) * panels / row_groups * kBlockM),
                     column * kChunkN, std::min(n, (column + 1) * kChunkN));
        }
      });
  return true;
}

}  // namespace moh
