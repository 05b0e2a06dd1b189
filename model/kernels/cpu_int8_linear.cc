// Int8Linear (weight-only int8, a scale per row of W), its widening and the
// quantization that makes its weights (model/kernels/cpu_lowp_linear.h).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "model/kernels/cpu_isa.h"
#include "model/kernels/cpu_linear.h"
#include "model/kernels/cpu_lowp_linear.h"

namespace moh {

void WidenInt8Rows(const int8_t *w, int64_t ldw, int64_t n, int64_t k,
                   const float *scale, float *out) {
  for (int64_t j = 0; j < n; ++j) {
    const int8_t *from = w + j * ldw;
    const float s = scale[j];
    float *to = out + j * k;
    for (int64_t p = 0; p < k; ++p) to[p] = static_cast<float>(from[p]) * s;
  }
}

void QuantizeInt8Rows(const float *w, int64_t ldw, int64_t n, int64_t k,
                      int8_t *q, float *scale) {
  at::parallel_for(0, n, 16, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const float *row = w + j * ldw;
      float largest = 0.0f;
      for (int64_t p = 0; p < k; ++p)
        largest = std::max(largest, std::fabs(row[p]));
      const float s = largest > 0.0f ? largest / 127.0f : 1.0f;
      scale[j] = s;
      const float inverse = 1.0f / s;
      int8_t *out = q + j * k;
      for (int64_t p = 0; p < k; ++p) {
        const float v = std::nearbyint(row[p] * inverse);
        out[p] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
      }
    }
  });
}

bool Int8Linear(const float *x, int64_t m, int64_t k, const int8_t *w,
                int64_t ldw, int64_t n, const float *scale, const float *bias,
                float *y) {
  if (ActiveIsa() == CpuIsa::kPortable || m < 1 || n < 1 || k < 1) return false;
  // Panels of W widened into ~1 MiB and multiplied by the float32 kernels.
  const int64_t panel =
      std::min<int64_t>(n, std::max<int64_t>(16, ((1 << 18) / k) & ~15));
  std::vector<float> wide(static_cast<size_t>(panel * k));
  std::vector<float> block(static_cast<size_t>(m * panel));
  for (int64_t j0 = 0; j0 < n; j0 += panel) {
    const int64_t cols = std::min(panel, n - j0);
    at::parallel_for(0, cols, 16, [&](int64_t a, int64_t b) {
      WidenInt8Rows(w + (j0 + a) * ldw, ldw, b - a, k, scale + j0 + a,
                    wide.data() + a * k);
    });
    const float *b = bias != nullptr ? bias + j0 : nullptr;
    const bool ok =
        m == 1 ? RowLinear(x, k, wide.data(), k, cols, b, block.data())
        : m < kMinStreamedRows
            ? SkinnyLinear(x, m, k, wide.data(), k, cols, b, block.data())
        : m <= kMaxStreamedRows
            ? StreamedLinear(x, m, k, wide.data(), k, cols, b, block.data())
            : BlockedLinear(x, m, k, wide.data(), k, cols, b, block.data());
    if (!ok) return false;
    for (int64_t i = 0; i < m; ++i) {
      std::memcpy(y + i * n + j0, block.data() + i * cols,
                  sizeof(float) * cols);
    }
  }
  return true;
}

}  // namespace moh
