#include "model/kernels/cpu_linear.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

// The Fortran BLAS single-precision product every BLAS exports (LibTorch's
// own wrapper is not exported). Column-major: C = alpha op(A) op(B) + beta C.
extern "C" void sgemm_(const char *transa, const char *transb, const int *m,
                       const int *n, const int *k, const float *alpha,
                       const float *a, const int *lda, const float *b,
                       const int *ldb, const float *beta, float *c,
                       const int *ldc);
// And its matrix-vector product: y = alpha op(A) x + beta y.
extern "C" void sgemv_(const char *trans, const int *m, const int *n,
                       const float *alpha, const float *a, const int *lda,
                       const float *x, const int *incx, const float *beta,
                       float *y, const int *incy);

namespace moh {
namespace {

// Up to this many columns of B, C = op(A) B is computed as one
// matrix-vector product per column: a decode step's few queries per KV head
// would otherwise pay sgemm's packing of A (the keys or values) every call,
// several times the product itself (callgrind: 2.2 M of 19 M instructions
// of a 24 M-parameter model's decode step).
constexpr int64_t kMaxGemvColumns = 4;

}  // namespace

void Gemm(bool transpose_a, int64_t m, int64_t n, int64_t k, float alpha,
          const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
          float *c, int64_t ldc) {
  const char ta = transpose_a ? 'T' : 'N', tb = 'N';
  const int im = static_cast<int>(m), in = static_cast<int>(n),
            ik = static_cast<int>(k), ilda = static_cast<int>(lda),
            ildb = static_cast<int>(ldb), ildc = static_cast<int>(ldc);
  if (n <= kMaxGemvColumns) {
    // A as stored: [k, m] when transposed, else [m, k].
    const int rows = transpose_a ? ik : im, cols = transpose_a ? im : ik;
    const int one = 1;
    for (int64_t j = 0; j < n; ++j) {
      sgemv_(&ta, &rows, &cols, &alpha, a, &ilda, b + j * ldb, &one, &beta,
             c + j * ldc, &one);
    }
    return;
  }
  sgemm_(&ta, &tb, &im, &in, &ik, &alpha, a, &ilda, b, &ildb, &beta, c, &ildc);
}

namespace {

// Rows of x and of W one tile of SkinnyLinear computes: kTileM x kTileN dot
// products in 8 accumulators, with W's kTileN rows and one x row in
// registers (11 of AVX2's 16), so the loads (2 + 4 per 8 columns) stay
// under the FMAs (8).
constexpr int64_t kTileM = 4;
constexpr int64_t kTileN = 2;
// W rows per parallel task, and the multiply-adds below which one thread
// does it all (waking the pool costs microseconds).
constexpr int64_t kRowsPerTask = 64;
constexpr int64_t kMinParallelMacs = 1 << 18;
constexpr int64_t kMinParallelRowMacs = 1 << 15;

// y [m, n] += bias [n] on every row (nothing when bias is null).
void AddBias(const float *bias, int64_t m, int64_t n, float *y) {
  if (bias == nullptr) return;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) y[i * n + j] += bias[j];
  }
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

// Threads a parallel region would have here: 1 inside one already (where
// at::parallel_for runs inline).
int64_t AvailableThreads() {
  return at::in_parallel_region() ? 1 : at::get_num_threads();
}

// run(begin, end) over tasks [0, count): on the intra-op pool when the
// product is `large` enough to pay for waking it, else on this thread.
template <typename Fn>
void RunTasks(int64_t count, bool large, const Fn &run) {
  if (!large || at::get_num_threads() < 2) {
    run(0, count);
  } else {
    at::parallel_for(0, count, 1, run);
  }
}

__attribute__((target("avx2,fma"))) inline float HorizontalSum(__m256 v) {
  const __m128 half =
      _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
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
      float sum = HorizontalSum(acc[i][j]);
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

bool HasAvx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

// y[j] = W[j] . x for R rows of W: R accumulators of 16 floats, k's
// remainder through masked loads.
template <int R>
__attribute__((target("avx512f"))) void DotRows(const float *x, int64_t k,
                                                const float *w, int64_t ldw,
                                                float *y) {
  __m512 acc[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t body = k & ~int64_t{15};
  for (int64_t p = 0; p < body; p += 16) {
    const __m512 xv = _mm512_loadu_ps(x + p);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w + r * ldw + p), xv, acc[r]);
    }
  }
  if (body < k) {
    const __mmask16 mask = __mmask16((1u << (k - body)) - 1);
    const __m512 xv = _mm512_maskz_loadu_ps(mask, x + body);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, w + r * ldw + body),
                               xv, acc[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) y[r] = _mm512_reduce_add_ps(acc[r]);
}

