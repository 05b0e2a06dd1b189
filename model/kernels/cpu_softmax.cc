#include "model/kernels/cpu_softmax.h"

#include <immintrin.h>

#include <algorithm>

namespace moh {
namespace {

// e^x for x <= 0 (a score minus its row's maximum): x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its Taylor polynomial to r^6 (relative error below
// 2e-7), times 2^n. Below -87.3 the result is 0 or a denormal, as expf's.
__attribute__((target("avx512f"))) inline __m512 ExpNonPositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2, with ln2 split in two so that n ln2 is exact enough.
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

__mmask16 Head(int64_t count) {
  return count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
}

__attribute__((target("avx512f"))) void SoftmaxRow(const float *s, float *p,
                                                   int64_t n, int64_t cols) {
  __m512 max = _mm512_set1_ps(-__builtin_inff());
  for (int64_t j = 0; j < n; j += 16) {
    max = _mm512_mask_max_ps(max, Head(n - j), max,
                             _mm512_maskz_loadu_ps(Head(n - j), s + j));
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(max));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = Head(n - j);
    const __m512 e =
        ExpNonPositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + j), top));
    sum = _mm512_mask_add_ps(sum, mask, sum, e);
    _mm512_mask_storeu_ps(p + j, mask, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = Head(n - j);
    _mm512_mask_storeu_ps(
        p + j, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, p + j), inv));
  }
  std::fill(p + n, p + cols, 0.0f);
}

}  // namespace

bool SoftmaxRows(const float *scores, float *probs, int64_t rows, int64_t cols,
                 const int64_t *visible) {
  static const bool has = __builtin_cpu_supports("avx512f");
  if (!has) return false;
  for (int64_t i = 0; i < rows; ++i) {
    SoftmaxRow(scores + i * cols, probs + i * cols, visible[i], cols);
  }
  return true;
}

}  // namespace moh
