// y = x W^T for a bfloat16 W with x rounded to bfloat16 as well, on CPUs
// with AVX512_BF16: vdpbf16ps multiplies pairs of bfloat16 values and adds
// both products into a float32 lane, twice the multiply-adds of a float32
// FMA per instruction. llama.cpp multiplies a bf16 model's prefill this way;
// Bf16Linear (cpu_lowp_linear.h) takes it for prefill row counts, where
// widening W to float32 would cost as many instructions as the product.
#pragma once

#include <cstdint>

namespace moh {

// y [m, n] = round_bf16(x [m, k]) W^T (+ bias [n]) for row-major contiguous
// float32 x and y and a row-major bfloat16 W [n, k] (bits as uint16) with
// row stride ldw >= k, read in place. x is rounded to the nearest bfloat16
// (ties to even), so y differs from the float32 product by up to 2^-9 of
// each |x| |w| term, and products are summed in float32; subnormal values
// become zero in both steps, as the instructions (vcvtne2ps2bf16,
// vdpbf16ps) do whatever MXCSR says. Returns false, doing
// nothing, unless ActiveExtension(CpuExtension::kAvx512Bf16) (cpu_isa.h) or
// when a dimension is < 1. Threads split y's columns on the intra-op pool.
bool Bf16DotLinear(const float *x, int64_t m, int64_t k, const uint16_t *w,
                   int64_t ldw, int64_t n, const float *bias, float *y);

// Bf16DotLinear's numerics (x rounded to bfloat16, products summed in
// float32) for decode batches of up to kMaxStreamedRows (cpu_linear.h) rows:
// x rounded and transposed once by pairs of k into [pairs][16 or 32 n]
// (one 32-bit element, one pair, per row of x), and W read once, in place,
// in row order, 14 rows at a time, each row's pair broadcast against 16 rows
// of x per vdpbf16ps. Neither widens nor packs W: the float32 path widened
// it (WidenBf16RowAvx2 took nearly as long as the product at batch 16).
// Same contract as Bf16DotLinear otherwise, and false as well when m is
// beyond kMaxStreamedRows. Threads split W's rows on the intra-op pool.
bool Bf16DotRowsLinear(const float *x, int64_t m, int64_t k, const uint16_t *w,
                       int64_t ldw, int64_t n, const float *bias, float *y);

// Bf16DotLinear's numerics (x rounded to bfloat16, products summed in
// float32) on AMX-BF16: tdpbf16ps multiplies a 16 x 32 bfloat16 tile by a
// 32 x 16 one into a 16 x 16 float32 tile, 8,192 multiply-adds an
// instruction (vdpbf16ps: 32). It computes y^T = W x^T: W's rows, read in
// place with stride ldw, are the left tiles (never packed), and x, rounded
// and transposed once into 32-row panels of pairs of k, the right ones.
// Blocks of 32 x 32 outputs in four accumulator tiles; each task takes 256
// rows of W against its panels of x. Same contract as Bf16DotLinear, and
// reads nothing of W outside its n rows of k values; returns false, doing
// nothing, unless ActiveExtension(CpuExtension::kAmxBf16) or when a dimension
// is < 1. Threads split W's rows (and x's panels, when W's 256-row chunks are
// fewer than threads). Bf16Linear takes it past kMaxBf16StreamRows rows
// (cpu_lowp_linear.h).
bool Bf16AmxLinear(const float *x, int64_t m, int64_t k, const uint16_t *w,
                   int64_t ldw, int64_t n, const float *bias, float *y);

namespace kernels_internal {
// x [rows, k] (row stride k) rounded to bfloat16 (nearest, ties to even)
// into out [rows][k_pairs] (row stride k_pairs): each 32-bit element holds
// values 2 q (low half) and 2 q + 1 of a row; an odd k's last pair has a
// zero above it. Needs AVX512_BF16 (the caller checks ActiveExtension).
void RoundRowsBf16(const float *x, int64_t rows, int64_t k, int64_t k_pairs,
                   float *out);
}  // namespace kernels_internal

}  // namespace moh