// One row of x against W rows [first, last), four at a time.
void RowAgainstRows(const float *x, int64_t k, const float *w, int64_t ldw,
                    int64_t first, int64_t last, float *y) {
  int64_t j = first;
  for (; j + 4 <= last; j += 4) DotRows<4>(x, k, w + j * ldw, ldw, y + j);
  for (; j < last; ++j) DotRows<1>(x, k, w + j * ldw, ldw, y + j);
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

bool HasAvx2Fma() {
  static const bool has =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
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
  const __mmask16 mask0 =
      cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  const __mmask16 mask1 =
      cols >= 32
          ? __mmask16(0xFFFF)
          : (cols <= 16 ? __mmask16(0) : __mmask16((1u << (cols - 16)) - 1));
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

// out[q][i] = src[i][q] for i < count <= 16 rows and q < 16 columns (out's
// row stride ldo; its columns from count on are left as they are): four
// rounds of in-register shuffles instead of 16 count scalar moves.
__attribute__((target("avx512f"))) void Transpose16(const InputRows &src,
                                                    int64_t count, float *out,
                                                    int64_t ldo) {
  __m512 a[16], u[16];
  for (int i = 0; i < 16; ++i) {
    a[i] = i < count ? _mm512_loadu_ps(RowAt(src, i)) : _mm512_setzero_ps();
  }
  const __mmask16 mask = __mmask16((1u << count) - 1);
  // Pairs of rows interleaved, then pairs of pairs: u[4 g + c] holds, in
  // 128-bit lane L, column 4 L + c of rows 4 g .. 4 g + 3.
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
  for (int c = 0; c < 4; ++c) {
    const __m512 v_lo = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44);
    const __m512 v_hi = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
    const __m512 w_lo = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
    const __m512 w_hi = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    _mm512_mask_storeu_ps(out + (0 + c) * ldo, mask,
                          _mm512_shuffle_f32x4(v_lo, w_lo, 0x88));
    _mm512_mask_storeu_ps(out + (4 + c) * ldo, mask,
                          _mm512_shuffle_f32x4(v_lo, w_lo, 0xDD));
    _mm512_mask_storeu_ps(out + (8 + c) * ldo, mask,
                          _mm512_shuffle_f32x4(v_hi, w_hi, 0x88));
    _mm512_mask_storeu_ps(out + (12 + c) * ldo, mask,
                          _mm512_shuffle_f32x4(v_hi, w_hi, 0xDD));
  }
}

// One panel: out[p][r] = src[r][p] for r < rows, p < depth; zero for
// rows <= r < width, so the kernel's padding computes zeros. Blocks of 16
// steps of p go through Transpose16, 16 rows at a time; the remaining steps
// one float at a time.
void PackPanel(const InputRows &src, int64_t rows, int64_t depth, int64_t width,
               float *out) {
  const int64_t block_depth = depth / 16 * 16;
  for (int64_t r = 0; r < rows; r += 16) {
    for (int64_t p = 0; p < block_depth; p += 16) {
      Transpose16(Skip(src, r, p), std::min<int64_t>(16, rows - r),
                  out + p * width + r, width);
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
// of kBlockM): one task of BlockedProduct. It packs its own columns of W, one
// pass at a time.
void BlockedColumns(const float *xp, const InputRows *direct, int64_t m0,
                    int64_t m1, int64_t padded_m, int64_t k, const float *w,
                    int64_t ldw, int64_t n0, int64_t n1, const OutputRows &y) {
  thread_local AlignedBuffer w_buffer;
  const Passes passes = CutDepth(k);
  const int64_t cols = n1 - n0;
  float *wp = w_buffer.Get(kChunkN * passes.depth);
  for (int64_t pass = 0; pass < passes.count; ++pass) {
    const int64_t p0 = pass * passes.depth;
    const int64_t depth = std::min(passes.depth, k - p0);
    for (int64_t j = 0; j < cols; j += kBlockN) {
      PackPanel({w + (n0 + j) * ldw + p0, ldw}, std::min(kBlockN, cols - j),
                depth, kBlockN, wp + j * depth);
    }
    const float *x_pass = direct != nullptr ? nullptr : xp + p0 * padded_m;
    for (int64_t i = m0; i < m1; i += kBlockM) {
      const int64_t rows = std::min(kBlockM, m1 - i);
      const float *x_rows[kBlockM];
      if (direct != nullptr) {
        for (int64_t r = 0; r < kBlockM; ++r) {
          x_rows[r] = RowAt(*direct, i + std::min(r, rows - 1)) + p0;
        }
      }
      for (int64_t j = 0; j < cols; j += kBlockN) {
        const int64_t tile_cols = std::min(kBlockN, cols - j);
        const bool accumulate = pass > 0 || y.accumulate;
        if (direct != nullptr) {
          BlockKernel<true>(depth, nullptr, x_rows, wp + j * depth,
                            Skip(y, i, n0 + j), rows, tile_cols, accumulate);
        } else {
          BlockKernel<false>(depth, x_pass + i * depth, nullptr, wp + j * depth,
                             Skip(y, i, n0 + j), rows, tile_cols, accumulate);
        }
      }
    }
  }
}

// StreamedLinear: y^T = W x^T as outer products. x is packed transposed
// (xt [k][padded m], small); W is read in place, kStreamRows rows at a time,
// each value broadcast from memory against V vectors of 16 rows of x, so W
// streams from memory once, in row order, with no packing.
template <int R, int V>
__attribute__((target("avx512f"))) void StreamTile(const float *xt, int64_t ldx,
                                                   int64_t k, const float *w,
                                                   int64_t ldw,
                                                   const OutputRows &y,
                                                   int64_t rows) {
  __m512 acc[R][V];
#pragma GCC unroll 28
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < k; ++p) {
    __m512 xv[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) xv[v] = _mm512_loadu_ps(xt + p * ldx + 16 * v);
#pragma GCC unroll 28
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_set1_ps(w[r * ldw + p]);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) {
        acc[r][v] = _mm512_fmadd_ps(wv, xv[v], acc[r][v]);
      }
    }
  }
  alignas(64) float tile[R][16 * V];
  // Unrolled: see BlockKernel.
#pragma GCC unroll 28
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) _mm512_store_ps(&tile[r][16 * v], acc[r][v]);
  }
  for (int64_t i = 0; i < rows; ++i) {
    float *row = RowAt(y, i);
    if (y.accumulate) {
      for (int r = 0; r < R; ++r) row[r] += tile[r][i];
    } else {
      for (int r = 0; r < R; ++r) row[r] = tile[r][i];
    }
  }
}

