#include "model/kernels/cpu_linear.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

#include "model/kernels/cpu_kernels_avx2.h"
#include "model/kernels/cpu_streamed_rows.h"

namespace moh {
namespace {

using kernels_internal::AlignedBuffer;
using kernels_internal::BlockKernelAvx2;
using kernels_internal::HorizontalSum8;
using kernels_internal::kBlockMAvx2;
using kernels_internal::kBlockNAvx2;
using kernels_internal::kMinParallelMacs;
using kernels_internal::LaneMask16;
using kernels_internal::PackPanel;
using kernels_internal::PackTransposed;
using kernels_internal::RowAgainstRowsAvx2;
using kernels_internal::RowAt;
using kernels_internal::RunBlockTasks;
using kernels_internal::RunTasks;
using kernels_internal::Skip;
using kernels_internal::StreamRows;
using kernels_internal::TransposedWidth;
using kernels_internal::UseAvx2;
using kernels_internal::UseAvx512;

// Rows of x and of W one tile of SkinnyLinear computes: kTileM x kTileN dot
// products in 8 accumulators, with W's kTileN rows and one x row in
// registers (11 of AVX2's 16), so the loads (2 + 4 per 8 columns) stay
// under the FMAs (8).
constexpr int64_t kTileM = 4;
constexpr int64_t kTileN = 2;
// W rows per parallel task.
constexpr int64_t kRowsPerTask = 64;
constexpr int64_t kMinParallelRowMacs = 1 << 15;

// y [m, n] += bias [n] on every row (nothing when bias is null).
void AddBias(const float *bias, int64_t m, int64_t n, float *y) {
  if (bias == nullptr) return;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) y[i * n + j] += bias[j];
  }
}

// y[i][j] for i < M rows of x, j < N rows of W (M <= kTileM, N <= kTileN).
template <int M, int N>
__attribute__((target("avx2,fma"))) void Tile(const float *x, int64_t k,
                                              const float *w, int64_t ldw,
                                              float *y, int64_t ldy) {
  __m256 acc[M][N];
#pragma GCC unroll 4
  for (int i = 0; i < M; ++i) {
#pragma GCC unroll 2
    for (int j = 0; j < N; ++j) acc[i][j] = _mm256_setzero_ps();
  }
  const int64_t body = k & ~int64_t{7};
  for (int64_t p = 0; p < body; p += 8) {
    __m256 wv[N];
#pragma GCC unroll 2
    for (int j = 0; j < N; ++j) wv[j] = _mm256_loadu_ps(w + j * ldw + p);
#pragma GCC unroll 4
    for (int i = 0; i < M; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * k + p);
#pragma GCC unroll 2
      for (int j = 0; j < N; ++j) {
        acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; ++j) {
      float sum = HorizontalSum8(acc[i][j]);
      for (int64_t p = body; p < k; ++p) sum += x[i * k + p] * w[j * ldw + p];
      y[i * ldy + j] = sum;
    }
  }
}

using TileFn = void (*)(const float *, int64_t, const float *, int64_t, float *,
                        int64_t);

template <int N>
TileFn TileFor(int64_t rows) {
  switch (rows) {
    case 1:
      return &Tile<1, N>;
    case 2:
      return &Tile<2, N>;
    case 3:
      return &Tile<3, N>;
    default:
      return &Tile<4, N>;
  }
}

// y[j] = W[j] . x for R rows of W: R accumulators of 16 floats, k's
// remainder through masked loads. Each step (a cache line of each row)
// prefetches the same line of the next R rows into L2, as the low-precision
// kernels do (cpu_lowp_rows_impl.h): a model's rows are short streams (2 KiB
// at k 512) for the hardware prefetchers to ramp up on.
template <int R>
__attribute__((target("avx512f"))) void DotRows(const float *x, int64_t k,
                                                const float *w, int64_t ldw,
                                                float *y) {
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t body = k & ~int64_t{15};
  for (int64_t p = 0; p < body; p += 16) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char *>(w + (R + r) * ldw + p),
                   _MM_HINT_T1);
    }
    const __m512 xv = _mm512_loadu_ps(x + p);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w + r * ldw + p), xv, acc[r]);
    }
  }
  if (body < k) {
    const __mmask16 mask = __mmask16((1u << (k - body)) - 1);
    const __m512 xv = _mm512_maskz_loadu_ps(mask, x + body);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, w + r * ldw + body),
                               xv, acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) y[r] = _mm512_reduce_add_ps(acc[r]);
}

// One row of x against W rows [first, last), eight at a time (eight weight
// streams in flight: see DotRows8 in cpu_linear_avx2.cc), then four, then
// one.
void RowAgainstRows(const float *x, int64_t k, const float *w, int64_t ldw,
                    int64_t first, int64_t last, float *y) {
  kernels_internal::ForEachRowTile<8, 4>(
      first, last, [&](auto rows, int64_t j, bool) {
        DotRows<rows>(x, k, w + j * ldw, ldw, y + j);
      });
}

