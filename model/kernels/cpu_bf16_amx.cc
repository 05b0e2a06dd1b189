// Bf16AmxLinear (cpu_bf16_dot.h): a bfloat16 W's product on AMX-BF16,
// computed as y^T = W x^T so that W's rows are the tiles' left operand as
// they lie in memory: a tile row is 32 consecutive values of k of one row of
// W, loaded with W's row stride, never packed or copied (an earlier version
// packed W into pairs first: at 16 rows of x that took twice the tiles'
// time). x is the right operand, rounded once into pairs of k and
// transposed into panels of 32 rows ([pairs][32 rows], one 32-bit pair per
// element). Eight tile registers of 16 rows x 64 bytes: tmm0-3 a 32 x 32
// block of y^T in float32, tmm4-5 two 16-row tiles of W, tmm6-7 x's two
// 16-row halves of a panel; each step of 32 values of k is four loads and
// four tdpbf16ps. The last part of k (or of W's rows) that is not a whole
// tile is read from a zero-padded copy, as W's bytes past k may not be
// there; y is written as 16 x 16 transposes of the sums.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "model/kernels/cpu_bf16_dot.h"
#include "model/kernels/cpu_isa.h"
#include "model/kernels/cpu_streamed_rows.h"

namespace moh {
namespace {

using kernels_internal::AlignedBuffer;
using kernels_internal::kMinParallelMacs;
using kernels_internal::LaneMask16;
using kernels_internal::PackPanel;
using kernels_internal::RunTasks;

// Rows of a tile; a block of y^T is 2 x 2 tiles: 32 rows of W by 32 of x.
constexpr int64_t kTileRows = 16;
constexpr int64_t kBlock = 2 * kTileRows;
// Values of k one step reads (a tile row: 64 bytes of bfloat16), and pairs.
constexpr int64_t kStep = 32;
constexpr int64_t kStepPairs = kStep / 2;
// Rows of W one task runs against its rows of x: 256 rows of 2,048 values
// are 1 MiB, in L2 while each panel of x passes them.
constexpr int64_t kTaskRows = 256;

// The LDTILECFG operand: palette 1, every tile 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// 32 rows of W as the tiles read them: the whole steps in place (`rows`,
// row stride `ld` values), the last part of k from `tail` ([32][kStep],
// zero past k; null when k is whole steps).
struct WRows {
  const uint16_t *rows;
  int64_t ld;
  const uint16_t *tail;
};

// What the tasks of one Bf16AmxLinear share.
struct AmxProblem {
  const float *xp;  // x's panels: [panel][padded pairs][kBlock] pairs
  int64_t m, k, padded_pairs;
  const uint16_t *w;
  int64_t ldw, n;
  const float *bias;
  float *y;
};

}  // namespace
}  // namespace moh

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")
namespace moh {
namespace {

void ConfigureTiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = kTileRows;
  }
  // Not _tile_loadconfig: GCC 12's names one byte of the operand as read,
  // so the stores of the rest were dropped as dead (a #GP on ldtilecfg).
  __asm__ volatile("ldtilecfg %0" : : "m"(config));
}

void ReleaseTiles() { _tile_release(); }

// The four accumulator tiles += 32 rows of W (two tiles of 16 rows at
// `w`, row stride `w_stride` bytes) times 32 rows of x (a panel's step:
// 16 pairs of k by 32 rows at `x`).
inline void AmxStep(const uint16_t *w, int64_t w_rows_apart, int64_t w_stride,
                    const float *x) {
  constexpr int64_t kPanelStride = kBlock * sizeof(float);
  _tile_loadd(4, w, w_stride);
  _tile_loadd(5, w + w_rows_apart, w_stride);
  _tile_loadd(6, x, kPanelStride);
  _tile_loadd(7, x + kTileRows, kPanelStride);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// sums [32][32] (W row, x row) = W's 32 rows times a panel of x, over
// `steps` whole steps and the tail when there is one.
void AmxBlock(const WRows &w, int64_t steps, const float *panel, float *sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    AmxStep(w.rows + s * kStep, kTileRows * w.ld,
            w.ld * static_cast<int64_t>(sizeof(uint16_t)),
            panel + s * kStepPairs * kBlock);
  }
  if (w.tail != nullptr) {
    AmxStep(w.tail, kTileRows * kStep, kStep * sizeof(uint16_t),
            panel + steps * kStepPairs * kBlock);
  }
  constexpr int64_t kSumsStride = kBlock * sizeof(float);
  _tile_stored(0, sums, kSumsStride);
  _tile_stored(1, sums + kTileRows, kSumsStride);
  _tile_stored(2, sums + kTileRows * kBlock, kSumsStride);
  _tile_stored(3, sums + kTileRows * kBlock + kTileRows, kSumsStride);
}

}  // namespace
}  // namespace moh
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace moh {
namespace {

// y [x_rows][w_rows] (row stride ldy) = sums^T (+ bias [w_rows]) for sums
// [32][32] (W row, x row): 16 x 16 transposes, a masked store per row of y.
void StoreBlock(const float *sums, int64_t w_rows, int64_t x_rows,
                const float *bias, float *y, int64_t ldy) {
  for (int64_t wr = 0; wr < w_rows; wr += kTileRows) {
    const __mmask16 mask = LaneMask16(w_rows - wr);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + wr)
                                     : _mm512_setzero_ps();
    for (int64_t xr = 0; xr < x_rows; xr += kTileRows) {
      __m512 a[16], t[16];
      for (int r = 0; r < 16; ++r) {
        a[r] = _mm512_loadu_ps(sums + (wr + r) * kBlock + xr);
      }
      kernels_internal::Transpose16x16(a, t);
      const int64_t count = std::min(kTileRows, x_rows - xr);
      for (int64_t i = 0; i < count; ++i) {
        _mm512_mask_storeu_ps(y + (xr + i) * ldy + wr, mask,
                              _mm512_add_ps(t[i], b));
      }
    }
  }
}

}  // namespace
}  // namespace moh
#pragma GCC pop_options