// W rows [first, last) against x's 16 V-row blocks: tiles of R W rows, the
// remainder in smaller ones.
template <int V>
void StreamRows(const float *xt, int64_t ldx, int64_t m, int64_t k,
                const float *w, int64_t ldw, int64_t first, int64_t last,
                const OutputRows &y) {
  constexpr int64_t kTile = V == 1 ? 28 : 14;
  for (int64_t i = 0; i < m; i += 16 * V) {
    const int64_t rows = std::min<int64_t>(16 * V, m - i);
    const float *xb = xt + i;
    int64_t j = first;
    for (; j + kTile <= last; j += kTile) {
      StreamTile<kTile, V>(xb, ldx, k, w + j * ldw, ldw, Skip(y, i, j), rows);
    }
    for (; j + 4 <= last; j += 4) {
      StreamTile<4, V>(xb, ldx, k, w + j * ldw, ldw, Skip(y, i, j), rows);
    }
    for (; j < last; ++j) {
      StreamTile<1, V>(xb, ldx, k, w + j * ldw, ldw, Skip(y, i, j), rows);
    }
  }
}

// Row width of x^T for StreamRows: whole blocks of the 16 (m <= 16) or 32
// rows its tiles read, so that the last block's padding lies inside the row.
int64_t TransposedWidth(int64_t m) { return m <= 16 ? 16 : (m + 31) / 32 * 32; }