// W rows [first, last): every row of x against each pair of them.
void SkinnyRows(const float *x, int64_t m, int64_t k, const float *w,
                int64_t ldw, int64_t n, int64_t first, int64_t last, float *y) {
  for (int64_t j = first; j < last; j += kTileN) {
    const int64_t cols = std::min(kTileN, last - j);
    for (int64_t i = 0; i < m; i += kTileM) {
      const int64_t rows = std::min(kTileM, m - i);
      const TileFn tile =
          cols == kTileN ? TileFor<kTileN>(rows) : TileFor<1>(rows);
      tile(x + i * k, k, w + j * ldw, ldw, y + i * n + j, n);
    }
  }
}

// BlockedLinear: the GotoBLAS/BLIS loop nest around an AVX-512 micro-kernel
// that keeps a kBlockM x kBlockN tile of y in 28 of the 32 zmm registers.
// Per k step it loads 2 vectors of packed W (kBlockN = 32 columns of y) and
// broadcasts kBlockM values of packed x from memory into 28 FMAs. A packed
// x micro-panel (kBlockM x up to kMaxDepth, 28 KB) stays in L1 while the
// packed W block (up to kMaxDepth x kChunkN, 256 KB) streams from L2 under
// it.
constexpr int64_t kBlockM = 14;
constexpr int64_t kBlockN = 32;
// Longest pass over k (k is cut into equal passes no longer than this), and
// the columns of y one parallel task owns.
constexpr int64_t kMaxDepth = 512;
constexpr int64_t kChunkN = 4 * kBlockN;
// Most columns of y for which BlockedProduct reads x in place.
constexpr int64_t kMaxDirectColumns = 2 * kBlockN;

// y rows [0, rows) x columns [0, cols) (rows <= kBlockM, cols <= kBlockN)
// = (or +=, when `accumulate`) x times packed W [depth][kBlockN], where x is
// packed [depth][kBlockM] at `xp` or, when kDirect, read where its kBlockM
// rows lie (`x_rows`, each from the pass's first column; rows past `rows`
// repeat a valid one).
template <bool kDirect>
__attribute__((target("avx512f"))) void BlockKernel(
    int64_t depth, const float *xp, const float *const *x_rows, const float *wp,
    const OutputRows &y, int64_t rows, int64_t cols, bool accumulate) {
  __m512 acc[kBlockM][2];
#pragma GCC unroll 14
  for (int i = 0; i < kBlockM; ++i) {
    acc[i][0] = _mm512_setzero_ps();
    acc[i][1] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < depth; ++p) {
    const __m512 w0 = _mm512_load_ps(wp + p * kBlockN);
    const __m512 w1 = _mm512_load_ps(wp + p * kBlockN + 16);
    const float *xs = xp + p * kBlockM;
#pragma GCC unroll 14
    for (int i = 0; i < kBlockM; ++i) {
      const __m512 xv = _mm512_set1_ps(kDirect ? x_rows[i][p] : xs[i]);
      acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
    }
  }
  const __mmask16 mask0 = LaneMask16(cols), mask1 = LaneMask16(cols - 16);
  // Unrolled, so that acc is indexed by constants and stays in registers
  // (with a run-time index GCC keeps the array on the stack, storing it
  // every step of the loop above).
#pragma GCC unroll 14
  for (int i = 0; i < kBlockM; ++i) {
    if (i >= rows) break;
    float *row = RowAt(y, i);
    __m512 v0 = acc[i][0], v1 = acc[i][1];
    if (accumulate) {
      v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(mask0, row));
      v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(mask1, row + 16));
    }
    _mm512_mask_storeu_ps(row, mask0, v0);
    _mm512_mask_storeu_ps(row + 16, mask1, v1);
  }
}

// A micro-kernel with BlockKernel's contract.
using BlockKernelFn = void (*)(int64_t depth, const float *xp,
                               const float *const *x_rows, const float *wp,
                               const OutputRows &y, int64_t rows, int64_t cols,
                               bool accumulate);

// BlockedLinear's micro-kernels and their tiles, for the loop nest below: a
// kTileM x kTileN tile of y, Kernel<false> from packed x and Kernel<true>
// from x in place (BlockKernel's kDirect).
template <int64_t kTileM, int64_t kTileN, BlockKernelFn kPacked,
          BlockKernelFn kInPlace>
struct Blocks {
  static constexpr int64_t kM = kTileM, kN = kTileN;
  template <bool kDirect>
  static constexpr BlockKernelFn Kernel = kDirect ? kInPlace : kPacked;
};
// AVX-512's 14 x 32 and AVX2's 6 x 16 (cpu_linear_avx2.cc).
using Avx512Blocks =
    Blocks<kBlockM, kBlockN, BlockKernel<false>, BlockKernel<true>>;
