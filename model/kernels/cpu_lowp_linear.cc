// Bf16Linear: the dispatcher, the panel path (prefill) and the AVX-512
// few-row kernel; the AVX2 kernel is in cpu_lowp_linear_avx2.cc.
#include "model/kernels/cpu_lowp_linear.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "model/kernels/cpu_isa.h"
#include "model/kernels/cpu_linear.h"

namespace moh {
namespace {

inline float ToFloat(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float ToFloat(int8_t v) { return static_cast<float>(v); }

// 16 of W's values from p widened to float32: bf16 by a 16-bit left shift
// of the bits, int8 by sign extension and conversion.
__attribute__((target("avx512f"))) inline __m512 Widen16(const uint16_t *p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))),
      16));
}
__attribute__((target("avx512f"))) inline __m512 Widen16(const int8_t *p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i *>(p))));
}

// acc[i][r] += W[r, p:p+16] x[i, p:p+16] for R rows of W and M of x, each
// W vector widened once and used against every row of x.
template <int R, int M, typename T>
__attribute__((target("avx512f"), always_inline)) inline void Step512(
    __m512 (&acc)[M][R], const float *x, int64_t k, const T *w, int64_t ldw,
    int64_t p) {
  __m512 wv[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) wv[r] = Widen16(w + r * ldw + p);
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) {
    const __m512 xv = _mm512_loadu_ps(x + i * k + p);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      acc[i][r] = _mm512_fmadd_ps(wv[r], xv, acc[i][r]);
  }
}

// y[i, j] for R rows of W (from j) and M rows of x: R * M accumulators of 16
// lanes (W is the stream; x's few rows stay in L1). A cache line of each
// row a step, prefetching the same line of the next R rows (the next
// block's, R * ldw ahead) into L2: a row of W is short (2 KiB of int8 at
// k 2048) for the hardware prefetchers to ramp up on, and the int8 loop
// issues too few loads per line for out-of-order execution to keep enough
// misses in flight (prefetching into L1 instead evicts the block in use).
// Cold int8 W [2048, 2048], one row of x, one thread: 770 us without,
// 490 us into L1, 249 us into L2. k's remainder in scalar code.
template <int R, int M, typename T>
__attribute__((target("avx512f"))) void Block512(const float *x, int64_t k,
                                                 const T *w, int64_t ldw,
                                                 int64_t n, float *y) {
  constexpr int64_t kLine = 64 / sizeof(T);
  __m512 acc[M][R];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  }
  const int64_t lines = k & ~(kLine - 1), body = k & ~int64_t{15};
  int64_t p = 0;
  for (; p < lines; p += kLine) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char *>(w + (R + r) * ldw + p),
                   _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int64_t q = 0; q < kLine; q += 16) Step512(acc, x, k, w, ldw, p + q);
  }
  for (; p < body; p += 16) Step512(acc, x, k, w, ldw, p);
  for (int i = 0; i < M; ++i) {
    for (int r = 0; r < R; ++r) {
      float s = _mm512_reduce_add_ps(acc[i][r]);
      for (int64_t p = body; p < k; ++p)
        s += ToFloat(w[r * ldw + p]) * x[i * k + p];
      y[i * n + r] = s;
    }
  }
}

template <int M, typename T>
__attribute__((target("avx512f"))) void Rows512(const float *x, int64_t k,
                                                const T *w, int64_t ldw,
                                                int64_t n, int64_t j0,
                                                int64_t j1, float *y) {
  // Four rows of W a step at one or two rows of x (independent FMA chains
  // for the 4-cycle latency); two at more rows, within 32 zmm registers.
  constexpr int R = M == 1 ? 8 : M == 2 ? 4 : 2;
  int64_t j = j0;
  for (; j + R <= j1; j += R) Block512<R, M>(x, k, w + j * ldw, ldw, n, y + j);
  for (; j < j1; ++j) Block512<1, M>(x, k, w + j * ldw, ldw, n, y + j);
}

// The few-row kernel over rows [j0, j1) of W: x's rows in groups of 8, 4,
// 2 and 1 (8 rows: 16 accumulators, W read once per 8 rows of x).
template <typename T>
__attribute__((target("avx512f"))) void FewRows512(
    const float *x, int64_t m, int64_t k, const T *w, int64_t ldw, int64_t n,
    int64_t j0, int64_t j1, const float *scale, const float *bias, float *y) {
  for (int64_t i = 0; i < m;) {
    const int64_t left = m - i;
    const float *xi = x + i * k;
    float *yi = y + i * n;
    if (left >= 8) {
      Rows512<8>(xi, k, w, ldw, n, j0, j1, yi);
      i += 8;
    } else if (left >= 4) {
      Rows512<4>(xi, k, w, ldw, n, j0, j1, yi);
      i += 4;
    } else if (left >= 2) {
      Rows512<2>(xi, k, w, ldw, n, j0, j1, yi);
      i += 2;
    } else {
      Rows512<1>(xi, k, w, ldw, n, j0, j1, yi);
      i += 1;
    }
  }
  kernels_internal::ScaleAndAddBias(m, n, j0, j1, scale, bias, y);
}

}  // namespace