// x [m, k] times `scale`, transposed into this thread's buffer:
// xt [k][TransposedWidth(m)], zero-padded.
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

// y[0, R) x [0, 16 NV) (row stride ldy; the last vector masked by `tail`)
// (+)= x [R, k] (row stride ldx) V [k, 16 NV] (row stride ldv): each value of
// x broadcast from memory against NV vectors of V's row, R NV accumulators.
template <int R, int NV>
__attribute__((target("avx512f"))) void ProductTile(const float *x, int64_t ldx,
                                                    int64_t k, const float *v,
                                                    int64_t ldv, __mmask16 tail,
                                                    float *y, int64_t ldy,
                                                    bool accumulate) {
  __m512 acc[R][NV];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < k; ++p) {
    __m512 vv[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) {
      vv[c] = c + 1 < NV ? _mm512_loadu_ps(v + p * ldv + 16 * c)
                         : _mm512_maskz_loadu_ps(tail, v + p * ldv + 16 * c);
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + p]);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) {
        acc[r][c] = _mm512_fmadd_ps(xv, vv[c], acc[r][c]);
      }
    }
  }
  // Unrolled: see BlockKernel.
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    float *row = y + r * ldy;
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) {
      const __mmask16 mask = c + 1 < NV ? __mmask16(0xFFFF) : tail;
      __m512 out = acc[r][c];
      if (accumulate) {
        out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(mask, row + 16 * c));
      }
      _mm512_mask_storeu_ps(row + 16 * c, mask, out);
    }
  }
}

using ProductTileFn = void (*)(const float *, int64_t, int64_t, const float *,
                               int64_t, __mmask16, float *, int64_t, bool);

// Rows of x per ProductTile (R NV <= 24 accumulators), and the tile for
// `rows` <= kProductRows rows and `vectors` <= 4 vectors of columns.
constexpr int64_t kProductRows = 6;

template <int NV>
ProductTileFn ProductTileFor(int64_t rows) {
  switch (rows) {
    case 1:
      return &ProductTile<1, NV>;
    case 2:
      return &ProductTile<2, NV>;
    case 3:
      return &ProductTile<3, NV>;
    case 4:
      return &ProductTile<4, NV>;
    case 5:
      return &ProductTile<5, NV>;
    default:
      return &ProductTile<6, NV>;
  }
}

ProductTileFn ProductTileFor(int64_t rows, int64_t vectors) {
  switch (vectors) {
    case 1:
      return ProductTileFor<1>(rows);
    case 2:
      return ProductTileFor<2>(rows);
    case 3:
      return ProductTileFor<3>(rows);
    default:
      return ProductTileFor<4>(rows);
  }
}

