// The CPU's hand-written attention products, for the pair kernels' work
// items over a KV cache in float32 or bfloat16: a block of queries' scores
// against keys read in place and the probabilities' product with the values
// (ScoresProduct, ValuesProduct), their decode variants over cached rows given
// by address (Bfloat16Scores, Float32Values, ...), and the widening of
// bfloat16 rows. Each runs the instruction set ActiveIsa() names (cpu_isa.h:
// AVX-512F, or AVX2 + FMA with tiles cut for 16 ymm registers) and returns
// false, doing nothing, under CpuIsa::kPortable: the caller then takes its
// portable path (the BLAS, cpu_blas.h).
#pragma once

#include <cstdint>

#include "model/kernels/cpu_linear.h"

namespace moh {

// An attention item's two products on the calling thread (false, doing
// nothing, under kPortable); OpenBLAS's AVX2 sgemm packed both operands of
// these small products every call. Scores: y [m, n] (row stride ldy) = scale
// q [m, k] keys^T, keys [n, k] with row stride ldk read in place (a run of
// the KV cache), 1 <= m <= kMaxStreamedRows, as StreamedLinear.
bool ScoresProduct(const float *q, int64_t m, int64_t k, float scale,
                   const float *keys, int64_t ldk, int64_t n, float *y,
                   int64_t ldy);
// Values: y [m, n] (row stride ldy) = (or +=, when `accumulate`) p [m, k]
// (row stride ldp) values [k, n] (row stride ldv): each probability
// broadcast against a value row, 6 rows of p by 64 (AVX2: 16) columns at a
// time.
bool ValuesProduct(const float *p, int64_t ldp, int64_t m, int64_t k,
                   const float *values, int64_t ldv, int64_t n, float *y,
                   int64_t ldy, bool accumulate);

// to[i] = from[i] as float for n bfloat16 values (their bits), 16 (AVX2: 8)
// at a time (false, doing nothing, under kPortable): the pair kernel widens a
// bfloat16 KV cache's rows before its products. The scalar loop was 13% of
// a batch-16 decode step of the bench model.
bool WidenBfloat16(const uint16_t *from, int64_t n, float *to);

// A decode item's products straight from a KV cache's rows (false, doing
// nothing, under kPortable or when d is not a multiple of 16). Rows are
// given by address: rows[t] holds d values (bfloat16 bits, each row widened
// as it is loaded, or float32). Scores: y[i][t] (row stride ldy) = scale q_i
// . keys[t], for i < m queries (row-major [m, d]) and t < n: 16 (AVX2: 8)
// keys at a time, their dot products summed by one transposing tree. Values:
// y[i] (row stride ldy) = sum over t < n of p[i][t] (row stride ldp)
// values[t], four (AVX2: two) rows at a time into separate accumulators.
// Against the BLAS's matrix-vector products over runs of rows (the float32 path
// before): a batch-16 decode step over 512 keys 4-8% faster
// (moh_attention_bench BM_ModelDecode), equal over the suite's 16-80.
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

}  // namespace moh