namespace moh {
namespace {

// y rows [m0, m1) (m0 a multiple of kBlock) x columns [n0, n1): one task.
// Runs each panel of x against every 32 rows of W in [n0, n1).
void AmxRows(const AmxProblem &a, int64_t m0, int64_t m1, int64_t n0,
             int64_t n1) {
  const int64_t steps = a.k / kStep;
  const int64_t tail_values = a.k - steps * kStep;
  const int64_t blocks = (n1 - n0 + kBlock - 1) / kBlock;
  // Each block's tail of k, and a last block of fewer than 32 rows whole
  // (rows past n would be read past W), zero-padded.
  thread_local AlignedBuffer tail_buffer, partial_buffer;
  auto *tails = reinterpret_cast<uint16_t *>(
      tail_buffer.Get(blocks * kBlock * kStep / 2));
  const int64_t padded_k = a.padded_pairs * 2;
  std::vector<WRows> rows(blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t j = n0 + b * kBlock;
    const int64_t count = std::min(kBlock, n1 - j);
    WRows &r = rows[b];
    r = {a.w + j * a.ldw, a.ldw, nullptr};
    if (count < kBlock) {
      auto *partial = reinterpret_cast<uint16_t *>(
          partial_buffer.Get(kBlock * padded_k / 2));
      std::memset(partial, 0, kBlock * padded_k * sizeof(uint16_t));
      for (int64_t i = 0; i < count; ++i) {
        std::memcpy(partial + i * padded_k, r.rows + i * a.ldw,
                    a.k * sizeof(uint16_t));
      }
      r = {partial, padded_k, nullptr};
    }
    if (tail_values > 0) {
      uint16_t *tail = tails + b * kBlock * kStep;
      std::memset(tail, 0, kBlock * kStep * sizeof(uint16_t));
      for (int64_t i = 0; i < count; ++i) {
        std::memcpy(tail + i * kStep, r.rows + i * r.ld + steps * kStep,
                    tail_values * sizeof(uint16_t));
      }
      r.tail = tail;
    }
  }
  alignas(64) float sums[kBlock * kBlock];
  ConfigureTiles();
  for (int64_t i = m0; i < m1; i += kBlock) {
    const float *panel = a.xp + i * a.padded_pairs;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t j = n0 + b * kBlock;
      AmxBlock(rows[b], steps, panel, sums);
      StoreBlock(sums, std::min(kBlock, n1 - j), std::min(kBlock, m1 - i),
                 a.bias != nullptr ? a.bias + j : nullptr, a.y + i * a.n + j,
                 a.n);
    }
  }
  ReleaseTiles();
}

}  // namespace

bool Bf16AmxLinear(const float *x, int64_t m, int64_t k, const uint16_t *w,
                   int64_t ldw, int64_t n, const float *bias, float *y) {
  // RoundRowsBf16 needs AVX512_BF16 (every AMX-BF16 CPU has it).
  if (!ActiveExtension(CpuExtension::kAmxBf16) ||
      !ActiveExtension(CpuExtension::kAvx512Bf16) || m < 1 || k < 1 || n < 1) {
    return false;
  }
  const int64_t k_pairs = (k + 1) / 2;
  const int64_t padded_pairs =
      (k_pairs + kStepPairs - 1) / kStepPairs * kStepPairs;
  const int64_t panels = (m + kBlock - 1) / kBlock;
  const int64_t threads =
      m * k * n >= kMinParallelMacs && !at::in_parallel_region()
          ? at::get_num_threads()
          : 1;
  // x rounded and transposed once for every task, a panel at a time; the
  // padding (pairs past k, rows past m) is zero.
  thread_local AlignedBuffer x_buffer;
  float *xp = x_buffer.Get(panels * kBlock * padded_pairs);
  RunTasks(panels, threads > 1, [&](int64_t begin, int64_t end) {
    thread_local AlignedBuffer rounded_buffer;
    float *rounded = rounded_buffer.Get(kBlock * k_pairs);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t i = p * kBlock, count = std::min(kBlock, m - i);
      kernels_internal::RoundRowsBf16(x + i * k, count, k, k_pairs, rounded);
      float *panel = xp + i * padded_pairs;
      PackPanel({rounded, k_pairs}, count, k_pairs, kBlock, panel);
      std::memset(panel + k_pairs * kBlock, 0,
                  (padded_pairs - k_pairs) * kBlock * sizeof(float));
    }
  });
  // Threads split W's rows into chunks of kTaskRows and, when those are
  // fewer than the threads, x's panels into as many groups as make up the
  // difference.
  const int64_t row_tasks = (n + kTaskRows - 1) / kTaskRows;
  const int64_t groups = std::min(
      panels, std::max<int64_t>(1, (threads + row_tasks - 1) / row_tasks));
  const AmxProblem problem{xp, m, k, padded_pairs, w, ldw, n, bias, y};
  RunTasks(row_tasks * groups, threads > 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t group = t / row_tasks, chunk = t % row_tasks;
      AmxRows(problem, group * panels / groups * kBlock,
              std::min(m, (group + 1) * panels / groups * kBlock),
              chunk * kTaskRows, std::min(n, (chunk + 1) * kTaskRows));
    }
  });
  return true;
}

}  // namespace moh