// y (+)= x W^T on BlockedLinear's loop nest. Threads split y's columns
// into blocks of kChunkN and, when those are fewer than the threads (a
// product of few columns), its rows into as many groups as make up the
// difference (each group packs its own copy of W's block). When W has at
// most kMaxDirectColumns rows, x is not packed: each panel of it would be
// read by so few tiles that packing (a read and a write of x) costs more
// than the kernel's strided reads of it.
void BlockedProduct(const InputRows &x, int64_t m, int64_t k, const float *w,
                    int64_t ldw, int64_t n, const OutputRows &y) {
  const Passes passes = CutDepth(k);
  const int64_t panels = (m + kBlockM - 1) / kBlockM;
  const int64_t padded_m = panels * kBlockM;
  const bool large = m * k * n >= kMinParallelMacs;
  const bool direct = n <= kMaxDirectColumns;
  thread_local AlignedBuffer x_buffer;
  float *xp = direct ? nullptr : x_buffer.Get(padded_m * k);
  // x, packed once for every task: pass by pass, kBlockM-row panels.
  auto pack = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t pass = t / panels, i = (t % panels) * kBlockM;
      const int64_t p0 = pass * passes.depth;
      const int64_t depth = std::min(passes.depth, k - p0);
      PackPanel(Skip(x, i, p0), std::min(kBlockM, m - i), depth, kBlockM,
                xp + p0 * padded_m + i * depth);
    }
  };
  const int64_t column_tasks = (n + kChunkN - 1) / kChunkN;
  const int64_t threads = large ? AvailableThreads() : 1;
  const int64_t row_groups = std::min(
      panels,
      std::max<int64_t>(1, (threads + column_tasks - 1) / column_tasks));
  auto multiply = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t group = t / column_tasks, column = t % column_tasks;
      const int64_t m0 = group * panels / row_groups * kBlockM;
      const int64_t m1 =
          std::min(m, (group + 1) * panels / row_groups * kBlockM);
      BlockedColumns(xp, direct ? &x : nullptr, m0, m1, padded_m, k, w, ldw,
                     column * kChunkN, std::min(n, (column + 1) * kChunkN), y);
    }
  };
  if (!direct) RunTasks(passes.count * panels, large, pack);
  RunTasks(column_tasks * row_groups, large, multiply);
}

// y (+)= x W^T on StreamedLinear's tiles (m <= kMaxStreamedRows).
void StreamedProduct(const InputRows &x, int64_t m, int64_t k, const float *w,
                     int64_t ldw, int64_t n, const OutputRows &y) {
  const int64_t ldx = TransposedWidth(m);
  const float *xt = PackTransposed(x, m, k, 1.0f);
  const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  auto run = [&](int64_t begin, int64_t end) {
    const int64_t first = begin * kRowsPerTask;
    const int64_t last = std::min(n, end * kRowsPerTask);
    if (m > 16) {
      StreamRows<2>(xt, ldx, m, k, w, ldw, first, last, y);
    } else {
      StreamRows<1>(xt, ldx, m, k, w, ldw, first, last, y);
    }
  };
  RunTasks(tasks, m * k * n >= kMinParallelMacs, run);
}

}  // namespace

bool SkinnyLinear(const float *x, int64_t m, int64_t k, const float *w,
                  int64_t ldw, int64_t n, const float *bias, float *y) {
  if (!HasAvx2Fma() || m < 1 || m > kMaxSkinnyRows) return false;
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
  if (!HasAvx512() || m < 1 || k < 1 || n < 1) return false;
  BlockedProduct({x, k}, m, k, w, ldw, n, {y, n});
  AddBias(bias, m, n, y);
  return true;
}

bool StreamedLinear(const float *x, int64_t m, int64_t k, const float *w,
                    int64_t ldw, int64_t n, const float *bias, float *y) {
  if (!HasAvx512() || m < 1 || m > kMaxStreamedRows || k < 1 || n < 1) {
    return false;
  }
  StreamedProduct({x, k}, m, k, w, ldw, n, {y, n});
  AddBias(bias, m, n, y);
  return true;
}

bool IndexedLinear(const InputRows &x, int64_t m, int64_t k, const float *w,
                   int64_t ldw, int64_t n, const OutputRows &y) {
  if (!HasAvx512() || m < 1 || k < 1 || n < 1) return false;
  if (m <= kMaxStreamedRows) {
    StreamedProduct(x, m, k, w, ldw, n, y);
  } else {
    BlockedProduct(x, m, k, w, ldw, n, y);
  }
  return true;
}

bool RowLinear(const float *x, int64_t k, const float *w, int64_t ldw,
               int64_t n, const float *bias, float *y) {
  if (!HasAvx512() || k < 1 || n < 1) return false;
  const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  auto run = [&](int64_t begin, int64_t end) {
    RowAgainstRows(x, k, w, ldw, begin * kRowsPerTask,
                   std::min(n, end * kRowsPerTask), y);
  };
  // One row is bound by reading W, which a second core speeds up from far
  // smaller products than SkinnyLinear's threshold.
  RunTasks(tasks, k * n >= kMinParallelRowMacs, run);
  AddBias(bias, 1, n, y);
  return true;
}

