// Int8Linear (model/kernels/cpu_lowp_linear.h) against at::linear over the
// dequantized weights w * scale[:, None] (the exact values the kernel
// sees): every row count of the few-row path and beyond it (the panel
// path), depth remainders of both vector widths, a row stride wider than k,
// bias, and several panels; QuantizeInt8Rows' error bound, zero rows and
// round trip through WidenInt8Rows. Int8DotLinear (cpu_int8_dot.h), which
// Int8Linear's prefill runs on VNNI CPUs, and Int8DotRowsLinear, its
// decode batches there, and Int8MaddRowsLinear and Int8MaddLinear, the
// decode batches' and prefills' on AVX2, against a double-precision
// reference of their quantized arithmetic, and Int8Linear where it
// quantizes x within the bound of x's quantization. Registered once per
// instruction set (kernel_isa_test_util.h).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "model/kernels/cpu_int8_dot.h"
#include "model/kernels/cpu_isa.h"
#include "model/kernels/cpu_linear.h"
#include "model/kernels/cpu_lowp_linear.h"
#include "tests/model/kernels/kernel_isa_test_util.h"

namespace moh {
namespace {

bool DotPathRuns() { return ActiveExtension(CpuExtension::kAvx512Vnni); }

// Whether Int8Linear quantizes x at m rows: past the few-row path, on VNNI
// CPUs always, on AVX2 for decode batches (Int8MaddRowsLinear), and for
// prefills where Int8MaddLinear pays.
bool QuantizesX(int64_t m) {
  if (m <= kMaxBf16StreamRows) return false;
  if (DotPathRuns()) return true;
  return m <= kMaxStreamedRows ? ActiveIsa() == CpuIsa::kAvx2
                               : Int8MaddPrefillPays();
}

#define MOH_SKIP_UNLESS_DOT_PATH_RUNS() \
  MOH_SKIP_UNLESS_KERNELS_RUN();        \
  if (!DotPathRuns())                   \
  GTEST_SKIP() << "no AVX512_VNNI under " << ActiveIsaLabel()

// x [m, k] quantized as Int8DotLinear documents, written independently of
// it: per run of 32 values d = max |x| / 127 and q = nearest-even(x / d)
// (computed as x * (1 / d) in float32, as the contract says), q [m,
// blocks * 32] zero-padded and d [m, blocks], both double.
struct QuantizedX {
  at::Tensor q, d;
};
QuantizedX QuantizeBlocksOf32(const at::Tensor &x) {
  const int64_t m = x.size(0), k = x.size(1), blocks = (k + 31) / 32;
  const at::Tensor xc = x.contiguous();
  const float *data = xc.data_ptr<float>();
  std::vector<double> q(m * blocks * 32, 0.0), d(m * blocks, 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t p0 = b * 32, p1 = std::min(k, p0 + 32);
      float largest = 0.0f;
      for (int64_t p = p0; p < p1; ++p)
        largest = std::max(largest, std::fabs(data[i * k + p]));
      const float step = largest / 127.0f;
      const float inverse = step != 0.0f ? 1.0f / step : 0.0f;
      d[i * blocks + b] = step;
      for (int64_t p = p0; p < p1; ++p) {
        const float scaled = data[i * k + p] * inverse;
        q[i * blocks * 32 + p] = std::nearbyint(scaled);
      }
    }
  }
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  return {at::tensor(q, f64).reshape({m, blocks * 32}),
          at::tensor(d, f64).reshape({m, blocks})};
}

// W's int8 values [n, k] as double, zero-padded to whole blocks of 32.
at::Tensor PaddedWeights(const at::Tensor &w) {
  const int64_t k = w.size(1), padded = (k + 31) / 32 * 32;
  return at::constant_pad_nd(w.to(at::kDouble), {0, padded - k});
}

// Int8Linear past the few-row path on the dot paths quantizes x: each value
// moves by at most half its block's step d, so |y - x W^T| <= sum_b d_b / 2 *
// sum_{p in b} |W[j, p]| (the worst case, every error aligned with W's
// sign), plus float32's summation error as ExpectKernelEqualsLinear allows.
void ExpectWithinQuantizationBound(const at::Tensor &x,
                                   const at::Tensor &dequantized,
                                   const at::Tensor &bias,
                                   const std::string &what,
                                   const std::function<bool(float *)> &run) {
  const int64_t m = x.size(0), k = x.size(1), n = dequantized.size(0);
  const at::Tensor want = bias.defined() ? at::linear(x, dequantized, bias)
                                         : at::linear(x, dequantized);
  const QuantizedX qx = QuantizeBlocksOf32(x);
  const int64_t blocks = qx.d.size(1);
  const at::Tensor w_block_sums =
      PaddedWeights(dequantized).abs().reshape({n, blocks, 32}).sum(2);
  const at::Tensor bound =
      at::matmul(qx.d * 0.5, w_block_sums.t()).to(at::kFloat) +
      want.abs() * 1e-4 + 1e-3 * std::sqrt(double(k));
  at::Tensor got = at::full({m, n}, std::nanf(""));
  ASSERT_TRUE(run(got.data_ptr<float>()));
  const at::Tensor error = (got - want).abs();
  EXPECT_TRUE((error <= bound).all().item<bool>())
      << what << " m " << m << " k " << k << " n " << n << " max error "
      << error.max().item<float>() << " largest error / bound "
      << (error / bound).max().item<float>();
}

// W's values span int8's range; the scales keep |W| near 127 * 0.021.
// Rows where x is quantized (QuantizesX) are held to x's quantization
// bound.
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
  if (QuantizesX(m)) {
    ExpectWithinQuantizationBound(
        x, dequantized, b, "ldw " + std::to_string(w.stride(0)), [&](float *y) {
          return Int8Linear(x.data_ptr<float>(), m, k, w.data_ptr<int8_t>(),
                            w.stride(0), n, scale.data_ptr<float>(),
                            bias ? b.data_ptr<float>() : nullptr, y);
        });
    return;
  }
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

// Row counts on both sides of kMaxStreamedRows: the decode batches' and
// the prefill's dot paths on VNNI CPUs (else the panel path), with a wider
// row stride and several 128-column tasks.
TEST(Int8LinearTest, PrefillWithinQuantizationBound) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  for (int64_t m : {kMaxStreamedRows, kMaxStreamedRows + 1, int64_t{525}}) {
    ExpectMatchesLinear(m, 2048, 300, true, 0);
    ExpectMatchesLinear(m, 95, 33, false, 5);
  }
}