using Avx2Blocks = Blocks<kBlockMAvx2, kBlockNAvx2, BlockKernelAvx2<false>,
                          BlockKernelAvx2<true>>;

// How BlockedLinear cuts k: `passes` passes of `depth` (the last shorter).
struct Passes {
  int64_t count, depth;
};
Passes CutDepth(int64_t k) {
  const int64_t count = (k + kMaxDepth - 1) / kMaxDepth;
  return {count, (k + count - 1) / count};
}

// y rows [m0, m1) x columns [n0, n1) (+)= x W^T, from x packed by pass and
// row panel at `xp` or, when `direct` is given, read in place (m0 a multiple
// of Blocks::kM): one task of BlockedProduct. It packs its own columns of W,
// one pass at a time.
template <typename Blocks>
void BlockedColumns(const float *xp, const InputRows *direct, int64_t m0,
                    int64_t m1, int64_t padded_m, int64_t k, const float *w,
                    int64_t ldw, const WidenBlockFn *widen, int64_t n0,
                    int64_t n1, const OutputRows &y) {
  thread_local AlignedBuffer w_buffer, wide_buffer;
  const Passes passes = CutDepth(k);
  const int64_t cols = n1 - n0;
  float *wp = w_buffer.Get(kChunkN * passes.depth);
  float *wide =
      widen != nullptr ? wide_buffer.Get(Blocks::kN * passes.depth) : nullptr;
  for (int64_t pass = 0; pass < passes.count; ++pass) {
    const int64_t p0 = pass * passes.depth;
    const int64_t depth = std::min(passes.depth, k - p0);
    for (int64_t j = 0; j < cols; j += Blocks::kN) {
      const int64_t rows = std::min(Blocks::kN, cols - j);
      if (widen != nullptr) {
        (*widen)(n0 + j, rows, p0, depth, wide);
        PackPanel({wide, depth}, rows, depth, Blocks::kN, wp + j * depth);
      } else {
        PackPanel({w + (n0 + j) * ldw + p0, ldw}, rows, depth, Blocks::kN,
                  wp + j * depth);
      }
    }
    const float *x_pass = direct != nullptr ? nullptr : xp + p0 * padded_m;
    for (int64_t i = m0; i < m1; i += Blocks::kM) {
      const int64_t rows = std::min(Blocks::kM, m1 - i);
      const float *x_rows[Blocks::kM];
      if (direct != nullptr) {
        for (int64_t r = 0; r < Blocks::kM; ++r) {
          x_rows[r] = RowAt(*direct, i + std::min(r, rows - 1)) + p0;
        }
      }
      for (int64_t j = 0; j < cols; j += Blocks::kN) {
        const int64_t tile_cols = std::min(Blocks::kN, cols - j);
        const bool accumulate = pass > 0 || y.accumulate;
        if (direct != nullptr) {
          Blocks::template Kernel<true>(depth, nullptr, x_rows, wp + j * depth,
                                        Skip(y, i, n0 + j), rows, tile_cols,
                                        accumulate);
        } else {
          Blocks::template Kernel<false>(depth, x_pass + i * depth, nullptr,
                                         wp + j * depth, Skip(y, i, n0 + j),
                                         rows, tile_cols, accumulate);
        }
      }
    }
  }
}

// y (+)= x W^T on BlockedLinear's loop nest. Threads split y's columns
// into blocks of kChunkN and, when those are fewer than the threads (a
// product of few columns), its rows into as many groups as make up the
// difference (each group packs its own copy of W's block). When W has at
// most kMaxDirectColumns rows, x is not packed: each panel of it would be
// read by so few tiles that packing (a read and a write of x) costs more
// than the kernel's strided reads of it.
// W is either `w` (row stride ldw) or, when `widen` is given, widened by
// it block by block as BlockedColumns packs it.
template <typename Blocks>
void BlockedProductOn(const InputRows &x, int64_t m, int64_t k, const float *w,
                      int64_t ldw, const WidenBlockFn *widen, int64_t n,
                      const OutputRows &y) {
  constexpr int64_t kM = Blocks::kM;
  const Passes passes = CutDepth(k);
  const int64_t panels = (m + kM - 1) / kM;
  const int64_t padded_m = panels * kM;
  const bool large = m * k * n >= kMinParallelMacs;
  const bool direct = n <= kMaxDirectColumns;
  thread_local AlignedBuffer x_buffer;
  float *xp = direct ? nullptr : x_buffer.Get(padded_m * k);
  // x, packed once for every task: pass by pass, kM-row panels.
  auto pack = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t pass = t / panels, i = (t % panels) * kM;
      const int64_t p0 = pass * passes.depth;
      const int64_t depth = std::min(passes.depth, k - p0);
      PackPanel(Skip(x, i, p0), std::min(kM, m - i), depth, kM,
                xp + p0 * padded_m + i * depth);
    }
  };
  auto multiply = [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    BlockedColumns<Blocks>(xp, direct ? &x : nullptr, m0, m1, padded_m, k, w,
                           ldw, widen, n0, n1, y);
  };
  if (!direct) RunTasks(passes.count * panels, large, pack);
  RunBlockTasks(m, kM, n, kChunkN, large, multiply);
}