bool ScoresProduct(const float *q, int64_t m, int64_t k, float scale,
                   const float *keys, int64_t ldk, int64_t n, float *y,
                   int64_t ldy) {
  if (!HasAvx512() || m < 1 || m > kMaxStreamedRows || k < 1 || n < 1) {
    return false;
  }
  const int64_t ldx = TransposedWidth(m);
  const float *xt = PackTransposed({q, k}, m, k, scale);
  if (m > 16) {
    StreamRows<2>(xt, ldx, m, k, keys, ldk, 0, n, {y, ldy});
  } else {
    StreamRows<1>(xt, ldx, m, k, keys, ldk, 0, n, {y, ldy});
  }
  return true;
}

namespace {

// 16 values of a cached row: float32, or bfloat16 (their bits) widened.
__attribute__((target("avx512f"))) inline __m512 LoadRow16(const float *from) {
  return _mm512_loadu_ps(from);
}
__attribute__((target("avx512f"))) inline __m512 LoadRow16(
    const uint16_t *from) {
  const __m512i wide = _mm512_cvtepu16_epi32(
      _mm256_loadu_si256(reinterpret_cast<const __m256i *>(from)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

__attribute__((target("avx512f"))) void WidenBfloat16Avx512(
    const uint16_t *from, int64_t n, float *to) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(to + i, LoadRow16(from + i));
  for (; i < n; ++i) {
    const uint32_t bits = uint32_t{from[i]} << 16;
    std::memcpy(to + i, &bits, sizeof(bits));
  }
}

// [a0 + a1, a2 + a3, b0 + b1, b2 + b3] of a's and b's 128-bit lanes.
__attribute__((target("avx512f"))) inline __m512 FoldLanes(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Lane k of the result: the sum of v[k]'s 16 lanes. A transposing tree (45
// shuffles and adds for all 16) where one horizontal sum each costs 8
// dependent steps.
__attribute__((target("avx512f"))) inline __m512 SumEachOf16(const __m512 *v) {
  __m512 pairs[8];  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    pairs[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  }
  __m512 quads[4];  // per 128-bit lane: that lane's sum of 4 vectors
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const __m512d a = _mm512_castps_pd(pairs[2 * k]);
    const __m512d b = _mm512_castps_pd(pairs[2 * k + 1]);
    quads[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Twice: vector k's 4 lanes end in lane k.
  return FoldLanes(FoldLanes(quads[0], quads[1]),
                   FoldLanes(quads[2], quads[3]));
}

// y[i][t] = scale q_i . keys[t]: 16 keys at a time, one accumulator each,
// summed by SumEachOf16 (a block short of 16 repeats its first key, masked
// out at the store).
template <typename T>
__attribute__((target("avx512f"))) void DecodeScoresAvx512(
    const float *q, int64_t m, int64_t d, float scale, const T *const *keys,
    int64_t n, float *y, int64_t ldy) {
  const __m512 scaled = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int64_t count = std::min<int64_t>(16, n - t0);
    const T *rows[16];
    for (int64_t k = 0; k < 16; ++k) rows[k] = keys[t0 + (k < count ? k : 0)];
    const __mmask16 mask = __mmask16((1u << count) - 1);
    for (int64_t i = 0; i < m; ++i) {
      const float *qi = q + i * d;
      __m512 acc[16];
#pragma GCC unroll 16
      for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
      for (int64_t j = 0; j < d; j += 16) {
        const __m512 qv = _mm512_loadu_ps(qi + j);
#pragma GCC unroll 16
        for (int k = 0; k < 16; ++k) {
          acc[k] = _mm512_fmadd_ps(qv, LoadRow16(rows[k] + j), acc[k]);
        }
      }
      _mm512_mask_storeu_ps(y + i * ldy + t0, mask,
                            _mm512_mul_ps(scaled, SumEachOf16(acc)));
    }
  }
}

// y_i = sum over t of p[i][t] values[t], 64 columns at a time, 4 values
// at a time into 4 sets of accumulators (one set would chain every FMA on
// the one before).
template <typename T>
__attribute__((target("avx512f"))) void DecodeValuesAvx512(
    const float *p, int64_t ldp, int64_t m, const T *const *values, int64_t n,
    int64_t d, float *y, int64_t ldy) {
  for (int64_t i = 0; i < m; ++i) {
    const float *pi = p + i * ldp;
    for (int64_t j = 0; j < d; j += 64) {
      const int64_t vectors = std::min<int64_t>(4, (d - j) / 16);
      __m512 acc[4][4];
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) acc[u][v] = _mm512_setzero_ps();
      }
      int64_t t = 0;
      for (; t + 4 <= n; t += 4) {
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) {
          const __m512 weight = _mm512_set1_ps(pi[t + u]);
          const T *row = values[t + u] + j;
#pragma GCC unroll 4
          for (int v = 0; v < 4; ++v) {
            if (v < vectors) {
              acc[u][v] =
                  _mm512_fmadd_ps(weight, LoadRow16(row + 16 * v), acc[u][v]);
            }
          }
        }
      }
      for (; t < n; ++t) {
        const __m512 weight = _mm512_set1_ps(pi[t]);
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          if (v < vectors) {
            acc[0][v] = _mm512_fmadd_ps(
                weight, LoadRow16(values[t] + j + 16 * v), acc[0][v]);
          }
        }
      }
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        if (v < vectors) {
          _mm512_storeu_ps(y + i * ldy + j + 16 * v,
                           _mm512_add_ps(_mm512_add_ps(acc[0][v], acc[1][v]),
                                         _mm512_add_ps(acc[2][v], acc[3][v])));
        }
      }
    }
  }
}

}  // namespace