namespace kernels_internal {

void Bf16RowsAvx512(const float *x, int64_t m, int64_t k, const uint16_t *w,
                    int64_t ldw, int64_t n, int64_t j0, int64_t j1,
                    const float *bias, float *y) {
  FewRows512(x, m, k, w, ldw, n, j0, j1, nullptr, bias, y);
}

void Int8RowsAvx512(const float *x, int64_t m, int64_t k, const int8_t *w,
                    int64_t ldw, int64_t n, int64_t j0, int64_t j1,
                    const float *scale, const float *bias, float *y) {
  FewRows512(x, m, k, w, ldw, n, j0, j1, scale, bias, y);
}

void ScaleAndAddBias(int64_t m, int64_t n, int64_t j0, int64_t j1,
                     const float *scale, const float *bias, float *y) {
  if (scale == nullptr && bias == nullptr) return;
  for (int64_t i = 0; i < m; ++i) {
    float *yi = y + i * n;
    for (int64_t j = j0; j < j1; ++j) {
      yi[j] = (scale != nullptr ? yi[j] * scale[j] : yi[j]) +
              (bias != nullptr ? bias[j] : 0.0f);
    }
  }
}

bool PanelLinear(const float *x, int64_t m, int64_t k, int64_t n,
                 const float *bias, const WidenRowsFn &widen, float *y) {
  // Panels of W widened into ~1 MiB (L2) and multiplied by the float32
  // kernels, which thread inside; their output is a [m, panel] block copied
  // into y's columns. The copy and the widening are O(m n + n k) against
  // the product's O(m n k).
  const int64_t panel =
      std::min<int64_t>(n, std::max<int64_t>(16, ((1 << 18) / k) & ~15));
  std::vector<float> wide(static_cast<size_t>(panel * k));
  std::vector<float> block(static_cast<size_t>(m * panel));
  for (int64_t j0 = 0; j0 < n; j0 += panel) {
    const int64_t cols = std::min(panel, n - j0);
    at::parallel_for(0, cols, 16, [&](int64_t a, int64_t b) {
      widen(j0 + a, b - a, wide.data() + a * k);
    });
    const float *b = bias != nullptr ? bias + j0 : nullptr;
    const bool ok =
        m <= kMaxStreamedRows
            ? StreamedLinear(x, m, k, wide.data(), k, cols, b, block.data())
            : BlockedLinear(x, m, k, wide.data(), k, cols, b, block.data());
    if (!ok) return false;
    at::parallel_for(0, m, 16, [&](int64_t a, int64_t e) {
      for (int64_t i = a; i < e; ++i)
        std::memcpy(y + i * n + j0, block.data() + i * cols,
                    sizeof(float) * cols);
    });
  }
  return true;
}

}  // namespace kernels_internal

void WidenBf16Rows(const uint16_t *w, int64_t ldw, int64_t n, int64_t k,
                   float *out) {
  const bool avx2 = ActiveIsa() != CpuIsa::kPortable;
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t *from = w + j * ldw;
    float *to = out + j * k;
    if (avx2) {
      kernels_internal::WidenBf16RowAvx2(from, k, to);
      continue;
    }
    for (int64_t p = 0; p < k; ++p) to[p] = ToFloat(from[p]);
  }
}

bool Bf16Linear(const float *x, int64_t m, int64_t k, const uint16_t *w,
                int64_t ldw, int64_t n, const float *bias, float *y) {
  const CpuIsa isa = ActiveIsa();
  if (isa == CpuIsa::kPortable || m < 1 || n < 1 || k < 1) return false;
  if (m <= kMaxBf16StreamRows) {
    // 64 rows of W a task: enough work to amortize a task, and W's rows
    // split evenly for a handful of threads.
    at::parallel_for(0, n, 64, [&](int64_t j0, int64_t j1) {
      if (isa == CpuIsa::kAvx512) {
        kernels_internal::Bf16RowsAvx512(x, m, k, w, ldw, n, j0, j1, bias, y);
      } else {
        kernels_internal::Bf16RowsAvx2(x, m, k, w, ldw, n, j0, j1, bias, y);
      }
    });
    return true;
  }
  return kernels_internal::PanelLinear(
      x, m, k, n, bias,
      [&](int64_t j, int64_t rows, float *out) {
        WidenBf16Rows(w + j * ldw, ldw, rows, k, out);
      },
      y);
}

}  // namespace moh
