// The few-row kernel of Bf16Linear and Int8Linear (cpu_lowp_linear.h),
// written once over the vector width and the weight type. An implementation
// file, not an interface: cpu_lowp_linear.cc (AVX-512) and
// cpu_lowp_linear_avx2.cc (AVX2 + FMA) each include it inside their own
// `#pragma GCC target` region, after defining the vector type V:
//   V::Reg                 the register (__m512, __m256); V::kLanes floats
//   V::kMaxRowsOfX         rows of x a pass over W (8 within 32 zmm, 4 in 16)
//   V::RowsOfW(m)          rows of W a block at m rows of x
//   V::Zero(), V::Load(const float *), V::Widen(const uint16_t *),
//   V::Widen(const int8_t *), V::Fma(a, b, c) = a b + c, V::Sum(Reg)
// Everything here is in an unnamed namespace so that each file's copy,
// compiled for its instruction set, stays its own.
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "model/kernels/cpu_lowp_linear.h"

namespace moh::kernels_internal {
namespace {

inline float LowpToFloat(uint16_t v) { return Bf16BitsToFloat(v); }
inline float LowpToFloat(int8_t v) { return static_cast<float>(v); }

// acc[i][r] += W[r, p:p+kLanes] x[i, p:p+kLanes] for R rows of W and M of
// x, each W vector widened once and used against every row of x.
template <typename V, int R, int M, typename T>
__attribute__((always_inline)) inline void LowpStep(
    typename V::Reg (&acc)[M][R], const float *x, int64_t k, const T *w,
    int64_t ldw, int64_t p) {
  typename V::Reg wv[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) wv[r] = V::Widen(w + r * ldw + p);
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) {
    const typename V::Reg xv = V::Load(x + i * k + p);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[i][r] = V::Fma(wv[r], xv, acc[i][r]);
  }
}

// y[i, j] for R rows of W (from j) and M rows of x: R * M accumulators
// (W is the stream; x's few rows stay in L1). A cache line of each row a
// step, prefetching the same line of the next R rows (the next block's,
// R * ldw ahead) into L2: a row of W is short (2 KiB of int8 at k 2048)
// for the hardware prefetchers to ramp up on, and the int8 loop issues too
// few loads per line for out-of-order execution to keep enough misses in
// flight (prefetching into L1 instead evicts the block in use). Cold int8
// W [2048, 2048], one row of x, one thread, AVX-512: 770 us without, 490 us
// into L1, 249 us into L2. k's remainder in scalar code.
template <typename V, int R, int M, typename T>
void LowpBlock(const float *x, int64_t k, const T *w, int64_t ldw, int64_t n,
               const float *scale, const float *bias, float *y) {
  constexpr int64_t kLine = 64 / sizeof(T);
  typename V::Reg acc[M][R];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[i][r] = V::Zero();
  }
  const int64_t lines = k & ~(kLine - 1), body = k & ~int64_t{V::kLanes - 1};
  int64_t p = 0;
  for (; p < lines; p += kLine) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char *>(w + (R + r) * ldw + p),
                   _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int64_t q = 0; q < kLine; q += V::kLanes) {
      LowpStep<V>(acc, x, k, w, ldw, p + q);
    }
  }
  for (; p < body; p += V::kLanes) LowpStep<V>(acc, x, k, w, ldw, p);
  for (int i = 0; i < M; ++i) {
    for (int r = 0; r < R; ++r) {
      float s = V::Sum(acc[i][r]);
      for (int64_t q = body; q < k; ++q)
        s += LowpToFloat(w[r * ldw + q]) * x[i * k + q];
      if (scale != nullptr) s *= scale[r];
      y[i * n + r] = bias != nullptr ? s + bias[r] : s;
    }
  }
}

template <typename V, int M, typename T>
void LowpRows(const float *x, int64_t k, const T *w, int64_t ldw, int64_t n,
              int64_t j0, int64_t j1, const float *scale, const float *bias,
              float *y) {
  constexpr int R = V::RowsOfW(M);
  auto block = [&](auto rows, int64_t j) {
    LowpBlock<V, decltype(rows)::value, M>(
        x, k, w + j * ldw, ldw, n, scale != nullptr ? scale + j : nullptr,
        bias != nullptr ? bias + j : nullptr, y + j);
  };
  int64_t j = j0;
  for (; j + R <= j1; j += R) block(std::integral_constant<int, R>{}, j);
  for (; j < j1; ++j) block(std::integral_constant<int, 1>{}, j);
}

// Rows [j0, j1) of y: x's rows in passes of V::kMaxRowsOfX, 4, 2 and 1,
// each row's sum times its scale plus its bias as it is stored.
template <typename V, typename T>
void LowpFewRows(const float *x, int64_t m, int64_t k, const T *w, int64_t ldw,
                 int64_t n, int64_t j0, int64_t j1, const float *scale,
                 const float *bias, float *y) {
  for (int64_t i = 0; i < m;) {
    const int64_t left = m - i;
    const float *xi = x + i * k;
    float *yi = y + i * n;
    if constexpr (V::kMaxRowsOfX >= 8) {
      if (left >= 8) {
        LowpRows<V, 8>(xi, k, w, ldw, n, j0, j1, scale, bias, yi);
        i += 8;
        continue;
      }
    }
    if (left >= 4) {
      LowpRows<V, 4>(xi, k, w, ldw, n, j0, j1, scale, bias, yi);
      i += 4;
    } else if (left >= 2) {
      LowpRows<V, 2>(xi, k, w, ldw, n, j0, j1, scale, bias, yi);
      i += 2;
    } else {
      LowpRows<V, 1>(xi, k, w, ldw, n, j0, j1, scale, bias, yi);
      i += 1;
    }
  }
}

}  // namespace
}  // namespace moh::kernels_internal
