// Bf16AmxLinear (cpu_bf16_dot.h): a prefill's product with a bfloat16 W on
// AMX-BF16. Eight tile registers of 16 rows x 64 bytes: tmm0-3 hold a
// 32 x 32 block of y in float32 (2 x 2 tiles), tmm4-5 two 16-row tiles of x
// (16 pairs of k a row, 32 bfloat16 values), tmm6-7 two tiles of W (16 pairs
// of k by 16 columns, each element a pair: PackWeightPairs' panel). Each
// step of 32 values of k is four loads and four tdpbf16ps.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "model/kernels/cpu_bf16_dot.h"
#include "model/kernels/cpu_isa.h"
#include "model/kernels/cpu_streamed_rows.h"

namespace moh {
namespace {

using kernels_internal::AlignedBuffer;
using kernels_internal::kMinParallelMacs;
using kernels_internal::kPairPanelWidth;
using kernels_internal::RunTasks;

// Rows and columns of y one block computes (2 x 2 tiles of 16 x 16).
constexpr int64_t kTileRows = 16;
constexpr int64_t kBlockRows = 2 * kTileRows;
constexpr int64_t kBlockCols = kPairPanelWidth;
// Pairs of k a tile row holds (64 bytes).
constexpr int64_t kTilePairs = 16;
// Rows of x a task runs against all of its panels before the next: 128 rows
// of 4,096 values of k are 1 MiB of bfloat16, in L2 while they are reused.
constexpr int64_t kRowChunk = 128;
// Columns of y one task owns (two panels).
constexpr int64_t kChunkCols = 2 * kBlockCols;

// The LDTILECFG operand: palette 1, every tile 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// What the tasks of one Bf16AmxLinear share.
struct AmxProblem {
  const float *xr;  // x rounded: [padded rows][padded pairs], pairs in floats
  int64_t k, m, padded_pairs;
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

// out [32][32] = rounded x rows [0, 32) (row stride ldx floats) times the
// packed panel wp [pairs][32], over `pairs` (a multiple of kTilePairs).
void AmxBlock(const float *xr, int64_t ldx, const float *wp, int64_t pairs,
              float *out) {
  const int64_t x_stride = ldx * static_cast<int64_t>(sizeof(float));
  constexpr int64_t kPanelStride = kBlockCols * sizeof(float);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t q = 0; q < pairs; q += kTilePairs) {
    _tile_loadd(4, xr + q, x_stride);
    _tile_loadd(5, xr + kTileRows * ldx + q, x_stride);
    _tile_loadd(6, wp + q * kBlockCols, kPanelStride);
    _tile_loadd(7, wp + q * kBlockCols + kTileRows, kPanelStride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, out, kPanelStride);
  _tile_stored(1, out + kTileRows, kPanelStride);
  _tile_stored(2, out + kTileRows * kBlockCols, kPanelStride);
  _tile_stored(3, out + kTileRows * kBlockCols + kTileRows, kPanelStride);
}

void ReleaseTiles() { _tile_release(); }

}  // namespace
}  // namespace moh
#pragma GCC pop_options

namespace moh {
namespace {

// y rows [m0, m1) x columns [n0, n1) (m0 a multiple of kBlockRows, n0 of
// kBlockCols): one task. It packs its columns of W once, then runs every
// block of them, kRowChunk rows of x at a time.
void AmxColumns(const AmxProblem &a, int64_t m0, int64_t m1, int64_t n0,
                int64_t n1) {
  thread_local AlignedBuffer w_buffer;
  const int64_t cols = n1 - n0;
  const int64_t panels = (cols + kBlockCols - 1) / kBlockCols;
  const int64_t panel_floats = a.padded_pairs * kBlockCols;
  float *wp = w_buffer.Get(panels * panel_floats);
  const int64_t k_pairs = (a.k + 1) / 2;
  for (int64_t panel = 0; panel < panels; ++panel) {
    const int64_t j = panel * kBlockCols;
    float *to = wp + panel * panel_floats;
    kernels_internal::PackWeightPairs(a.w + (n0 + j) * a.ldw, a.ldw,
                                      std::min(kBlockCols, cols - j), a.k, 0,
                                      k_pairs, to);
    std::memset(to + k_pairs * kBlockCols, 0,
                (a.padded_pairs - k_pairs) * kBlockCols * sizeof(float));
  }
  alignas(64) float out[kBlockRows * kBlockCols];
  ConfigureTiles();
  for (int64_t chunk = m0; chunk < m1; chunk += kRowChunk) {
    const int64_t chunk_end = std::min(m1, chunk + kRowChunk);
    for (int64_t panel = 0; panel < panels; ++panel) {
      const int64_t j = panel * kBlockCols;
      const int64_t width = std::min(kBlockCols, cols - j);
      const float *bias = a.bias != nullptr ? a.bias + n0 + j : nullptr;
      for (int64_t i = chunk; i < chunk_end; i += kBlockRows) {
        AmxBlock(a.xr + i * a.padded_pairs, a.padded_pairs,
                 wp + panel * panel_floats, a.padded_pairs, out);
        const int64_t rows = std::min(kBlockRows, chunk_end - i);
        for (int64_t r = 0; r < rows; ++r) {
          float *row = a.y + (i + r) * a.n + n0 + j;
          const float *sums = out + r * kBlockCols;
          for (int64_t c = 0; c < width; ++c) {
            row[c] = sums[c] + (bias != nullptr ? bias[c] : 0.0f);
          }
        }
      }
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
      (k_pairs + kTilePairs - 1) / kTilePairs * kTilePairs;
  const int64_t blocks = (m + kBlockRows - 1) / kBlockRows;
  const int64_t padded_m = blocks * kBlockRows;
  const int64_t threads =
      m * k * n >= kMinParallelMacs && !at::in_parallel_region()
          ? at::get_num_threads()
          : 1;
  // x rounded once for every task, a block of rows at a time; the padding
  // (pairs past k, rows past m) is zero.
  thread_local AlignedBuffer x_buffer;
  float *xr = x_buffer.Get(padded_m * padded_pairs);
  RunTasks(blocks, threads > 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t i = b * kBlockRows, rows = std::min(kBlockRows, m - i);
      kernels_internal::RoundRowsBf16(x + i * k, rows, k, padded_pairs,
                                      xr + i * padded_pairs);
      for (int64_t r = 0; r < kBlockRows; ++r) {
        float *row = xr + (i + r) * padded_pairs;
        const int64_t from = r < rows ? k_pairs : 0;
        std::memset(row + from, 0, (padded_pairs - from) * sizeof(float));
      }
    }
  });
  // As Bf16DotLinear: threads split y's columns into chunks and, when those
  // are fewer than the threads, its rows into groups (each packing its own
  // copy of the chunk's W).
  const int64_t column_tasks = (n + kChunkCols - 1) / kChunkCols;
  const int64_t row_groups = std::min(
      blocks,
      std::max<int64_t>(1, (threads + column_tasks - 1) / column_tasks));
  const AmxProblem problem{xr, k, m, padded_pairs, w, ldw, n, bias, y};
  RunTasks(column_tasks * row_groups, threads > 1,
           [&](int64_t begin, int64_t end) {
             for (int64_t t = begin; t < end; ++t) {
               const int64_t group = t / column_tasks;
               const int64_t column = t % column_tasks;
               AmxColumns(
                   problem, group * blocks / row_groups * kBlockRows,
                   std::min(m, (group + 1) * blocks / row_groups * kBlockRows),
                   column * kChunkCols, std::min(n, (column + 1) * kChunkCols));
             }
           });
  return true;
}

}  // namespace moh