using Int8DotProduct = bool (*)(const float *, int64_t, int64_t, const int8_t *,
                                int64_t, int64_t, const float *, const float *,
                                float *);

// Int8DotLinear, Int8DotRowsLinear, Int8MaddRowsLinear or Int8MaddLinear
// against the double-precision sum of its quantized products: the integer
// sums are exact, so the only difference is float32's rounding of the
// per-block scaling and accumulation, however the kernel splits a block's
// products across lanes: at most one rounding per block, three for the lanes'
// sum and three for the scale, the bias and the conversion, each of a partial
// sum that sum_b d_b sum_p |qx_p w_p| bounds. x's rows have different
// magnitudes, row 5 (where there is one) is zeros; W spans all of int8
// (-128 too). The output starts as NaN, so a value left unwritten fails.
void ExpectDotMatchesReference(Int8DotProduct product, int64_t m, int64_t k,
                               int64_t n, bool bias) {
  const std::string what = "m " + std::to_string(m) + " k " +
                           std::to_string(k) + " n " + std::to_string(n) +
                           " bias " + std::to_string(bias);
  at::manual_seed(m * 7919 + k * 31 + n);
  at::Tensor x = at::randn({m, k}) * (at::rand({m, 1}) * 8 + 0.01);
  const bool zero_row = m > 5;
  if (zero_row) x[5].zero_();
  const int64_t extra_columns = bias ? 3 : 0;
  const at::Tensor w = at::randint(-128, 128, {n, k + extra_columns})
                           .to(at::kChar)
                           .narrow(1, 0, k);
  const at::Tensor scale = at::rand({n}) * 0.02 + 0.001;
  const at::Tensor b = bias ? at::randn({n}) : at::zeros({n});

  const QuantizedX qx = QuantizeBlocksOf32(x);
  const at::Tensor qw = PaddedWeights(w);
  const int64_t blocks = qx.d.size(1);
  at::Tensor sum = at::zeros({m, n}, at::kDouble);
  at::Tensor magnitude = at::zeros({m, n}, at::kDouble);
  for (int64_t block = 0; block < blocks; ++block) {
    const at::Tensor dot = at::matmul(qx.q.narrow(1, block * 32, 32),
                                      qw.narrow(1, block * 32, 32).t());
    sum += qx.d.narrow(1, block, 1) * dot;
    magnitude += qx.d.narrow(1, block, 1) *
                 at::matmul(qx.q.narrow(1, block * 32, 32).abs(),
                            qw.narrow(1, block * 32, 32).abs().t());
  }
  const at::Tensor s = scale.to(at::kDouble);
  const at::Tensor want = sum * s + b.to(at::kDouble);
  const at::Tensor tolerance =
      (magnitude * s + b.to(at::kDouble).abs()) * ((blocks + 6) * 1.2e-7);

  at::Tensor got = at::full({m, n}, std::nanf(""));
  ASSERT_TRUE(product(x.data_ptr<float>(), m, k, w.data_ptr<int8_t>(),
                      w.stride(0), n, scale.data_ptr<float>(),
                      bias ? b.data_ptr<float>() : nullptr,
                      got.data_ptr<float>()))
      << what;
  const at::Tensor error = (got.to(at::kDouble) - want).abs();
  // NaN fails the comparison, so a value left unwritten never passes.
  EXPECT_TRUE((error <= tolerance).all().item<bool>())
      << what << " max error " << error.max().item<double>()
      << " largest error / tolerance "
      << (error / tolerance).nan_to_num(1e30).max().item<double>();
  if (zero_row) {
    EXPECT_TRUE((got[5] == (bias ? b : at::zeros({n}))).all().item<bool>())
        << what << ": a row of zeros gives the bias";
  }
}

