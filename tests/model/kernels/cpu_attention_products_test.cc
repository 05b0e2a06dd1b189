// The CPU attention products of model/kernels/cpu_attention_products.h and
// the pair kernel's softmax (cpu_softmax.h) against LibTorch's: the bfloat16
// widening, the pair kernel's products over keys and values read in place,
// the decode products over a cache's rows given by address, the masked row
// softmax; and which instruction set runs them. Registered once per
// instruction set (kernel_isa_test_util.h): sizes straddle both AVX-512's
// 16-float and AVX2's 8-float vectors.
#include "model/kernels/cpu_attention_products.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "model/kernels/cpu_bf16_dot.h"
#include "model/kernels/cpu_int8_dot.h"
#include "model/kernels/cpu_linear.h"
#include "model/kernels/cpu_softmax.h"
#include "tests/model/kernels/kernel_isa_test_util.h"

namespace moh {
namespace {

// MOH_CPU_ISA caps the instruction set at what it names (so that the avx2
// registration runs the AVX2 paths on an AVX-512 machine), and under
// portable every kernel refuses, leaving its output alone.
// The dot-product extensions run only under an uncapped (or avx512) AVX-512
// and where the CPU has them; avx512f, avx2 and portable leave them out, and
// the prefill kernels that need them then refuse, leaving y alone. The label
// names what runs.
TEST(KernelIsaTest, ExtensionsOnlyWhereAllowed) {
  const char *requested = std::getenv("MOH_CPU_ISA");
  const std::string cap = requested != nullptr ? requested : "";
  const bool allowed = ActiveIsa() == CpuIsa::kAvx512 && cap != "avx512f";
  const bool bf16 = ActiveExtension(CpuExtension::kAvx512Bf16);
  const bool vnni = ActiveExtension(CpuExtension::kAvx512Vnni);
  EXPECT_EQ(bf16, allowed && __builtin_cpu_supports("avx512bf16"));
  EXPECT_EQ(vnni, allowed && __builtin_cpu_supports("avx512vnni"));
  const std::string label = ActiveIsaLabel();
  EXPECT_EQ(label.rfind(IsaName(ActiveIsa()), 0), 0u) << label;
  EXPECT_EQ(label.find("+bf16") != std::string::npos, bf16) << label;
  EXPECT_EQ(label.find("+vnni") != std::string::npos, vnni) << label;
  float x[16] = {1.0f}, y[1] = {7.0f};
  const uint16_t half[16] = {};
  const int8_t bytes[16] = {};
  const float scale[1] = {1.0f};
  if (!bf16) {
    EXPECT_FALSE(Bf16DotLinear(x, 1, 16, half, 16, 1, nullptr, y));
  }
  if (!vnni) {
    EXPECT_FALSE(Int8DotLinear(x, 1, 16, bytes, 16, 1, scale, nullptr, y));
  }
  EXPECT_EQ(y[0], 7.0f);
}

TEST(KernelIsaTest, RequestedInstructionSetIsTheOneThatRuns) {
  const char *requested = std::getenv("MOH_CPU_ISA");
  const CpuIsa best = BestCpuIsa();
  EXPECT_LE(ActiveIsa(), best);
  if (requested == nullptr || *requested == '\0') {
    EXPECT_EQ(ActiveIsa(), best);
  } else if (std::string(requested) == "avx2" && best >= CpuIsa::kAvx2) {
    EXPECT_EQ(ActiveIsa(), CpuIsa::kAvx2);
  } else if (std::string(requested) == "avx512") {
    EXPECT_EQ(ActiveIsa(), best);
  }
  if (ActiveIsa() != CpuIsa::kPortable) return;
  EXPECT_STREQ(IsaName(ActiveIsa()), "portable");
  float x[16] = {1.0f}, w[16] = {1.0f}, y[16] = {};
  const float *rows[1] = {w};
  const uint16_t half[16] = {};
  const uint16_t *half_rows[1] = {half};
  const int64_t visible = 1;
  float inverse_sum = 0.0f;
  EXPECT_FALSE(RowLinear(x, 16, w, 16, 1, nullptr, y));
  EXPECT_FALSE(SkinnyLinear(x, 1, 16, w, 16, 1, nullptr, y));
  EXPECT_FALSE(StreamedLinear(x, 1, 16, w, 16, 1, nullptr, y));
  EXPECT_FALSE(BlockedLinear(x, 1, 16, w, 16, 1, nullptr, y));
  EXPECT_FALSE(IndexedLinear({x, 16}, 1, 16, w, 16, 1, {y, 16}));
  EXPECT_FALSE(ScoresProduct(x, 1, 16, 1.0f, w, 16, 1, y, 1));
  EXPECT_FALSE(ValuesProduct(x, 1, 1, 1, w, 16, 16, y, 16, false));
  EXPECT_FALSE(WidenBfloat16(half, 16, y));
  EXPECT_FALSE(Float32Scores(x, 1, 16, 1.0f, rows, 1, y, 1));
  EXPECT_FALSE(Float32Values(x, 1, 1, rows, 1, 16, y, 16));
  EXPECT_FALSE(Bfloat16Scores(x, 1, 16, 1.0f, half_rows, 1, y, 1));
  EXPECT_FALSE(Bfloat16Values(x, 1, 1, half_rows, 1, 16, y, 16));
  EXPECT_FALSE(SoftmaxRows(x, y, 1, 16, &visible, &inverse_sum));
  EXPECT_FALSE(SiluMulRows(x, 16, 1, 8, y));
  for (float v : y) EXPECT_EQ(v, 0.0f);
}

// The pair kernel's products over a block of queries: scores against keys
// read in place (a run of the cache, row stride wider than d), and the
// probabilities times values, written or added, into a wider output.
TEST(PairProductsTest, EqualATensAroundTilesAndVectors) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  at::manual_seed(11);
  for (int64_t m : {1, 5, 6, 7, 9, 16, 17, 40}) {
    for (int64_t n : {1, 7, 8, 13, 29, 70}) {
      for (int64_t d : {8, 16, 24, 64, 80}) {
        const at::Tensor q = at::randn({m, d});
        const at::Tensor keys = at::randn({n, d + 5});
        at::Tensor scores = at::full({m, n + 3}, std::nanf(""));
        ASSERT_TRUE(ScoresProduct(q.data_ptr<float>(), m, d, 0.25f,
                                  keys.data_ptr<float>(), d + 5, n,
                                  scores.data_ptr<float>(), n + 3));
        EXPECT_TRUE(at::allclose(scores.narrow(1, 0, n),
                                 0.25 * at::mm(q, keys.narrow(1, 0, d).t()),
                                 1e-4, 1e-4))
            << "scores m " << m << " n " << n << " d " << d;
        EXPECT_TRUE(at::isnan(scores.narrow(1, n, 3)).all().item<bool>());
        const at::Tensor p = at::softmax(at::randn({m, n + 2}), 1);
        const at::Tensor values = at::randn({n, d + 3});
        const at::Tensor product =
            at::mm(p.narrow(1, 0, n), values.narrow(1, 0, d));
        for (bool accumulate : {false, true}) {
          const at::Tensor before = at::randn({m, d + 4});
          at::Tensor out = before.clone();
          ASSERT_TRUE(ValuesProduct(p.data_ptr<float>(), n + 2, m, n,
                                    values.data_ptr<float>(), d + 3, d,
                                    out.data_ptr<float>(), d + 4, accumulate));
          const at::Tensor want =
              accumulate ? before.narrow(1, 0, d) + product : product;
          EXPECT_TRUE(at::allclose(out.narrow(1, 0, d), want, 1e-4, 1e-4))
              << "values m " << m << " n " << n << " d " << d << " accumulate "
              << accumulate;
          EXPECT_TRUE(at::equal(out.narrow(1, d, 4), before.narrow(1, d, 4)));
        }
      }
    }
  }
}

TEST(WidenBfloat16Test, EqualsATensConversionWithTails) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  for (int64_t n : {1, 7, 8, 9, 15, 16, 17, 64, 100}) {
    const at::Tensor half = at::randn({n}).to(at::kBFloat16);
    at::Tensor got = at::full({n}, std::nanf(""));
    ASSERT_TRUE(WidenBfloat16(
        reinterpret_cast<const uint16_t *>(half.data_ptr<at::BFloat16>()), n,
        got.data_ptr<float>()));
    EXPECT_TRUE(at::equal(got, half.to(at::kFloat))) << "n " << n;
  }
}

