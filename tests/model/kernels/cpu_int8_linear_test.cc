// Int8Linear (model/kernels/cpu_lowp_linear.h) against at::linear over the
// dequantized weights w * scale[:, None] (the exact values the kernel
// sees): every row count of the few-row path and beyond it (the panel
// path), depth remainders of both vector widths, a row stride wider than k,
// bias, and several panels; QuantizeInt8Rows' error bound, zero rows and
// round trip through WidenInt8Rows. Registered once per instruction set
// (kernel_isa_test_util.h).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "model/kernels/cpu_lowp_linear.h"
#include "tests/model/kernels/kernel_isa_test_util.h"

namespace moh {
namespace {

// W's values span int8's range; the scales keep |W| near 127 * 0.021.
void ExpectMatchesLinear(int64_t m, int64_t k, int64_t n, bool bias,
                         int64_t extra_columns) {
  at::manual_seed(m * 1000 + k + n);
  const at::Tensor x = at::randn({m, k});
  const at::Tensor w = at::randint(-127, 128, {n, k + extra_columns})
                           .to(at::kChar)
                           .narrow(1, 0, k);
  const at::Tensor scale = at::rand({n}) * 0.02 + 0.001;
  const at::Tensor b = bias ? at::randn({n}) : at::Tensor();
  const at::Tensor dequantized = w.to(at::kFloat) * scale.unsqueeze(1);
  ExpectKernelEqualsLinear(
      x, dequantized, b, "ldw " + std::to_string(w.stride(0)), [&](float *y) {
        return Int8Linear(x.data_ptr<float>(), m, k, w.data_ptr<int8_t>(),
                          w.stride(0), n, scale.data_ptr<float>(),
                          bias ? b.data_ptr<float>() : nullptr, y);
      });
}

// The few-row path at every row count, its remainders, and the panel path.
TEST(Int8LinearTest, EqualsLinearOnEveryPath) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  ForFewRowCounts(kMaxBf16StreamRows, ExpectMatchesLinear);
  ForRemainders(ExpectMatchesLinear);
  ForPanelPath(kMaxBf16StreamRows + 1, ExpectMatchesLinear);
}

TEST(Int8LinearTest, RefusesUnderPortable) {
  if (ActiveIsa() != CpuIsa::kPortable) GTEST_SKIP() << "kernels run";
  float x = 1, y = 0, scale = 1;
  const int8_t w = 1;
  EXPECT_FALSE(Int8Linear(&x, 1, 1, &w, 1, 1, &scale, nullptr, &y));
}

// Every instruction set's run: under portable the scalar rows, else AVX2.
TEST(QuantizeInt8RowsTest, ErrorWithinHalfAStepAndZeroRows) {
  for (int64_t k : {1, 7, 31, 32, 33, 100}) {
    at::manual_seed(k);
    const int64_t n = 5;
    at::Tensor w = at::randn({n, k + 3}) * 3;
    w[2].zero_();
    w[4][0] = -50;  // its row's largest magnitude is negative
    const at::Tensor wk = w.narrow(1, 0, k);
    at::Tensor q = at::full({n, k}, 99, at::kChar);
    at::Tensor scale = at::full({n}, std::nanf(""));
    QuantizeInt8Rows(w.data_ptr<float>(), w.stride(0), n, k,
                     q.data_ptr<int8_t>(), scale.data_ptr<float>());
    EXPECT_EQ(scale[2].item<float>(), 1.0f);
    EXPECT_TRUE(at::equal(q[2], at::zeros({k}, at::kChar)));
    const at::Tensor largest = std::get<0>(wk.abs().max(1));
    for (int64_t j : {0, 1, 3, 4}) {
      EXPECT_FLOAT_EQ(scale[j].item<float>(), largest[j].item<float>() / 127);
    }
    EXPECT_EQ(q[4][0].item<int8_t>(), -127);
    EXPECT_LE(q.abs().max().item<int8_t>(), 127);
    const at::Tensor back = q.to(at::kFloat) * scale.unsqueeze(1);
    const at::Tensor bound = scale.unsqueeze(1) * (0.5 + 1e-5);
    EXPECT_TRUE(((back - wk).abs() <= bound).all().item<bool>())
        << "k " << k << " max error " << (back - wk).abs().max().item<float>();
    // Rounds to nearest: the same as LibTorch's round (half to even).
    const at::Tensor want = at::round(wk / scale.unsqueeze(1)).to(at::kChar);
    EXPECT_LE((q.to(at::kInt) - want.to(at::kInt)).abs().max().item<int>(), 1);
  }
}

TEST(QuantizeInt8RowsTest, WidenIsQuantizedTimesScaleAndRoundTrips) {
  at::manual_seed(7);
  const at::Tensor w = at::randn({4, 45});
  at::Tensor q = at::empty({4, 45}, at::kChar);
  at::Tensor scale = at::empty({4});
  QuantizeInt8Rows(w.data_ptr<float>(), 45, 4, 45, q.data_ptr<int8_t>(),
                   scale.data_ptr<float>());
  // A row stride wider than k: the first 37 columns of each row.
  at::Tensor part = at::full({4, 37}, std::nanf(""));
  WidenInt8Rows(q.data_ptr<int8_t>(), 45, 4, 37, scale.data_ptr<float>(),
                part.data_ptr<float>());
  EXPECT_TRUE(
      at::equal(part, q.narrow(1, 0, 37).to(at::kFloat) * scale.unsqueeze(1)));
  // Quantizing the widened rows again gives the same int8 and scales.
  at::Tensor out = at::full({4, 45}, std::nanf(""));
  WidenInt8Rows(q.data_ptr<int8_t>(), 45, 4, 45, scale.data_ptr<float>(),
                out.data_ptr<float>());
  at::Tensor again = at::empty({4, 45}, at::kChar);
  at::Tensor scale_again = at::empty({4});
  QuantizeInt8Rows(out.data_ptr<float>(), 45, 4, 45, again.data_ptr<int8_t>(),
                   scale_again.data_ptr<float>());
  EXPECT_TRUE(at::equal(again, q));
  EXPECT_TRUE(at::allclose(scale_again, scale, 1e-6, 0));
}

}  // namespace
}  // namespace moh
