// Int8DotLinear: a prefill's product with weight-only int8 W (Int8Linear's
// weights, model/kernels/cpu_lowp_linear.h) in integer dot products on
// AVX512_VNNI, with x quantized to int8 per 32 values as llama.cpp's Q8_0
// quantizes activations.
#pragma once

#include <cstdint>

namespace moh {

// Values of a row of x that share one int8 scale (llama.cpp's QK8_0).
inline constexpr int64_t kInt8DotBlock = 32;

// y [m, n] = x [m, k] W^T (+ bias [n]) for row-major contiguous x and y and a
// row-major int8 W [n, k] (row stride ldw >= k) with one float32 scale per
// row: W[j, p] = w[j, p] * scale[j]. Each run of kInt8DotBlock values of a
// row of x (the last zero-padded) is quantized symmetrically:
// d = max |x| / 127 and qx = round-to-nearest-even(x * (1 / d)) (0 where
// d is 0), so that
//   y[i, j] = scale[j] * sum_b d[i, b] * (sum_{p in b} qx[i, p] w[j, p])
// with exact integer inner sums. Unlike Q8_0, d stays float32 (Q8_0 stores
// it as float16). Returns false, doing nothing, unless
// ActiveExtension(CpuExtension::kAvx512Vnni). Threads split y's columns
// on the intra-op pool. bias may be null.
bool Int8DotLinear(const float *x, int64_t m, int64_t k, const int8_t *w,
                   int64_t ldw, int64_t n, const float *scale,
                   const float *bias, float *y);

// Int8DotLinear's numerics for decode batches of up to kMaxStreamedRows
// (cpu_linear.h) rows, W read in place: x quantized once into blocks of
// [4-value groups][16 or 32 n lanes][4 bytes], and W's rows streamed once, in
// row order, 14 (more than 16 rows of x: 7) rows at a time, each row's 4
// bytes broadcast against 16 rows of x per vpdpbusd. Each tile first sums
// its rows' blocks (the -128 correction of x's unsigned offset, which
// Int8DotLinear works out as it packs W), which is also the pass that
// brings them in from memory. Same contract as Int8DotLinear otherwise,
// and false as well when m is beyond kMaxStreamedRows. Threads split W's
// rows on the intra-op pool.
bool Int8DotRowsLinear(const float *x, int64_t m, int64_t k, const int8_t *w,
                       int64_t ldw, int64_t n, const float *scale,
                       const float *bias, float *y);

// Int8DotLinear's numerics (x quantized per kInt8DotBlock values, exact
// integer block sums) on AVX2 + FMA, for 1 <= m <= kMaxStreamedRows: x
// quantized once into int16, W read in place and widened to int16 in
// registers, pairs of products summed by vpmaddwd. Tiles of 8 rows of W
// against one row of x, or of 4 against pairs of rows. Returns false,
// doing nothing, under CpuIsa::kPortable or past kMaxStreamedRows rows.
// Threads split W's rows on the intra-op pool. bias may be null.
bool Int8MaddRowsLinear(const float *x, int64_t m, int64_t k, const int8_t *w,
                        int64_t ldw, int64_t n, const float *scale,
                        const float *bias, float *y);

// Int8MaddRowsLinear's arithmetic for any m (a prefill): BlockedLinear's
// loop nest, W's columns packed a pass at a time into int16 pairs, a 4 x 16
// tile of y in int32 accumulators per block, x's pairs broadcast against
// them (cpu_int8_madd_avx2.cc). Same contract as Int8DotLinear, on AVX2 +
// FMA: false, doing nothing, only under CpuIsa::kPortable. Threads split
// y's columns (and, for few of them, x's rows) on the intra-op pool.
bool Int8MaddLinear(const float *x, int64_t m, int64_t k, const int8_t *w,
                    int64_t ldw, int64_t n, const float *scale,
                    const float *bias, float *y);

namespace kernels_internal {
// Rows [0, rows) of x [., k] (row stride k; rows <= width) quantized as
// Int8DotLinear documents into one panel of `width` lanes: block b at
// out + b * kInt8DotBlock * width holds [4-value group][lane][4 bytes] of
// qx + 128, and scales[b * width + lane] its d. Lanes from `rows` on and
// values past k hold 0 (qx + 128 = 128, d = 0). Needs AVX-512 (BW): the
// caller checks ActiveExtension.
void PackInt8XPanel(const float *x, int64_t k, int64_t rows, int64_t width,
                    int64_t blocks, uint8_t *out, float *scales);
}  // namespace kernels_internal

}  // namespace moh