// The decode products over one cache's rows, given by address: bfloat16
// (widened as loaded) or float32.
template <typename T>
void ExpectDecodeProductsMatch(at::ScalarType dtype) {
  const auto scores_product = [](const float *q, int64_t m, int64_t d,
                                 float scale, const T *const *keys, int64_t n,
                                 float *y, int64_t ldy) {
    if constexpr (std::is_same_v<T, float>) {
      return Float32Scores(q, m, d, scale, keys, n, y, ldy);
    } else {
      return Bfloat16Scores(q, m, d, scale, keys, n, y, ldy);
    }
  };
  const auto values_product = [](const float *p, int64_t ldp, int64_t m,
                                 const T *const *values, int64_t n, int64_t d,
                                 float *y, int64_t ldy) {
    if constexpr (std::is_same_v<T, float>) {
      return Float32Values(p, ldp, m, values, n, d, y, ldy);
    } else {
      return Bfloat16Values(p, ldp, m, values, n, d, y, ldy);
    }
  };
  // d around AVX2's 32-column pass of the values.
  for (int64_t d : {16, 32, 48, 64, 80}) {
    for (int64_t m : {1, 2, 4}) {
      // n: short and whole blocks of 16 (AVX2: 8) keys, and several.
      for (int64_t n : {1, 7, 8, 9, 16, 37}) {
        // Rows scattered through a larger cache: every other row, reversed.
        const at::Tensor cache = at::randn({2 * n, d}).to(dtype);
        const T *base = static_cast<const T *>(cache.data_ptr());
        std::vector<const T *> rows(n);
        std::vector<int64_t> picked(n);
        for (int64_t t = 0; t < n; ++t) {
          picked[t] = 2 * (n - 1 - t);
          rows[t] = base + picked[t] * d;
        }
        const at::Tensor wide =
            cache.to(at::kFloat).index_select(0, at::tensor(picked));
        const at::Tensor q = at::randn({m, d});
        // Row stride n + 3: the products write only their own columns.
        at::Tensor scores = at::full({m, n + 3}, std::nanf(""));
        ASSERT_TRUE(scores_product(q.data_ptr<float>(), m, d, 0.5f, rows.data(),
                                   n, scores.data_ptr<float>(), n + 3));
        EXPECT_TRUE(at::allclose(scores.narrow(1, 0, n),
                                 0.5 * at::mm(q, wide.t()), 1e-4, 1e-4))
            << "scores d " << d << " m " << m << " n " << n;
        EXPECT_TRUE(at::isnan(scores.narrow(1, n, 3)).all().item<bool>());
        const at::Tensor p = at::softmax(at::randn({m, n}), 1);
        at::Tensor out = at::full({m, d}, std::nanf(""));
        ASSERT_TRUE(values_product(p.data_ptr<float>(), n, m, rows.data(), n, d,
                                   out.data_ptr<float>(), d));
        EXPECT_TRUE(at::allclose(out, at::mm(p, wide), 1e-4, 1e-4))
            << "values d " << d << " m " << m << " n " << n;
      }
    }
  }
  float q[16] = {}, y = 0.0f;
  const T row[16] = {};
  const T *rows = row;
  EXPECT_FALSE(scores_product(q, 1, 8, 1.0f, &rows, 1, &y, 1));  // d % 16
}

