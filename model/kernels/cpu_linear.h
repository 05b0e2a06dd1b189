// The CPU's hand-written linear-layer products, y = x W^T (+ bias) for a
// row-major weight W read in place: RowLinear for one row, SkinnyLinear,
// StreamedLinear and BlockedLinear for more, IndexedLinear for rows picked
// out of larger matrices. linear.h (model/core) picks one by row count. Each
// kernel runs the instruction set ActiveIsa() names (cpu_isa.h: AVX-512F, or
// AVX2 + FMA with tiles cut for 16 ymm registers) and returns false, doing
// nothing, under CpuIsa::kPortable (a CPU without AVX2 + FMA, or
// MOH_CPU_ISA=portable): the caller then takes its portable path.
#pragma once

#include <cstdint>
#include <functional>

namespace moh {

// A row-major float32 matrix given by its rows, which may be picked out of a
// larger one: row i lies at data + (index ? index[i] : i) * ld.
struct InputRows {
  const float *data;
  int64_t ld;
  const int64_t *index = nullptr;
};

// Where a product's rows go, as InputRows: written, or added to what is
// there when `accumulate`.
struct OutputRows {
  float *data;
  int64_t ld;
  const int64_t *index = nullptr;
  bool accumulate = false;
};

// y [n] = W x for one row x [k] (W as below), dot products of four rows of W
// at a time (false, doing nothing, under kPortable): a batch-1
// decode step, which reads every weight once. Threads split W's rows on the
// intra-op pool.
bool RowLinear(const float *x, int64_t k, const float *w, int64_t ldw,
               int64_t n, const float *bias, float *y);

// Largest row count SkinnyLinear takes. Measured on the bench model
// (bench/make_bench_lm.py, moh-generate, 2 threads, decode tokens/s against
// OpenBLAS's sgemm): 1.9x at 4 rows, 1.8x at 8, 2.0x at 12, but 0.92-0.96x
// at 16, where OpenBLAS starts to thread its sgemm and its packing is paid
// back. `moh_attention_bench --benchmark_filter=BM_Linear` times one
// projection both ways.
inline constexpr int64_t kMaxSkinnyRows = 12;

// y [m, n] = x [m, k] W^T (+ bias [n]) for row-major contiguous x and y and
// row-major W [n, k] with row stride ldw >= k (a slice of a wider weight's
// columns), with 1 <= m <= kMaxSkinnyRows: a decode step's few rows. It streams
// W once (each pair of its rows stays in L1 while every row of x passes),
// where OpenBLAS 0.3.21's sgemm first copies ("packs") the whole of W every
// call, which for a few rows costs as much as the product. AVX2 + FMA (also
// under kAvx512); returns false (and does nothing) under kPortable. Threads
// split W's rows on the intra-op pool when the product is large enough.
bool SkinnyLinear(const float *x, int64_t m, int64_t k, const float *w,
                  int64_t ldw, int64_t n, const float *bias, float *y);

// Row counts StreamedLinear takes: from kMinStreamedRows (below, SkinnyLinear
// is faster) to kMaxStreamedRows (above, BlockedLinear). One projection
// (moh_attention_bench, BM_Linear and BM_LinearColdWeights: x [rows, 512]
// W^T, W [1376, 512] hot in cache and read from memory; 2 threads), against
// OpenBLAS's sgemm, hot / cold: 16 rows 80 / 122 us vs 178 / 215; 32 rows
// 118 / 183 vs 277 / 304; 128 rows 484 / 503 vs 837 / 840 (BlockedLinear
// 522 / 618). At 8 rows SkinnyLinear 68 / 120 us, StreamedLinear 77 / 129; at
// 12, 96 against 75. At 512 rows both AVX-512 kernels take 1.8 ms, but the
// whole model's prefill is 1.07x faster with BlockedLinear.
inline constexpr int64_t kMinStreamedRows = 9;
inline constexpr int64_t kMaxStreamedRows = 128;

// y = x W^T with SkinnyLinear's layouts, for 1 <= m <= kMaxStreamedRows
// (false, doing nothing, under kPortable): y^T = W x^T as outer products,
// each value of W broadcast from memory against x^T vectors: up to 16 rows
// of x, 8 or 16 rows at a time with 12 or 6 rows of W in 12 accumulators
// (the AVX2 tiles, on AVX-512 CPUs too: fewer concurrent streams of W);
// beyond, 32 rows (two AVX-512 vectors) with 14 rows of W in 28
// accumulators (AVX2: still 16 rows at a time). W is read once,
// in place and in row order, where BlockedLinear's packing of W (and
// OpenBLAS's) cannot keep up with memory when a few rows must pay it back;
// only x is packed (transposed). Threads split W's rows on the intra-op pool.
bool StreamedLinear(const float *x, int64_t m, int64_t k, const float *w,
                    int64_t ldw, int64_t n, const float *bias, float *y);

// y = x W^T with SkinnyLinear's layouts, for any m: a prefill's rows.
// OpenBLAS 0.3.21 runs its AVX2 kernels on CPUs it does not know (and this
// project's machines pin OPENBLAS_CORETYPE=Haswell, since that build computes
// wrong results or crashes on some of them), which leaves half of an AVX-512
// core's multiply throughput unused. This is the GotoBLAS loop nest (x and W
// packed into panels, W's block in L2 and x's micro-panel in L1) around a
// 14 x 32 AVX-512 micro-kernel (AVX2: 6 x 16), with 16 x 16 (8 x 8)
// in-register transposes packing W. Returns false (and does nothing) under
// kPortable. Threads split y's columns into blocks of 128 on the intra-op
// pool. The bench model's prefill of 512 tokens in process: 1.39x OpenBLAS.
bool BlockedLinear(const float *x, int64_t m, int64_t k, const float *w,
                   int64_t ldw, int64_t n, const float *bias, float *y);

// Writes W's rows [j, j + rows), columns [p0, p0 + depth) widened to
// float32 into out [rows, depth] (contiguous): a W held in another format.
using WidenBlockFn = std::function<void(int64_t j, int64_t rows, int64_t p0,
                                        int64_t depth, float *out)>;

// BlockedLinear over a W [n, k] held in another format: each task widens
// the block of W it is about to pack (32 of W's rows, or 16 with AVX2, by
// one pass of at most 512 of k) into a buffer in its cache and packs it from
// there, so W is never widened whole, nor y copied from a panel's result.
bool BlockedLinearWidened(const float *x, int64_t m, int64_t k, int64_t n,
                          const WidenBlockFn &widen, const float *bias,
                          float *y);

// y [m, n] = (or +=) x [m, k] W^T, W as SkinnyLinear's, for any m, with x's
// rows gathered and y's scattered by index: a head-sparse layer's per-head
// products over the tokens that chose the head. The gather happens while x
// is packed and the scatter (and add) in the kernels' stores, where
// index_select, a product and index_add_ would copy both sides once more.
// StreamedLinear's tiles up to kMaxStreamedRows rows, BlockedLinear's loop
// nest beyond (false, doing nothing, under kPortable). y's rows
// must be distinct.
bool IndexedLinear(const InputRows &x, int64_t m, int64_t k, const float *w,
                   int64_t ldw, int64_t n, const OutputRows &y);

}  // namespace moh
