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

}  // namespace moh
