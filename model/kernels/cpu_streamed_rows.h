// Internal to model/kernels: what the linear kernels (cpu_linear.cc) and the
// attention products (cpu_attention_products.cc) share. StreamRows computes
// y^T = W x^T as outer products, W's rows read in place (a weight, or a run
// of a KV cache's keys) against x packed transposed by PackTransposed;
// PackPanel and AlignedBuffer are the packing both use. Each runs the
// instruction set ActiveIsa() (cpu_isa.h) names, AVX-512F or AVX2 + FMA;
// callers check that it is not kPortable. Not for callers outside
// model/kernels.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <type_traits>

#include "model/kernels/cpu_isa.h"
#include "model/kernels/cpu_linear.h"

namespace moh::kernels_internal {

// Whether the active instruction set is AVX-512F, and whether it is at
// least AVX2 + FMA (what every kernel here needs).
inline bool UseAvx512() { return ActiveIsa() == CpuIsa::kAvx512; }
inline bool UseAvx2() { return ActiveIsa() >= CpuIsa::kAvx2; }

// The first `count` of 16 lanes as an AVX-512 mask's bits (none for
// count <= 0, all from 16 on): the masked loads and stores of a
// remainder, e.g. LaneMask16(cols) and LaneMask16(cols - 16) for a tile of
// 32 columns.
inline uint16_t LaneMask16(int64_t count) {
  if (count <= 0) return 0;
  return count >= 16 ? uint16_t{0xFFFF} : uint16_t((1u << count) - 1);
}

// t[q] = column q of the 16 x 16 matrix whose rows are a[0..15]: four
// rounds of in-register shuffles.
__attribute__((target("avx512f"))) inline void Transpose16x16(
    const __m512 (&a)[16], __m512 (&t)[16]) {
  __m512 u[16];
  // Pairs of rows interleaved, then pairs of pairs: u[4 g + c] holds, in
  // 128-bit lane L, column 4 L + c of rows 4 g .. 4 g + 3.
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    const __m512 *r = a + 4 * g;
    const __m512d lo01 = _mm512_castps_pd(_mm512_unpacklo_ps(r[0], r[1]));
    const __m512d hi01 = _mm512_castps_pd(_mm512_unpackhi_ps(r[0], r[1]));
    const __m512d lo23 = _mm512_castps_pd(_mm512_unpacklo_ps(r[2], r[3]));
    const __m512d hi23 = _mm512_castps_pd(_mm512_unpackhi_ps(r[2], r[3]));
    u[4 * g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo01, lo23));
    u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo01, lo23));
    u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi01, hi23));
    u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi01, hi23));
  }
  // Lane L of the four groups' u[., c] side by side: column 4 L + c.
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512 v_lo = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44);
    const __m512 v_hi = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
    const __m512 w_lo = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
    const __m512 w_hi = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    t[0 + c] = _mm512_shuffle_f32x4(v_lo, w_lo, 0x88);
    t[4 + c] = _mm512_shuffle_f32x4(v_lo, w_lo, 0xDD);
    t[8 + c] = _mm512_shuffle_f32x4(v_hi, w_hi, 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(v_hi, w_hi, 0xDD);
  }
}

// Multiply-adds below which one thread does a whole product: waking the
// intra-op pool costs microseconds.
inline constexpr int64_t kMinParallelMacs = 1 << 18;

// run(begin, end) over tasks [0, count): on the intra-op pool, a task at a
// time, when `parallel` and the pool has another thread to wake (not inside
// a parallel region already), else on this thread in one call.
template <typename Fn>
void RunTasks(int64_t count, bool parallel, const Fn &run) {
  if (parallel && at::get_num_threads() > 1 && !at::in_parallel_region()) {
    at::parallel_for(0, count, 1, run);
  } else {
    run(0, count);
  }
}

// run(i0, i1, n0, n1) over the tasks of BlockedLinear's loop nest (and of
// the int8 products built like it): y's columns in chunks of `chunk` and,
// when those are fewer than the threads, x's rows (whole panels of `panel`
// rows) in as many groups as make up the difference; each group packs its
// own copy of W's columns. As RunTasks, on the intra-op pool when
// `parallel`.
template <typename Fn>
void RunBlockTasks(int64_t m, int64_t panel, int64_t n, int64_t chunk,
                   bool parallel, const Fn &run) {
  const int64_t panels = (m + panel - 1) / panel;
  const int64_t column_tasks = (n + chunk - 1) / chunk;
  const int64_t threads =
      parallel && !at::in_parallel_region() ? at::get_num_threads() : 1;
  const int64_t row_groups = std::min(
      panels,
      std::max<int64_t>(1, (threads + column_tasks - 1) / column_tasks));
  RunTasks(
      column_tasks * row_groups, parallel, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t group = t / column_tasks, column = t % column_tasks;
          run(group * panels / row_groups * panel,
              std::min(m, (group + 1) * panels / row_groups * panel),
              column * chunk, std::min(n, (column + 1) * chunk));
        }
      });
}

// W rows [first, last) in tiles: tile(TileRows<R>{}, j, another) for rows
// [j, j + R), R = kTile while whole tiles last (`another`: a whole tile
// follows, whose rows this one may prefetch), then kSmall (none when 1),
// then 1 (`another` false for both).
template <int R>
using TileRows = std::integral_constant<int, R>;
template <int kTile, int kSmall, typename Tile>
void ForEachRowTile(int64_t first, int64_t last, const Tile &tile) {
  int64_t j = first;
  for (; j + kTile <= last; j += kTile) {
    tile(TileRows<kTile>{}, j, j + 2 * kTile <= last);
  }
  if constexpr (kSmall > 1) {
    for (; j + kSmall <= last; j += kSmall) tile(TileRows<kSmall>{}, j, false);
  }
  for (; j < last; ++j) tile(TileRows<1>{}, j, false);
}

