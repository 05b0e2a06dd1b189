// Bf16Linear: the dispatcher, the panel path (prefill, Int8Linear's too)
// and the AVX-512 few-row kernels of both; the AVX2 ones are in
// cpu_lowp_linear_avx2.cc, both instances of cpu_lowp_rows_impl.h.
#include "model/kernels/cpu_lowp_linear.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

#include "model/kernels/cpu_bf16_dot.h"
#include "model/kernels/cpu_isa.h"
#include "model/kernels/cpu_linear.h"
#include "model/kernels/cpu_streamed_rows.h"

// The few-row kernel for AVX-512 (cpu_lowp_rows_impl.h over 16 lanes).
#pragma GCC push_options
#pragma GCC target("avx512f")
namespace moh::kernels_internal {
namespace {

struct Avx512 {
  using Reg = __m512;
  static constexpr int kLanes = 16;
  // 8 rows of x at 2 rows of W: 16 accumulators of the 32 zmm registers.
  static constexpr int kMaxRowsOfX = 8;
  // More rows of W at fewer rows of x: independent FMA chains for the
  // 4-cycle latency, and more of W's rows streaming at once.
  static constexpr int RowsOfW(int m) { return m == 1 ? 8 : m == 2 ? 4 : 2; }
  static Reg Zero() { return _mm512_setzero_ps(); }
  static Reg Load(const float *p) { return _mm512_loadu_ps(p); }
  // bf16 widens by a 16-bit left shift of the bits, int8 by sign extension.
  static Reg Widen(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))),
        16));
  }
  static Reg Widen(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i *>(p))));
  }
  static Reg Fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static float Sum(Reg v) { return _mm512_reduce_add_ps(v); }
};

}  // namespace
}  // namespace moh::kernels_internal

#include "model/kernels/cpu_lowp_rows_impl.h"

namespace moh::kernels_internal {

void Bf16RowsAvx512(const float *x, int64_t m, int64_t k, const uint16_t *w,
                    int64_t ldw, int64_t n, int64_t j0, int64_t j1,
                    const float *bias, float *y) {
  LowpFewRows<Avx512>(x, m, k, w, ldw, n, j0, j1, nullptr, bias, y);
}

void Int8RowsAvx512(const float *x, int64_t m, int64_t k, const int8_t *w,
                    int64_t ldw, int64_t n, int64_t j0, int64_t j1,
                    const float *scale, const float *bias, float *y) {
  LowpFewRows<Avx512>(x, m, k, w, ldw, n, j0, j1, scale, bias, y);
}

}  // namespace moh::kernels_internal
#pragma GCC pop_options

namespace moh {
namespace kernels_internal {

bool PanelLinear(const float *x, int64_t m, int64_t k, int64_t n,
                 const float *bias, const WidenBlockFn &widen, float *y) {
  if (m <= kMaxStreamedRows) {
    // A decode batch: one parallel region over blocks of W's rows, each
    // widened into its thread's buffer (32 rows, L1/L2-sized) and streamed
    // at once against x^T, packed once, into y's columns in place. Panels
    // widened by every thread and then multiplied (below) cost two parallel
    // regions and a copy per panel: a 1 B layout's batch-16 decode with
    // int8 weights ran at 0.41-0.80 of llama.cpp's Q8_0.
    constexpr int64_t kBlockRows = 32;
    const int64_t ldx = TransposedWidth(m);
    const float *xt = PackTransposed({x, k}, m, k, 1.0f);
    const int64_t blocks = (n + kBlockRows - 1) / kBlockRows;
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      thread_local AlignedBuffer buffer;
      float *wide = buffer.Get(kBlockRows * k);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t j0 = b * kBlockRows;
        const int64_t rows = std::min(kBlockRows, n - j0);
        widen(j0, rows, 0, k, wide);
        StreamRows(xt, ldx, m, k, wide, k, 0, rows, {y + j0, n});
        if (bias == nullptr) continue;
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < rows; ++j) y[i * n + j0 + j] += bias[j0 + j];
        }
      }
    });
    return true;
  }
  // A prefill: each of BlockedLinear's tasks widens the block of W it packs
  // (32 rows by at most 512 of k, in its cache). Before, 8 MiB panels of W
  // were widened whole and multiplied, and each panel's [m, panel] result
  // copied into y's columns: the bench LM's bf16 prefill of 512 tokens ran
  // 0.67 of float32's (memset, memmove and the extra parallel regions took
  // 13% of it).
  return BlockedLinearWidened(x, m, k, n, widen, bias, y);
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
    for (int64_t p = 0; p < k; ++p)
      to[p] = kernels_internal::Bf16BitsToFloat(from[p]);
  }
}

