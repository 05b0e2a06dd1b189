// The CPU's hand-written products, and the BLAS LibTorch links (OpenBLAS)
// called directly (Gemm): the pair kernels' many small products would pay an
// ATen op's dispatch and allocation each. Two kinds live here: linear layers
// (RowLinear for one row, SkinnyLinear, StreamedLinear and BlockedLinear for
// more, IndexedLinear for rows picked out of larger matrices) and attention's
// products over a KV cache in float32 or bfloat16 (ScoresProduct,
// ValuesProduct and their typed variants). Each kernel says the instruction
// set it needs (AVX-512F, or AVX2 + FMA) and returns false, doing nothing, on
// a CPU without it: the caller then takes its portable path.
#pragma once

#include <cstdint>

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

// C [m, n] = alpha op(A) B + beta C, column-major; op(A) is [m, k] (A [k, m]
// when transposed), B [k, n]. Up to a few columns of B it runs as
// matrix-vector products (no packing of A).
void Gemm(bool transpose_a, int64_t m, int64_t n, int64_t k, float alpha,
          const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
          float *c, int64_t ldc);

// y [n] = W x for one row x [k] (W as below), AVX-512 dot products of four
// rows of W at a time (false, doing nothing, without AVX-512F): a batch-1
// decode step, which reads every weight once. Threads split W's rows on the
// intra-op pool.
bool RowLinear(const float *x, int64_t k, const float *w, int64_t ldw,
               int64_t n, const float *bias, float *y);

// An attention item's two products on the calling thread, AVX-512 (false,
// doing nothing, without it); OpenBLAS's AVX2 sgemm packed both operands of
// these small products every call. Scores: y [m, n] (row stride ldy) = scale
// q [m, k] keys^T, keys [n, k] with row stride ldk read in place (a run of
// the KV cache), 1 <= m <= kMaxStreamedRows, as StreamedLinear.
bool ScoresProduct(const float *q, int64_t m, int64_t k, float scale,
                   const float *keys, int64_t ldk, int64_t n, float *y,
                   int64_t ldy);
// Values: y [m, n] (row stride ldy) = (or +=, when `accumulate`) p [m, k]
// (row stride ldp) values [k, n] (row stride ldv): each probability
// broadcast against a value row, 6 rows of p by 64 columns at a time.
bool ValuesProduct(const float *p, int64_t ldp, int64_t m, int64_t k,
                   const float *values, int64_t ldv, int64_t n, float *y,
                   int64_t ldy, bool accumulate);

// to[i] = from[i] as float for n bfloat16 values (their bits), 16 at a time
// (false, doing nothing, without AVX-512F): the pair kernel widens a
// bfloat16 KV cache's rows before its products. The scalar loop was 13% of
// a batch-16 decode step of the bench model.
bool WidenBfloat16(const uint16_t *from, int64_t n, float *to);

// A decode item's products straight from a KV cache's rows (AVX-512; false,
// doing nothing, without it or when d is not a multiple of 16). Rows are
// given by address: rows[t] holds d values (bfloat16 bits, each row widened
// as it is loaded, or float32). Scores: y[i][t] (row stride ldy) = scale q_i
// . keys[t], for i < m queries (row-major [m, d]) and t < n: 16 keys at a
// time, their dot products summed by one transposing tree. Values: y[i]
// (row stride ldy) = sum over t < n of p[i][t] (row stride ldp) values[t],
// four rows at a time into separate accumulators. Against the BLAS's
// matrix-vector products over runs of rows (the float32 path before): a
// batch-16 decode step over 512 keys 4-8% faster (moh_attention_bench
// BM_ModelDecode), equal over the suite's 16-80.
bool Bfloat16Scores(const float *q, int64_t m, int64_t d, float scale,
                    const uint16_t *const *keys, int64_t n, float *y,
                    int64_t ldy);
bool Bfloat16Values(const float *p, int64_t ldp, int64_t m,
                    const uint16_t *const *values, int64_t n, int64_t d,
                    float *y, int64_t ldy);
// The same over a float32 cache's rows.
bool Float32Scores(const float *q, int64_t m, int64_t d, float scale,
                   const float *const *keys, int64_t n, float *y, int64_t ldy);
bool Float32Values(const float *p, int64_t ldp, int64_t m,
                   const float *const *values, int64_t n, int64_t d, float *y,
                   int64_t ldy);

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
// call, which for a few rows costs as much as the product. AVX2 + FMA, chosen
// at run time; returns false (and does nothing) on a CPU without them. Threads
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

// y = x W^T with SkinnyLinear's layouts, for 1 <= m <= kMaxStreamedRows, on
// AVX-512 (false, doing nothing, without it): y^T = W x^T as outer products,
// each value of W broadcast from memory against x^T vectors of 16 (or 32)
// rows, 28 (or 14) rows of W at a time in 28 accumulators. W is read once,
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
// 14 x 32 AVX-512 micro-kernel, with 16 x 16 in-register transposes packing
// W. Chosen at run time; returns false (and does nothing) on a CPU without
// AVX-512F. Threads split y's columns into blocks of 128 on the intra-op
// pool. The bench model's prefill of 512 tokens in process: 1.39x OpenBLAS.
bool BlockedLinear(const float *x, int64_t m, int64_t k, const float *w,
                   int64_t ldw, int64_t n, const float *bias, float *y);

// y [m, n] = (or +=) x [m, k] W^T, W as SkinnyLinear's, for any m, with x's
// rows gathered and y's scattered by index: a head-sparse layer's per-head
// products over the tokens that chose the head. The gather happens while x
// is packed and the scatter (and add) in the kernels' stores, where
// index_select, a product and index_add_ would copy both sides once more.
// StreamedLinear's tiles up to kMaxStreamedRows rows, BlockedLinear's loop
// nest beyond; AVX-512 only (false, doing nothing, without it). y's rows
// must be distinct.
bool IndexedLinear(const InputRows &x, int64_t m, int64_t k, const float *w,
                   int64_t ldw, int64_t n, const OutputRows &y);

}  // namespace moh