// run(first, last) over W rows [0, n) on the intra-op pool, in tasks of
// whole tiles of `tile` rows, enough of them that a task (m rows of x, depth
// k) is worth waking a thread for.
template <typename Fn>
void ParallelRowTiles(int64_t n, int64_t tile, int64_t m, int64_t k,
                      const Fn &run) {
  const int64_t tiles = (n + tile - 1) / tile;
  const int64_t grain = std::max<int64_t>(1, kMinParallelMacs / (m * k * tile));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    run(t0 * tile, std::min(n, t1 * tile));
  });
}

// Row i of a matrix given by its rows, and the matrix from row `row` and
// column `col` on.
template <typename Rows>
auto RowAt(const Rows &m, int64_t i) {
  return m.data + (m.index != nullptr ? m.index[i] : i) * m.ld;
}
template <typename Rows>
Rows Skip(Rows m, int64_t row, int64_t col) {
  if (m.index != nullptr) {
    m.index += row;
  } else {
    m.data += row * m.ld;
  }
  m.data += col;
  return m;
}

// A tile's sums stored out of registers as tile[r][i] (row r of W, row i
// of x) written, or added, as rows of y: y[i][0, R) for i < rows. The
// scalar write-out of the one-row tiles; wider ones transpose in registers.
template <int R, int kWidth>
void StoreTileRows(const float (&tile)[R][kWidth], const OutputRows &y,
                   int64_t rows) {
  for (int64_t i = 0; i < rows; ++i) {
    float *row = RowAt(y, i);
    for (int r = 0; r < R; ++r) {
      row[r] = y.accumulate ? row[r] + tile[r][i] : tile[r][i];
    }
  }
}

// A 64-byte aligned float buffer, grown on demand and kept by its owner (a
// thread): prefill calls it a few hundred times a second.
class AlignedBuffer {
 public:
  float *Get(int64_t floats) {
    if (floats > capacity_) {
      const size_t bytes =
          (static_cast<size_t>(floats) * sizeof(float) + 63) / 64 * 64;
      data_.reset(static_cast<float *>(std::aligned_alloc(64, bytes)));
      capacity_ = floats;
    }
    return data_.get();
  }

 private:
  struct Free {
    void operator()(float *p) const { std::free(p); }
  };
  std::unique_ptr<float[], Free> data_;
  int64_t capacity_ = 0;
};

// One panel: out[p][r] = src[r][p] for r < rows, p < depth; zero for
// rows <= r < width, so the kernel's padding computes zeros. Blocks of 16
// (AVX2: 8) steps of p go through in-register transposes, 16 (8) rows at a
// time; the remaining steps one float at a time.
void PackPanel(const InputRows &src, int64_t rows, int64_t depth, int64_t width,
               float *out);

// Row width of x^T for StreamRows: whole blocks of the 16 (m <= 16) or 32
// rows its tiles read, so that the last block's padding lies inside the row.
inline int64_t TransposedWidth(int64_t m) {
  return m <= 16 ? 16 : (m + 31) / 32 * 32;
}

// x [m, k] times `scale`, transposed into this thread's buffer:
// xt [k][TransposedWidth(m)], zero-padded.
const float *PackTransposed(const InputRows &x, int64_t m, int64_t k,
                            float scale);

// y rows [0, m) x columns [first, last) (+)= (when y.accumulate) x W^T, for
// W rows [first, last) (row stride ldw) and xt = PackTransposed(x, m, k, .)
// (row stride ldx = TransposedWidth(m)), m <= kMaxStreamedRows: each value of
// W broadcast from memory against x^T vectors: on AVX-512 one vector (16
// rows) against 8 rows of W at a time up to 16 rows, beyond them 32 rows
// (two vectors) against 14 rows of W; StreamRowsAvx2's tiles on AVX2.
void StreamRows(const float *xt, int64_t ldx, int64_t m, int64_t k,
                const float *w, int64_t ldw, int64_t first, int64_t last,
                const OutputRows &y);

// AVX2 + FMA counterparts (cpu_streamed_rows_avx2.cc). StreamRows' tiles
// for 16 ymm registers: each value of W broadcast against one vector of 8
// rows of x^T, 12 rows of W at a time (12 accumulators) up to 8 rows of x,
// or against two (16 rows), 6 rows of W at a time, beyond. Each tile of W
// runs against every block of x's rows before the next (W streams from
// memory once) and prefetches the next tile's rows into L2: the bench
// model's batch-16 and 32 decode under MOH_CPU_ISA=avx2 on a Sapphire
// Rapids VM, 2 threads, 1.15-1.29x and 1.19-1.20x the tiles without
// (x's blocks outer, W streamed once per 16 rows, no prefetch).
void StreamRowsAvx2(const float *xt, int64_t ldx, int64_t m, int64_t k,
                    const float *w, int64_t ldw, int64_t first, int64_t last,
                    const OutputRows &y);
// out[q][i] = src[i][q] for i < count <= 8 rows and q < 8 columns (out's row
// stride ldo; its columns from count on are left as they are).
void Transpose8Avx2(const InputRows &src, int64_t count, float *out,
                    int64_t ldo);

}  // namespace moh::kernels_internal