TEST(DecodeProductsTest, EqualATensOnScatteredBfloat16Rows) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  ExpectDecodeProductsMatch<uint16_t>(at::kBFloat16);
}

TEST(DecodeProductsTest, EqualATensOnScatteredFloat32Rows) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  ExpectDecodeProductsMatch<float>(at::kFloat);
}

TEST(SoftmaxRowsTest, EqualsSoftmaxOverEachRowsVisibleScores) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  const int64_t rows = 10, cols = 37;
  at::manual_seed(7);
  at::Tensor scores = at::randn({rows, cols}) * 30;
  scores[2][3] = -std::numeric_limits<float>::infinity();
  scores[4].fill_(-1e4);  // a row far below zero: every exp underflows alone
  // Visible lengths around the 16- and 8-float vectors, and the whole row.
  const std::vector<int64_t> visible = {1, 15, 16, 17, 33, cols, 7, 8, 9, 25};
  // Into another matrix, and in place over the scores.
  for (bool in_place : {false, true}) {
    at::Tensor input = scores.clone();
    at::Tensor probs = in_place ? input : at::full({rows, cols}, std::nanf(""));
    std::vector<float> inverse_sums(rows, std::nanf(""));
    ASSERT_TRUE(SoftmaxRows(input.data_ptr<float>(), probs.data_ptr<float>(),
                            rows, cols, visible.data(), inverse_sums.data()));
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t n = visible[i];
      const at::Tensor want = at::softmax(scores[i].narrow(0, 0, n), 0);
      const at::Tensor got = probs[i].narrow(0, 0, n) * inverse_sums[i];
      EXPECT_TRUE(at::allclose(got, want, 1e-6, 1e-7))
          << "row " << i << " in place " << in_place << " max error "
          << (got - want).abs().max().item<float>();
      // Unnormalized: the row's largest is e^0.
      EXPECT_EQ(probs[i].narrow(0, 0, n).max().item<float>(), 1.0f);
      EXPECT_EQ(probs[i].narrow(0, n, cols - n).abs().sum().item<float>(), 0.0f)
          << "row " << i;
    }
  }
}