TEST(Int8DotLinearTest, EqualsQuantizedReferenceWithRemainders) {
  MOH_SKIP_UNLESS_DOT_PATH_RUNS();
  for (int64_t m : {129, 200, 525}) {
    for (int64_t k : {1, 3, 31, 32, 33, 64, 95, 513, 2048}) {
      for (int64_t n : {1, 17, 32, 33, 100, 1000}) {
        ExpectDotMatchesReference(Int8DotLinear, m, k, n, false);
        ExpectDotMatchesReference(Int8DotLinear, m, k, n, true);
      }
    }
  }
}

// k past one pass over W (2048 values): the second pass adds to y.
TEST(Int8DotLinearTest, SeveralPassesOverK) {
  MOH_SKIP_UNLESS_DOT_PATH_RUNS();
  ExpectDotMatchesReference(Int8DotLinear, 131, 4100, 70, true);
}

// Decode batches: one and two vectors of x's rows (16, 32) and their
// remainders, more rows than one block of 32 (each tile of W against
// several), up to kMaxStreamedRows; depths with eight-block rounds of W's
// sums (k >= 256), single blocks after them and a short last block; W's row
// counts through tiles of 14 and 7, then 4 and 1.
TEST(Int8DotRowsLinearTest, EqualsQuantizedReferenceWithRemainders) {
  MOH_SKIP_UNLESS_DOT_PATH_RUNS();
  for (int64_t m : {1, 9, 16, 17, 32, 33, 100, 128}) {
    for (int64_t k : {1, 3, 31, 32, 33, 95, 256, 300, 513, 2048}) {
      for (int64_t n : {1, 5, 14, 19, 29, 100}) {
        ExpectDotMatchesReference(Int8DotRowsLinear, m, k, n, n % 2 == 1);
      }
    }
  }
  ExpectDotMatchesReference(Int8DotRowsLinear, 48, 5632, 300, true);
}

TEST(Int8DotRowsLinearTest, RefusesPastDecodeBatches) {
  MOH_SKIP_UNLESS_DOT_PATH_RUNS();
  std::vector<float> x((kMaxStreamedRows + 1) * 2, 1.0f), y(x.size(), 0.0f);
  const int8_t w[2] = {1, 1};
  const float scale = 1;
  EXPECT_FALSE(Int8DotRowsLinear(x.data(), kMaxStreamedRows + 1, 2, w, 2, 1,
                                 &scale, nullptr, y.data()));
  EXPECT_EQ(y[0], 0.0f);
}

// The AVX2 integer path, on every instruction set but portable: one row of
// x (tiles of 8 rows of W), pairs and an odd row left over, up to
// kMaxStreamedRows; short last blocks; W's rows through tiles of 8 or 4,
// then 1, with the next tile prefetched or not.
TEST(Int8MaddRowsLinearTest, EqualsQuantizedReferenceWithRemainders) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  for (int64_t m : {1, 2, 3, 8, 9, 16, 33, 128}) {
    for (int64_t k : {1, 3, 31, 32, 33, 95, 300, 2048}) {
      for (int64_t n : {1, 5, 8, 9, 17, 100}) {
        ExpectDotMatchesReference(Int8MaddRowsLinear, m, k, n, n % 2 == 1);
      }
    }
  }
  ExpectDotMatchesReference(Int8MaddRowsLinear, 7, 5632, 300, true);
}

TEST(Int8MaddRowsLinearTest, RefusesPastDecodeBatchesAndUnderPortable) {
  std::vector<float> x((kMaxStreamedRows + 1) * 2, 1.0f), y(x.size(), 0.0f);
  const int8_t w[2] = {1, 1};
  const float scale = 1;
  EXPECT_FALSE(Int8MaddRowsLinear(x.data(), kMaxStreamedRows + 1, 2, w, 2, 1,
                                  &scale, nullptr, y.data()));
  EXPECT_EQ(
      Int8MaddRowsLinear(x.data(), 1, 2, w, 2, 1, &scale, nullptr, y.data()),
      ActiveIsa() != CpuIsa::kPortable);
  EXPECT_NEAR(y[0], ActiveIsa() != CpuIsa::kPortable ? 2.0f : 0.0f, 1e-5);
}