void BlockedProduct(const InputRows &x, int64_t m, int64_t k, const float *w,
                    int64_t ldw, int64_t n, const OutputRows &y,
                    const WidenBlockFn *widen = nullptr) {
  if (UseAvx512()) {
    BlockedProductOn<Avx512Blocks>(x, m, k, w, ldw, widen, n, y);
  } else {
    BlockedProductOn<Avx2Blocks>(x, m, k, w, ldw, widen, n, y);
  }
}

// y (+)= x W^T on StreamedLinear's tiles (m <= kMaxStreamedRows).
void StreamedProduct(const InputRows &x, int64_t m, int64_t k, const float *w,
                     int64_t ldw, int64_t n, const OutputRows &y) {
  const int64_t ldx = TransposedWidth(m);
  const float *xt = PackTransposed(x, m, k, 1.0f);
  const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  auto run = [&](int64_t begin, int64_t end) {
    StreamRows(xt, ldx, m, k, w, ldw, begin * kRowsPerTask,
               std::min(n, end * kRowsPerTask), y);
  };
  RunTasks(tasks, m * k * n >= kMinParallelMacs, run);
}

}  // namespace

bool SkinnyLinear(const float *x, int64_t m, int64_t k, const float *w,
                  int64_t ldw, int64_t n, const float *bias, float *y) {
  if (!UseAvx2() || m < 1 || m > kMaxSkinnyRows) return false;
  const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  auto run = [&](int64_t begin, int64_t end) {
    SkinnyRows(x, m, k, w, ldw, n, begin * kRowsPerTask,
               std::min(n, end * kRowsPerTask), y);
  };
  RunTasks(tasks, m * k * n >= kMinParallelMacs, run);
  AddBias(bias, m, n, y);
  return true;
}

bool BlockedLinear(const float *x, int64_t m, int64_t k, const float *w,
                   int64_t ldw, int64_t n, const float *bias, float *y) {
  if (!UseAvx2() || m < 1 || k < 1 || n < 1) return false;
  BlockedProduct({x, k}, m, k, w, ldw, n, {y, n});
  AddBias(bias, m, n, y);
  return true;
}

bool BlockedLinearWidened(const float *x, int64_t m, int64_t k, int64_t n,
                          const WidenBlockFn &widen, const float *bias,
                          float *y) {
  if (!UseAvx2() || m < 1 || k < 1 || n < 1) return false;
  BlockedProduct({x, k}, m, k, nullptr, 0, n, {y, n}, &widen);
  AddBias(bias, m, n, y);
  return true;
}

bool StreamedLinear(const float *x, int64_t m, int64_t k, const float *w,
                    int64_t ldw, int64_t n, const float *bias, float *y) {
  if (!UseAvx2() || m < 1 || m > kMaxStreamedRows || k < 1 || n < 1) {
    return false;
  }
  StreamedProduct({x, k}, m, k, w, ldw, n, {y, n});
  AddBias(bias, m, n, y);
  return true;
}

bool IndexedLinear(const InputRows &x, int64_t m, int64_t k, const float *w,
                   int64_t ldw, int64_t n, const OutputRows &y) {
  if (!UseAvx2() || m < 1 || k < 1 || n < 1) return false;
  if (m <= kMaxStreamedRows) {
    StreamedProduct(x, m, k, w, ldw, n, y);
  } else {
    BlockedProduct(x, m, k, w, ldw, n, y);
  }
  return true;
}

bool RowLinear(const float *x, int64_t k, const float *w, int64_t ldw,
               int64_t n, const float *bias, float *y) {
  if (!UseAvx2() || k < 1 || n < 1) return false;
  const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  auto run = [&](int64_t begin, int64_t end) {
    const int64_t first = begin * kRowsPerTask;
    const int64_t last = std::min(n, end * kRowsPerTask);
    if (UseAvx512()) {
      RowAgainstRows(x, k, w, ldw, first, last, y);
    } else {
      RowAgainstRowsAvx2(x, k, w, ldw, first, last, y);
    }
  };
  // One row is bound by reading W, which a second core speeds up from far
  // smaller products than SkinnyLinear's threshold.
  RunTasks(tasks, k * n >= kMinParallelRowMacs, run);
  AddBias(bias, 1, n, y);
  return true;
}

}  // namespace moh
