// Bf16Linear's and Int8Linear's few-row kernels for AVX2 + FMA, chosen when
// ActiveIsa() is kAvx2: 8 lanes, 16 ymm registers.
#include <immintrin.h>

#include <cstring>

#include "model/kernels/cpu_lowp_linear.h"

namespace moh::kernels_internal {
namespace {

inline float ToFloat(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float ToFloat(int8_t v) { return static_cast<float>(v); }

__attribute__((target("avx2,fma"))) inline __m256 Widen8(const uint16_t *p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i *>(p))),
      16));
}
__attribute__((target("avx2,fma"))) inline __m256 Widen8(const int8_t *p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i *>(p))));
}

__attribute__((target("avx2,fma"))) inline float Sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int R, int M, typename T>
__attribute__((target("avx2,fma"), always_inline)) inline void Step256(
    __m256 (&acc)[M][R], const float *x, int64_t k, const T *w, int64_t ldw,
    int64_t p) {
  __m256 wv[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) wv[r] = Widen8(w + r * ldw + p);
#pragma GCC unroll 4
  for (int i = 0; i < M; ++i) {
    const __m256 xv = _mm256_loadu_ps(x + i * k + p);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      acc[i][r] = _mm256_fmadd_ps(wv[r], xv, acc[i][r]);
  }
}

// As Block512 in cpu_lowp_linear.cc (a cache line of each row a step, the
// next block's line prefetched into L2), 8 lanes: R * M <= 8 accumulators
// plus R widened W vectors and one x vector fit 16 ymm registers.
template <int R, int M, typename T>
__attribute__((target("avx2,fma"))) void Block256(const float *x, int64_t k,
                                                  const T *w, int64_t ldw,
                                                  int64_t n, float *y) {
  constexpr int64_t kLine = 64 / sizeof(T);
  __m256 acc[M][R];
#pragma GCC unroll 4
  for (int i = 0; i < M; ++i) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  }
  const int64_t lines = k & ~(kLine - 1), body = k & ~int64_t{7};
  int64_t p = 0;
  for (; p < lines; p += kLine) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char *>(w + (R + r) * ldw + p),
                   _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int64_t q = 0; q < kLine; q += 8) Step256(acc, x, k, w, ldw, p + q);
  }
  for (; p < body; p += 8) Step256(acc, x, k, w, ldw, p);
  for (int i = 0; i < M; ++i) {
    for (int r = 0; r < R; ++r) {
      float s = Sum8(acc[i][r]);
      for (int64_t p = body; p < k; ++p)
        s += ToFloat(w[r * ldw + p]) * x[i * k + p];
      y[i * n + r] = s;
    }
  }
}

template <int M, typename T>
__attribute__((target("avx2,fma"))) void Rows256(const float *x, int64_t k,
                                                 const T *w, int64_t ldw,
                                                 int64_t n, int64_t j0,
                                                 int64_t j1, float *y) {
  constexpr int R = M == 1 ? 4 : 2;
  int64_t j = j0;
  for (; j + R <= j1; j += R) Block256<R, M>(x, k, w + j * ldw, ldw, n, y + j);
  for (; j < j1; ++j) Block256<1, M>(x, k, w + j * ldw, ldw, n, y + j);
}

template <typename T>
__attribute__((target("avx2,fma"))) void FewRows256(
    const float *x, int64_t m, int64_t k, const T *w, int64_t ldw, int64_t n,
    int64_t j0, int64_t j1, const float *scale, const float *bias, float *y) {
  for (int64_t i = 0; i < m;) {
    const int64_t left = m - i;
    const float *xi = x + i * k;
    float *yi = y + i * n;
    if (left >= 4) {
      Rows256<4>(xi, k, w, ldw, n, j0, j1, yi);
      i += 4;
    } else if (left >= 2) {
      Rows256<2>(xi, k, w, ldw, n, j0, j1, yi);
      i += 2;
    } else {
      Rows256<1>(xi, k, w, ldw, n, j0, j1, yi);
      i += 1;
    }
  }
  ScaleAndAddBias(m, n, j0, j1, scale, bias, y);
}

}  // namespace

void Bf16RowsAvx2(const float *x, int64_t m, int64_t k, const uint16_t *w,
                  int64_t ldw, int64_t n, int64_t j0, int64_t j1,
                  const float *bias, float *y) {
  FewRows256(x, m, k, w, ldw, n, j0, j1, nullptr, bias, y);
}

__attribute__((target("avx2,fma"))) void WidenBf16RowAvx2(const uint16_t *w,
                                                          int64_t k,
                                                          float *out) {
  const int64_t body = k & ~int64_t{7};
  for (int64_t p = 0; p < body; p += 8)
    _mm256_storeu_ps(out + p, Widen8(w + p));
  for (int64_t p = body; p < k; ++p) out[p] = ToFloat(w[p]);
}

void Int8RowsAvx2(const float *x, int64_t m, int64_t k, const int8_t *w,
                  int64_t ldw, int64_t n, int64_t j0, int64_t j1,
                  const float *scale, const float *bias, float *y) {
  FewRows256(x, m, k, w, ldw, n, j0, j1, scale, bias, y);
}

}  // namespace moh::kernels_internal
