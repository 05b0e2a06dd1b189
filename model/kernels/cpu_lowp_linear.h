// y = x W^T (+ bias) for float32 x and y and a bfloat16 W read in place:
// the products widen W's values in registers (bf16 -> f32 is a 16-bit left
// shift of the bits), so a model can hold its linear weights in half the
// memory of float32 without a widened copy, where LibTorch 1.13's CPU
// bf16 matmul runs generic kernels (4.2x slower than float32 per decode
// token of the bench model, 26x at prefill: issue 33). Likewise for a
// weight-only int8 W with a scale per row (a quarter of float32's bytes).
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>

#include "model/kernels/cpu_linear.h"

namespace moh {

// Row counts up to this (bf16 and int8 alike) stream W once, each group of
// W's rows widened in registers against every row of x (a decode step), x
// kept float32. Beyond, a bf16 W on AMX-BF16 multiplies in tiles against x
// rounded to bfloat16 (Bf16AmxLinear, cpu_bf16_dot.h: 2.5-5x the
// AVX512_BF16 path below at 16-128 rows, 4.9-6.1x the float32 product at
// prefill). Otherwise, up to kMaxStreamedRows (a decode batch), a bf16 W on
// AVX512_BF16 is read in place against x rounded to bfloat16
// (Bf16DotRowsLinear, cpu_bf16_dot.h: decode 1.8-2.1x the widening path's
// on the 24 M bench model at batches 16 and 32), an int8 W on AVX512_VNNI
// against x quantized per 32 values (Int8DotRowsLinear, cpu_int8_dot.h),
// otherwise each thread widens
// 32 rows of W at a time into its buffer and streams them against float32 x
// (StreamedLinear's tiles). Beyond (a prefill), the CPU's dot-product
// extensions multiply in low precision as llama.cpp does: a bf16 W on
// AVX512_BF16 with x rounded to bfloat16 (Bf16DotLinear) where that is
// faster than widening W (Bf16DotPrefillPays), an int8 W on
// AVX512_VNNI with x quantized per 32 values of a row as Q8_0 does
// (Int8DotLinear, cpu_int8_dot.h), the products summed in float32 (int32
// within a block); without them, W is widened into BlockedLinear's loop
// nest block by block as its tasks pack it (BlockedLinearWidened): a prefill
// pays the widening once per block against many rows. (At 16 rows the few-row
// kernel, two passes over W, measured no faster than the widened blocks.)
inline constexpr int64_t kMaxBf16StreamRows = 8;

// y [m, n] = x [m, k] W^T (+ bias [n]) for row-major contiguous x and y and
// a row-major bfloat16 W [n, k] (bits as uint16) with row stride ldw >= k.
// Runs ActiveIsa()'s instruction set; returns false, doing nothing, under
// CpuIsa::kPortable. Past kMaxBf16StreamRows rows with AVX512_BF16 active,
// x is rounded to bfloat16 (above): with AMX-BF16 or up to kMaxStreamedRows
// always, beyond only where Bf16DotPrefillPays. Threads split W's rows on the
// intra-op pool.
bool Bf16Linear(const float *x, int64_t m, int64_t k, const uint16_t *w,
                int64_t ldw, int64_t n, const float *bias, float *y);

// Whether Bf16Linear's prefills (more than kMaxStreamedRows rows) take
// Bf16DotLinear: AVX512_BF16 is active and, measured once per process on
// one product, vdpbf16ps beats widening W into the float32 kernels. It does
// not everywhere: 2.2x the widening path on an AMD EPYC (Zen 4), 0.6-0.7x
// on a Sapphire Rapids VM, whose FMA units do as many multiply-adds a cycle
// (bench/RESULTS.md section 20). MOH_BF16_DOT_PREFILL=1 or 0 decides instead
// (read at every call: the tests run both paths).
bool Bf16DotPrefillPays();

// W [n, k] (row stride ldw) widened to float32 into out [n, k] (contiguous):
// the panel path's and the head-sparse kernel's per-head slices.
void WidenBf16Rows(const uint16_t *w, int64_t ldw, int64_t n, int64_t k,
                   float *out);

// Weight-only int8 with one float32 scale per row of W (per output channel):
// W[j, p] = w[j, p] * scale[j]. y [m, n] = x [m, k] W^T (+ bias [n]) for
// row-major contiguous x and y and an int8 W [n, k] with row stride
// ldw >= k. Runs ActiveIsa()'s instruction set; returns false, doing
// nothing, under CpuIsa::kPortable. Threads split W's rows. Beyond
// kMaxBf16StreamRows rows with AVX512_VNNI (ActiveExtension), and from
// there up to kMaxStreamedRows under kAvx2 (Int8MaddRowsLinear), x is
// quantized per 32 values (Int8DotLinear's numerics), else it stays float32.
bool Int8Linear(const float *x, int64_t m, int64_t k, const int8_t *w,
                int64_t ldw, int64_t n, const float *scale, const float *bias,
                float *y);

// Whether Int8Linear's prefills (more than kMaxStreamedRows rows) take
// Int8MaddLinear (cpu_int8_dot.h) on a CPU without AVX512_VNNI: vpmaddwd's
// 16 multiply-adds an instruction beat widening W into the float32 kernels,
// measured once per process on one product as Bf16DotPrefillPays is
// (bench/RESULTS.md section 22). MOH_INT8_MADD_PREFILL=1 or 0 decides
// instead. False under CpuIsa::kPortable and where VNNI runs the prefills.
bool Int8MaddPrefillPays();

// W [n, k] (row stride ldw) times its rows' scales into out [n, k]
// (contiguous float32): the panel path's and the head-sparse kernel's slices.
void WidenInt8Rows(const int8_t *w, int64_t ldw, int64_t n, int64_t k,
                   const float *scale, float *out);

// Symmetric per-row quantization of a float32 W [n, k] (row stride ldw):
// scale[j] = max_p |W[j, p]| / 127 (1 for a row of zeros) and
// q[j, p] = round-to-nearest-even(W[j, p] / scale[j]) into q [n, k]
// (contiguous), so |W - q scale| <= scale / 2 elementwise. Threads split
// the rows.
void QuantizeInt8Rows(const float *w, int64_t ldw, int64_t n, int64_t k,
                      int8_t *q, float *scale);

namespace kernels_internal {
// A bfloat16's bits widened to float32: a 16-bit left shift.
inline float Bf16BitsToFloat(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Rows [j0, j1) of y for the few-row path; x has m <= kMaxBf16StreamRows
// rows. W's values are widened in registers; the int8 kernels multiply a
// row's sum by scale[j] once at the end. bias may be null.
void Bf16RowsAvx512(const float *x, int64_t m, int64_t k, const uint16_t *w,
                    int64_t ldw, int64_t n, int64_t j0, int64_t j1,
                    const float *bias, float *y);
void Bf16RowsAvx2(const float *x, int64_t m, int64_t k, const uint16_t *w,
                  int64_t ldw, int64_t n, int64_t j0, int64_t j1,
                  const float *bias, float *y);
void Int8RowsAvx512(const float *x, int64_t m, int64_t k, const int8_t *w,
                    int64_t ldw, int64_t n, int64_t j0, int64_t j1,
                    const float *scale, const float *bias, float *y);
void Int8RowsAvx2(const float *x, int64_t m, int64_t k, const int8_t *w,
                  int64_t ldw, int64_t n, int64_t j0, int64_t j1,
                  const float *scale, const float *bias, float *y);

// Whether `candidate` ran faster than `baseline`: each one's best of 3
// runs, interleaved, after an untimed first one. How Bf16DotPrefillPays and
// Int8MaddPrefillPays choose a prefill's path, once per process.
bool FasterThan(const std::function<void()> &candidate,
                const std::function<void()> &baseline);

// The choice an environment variable forces: "1" true, "0" false, else
// none (read at every call, so that tests can run both paths).
std::optional<bool> ForcedChoice(const char *variable);

// The widening path (m > kMaxBf16StreamRows) of Bf16Linear and Int8Linear:
// y [m, n] = x [m, k] W^T (+ bias) with W widened by `widen` (cpu_linear.h)
// block by block into the float32 kernels: StreamedLinear's tiles for a
// decode batch, BlockedLinearWidened beyond. False only under
// CpuIsa::kPortable.
bool PanelLinear(const float *x, int64_t m, int64_t k, int64_t n,
                 const float *bias, const WidenBlockFn &widen, float *y);

// One row of WidenBf16Rows, QuantizeInt8Rows and WidenInt8Rows in AVX2
// (the caller checks that ActiveIsa() is not kPortable).
void WidenBf16RowAvx2(const uint16_t *w, int64_t k, float *out);
void QuantizeInt8RowAvx2(const float *w, int64_t k, int8_t *q, float *scale);
void WidenInt8RowAvx2(const int8_t *w, int64_t k, float scale, float *out);
}  // namespace kernels_internal

}  // namespace moh
