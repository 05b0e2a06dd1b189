// Bf16Linear (model/kernels/cpu_lowp_linear.h) against at::linear over the
// same bf16 weights widened to float32 (the exact values the kernel sees):
// every row count of the few-row path and beyond it (the panel path, into
// StreamedLinear and BlockedLinear), depth remainders of both vector widths,
// a row stride wider than k (a column slice), bias, and several panels.
// Past kMaxBf16StreamRows on AVX512_BF16 CPUs it multiplies x rounded to
// bfloat16 (Bf16DotRowsLinear for decode batches, Bf16DotLinear beyond,
// cpu_bf16_dot.h), tested here against a double reference over the same
// rounded x. Registered once per instruction set
// (kernel_isa_test_util.h).
#include "model/kernels/cpu_lowp_linear.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "model/kernels/cpu_bf16_dot.h"
#include "model/kernels/cpu_isa.h"
#include "model/kernels/cpu_linear.h"
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
  // What the kernel multiplies: x itself, or on the dot path x's bfloat16s.
  const bool dot =
      m > kMaxBf16StreamRows && ActiveExtension(CpuExtension::kAvx512Bf16) &&
      (m <= kMaxStreamedRows || ActiveExtension(CpuExtension::kAmxBf16) ||
       Bf16DotPrefillPays());
  ExpectKernelEqualsLinear(
      dot ? x.to(at::kBFloat16).to(at::kFloat) : x, w.to(at::kFloat), b,
      "ldw " + std::to_string(w.stride(0)), [&](float *y) {
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

// Bf16Linear's prefill against float32 x: within the rounding of x to
// bfloat16 (<= 2^-9 of each |x| |w| term) on the dot path, and far inside
// it on the widening one.
TEST(Bf16LinearTest, PrefillWithinBf16ActivationBound) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  for (int64_t m : {kMaxStreamedRows + 1, int64_t{300}}) {
    at::manual_seed(m);
    const int64_t k = 2048, n = 300;
    const at::Tensor x = at::randn({m, k});
    const at::Tensor w = at::randn({n, k}).to(at::kBFloat16);
    const at::Tensor wf = w.to(at::kFloat);
    at::Tensor y = at::full({m, n}, std::nanf(""));
    ASSERT_TRUE(Bf16Linear(
        x.data_ptr<float>(), m, k,
        reinterpret_cast<const uint16_t *>(w.data_ptr<at::BFloat16>()), k, n,
        nullptr, y.data_ptr<float>()));
    const at::Tensor want = at::linear(x.to(at::kDouble), wf.to(at::kDouble));
    const at::Tensor bound =
        (std::ldexp(1.0, -9) + 1e-5) *
        at::linear(x.abs().to(at::kDouble), wf.abs().to(at::kDouble));
    EXPECT_TRUE(at::all((y.to(at::kDouble) - want).abs() <= bound).item<bool>())
        << "m " << m << " max error / bound "
        << ((y.to(at::kDouble) - want).abs() / bound).max().item<double>();
  }
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

// Bf16DotLinear against a double product of the same bfloat16 values (x
// rounded to nearest even, as at::Tensor::to rounds): only float32
// summation error, bounded by 1e-5 of each element's |x| |w| sum (plus
// |bias|, added in float32 too). Row,
// depth (odd ones padded with a zero) and column remainders of its 14 x 32
// tiles, 512-pair passes, and row strides odd and even.
// `product` is the kernel: Bf16DotLinear, Bf16DotRowsLinear (decode
// batches) or Bf16AmxLinear.
using Bf16Product = bool (*)(const float *, int64_t, int64_t, const uint16_t *,
                             int64_t, int64_t, const float *, float *);
void ExpectDotMatchesReference(int64_t m, int64_t k, int64_t n, bool bias,
                               Bf16Product product = Bf16DotLinear) {
  const int64_t extra_columns = n % 3;
  at::manual_seed(m * 7919 + k * 31 + n);
  const at::Tensor x = at::randn({m, k});
  const at::Tensor w =
      at::randn({n, k + extra_columns}).to(at::kBFloat16).narrow(1, 0, k);
  const at::Tensor b = bias ? at::randn({n}) : at::Tensor();
  const at::Tensor xd = x.to(at::kBFloat16).to(at::kDouble);
  const at::Tensor wd = w.to(at::kDouble);
  at::Tensor want = at::matmul(xd, wd.t());
  at::Tensor bound = at::matmul(xd.abs(), wd.abs().t());
  if (bias) {
    want += b.to(at::kDouble);
    bound += b.abs().to(at::kDouble);
  }
  bound *= 1e-5;
  at::Tensor y = at::full({m, n}, std::nanf(""));
  ASSERT_TRUE(
      product(x.data_ptr<float>(), m, k,
              reinterpret_cast<const uint16_t *>(w.data_ptr<at::BFloat16>()),
              w.stride(0), n, bias ? b.data_ptr<float>() : nullptr,
              y.data_ptr<float>()));
  // NaN (an element left unwritten) fails the comparison.
  const at::Tensor error = (y.to(at::kDouble) - want).abs();
  EXPECT_TRUE(at::all(error <= bound).item<bool>())
      << "m " << m << " k " << k << " n " << n << " ldw " << w.stride(0)
      << " bias " << bias << " NaNs " << at::isnan(y).sum().item<int64_t>()
      << " max error / bound " << (error / bound).max().item<double>();
}

#define MOH_SKIP_UNLESS_BF16_DOT_RUNS()            \
  MOH_SKIP_UNLESS_KERNELS_RUN();                   \
  if (!ActiveExtension(CpuExtension::kAvx512Bf16)) \
  GTEST_SKIP() << "no AVX512_BF16 under " << ActiveIsaLabel()

// A prefill takes the path MOH_BF16_DOT_PREFILL forces, each exact to its
// own reference (x rounded to bfloat16 on the dot path), and the two differ.
// With AMX, every prefill takes its tiles instead (the test below).
TEST(Bf16LinearTest, PrefillTakesThePathForced) {
  MOH_SKIP_UNLESS_BF16_DOT_RUNS();
  if (ActiveExtension(CpuExtension::kAmxBf16)) {
    GTEST_SKIP() << "AMX takes the prefills under " << ActiveIsaLabel();
  }
  const char *before = std::getenv("MOH_BF16_DOT_PREFILL");
  const std::string saved = before ? before : "";
  const int64_t m = kMaxStreamedRows + 72, k = 300, n = 90;
  const at::Tensor x = at::randn({m, k});
  const at::Tensor w = at::randn({n, k}).to(at::kBFloat16);
  std::vector<at::Tensor> y;
  for (const char *force : {"1", "0"}) {
    setenv("MOH_BF16_DOT_PREFILL", force, 1);
    EXPECT_EQ(Bf16DotPrefillPays(), force[0] == '1');
    ForPanelPath(kMaxStreamedRows + 1, ExpectMatchesLinear);
    y.push_back(at::empty({m, n}));
    ASSERT_TRUE(Bf16Linear(
        x.data_ptr<float>(), m, k,
        reinterpret_cast<const uint16_t *>(w.data_ptr<at::BFloat16>()), k, n,
        nullptr, y.back().data_ptr<float>()));
  }
  if (before) {
    setenv("MOH_BF16_DOT_PREFILL", saved.c_str(), 1);
  } else {
    unsetenv("MOH_BF16_DOT_PREFILL");
  }
  EXPECT_FALSE(at::equal(y[0], y[1])) << "x was not rounded on the dot path";
}

TEST(Bf16DotLinearTest, EqualsDoubleReferenceOverRemainders) {
  MOH_SKIP_UNLESS_BF16_DOT_RUNS();
  for (int64_t m : {129, 200, 512 + 13}) {
    for (int64_t k : {1, 2, 3, 31, 64, 95, 513, 2048}) {
      for (int64_t n : {1, 17, 32, 33, 100, 1000}) {
        ExpectDotMatchesReference(m, k, n, false);
        ExpectDotMatchesReference(m, k, n, true);
      }
    }
  }
}

// Few rows and columns: one thread's tile, and row groups split for
// threads when y has fewer column chunks than there are threads.
TEST(Bf16DotLinearTest, FewRowsAndColumns) {
  MOH_SKIP_UNLESS_BF16_DOT_RUNS();
  for (int64_t m : {1, 13, 14, 15, 40}) {
    for (int64_t n : {1, 31, 200}) ExpectDotMatchesReference(m, 1100, n, m % 2);
  }
}

// The decode-batch kernel: one and two vectors of x's rows and their
// remainders, W's 14-, 4- and 1-row tiles, odd k (its last pair read
// alone), row strides wider than k (odd ones unaligned pairs).
TEST(Bf16DotRowsLinearTest, EqualsDoubleReferenceOverRemainders) {
  MOH_SKIP_UNLESS_BF16_DOT_RUNS();
  for (int64_t m : {9, 15, 16, 17, 31, 32, 33, 64, 100, 128}) {
    for (int64_t k : {1, 2, 3, 31, 64, 95, 513, 2048}) {
      for (int64_t n : {1, 13, 14, 15, 29, 100, 1000}) {
        ExpectDotMatchesReference(m, k, n, false, Bf16DotRowsLinear);
        ExpectDotMatchesReference(m, k, n, true, Bf16DotRowsLinear);
      }
    }
  }
}

#define MOH_SKIP_UNLESS_BF16_AMX_RUNS()         \
  MOH_SKIP_UNLESS_BF16_DOT_RUNS();              \
  if (!ActiveExtension(CpuExtension::kAmxBf16)) \
  GTEST_SKIP() << "no AMX-BF16 under " << ActiveIsaLabel()

// The AMX kernel: rows of x around its 32-row panels (panels split for the
// threads where W's rows are few), k around its 32-value steps (the tail
// read from a copy; odd: a zero in the last pair's high half), W's rows
// around its 32-row blocks (the last partial one copied) and 256-row tasks,
// row strides odd and even.
TEST(Bf16AmxLinearTest, EqualsDoubleReferenceOverRemainders) {
  MOH_SKIP_UNLESS_BF16_AMX_RUNS();
  for (int64_t m : {1, 16, 31, 32, 33, 129, 300}) {
    for (int64_t k : {1, 2, 3, 31, 32, 33, 95, 513, 2048}) {
      for (int64_t n : {1, 17, 32, 33, 64, 65, 200, 256, 300}) {
        ExpectDotMatchesReference(m, k, n, (m + k + n) % 2, Bf16AmxLinear);
      }
    }
  }
}

// Bf16Linear's decode batches and prefills take the tiles: the same bits as
// Bf16AmxLinear.
void ExpectBf16LinearTakesAmx(int64_t m) {
  const int64_t k = 200, n = 70;
  const at::Tensor x = at::randn({m, k});
  const at::Tensor w = at::randn({n, k}).to(at::kBFloat16);
  const at::Tensor b = at::randn({n});
  const auto *bits =
      reinterpret_cast<const uint16_t *>(w.data_ptr<at::BFloat16>());
  at::Tensor tiles = at::full({m, n}, std::nanf(""));
  at::Tensor linear = at::full({m, n}, std::nanf(""));
  ASSERT_TRUE(Bf16AmxLinear(x.data_ptr<float>(), m, k, bits, k, n,
                            b.data_ptr<float>(), tiles.data_ptr<float>()));
  ASSERT_TRUE(Bf16Linear(x.data_ptr<float>(), m, k, bits, k, n,
                         b.data_ptr<float>(), linear.data_ptr<float>()));
  EXPECT_TRUE(at::equal(tiles, linear)) << m << " rows";
}

TEST(Bf16AmxLinearTest, Bf16LinearTakesItPastTheFewRowPath) {
  MOH_SKIP_UNLESS_BF16_AMX_RUNS();
  for (int64_t m :
       {kMaxBf16StreamRows + 1, kMaxStreamedRows, kMaxStreamedRows + 40}) {
    ExpectBf16LinearTakesAmx(m);
  }
}

// The padding of k and of the rows is zero whatever the buffers held: a
// product of NaNs (rows of 64 values, no padding) leaves them in this
// thread's buffer where the next product's padding lies (k 33: 17 pairs,
// padded to 32). Both are too small to share out: one thread, one buffer.
TEST(Bf16AmxLinearTest, PaddingIsZeroAfterNonFiniteInputs) {
  MOH_SKIP_UNLESS_BF16_AMX_RUNS();
  const int64_t m = 40, n = 8;
  const at::Tensor nan_x = at::full({m, 64}, std::nanf(""));
  const at::Tensor nan_w = at::ones({n, 64}).to(at::kBFloat16);
  at::Tensor y = at::empty({m, n});
  ASSERT_TRUE(Bf16AmxLinear(
      nan_x.data_ptr<float>(), m, 64,
      reinterpret_cast<const uint16_t *>(nan_w.data_ptr<at::BFloat16>()), 64, n,
      nullptr, y.data_ptr<float>()));
  EXPECT_TRUE(at::isnan(y).all().item<bool>());
  ExpectDotMatchesReference(m - 8, 33, n, false, Bf16AmxLinear);
}

// W's rows are tiles' rows read in place, 64 bytes at a time: nothing past
// W is read, neither past k on its last row nor past its last row, when W
// ends where an inaccessible page begins (a read there is a SIGSEGV).
TEST(Bf16AmxLinearTest, ReadsNothingPastW) {
  MOH_SKIP_UNLESS_BF16_AMX_RUNS();
  for (const auto [n, k] :
       {std::pair<int64_t, int64_t>{33, 64}, {32, 33}, {33, 33}, {1, 1}}) {
    const at::Tensor wt = at::randn({n, k}).to(at::kBFloat16);
    const GuardedBytes w(wt.data_ptr<at::BFloat16>(),
                         static_cast<size_t>(n * k) * sizeof(uint16_t));
    const int64_t m = 20;
    const at::Tensor x = at::randn({m, k});
    at::Tensor y = at::full({m, n}, std::nanf(""));
    ASSERT_TRUE(Bf16AmxLinear(x.data_ptr<float>(), m, k, w.As<uint16_t>(), k, n,
                              nullptr, y.data_ptr<float>()));
    const at::Tensor want =
        at::matmul(x.to(at::kBFloat16).to(at::kDouble), wt.to(at::kDouble).t());
    EXPECT_TRUE(at::allclose(y.to(at::kDouble), want, 1e-4, 1e-4))
        << "n " << n << " k " << k;
  }
}

TEST(Bf16AmxLinearTest, RefusesWithoutAmx) {
  if (ActiveExtension(CpuExtension::kAmxBf16)) {
    GTEST_SKIP() << "AMX-BF16 runs";
  }
  float x = 1, y = 0;
  const uint16_t w = 0x3f80;  // 1.0
  EXPECT_FALSE(Bf16AmxLinear(&x, 1, 1, &w, 1, 1, nullptr, &y));
  EXPECT_EQ(y, 0.0f);
}

TEST(Bf16DotRowsLinearTest, RefusesPastStreamedRows) {
  MOH_SKIP_UNLESS_BF16_DOT_RUNS();
  const int64_t m = kMaxStreamedRows + 1;
  std::vector<float> x(m, 1.0f), y(m, 0.0f);
  const uint16_t w = 0x3f80;  // 1.0
  EXPECT_FALSE(Bf16DotRowsLinear(x.data(), m, 1, &w, 1, 1, nullptr, y.data()));
}

TEST(Bf16DotLinearTest, RefusesWithoutAvx512Bf16) {
  if (ActiveExtension(CpuExtension::kAvx512Bf16)) {
    GTEST_SKIP() << "AVX512_BF16 runs";
  }
  float x = 1, y = 0;
  const uint16_t w = 0x3f80;  // 1.0
  EXPECT_FALSE(Bf16DotLinear(&x, 1, 1, &w, 1, 1, nullptr, &y));
  EXPECT_FALSE(Bf16DotRowsLinear(&x, 1, 1, &w, 1, 1, nullptr, &y));
  EXPECT_EQ(y, 0.0f);
}

}  // namespace
}  // namespace moh