namespace {

// Bf16Linear's widening path (PanelLinear): W widened to float32 block by
// block into the float32 kernels, x kept float32.
bool WidenedBf16Linear(const float *x, int64_t m, int64_t k, const uint16_t *w,
                       int64_t ldw, int64_t n, const float *bias, float *y) {
  return kernels_internal::PanelLinear(
      x, m, k, n, bias,
      [&](int64_t j, int64_t rows, int64_t p0, int64_t depth, float *out) {
        WidenBf16Rows(w + j * ldw + p0, ldw, rows, depth, out);
      },
      y);
}

// Bf16DotLinear against WidenedBf16Linear, timed by PrefillPathPays on x
// [256, 1024] and W [512, 1024] (about 2 ms each).
bool MeasureBf16DotPrefill() {
  constexpr int64_t kRows = 256, kDepth = 1024, kCols = 512;
  std::vector<float> x(kRows * kDepth), y(kRows * kCols);
  std::vector<uint16_t> w(kCols * kDepth);
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = 0.25f * static_cast<float>(i % 7);
  // bfloat16 0.5, 0.75 and -1: the upper half of their float32 bits.
  const uint16_t values[3] = {0x3F00, 0x3F40, 0xBF80};
  for (size_t i = 0; i < w.size(); ++i) w[i] = values[i % 3];
  return kernels_internal::FasterThan(
      [&] {
        Bf16DotLinear(x.data(), kRows, kDepth, w.data(), kDepth, kCols, nullptr,
                      y.data());
      },
      [&] {
        WidenedBf16Linear(x.data(), kRows, kDepth, w.data(), kDepth, kCols,
                          nullptr, y.data());
      });
}

}  // namespace

namespace kernels_internal {

bool FasterThan(const std::function<void()> &candidate,
                const std::function<void()> &baseline) {
  double best[2] = {1e30, 1e30};
  for (int run = 0; run < 4; ++run) {
    for (int which = 0; which < 2; ++which) {
      const auto start = std::chrono::steady_clock::now();
      (which == 0 ? candidate : baseline)();
      const std::chrono::duration<double> took =
          std::chrono::steady_clock::now() - start;
      if (run > 0) best[which] = std::min(best[which], took.count());
    }
  }
  return best[0] < best[1];
}

std::optional<bool> ForcedChoice(const char *variable) {
  if (const char *force = std::getenv(variable)) {
    if (std::strcmp(force, "1") == 0) return true;
    if (std::strcmp(force, "0") == 0) return false;
  }
  return std::nullopt;
}

}  // namespace kernels_internal

bool Bf16DotPrefillPays() {
  if (!ActiveExtension(CpuExtension::kAvx512Bf16)) return false;
  if (const auto forced =
          kernels_internal::ForcedChoice("MOH_BF16_DOT_PREFILL")) {
    return *forced;
  }
  static const bool pays = MeasureBf16DotPrefill();
  return pays;
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
  // On AVX512_BF16 x is rounded to bfloat16 and multiplied in pairs, as
  // llama.cpp does at every batch size. With AMX, in tiles (Sapphire Rapids
  // VM, bench/RESULTS.md section 21): against Bf16DotRowsLinear 2.5-5x at
  // 16-128 rows (2 threads), against the float32 product 4.9-6.1x at 512
  // rows (one thread). Without it, decode batches
  // with W streamed in place (widening it to float32 cost nearly as much as
  // the product), a prefill in packed blocks where that is the faster path
  // on this CPU (Bf16DotPrefillPays). The few-row path above keeps float32 x.
  if (Bf16AmxLinear(x, m, k, w, ldw, n, bias, y) ||
      (m <= kMaxStreamedRows
           ? Bf16DotRowsLinear(x, m, k, w, ldw, n, bias, y)
           : Bf16DotPrefillPays() &&
                 Bf16DotLinear(x, m, k, w, ldw, n, bias, y))) {
    return true;
  }
  return WidenedBf16Linear(x, m, k, w, ldw, n, bias, y);
}

}  // namespace moh
