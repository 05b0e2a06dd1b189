// The CPU products of model/core/cpu_gemm.h against LibTorch's (OpenBLAS):
// SkinnyLinear at every row count it takes, odd column counts (the tiles'
// and the vector width's remainders), with and without bias, one thread and
// the pool.
#include "model/core/cpu_gemm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>

namespace moh {
namespace {

void ExpectMatchesLinear(int64_t m, int64_t k, int64_t n, bool bias,
                         int64_t extra_columns = 0) {
  at::manual_seed(m * 1000 + k + n);
  const at::Tensor x = at::randn({m, k});
  // W: the first k columns of a wider matrix when extra_columns > 0.
  const at::Tensor wide = at::randn({n, k + extra_columns});
  const at::Tensor w = wide.narrow(1, 0, k);
  const at::Tensor b = at::randn({n});
  const at::Tensor want = bias ? at::linear(x, w, b) : at::linear(x, w);
  at::Tensor got = at::full({m, n}, std::nanf(""));
  ASSERT_TRUE(SkinnyLinear(x.data_ptr<float>(), m, k, w.data_ptr<float>(),
                           w.stride(0), n, bias ? b.data_ptr<float>() : nullptr,
                           got.data_ptr<float>()))
      << "this test needs AVX2 and FMA";
  EXPECT_TRUE(at::allclose(got, want, 1e-4, 1e-4))
      << "m " << m << " k " << k << " n " << n << " bias " << bias << " ldw "
      << w.stride(0) << " max error " << (got - want).abs().max().item<float>();
}

TEST(SkinnyLinearTest, EqualsLinearAtEveryRowCount) {
  for (int64_t m = 1; m <= kMaxSkinnyRows; ++m) {
    ExpectMatchesLinear(m, 64, 37, m % 2 == 0);
  }
}

TEST(SkinnyLinearTest, RemaindersOfColumnsAndDepth) {
  for (int64_t k : {1, 7, 8, 9, 31, 513}) {
    for (int64_t n : {1, 2, 3, 65, 130}) {
      ExpectMatchesLinear(5, k, n, true);
    }
  }
}

TEST(SkinnyLinearTest, AWeightSliceOfAWiderMatrix) {
  ExpectMatchesLinear(6, 64, 33, true, /*extra_columns=*/64);
  ExpectMatchesLinear(3, 9, 5, false, /*extra_columns=*/3);
}

TEST(SkinnyLinearTest, LargeProductsOnThePool) {
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  ExpectMatchesLinear(kMaxSkinnyRows, 512, 1376, true);
  ExpectMatchesLinear(3, 1376, 515, false);
  at::set_num_threads(threads);
}

TEST(SkinnyLinearTest, RefusesRowCountsOutsideItsRange) {
  float x = 1.0f, w = 1.0f, y = 0.0f;
  EXPECT_FALSE(SkinnyLinear(&x, 0, 1, &w, 1, 1, nullptr, &y));
  EXPECT_FALSE(SkinnyLinear(&x, kMaxSkinnyRows + 1, 1, &w, 1, 1, nullptr, &y));
  EXPECT_EQ(y, 0.0f);
}

}  // namespace
}  // namespace moh
