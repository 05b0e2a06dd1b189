// The CPU attention products of model/kernels/cpu_attention_products.h and
// the pair kernel's softmax (cpu_softmax.h) against LibTorch's: the bfloat16
// widening, the decode products over a cache's rows given by address, the
// masked row softmax.
#include "model/kernels/cpu_attention_products.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "model/kernels/cpu_softmax.h"

namespace moh {
namespace {

bool HasAvx512() { return __builtin_cpu_supports("avx512f"); }

TEST(WidenBfloat16Test, EqualsATensConversionWithTails) {
  if (!HasAvx512()) GTEST_SKIP() << "WidenBfloat16 needs AVX-512F";
  for (int64_t n : {1, 15, 16, 17, 64, 100}) {
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
  for (int64_t d : {16, 64, 80}) {
    for (int64_t m : {1, 2, 4}) {
      // n: one short block of 16 keys, one whole, two and a short one.
      for (int64_t n : {1, 16, 37}) {
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
  if (!HasAvx512()) GTEST_SKIP() << "the decode products need AVX-512F";
  ExpectDecodeProductsMatch<uint16_t>(at::kBFloat16);
}

TEST(DecodeProductsTest, EqualATensOnScatteredFloat32Rows) {
  if (!HasAvx512()) GTEST_SKIP() << "the decode products need AVX-512F";
  ExpectDecodeProductsMatch<float>(at::kFloat);
}

TEST(SoftmaxRowsTest, EqualsSoftmaxOverEachRowsVisibleScores) {
  if (!HasAvx512()) GTEST_SKIP() << "SoftmaxRows needs AVX-512F";
  const int64_t rows = 6, cols = 37;
  at::manual_seed(7);
  at::Tensor scores = at::randn({rows, cols}) * 30;
  scores[2][3] = -std::numeric_limits<float>::infinity();
  scores[4].fill_(-1e4);  // a row far below zero: every exp underflows alone
  // Visible lengths around the 16-float vector, and the whole row.
  const std::vector<int64_t> visible = {1, 15, 16, 17, 33, cols};
  at::Tensor probs = at::full({rows, cols}, std::nanf(""));
  ASSERT_TRUE(SoftmaxRows(scores.data_ptr<float>(), probs.data_ptr<float>(),
                          rows, cols, visible.data()));
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t n = visible[i];
    const at::Tensor want = at::softmax(scores[i].narrow(0, 0, n), 0);
    EXPECT_TRUE(at::allclose(probs[i].narrow(0, 0, n), want, 1e-6, 1e-7))
        << "row " << i << " max error "
        << (probs[i].narrow(0, 0, n) - want).abs().max().item<float>();
    EXPECT_EQ(probs[i].narrow(0, n, cols - n).abs().sum().item<float>(), 0.0f)
        << "row " << i;
  }
}

}  // namespace
}  // namespace moh
