// Bf16Linear (model/kernels/cpu_lowp_linear.h) against at::linear over the
// same bf16 weights widened to float32 (the exact values the kernel sees):
// every row count of the few-row path and beyond it (the panel path, into
// StreamedLinear and BlockedLinear), depth remainders of both vector widths,
// a row stride wider than k (a column slice), bias, and several panels.
// Registered once per instruction set (kernel_isa_test_util.h).
#include "model/kernels/cpu_lowp_linear.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

#include "tests/model/kernels/kernel_isa_test_util.h"

namespace moh {
namespace {

void ExpectMatchesLinear(int64_t m, int64_t k, int64_t n, bool bias,
                         int64_t extra_columns) {
  at::manual_seed(m * 1000 + k + n);
  const at::Tensor x = at::randn({m, k});
  const at::Tensor wide = at::randn({n, k + extra_columns}).to(at::kBFloat16);
  const at::Tensor w = wide.narrow(1, 0, k);
  const at::Tensor b = bias ? at::randn({n}) : at::Tensor();
  ExpectKernelEqualsLinear(
      x, w.to(at::kFloat), b, "ldw " + std::to_string(w.stride(0)),
      [&](float *y) {
        return Bf16Linear(
            x.data_ptr<float>(), m, k,
            reinterpret_cast<const uint16_t *>(w.data_ptr<at::BFloat16>()),
            w.stride(0), n, bias ? b.data_ptr<float>() : nullptr, y);
      });
}

TEST(Bf16LinearTest, EqualsLinearAtFewRowCounts) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  ForFewRowCounts(kMaxBf16StreamRows, ExpectMatchesLinear);
}

TEST(Bf16LinearTest, RemaindersOfColumnsDepthAndStride) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  ForRemainders(ExpectMatchesLinear);
}

TEST(Bf16LinearTest, PanelPathStreamedAndBlocked) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  ForPanelPath(kMaxBf16StreamRows + 1, ExpectMatchesLinear);
}

TEST(Bf16LinearTest, RefusesUnderPortable) {
  if (ActiveIsa() != CpuIsa::kPortable) GTEST_SKIP() << "kernels run";
  float x = 1, y = 0;
  const uint16_t w = 0x3f80;  // 1.0
  EXPECT_FALSE(Bf16Linear(&x, 1, 1, &w, 1, 1, nullptr, &y));
}

TEST(Bf16LinearTest, WidenIsExact) {
  const at::Tensor w = at::randn({3, 20}).to(at::kBFloat16);
  at::Tensor out = at::empty({3, 10});
  WidenBf16Rows(reinterpret_cast<const uint16_t *>(w.data_ptr<at::BFloat16>()),
                20, 3, 10, out.data_ptr<float>());
  EXPECT_TRUE(at::equal(out, w.narrow(1, 0, 10).to(at::kFloat)));
}

}  // namespace
}  // namespace moh
