// QuantizeInt8Rows' and WidenInt8Rows' rows in AVX2 (cpu_int8_linear.cc
// calls them where ActiveIsa() is not kPortable): a model's load quantizes
// billions of weights.
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "model/kernels/cpu_kernels_avx2.h"
#include "model/kernels/cpu_lowp_linear.h"

namespace moh::kernels_internal {

__attribute__((target("avx2,fma"))) void QuantizeInt8RowAvx2(const float *w,
                                                             int64_t k,
                                                             int8_t *q,
                                                             float *scale) {
  const int64_t body = k & ~int64_t{31};
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 top = _mm256_setzero_ps();
  for (int64_t p = 0; p < (k & ~int64_t{7}); p += 8)
    top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(w + p), magnitude));
  float largest = HorizontalMax8(top);
  for (int64_t p = k & ~int64_t{7}; p < k; ++p)
    largest = std::max(largest, std::fabs(w[p]));
  const float s = largest > 0.0f ? largest / 127.0f : 1.0f;
  *scale = s;
  const float inverse = 1.0f / s;
  // 32 values a step: scaled, rounded to nearest even (the default MXCSR
  // mode), packed 32 -> 16 -> 8 bits with saturation (|v| <= 127 already);
  // the packs interleave 128-bit lanes, which the permutation undoes.
  const __m256 factor = _mm256_set1_ps(inverse);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t p = 0; p < body; p += 32) {
    __m256i v[4];
    for (int c = 0; c < 4; ++c) {
      v[c] = _mm256_cvtps_epi32(
          _mm256_mul_ps(_mm256_loadu_ps(w + p + 8 * c), factor));
    }
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                              _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(q + p),
                        _mm256_permutevar8x32_epi32(packed, order));
  }
  for (int64_t p = body; p < k; ++p) {
    const float v = std::nearbyint(w[p] * inverse);
    q[p] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
  }
}

__attribute__((target("avx2,fma"))) void WidenInt8RowAvx2(const int8_t *w,
                                                          int64_t k,
                                                          float scale,
                                                          float *out) {
  const int64_t body = k & ~int64_t{7};
  const __m256 factor = _mm256_set1_ps(scale);
  for (int64_t p = 0; p < body; p += 8) {
    const __m256i v = _mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i *>(w + p)));
    _mm256_storeu_ps(out + p, _mm256_mul_ps(_mm256_cvtepi32_ps(v), factor));
  }
  for (int64_t p = body; p < k; ++p) out[p] = static_cast<float>(w[p]) * scale;
}

}  // namespace moh::kernels_internal