bool Bfloat16Scores(const float *q, int64_t m, int64_t d, float scale,
                    const uint16_t *const *keys, int64_t n, float *y,
                    int64_t ldy) {
  if (!HasAvx512() || d % 16 != 0) return false;
  DecodeScoresAvx512(q, m, d, scale, keys, n, y, ldy);
  return true;
}

bool Bfloat16Values(const float *p, int64_t ldp, int64_t m,
                    const uint16_t *const *values, int64_t n, int64_t d,
                    float *y, int64_t ldy) {
  if (!HasAvx512() || d % 16 != 0) return false;
  DecodeValuesAvx512(p, ldp, m, values, n, d, y, ldy);
  return true;
}

bool Float32Scores(const float *q, int64_t m, int64_t d, float scale,
                   const float *const *keys, int64_t n, float *y, int64_t ldy) {
  if (!HasAvx512() || d % 16 != 0) return false;
  DecodeScoresAvx512(q, m, d, scale, keys, n, y, ldy);
  return true;
}

bool Float32Values(const float *p, int64_t ldp, int64_t m,
                   const float *const *values, int64_t n, int64_t d, float *y,
                   int64_t ldy) {
  if (!HasAvx512() || d % 16 != 0) return false;
  DecodeValuesAvx512(p, ldp, m, values, n, d, y, ldy);
  return true;
}

bool WidenBfloat16(const uint16_t *from, int64_t n, float *to) {
  if (!HasAvx512()) return false;
  WidenBfloat16Avx512(from, n, to);
  return true;
}

bool ValuesProduct(const float *p, int64_t ldp, int64_t m, int64_t k,
                   const float *values, int64_t ldv, int64_t n, float *y,
                   int64_t ldy, bool accumulate) {
  if (!HasAvx512() || m < 1 || k < 1 || n < 1) return false;
  for (int64_t c0 = 0; c0 < n; c0 += 64) {
    const int64_t cols = std::min<int64_t>(64, n - c0);
    const int64_t vectors = (cols + 15) / 16;
    const int64_t last = cols - 16 * (vectors - 1);
    const __mmask16 tail =
        last == 16 ? __mmask16(0xFFFF) : __mmask16((1u << last) - 1);
    for (int64_t i = 0; i < m; i += kProductRows) {
      const int64_t rows = std::min(kProductRows, m - i);
      ProductTileFor(rows, vectors)(p + i * ldp, ldp, k, values + c0, ldv, tail,
                                    y + i * ldy + c0, ldy, accumulate);
    }
  }
  return true;
}

}  // namespace moh