// The MLP's SwiGLU over [gate | up] rows (a wider row stride): silu(g) * u
// within float rounding of ATen's, at widths around the 16- and 8-float
// vectors, with g far below and above zero (e^-|g| underflows), infinities
// and NaN passed on.
TEST(SiluMulRowsTest, EqualsSiluOfGateTimesUp) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  at::manual_seed(5);
  for (int64_t n : {1, 7, 8, 9, 16, 17, 33, 1376}) {
    const int64_t rows = 5, ld = 2 * n + 3;
    at::Tensor x = at::randn({rows, ld}) * 6;
    x[1][0] = -200.0f;
    x[2][0] = 200.0f;
    x[3][n - 1] = std::numeric_limits<float>::infinity();
    x[4][0] = std::nanf("");
    at::Tensor out = at::full({rows, n}, std::nanf(""));
    ASSERT_TRUE(
        SiluMulRows(x.data_ptr<float>(), ld, rows, n, out.data_ptr<float>()));
    const at::Tensor gate = x.narrow(1, 0, n), up = x.narrow(1, n, n);
    const at::Tensor want = at::silu(gate) * up;
    EXPECT_TRUE(at::allclose(out, want, 1e-5, 1e-6, /*equal_nan=*/true))
        << "n " << n << " max error "
        << (out - want).abs().nan_to_num(0, 0, 0).max().item<float>();
    EXPECT_TRUE(std::isnan(out[4][0].item<float>()));
    // silu(-200) is 0 in float; the exp's clamp leaves under 1e-35.
    EXPECT_NEAR(out[1][0].item<float>(), 0.0f, 1e-30);
    EXPECT_EQ(out[2][0].item<float>(), 200.0f * up[2][0].item<float>());
  }
}

}  // namespace
}  // namespace moh
