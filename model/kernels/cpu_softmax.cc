#include "model/kernels/cpu_softmax.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

#include "model/kernels/cpu_isa.h"
#include "model/kernels/cpu_kernels_avx2.h"
#include "model/kernels/cpu_streamed_rows.h"

namespace moh {
namespace {

using kernels_internal::Head8;
using kernels_internal::HorizontalSum8;
using kernels_internal::LaneMask16;
using kernels_internal::LoadHead8;
using kernels_internal::StoreHead8;

// ExpNonPositive's constants, the same for every vector width: the clamp,
// log2(e), ln2 split in two (kLn2Hi + kLn2Lo) so that n ln2 is exact enough,
// and e^r's Taylor coefficients to r^6, highest power first (Horner's rule).
constexpr float kExpFloor = -87.3f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpTaylor[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6,
                                0.5f,       1.0f,       1.0f};
constexpr int kExpTerms = sizeof(kExpTaylor) / sizeof(kExpTaylor[0]);

// e^x for x <= 0 (a score minus its row's maximum): x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its Taylor polynomial to r^6 (relative error below
// 2e-7), times 2^n. Below -87.3 the result is 0 or a denormal, as expf's.
__attribute__((target("avx512f"))) inline __m512 ExpNonPositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpFloor));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
#pragma GCC unroll 8
  for (int i = 1; i < kExpTerms; ++i) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpTaylor[i]));
  }
  return _mm512_scalef_ps(p, n);
}

// One row of SoftmaxRows.
__attribute__((target("avx512f"))) void SoftmaxRow(const float *s, float *p,
                                                   int64_t n, int64_t cols,
                                                   float *inverse_sum) {
  __m512 max = _mm512_set1_ps(-__builtin_inff());
  for (int64_t j = 0; j < n; j += 16) {
    max = _mm512_mask_max_ps(max, LaneMask16(n - j), max,
                             _mm512_maskz_loadu_ps(LaneMask16(n - j), s + j));
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(max));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = LaneMask16(n - j);
    const __m512 e =
        ExpNonPositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + j), top));
    sum = _mm512_mask_add_ps(sum, mask, sum, e);
    _mm512_mask_storeu_ps(p + j, mask, e);
  }
  *inverse_sum = 1.0f / _mm512_reduce_add_ps(sum);
  std::fill(p + n, p + cols, 0.0f);
}

// ExpNonPositive on AVX2 + FMA: the same polynomial; 2^n built in the
// exponent field, since AVX2 has no scalef (n >= -126 after the clamp, so
// 2^n is a normal float).
__attribute__((target("avx2,fma"))) inline __m256 ExpNonPositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpFloor));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
#pragma GCC unroll 8
  for (int i = 1; i < kExpTerms; ++i) {
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpTaylor[i]));
  }
  const __m256i power = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

// SoftmaxRow on AVX2: whole vectors of 8, then one masked (masked-off
// lanes read as -inf for the maximum and count 0 in the sum).
__attribute__((target("avx2,fma"))) void SoftmaxRowAvx2(const float *s,
                                                        float *p, int64_t n,
                                                        int64_t cols,
                                                        float *inverse_sum) {
  const __m256 lowest = _mm256_set1_ps(-__builtin_inff());
  const int64_t whole = n / 8 * 8;
  __m256 max = lowest;
  for (int64_t j = 0; j < whole; j += 8) {
    max = _mm256_max_ps(max, _mm256_loadu_ps(s + j));
  }
  const __m256 tail = _mm256_castsi256_ps(Head8(n - whole));
  if (whole < n) {
    max = _mm256_max_ps(
        max, _mm256_blendv_ps(lowest, LoadHead8(s + whole, n - whole), tail));
  }
  const __m256 top = _mm256_set1_ps(kernels_internal::HorizontalMax8(max));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < whole; j += 8) {
    const __m256 e = ExpNonPositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), top));
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(p + j, e);
  }
  if (whole < n) {
    const __m256 e = _mm256_and_ps(
        ExpNonPositive(_mm256_sub_ps(LoadHead8(s + whole, n - whole), top)),
        tail);
    sum = _mm256_add_ps(sum, e);
    StoreHead8(p + whole, e, n - whole);
  }
  *inverse_sum = 1.0f / HorizontalSum8(sum);
  std::fill(p + n, p + cols, 0.0f);
}

// silu(g) * u over one row: t = e^-|g| (in (0, 1]), sigmoid(g) = 1 / (1 + t)
// for g >= 0 and t / (1 + t) below, so e^x is only ever taken of x <= 0.
__attribute__((target("avx512f"))) void SiluMulRow(const float *g,
                                                   const float *u, int64_t n,
                                                   float *out) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = LaneMask16(n - j);
    const __m512 x = _mm512_maskz_loadu_ps(mask, g + j);
    const __m512 t = ExpNonPositive(
        _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));  // e^-|x|
    const __mmask16 negative =
        _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 top = _mm512_mask_blend_ps(negative, one, t);
    const __m512 silu =
        _mm512_div_ps(_mm512_mul_ps(x, top), _mm512_add_ps(one, t));
    _mm512_mask_storeu_ps(
        out + j, mask, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(mask, u + j)));
  }
}

__attribute__((target("avx2,fma"))) __m256 SiluAvx2(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);  // |x|
  const __m256 t =
      ExpNonPositive(_mm256_sub_ps(_mm256_setzero_ps(), magnitude));
  const __m256 negative = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 top = _mm256_blendv_ps(one, t, negative);
  return _mm256_div_ps(_mm256_mul_ps(x, top), _mm256_add_ps(one, t));
}

__attribute__((target("avx2,fma"))) void SiluMulRowAvx2(const float *g,
                                                        const float *u,
                                                        int64_t n, float *out) {
  const int64_t whole = n / 8 * 8;
  for (int64_t j = 0; j < whole; j += 8) {
    _mm256_storeu_ps(out + j, _mm256_mul_ps(SiluAvx2(_mm256_loadu_ps(g + j)),
                                            _mm256_loadu_ps(u + j)));
  }
  if (whole < n) {
    StoreHead8(out + whole,
               _mm256_mul_ps(SiluAvx2(LoadHead8(g + whole, n - whole)),
                             LoadHead8(u + whole, n - whole)),
               n - whole);
  }
}

}  // namespace

bool SiluMulRows(const float *x, int64_t ldx, int64_t rows, int64_t n,
                 float *out) {
  const CpuIsa isa = ActiveIsa();
  if (isa == CpuIsa::kPortable) return false;
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 16) / n),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t i = begin; i < end; ++i) {
                       const float *g = x + i * ldx;
                       if (isa == CpuIsa::kAvx512) {
                         SiluMulRow(g, g + n, n, out + i * n);
                       } else {
                         SiluMulRowAvx2(g, g + n, n, out + i * n);
                       }
                     }
                   });
  return true;
}

bool SoftmaxRows(const float *scores, float *probs, int64_t rows, int64_t cols,
                 const int64_t *visible, float *inverse_sums) {
  const CpuIsa isa = ActiveIsa();
  if (isa == CpuIsa::kPortable) return false;
  for (int64_t i = 0; i < rows; ++i) {
    if (isa == CpuIsa::kAvx512) {
      SoftmaxRow(scores + i * cols, probs + i * cols, visible[i], cols,
                 inverse_sums + i);
    } else {
      SoftmaxRowAvx2(scores + i * cols, probs + i * cols, visible[i], cols,
                     inverse_sums + i);
    }
  }
  return true;
}

}  // namespace moh
