// Bf16Linear's and Int8Linear's few-row kernels for AVX2 + FMA, chosen when
// ActiveIsa() is kAvx2 (cpu_lowp_rows_impl.h over 8 lanes, 16 ymm
// registers), and WidenBf16Rows' row.
#include <immintrin.h>

#include <cstring>

#include "model/kernels/cpu_lowp_linear.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace moh::kernels_internal {
namespace {

struct Avx2 {
  using Reg = __m256;
  static constexpr int kLanes = 8;
  // R * M <= 8 accumulators, R widened W vectors and one x vector.
  static constexpr int kMaxRowsOfX = 4;
  static constexpr int RowsOfW(int m) { return m == 1 ? 4 : 2; }
  static Reg Zero() { return _mm256_setzero_ps(); }
  static Reg Load(const float *p) { return _mm256_loadu_ps(p); }
  static Reg Widen(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i *>(p))),
        16));
  }
  static Reg Widen(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i *>(p))));
  }
  static Reg Fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static float Sum(Reg v) {
    __m128 s =
        _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};

}  // namespace
}  // namespace moh::kernels_internal

#include "model/kernels/cpu_lowp_rows_impl.h"

namespace moh::kernels_internal {

void Bf16RowsAvx2(const float *x, int64_t m, int64_t k, const uint16_t *w,
                  int64_t ldw, int64_t n, int64_t j0, int64_t j1,
                  const float *bias, float *y) {
  LowpFewRows<Avx2>(x, m, k, w, ldw, n, j0, j1, nullptr, bias, y);
}

void WidenBf16RowAvx2(const uint16_t *w, int64_t k, float *out) {
  const int64_t body = k & ~int64_t{7};
  for (int64_t p = 0; p < body; p += 8)
    _mm256_storeu_ps(out + p, Avx2::Widen(w + p));
  for (int64_t p = body; p < k; ++p) out[p] = LowpToFloat(w[p]);
}

void Int8RowsAvx2(const float *x, int64_t m, int64_t k, const int8_t *w,
                  int64_t ldw, int64_t n, int64_t j0, int64_t j1,
                  const float *scale, const float *bias, float *y) {
  LowpFewRows<Avx2>(x, m, k, w, ldw, n, j0, j1, scale, bias, y);
}

}  // namespace moh::kernels_internal
#pragma GCC pop_options
