// Int8Linear (weight-only int8, a scale per row of W), its widening and the
// quantization that makes its weights (model/kernels/cpu_lowp_linear.h).
// The few-row kernels are Bf16Linear's, instantiated for int8
// (cpu_lowp_linear.cc, cpu_lowp_linear_avx2.cc); the AVX2 quantization and
// widening rows are in cpu_int8_linear_avx2.cc.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "model/kernels/cpu_int8_dot.h"
#include "model/kernels/cpu_isa.h"
#include "model/kernels/cpu_linear.h"
#include "model/kernels/cpu_lowp_linear.h"

namespace moh {

void WidenInt8Rows(const int8_t *w, int64_t ldw, int64_t n, int64_t k,
                   const float *scale, float *out) {
  const bool avx2 = ActiveIsa() != CpuIsa::kPortable;
  for (int64_t j = 0; j < n; ++j) {
    const int8_t *from = w + j * ldw;
    float *to = out + j * k;
    if (avx2) {
      kernels_internal::WidenInt8RowAvx2(from, k, scale[j], to);
      continue;
    }
    for (int64_t p = 0; p < k; ++p)
      to[p] = static_cast<float>(from[p]) * scale[j];
  }
}

void QuantizeInt8Rows(const float *w, int64_t ldw, int64_t n, int64_t k,
                      int8_t *q, float *scale) {
  const bool avx2 = ActiveIsa() != CpuIsa::kPortable;
  at::parallel_for(0, n, 16, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const float *row = w + j * ldw;
      int8_t *out = q + j * k;
      if (avx2) {
        kernels_internal::QuantizeInt8RowAvx2(row, k, out, scale + j);
        continue;
      }
      float largest = 0.0f;
      for (int64_t p = 0; p < k; ++p)
        largest = std::max(largest, std::fabs(row[p]));
      const float s = largest > 0.0f ? largest / 127.0f : 1.0f;
      scale[j] = s;
      const float inverse = 1.0f / s;
      for (int64_t p = 0; p < k; ++p) {
        const float v = std::nearbyint(row[p] * inverse);
        out[p] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
      }
    }
  });
}

namespace {

// Int8Linear's widening path (PanelLinear): W widened to float32 block by
// block into the float32 kernels, x kept float32.
bool WidenedInt8Linear(const float *x, int64_t m, int64_t k, const int8_t *w,
                       int64_t ldw, int64_t n, const float *scale,
                       const float *bias, float *y) {
  return kernels_internal::PanelLinear(
      x, m, k, n, bias,
      [&](int64_t j, int64_t rows, int64_t p0, int64_t depth, float *out) {
        WidenInt8Rows(w + j * ldw + p0, ldw, rows, depth, scale + j, out);
      },
      y);
}

// Int8MaddLinear against WidenedInt8Linear, timed by FasterThan on x
// [256, 1024] and W [512, 1024].
bool MeasureInt8MaddPrefill() {
  constexpr int64_t kRows = 256, kDepth = 1024, kCols = 512;
  std::vector<float> x(kRows * kDepth), y(kRows * kCols), scale(kCols, 0.01f);
  std::vector<int8_t> w(kCols * kDepth);
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = 0.25f * static_cast<float>(i % 7);
  for (size_t i = 0; i < w.size(); ++i)
    w[i] = static_cast<int8_t>(static_cast<int>(i % 255) - 127);
  return kernels_internal::FasterThan(
      [&] {
        Int8MaddLinear(x.data(), kRows, kDepth, w.data(), kDepth, kCols,
                       scale.data(), nullptr, y.data());
      },
      [&] {
        WidenedInt8Linear(x.data(), kRows, kDepth, w.data(), kDepth, kCols,
                          scale.data(), nullptr, y.data());
      });
}

}  // namespace

bool Int8MaddPrefillPays() {
  if (ActiveIsa() == CpuIsa::kPortable ||
      ActiveExtension(CpuExtension::kAvx512Vnni)) {
    return false;
  }
  if (const auto forced =
          kernels_internal::ForcedChoice("MOH_INT8_MADD_PREFILL")) {
    return *forced;
  }
  static const bool pays = MeasureInt8MaddPrefill();
  return pays;
}

bool Int8Linear(const float *x, int64_t m, int64_t k, const int8_t *w,
                int64_t ldw, int64_t n, const float *scale, const float *bias,
                float *y) {
  const CpuIsa isa = ActiveIsa();
  if (isa == CpuIsa::kPortable || m < 1 || n < 1 || k < 1) return false;
  if (m <= kMaxBf16StreamRows) {
    // As Bf16Linear: 64 rows of W a task.
    at::parallel_for(0, n, 64, [&](int64_t j0, int64_t j1) {
      if (isa == CpuIsa::kAvx512) {
        kernels_internal::Int8RowsAvx512(x, m, k, w, ldw, n, j0, j1, scale,
                                         bias, y);
      } else {
        kernels_internal::Int8RowsAvx2(x, m, k, w, ldw, n, j0, j1, scale, bias,
                                       y);
      }
    });
    return true;
  }
  // On VNNI CPUs x is quantized per 32 values into integer dot products, as
  // llama.cpp's Q8_0 does at every batch size: decode batches with W
  // streamed in place (widening it to float32 cost more than the product),
  // a prefill in packed blocks. The few-row path above keeps float32 x.
  if (m <= kMaxStreamedRows
          ? Int8DotRowsLinear(x, m, k, w, ldw, n, scale, bias, y)
          : Int8DotLinear(x, m, k, w, ldw, n, scale, bias, y)) {
    return true;
  }
  // Without VNNI, decode batches in vpmaddwd (Int8MaddRowsLinear): cold W
  // [2048-8192, 2048], AVX2 on a Sapphire Rapids, one thread, two runs:
  // 1.04-1.16x the widening below at 16 rows, 1.0-1.12x at 32; the bench
  // model's batch-16 decode 1.15x. At 8 rows and fewer the two were level
  // (W's reads decide), and the few-row path above keeps x in float32.
  // Prefills too (Int8MaddLinear) where that measured faster on this CPU.
  if (m <= kMaxStreamedRows
          ? isa == CpuIsa::kAvx2 &&
                Int8MaddRowsLinear(x, m, k, w, ldw, n, scale, bias, y)
          : Int8MaddPrefillPays() &&
                Int8MaddLinear(x, m, k, w, ldw, n, scale, bias, y)) {
    return true;
  }
  return WidenedInt8Linear(x, m, k, w, ldw, n, scale, bias, y);
}

}  // namespace moh