// The AVX2 prefill path, on every instruction set but portable: x's rows
// through tiles of 4 and every remainder (several row groups of a task when
// W has few rows), short last blocks, y's columns through 16-column panels
// and their remainders, several 128-column tasks.
TEST(Int8MaddLinearTest, EqualsQuantizedReferenceWithRemainders) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  for (int64_t m : {1, 3, 4, 5, 129, 202, 525}) {
    for (int64_t k : {1, 3, 31, 32, 33, 64, 95, 513, 2048}) {
      for (int64_t n : {1, 7, 16, 17, 100, 300}) {
        ExpectDotMatchesReference(Int8MaddLinear, m, k, n, n % 2 == 1);
      }
    }
  }
}

// k past one pass over W (1024 values): later passes add to y, with and
// without a bias, in one and in several row groups.
TEST(Int8MaddLinearTest, SeveralPassesOverK) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  ExpectDotMatchesReference(Int8MaddLinear, 131, 4100, 70, true);
  ExpectDotMatchesReference(Int8MaddLinear, 137, 1025, 260, false);
}

// Nothing past W is read, neither past k on its last row (a short last
// block) nor past its last row, when W ends where an inaccessible page
// begins (a read there is a SIGSEGV).
TEST(Int8MaddLinearTest, ReadsNothingPastW) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  for (const auto [n, k] :
       {std::pair<int64_t, int64_t>{17, 64}, {16, 33}, {17, 33}, {1, 1}}) {
    const at::Tensor wt = at::randint(-128, 128, {n, k}).to(at::kChar);
    const GuardedBytes w(wt.data_ptr<int8_t>(), static_cast<size_t>(n * k));
    const int64_t m = 200;
    const at::Tensor x = at::randn({m, k});
    const at::Tensor scale = at::ones({n});
    at::Tensor y = at::full({m, n}, std::nanf(""));
    ASSERT_TRUE(Int8MaddLinear(x.data_ptr<float>(), m, k, w.As<int8_t>(), k, n,
                               scale.data_ptr<float>(), nullptr,
                               y.data_ptr<float>()));
    const QuantizedX qx = QuantizeBlocksOf32(x);
    const int64_t blocks = qx.d.size(1);
    const at::Tensor want = (qx.q.reshape({m, blocks, 32}) * qx.d.unsqueeze(2))
                                .reshape({m, -1})
                                .matmul(PaddedWeights(wt).t());
    EXPECT_TRUE(at::allclose(y.to(at::kDouble), want, 1e-5, 1e-3))
        << "n " << n << " k " << k;
  }
}

TEST(Int8MaddLinearTest, RefusesUnderPortable) {
  float x = 1, y = 0, scale = 1;
  const int8_t w = 2;
  const bool runs = ActiveIsa() != CpuIsa::kPortable;
  EXPECT_EQ(Int8MaddLinear(&x, 1, 1, &w, 1, 1, &scale, nullptr, &y), runs);
  EXPECT_EQ(y, runs ? 2.0f : 0.0f);
}

// A prefill without VNNI takes the path MOH_INT8_MADD_PREFILL forces: x
// quantized (Int8MaddLinear, within x's quantization bound), or W widened
// (float32 x, within float32's summation error).
TEST(Int8LinearTest, PrefillTakesThePathForced) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  if (DotPathRuns()) GTEST_SKIP() << "AVX512_VNNI takes the prefills";
  const char *before = std::getenv("MOH_INT8_MADD_PREFILL");
  const std::string saved = before != nullptr ? before : "";
  for (const char *force : {"1", "0"}) {
    setenv("MOH_INT8_MADD_PREFILL", force, 1);
    EXPECT_EQ(Int8MaddPrefillPays(), force[0] == '1');
    EXPECT_EQ(QuantizesX(kMaxStreamedRows + 1), force[0] == '1');
    ExpectMatchesLinear(kMaxStreamedRows + 1, 300, 40, true, 3);
  }
  if (before != nullptr) {
    setenv("MOH_INT8_MADD_PREFILL", saved.c_str(), 1);
  } else {
    unsetenv("MOH_INT8_MADD_PREFILL");
  }
}

TEST(Int8DotLinearTest, RefusesWithoutVnni) {
  if (DotPathRuns()) GTEST_SKIP() << "AVX512_VNNI runs";
  float x = 1, y = 0, scale = 1;
  const int8_t w = 1;
  EXPECT_FALSE(Int8DotLinear(&x, 1, 1, &w, 1, 1, &scale, nullptr, &y));
  EXPECT_FALSE(Int8DotRowsLinear(&x, 1, 1, &w, 1, 1, &scale, nullptr, &y));
  EXPECT_EQ(y, 0.0f);
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
