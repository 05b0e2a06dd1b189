// The CPU linear products of model/kernels/cpu_linear.h against LibTorch's
// (OpenBLAS): SkinnyLinear at every row count it takes and BlockedLinear
// across its micro-tile, depth and task block edges; odd column counts (the
// tiles' and the vector width's remainders), with and without bias, one
// thread and the pool; IndexedLinear's gathered and scattered rows, written
// and added. Registered once per instruction set (kernel_isa_test_util.h):
// the sizes straddle both AVX-512's 16-float and AVX2's 8-float vectors and
// both sets of tiles.
#include "model/kernels/cpu_linear.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>

#include "tests/model/kernels/kernel_isa_test_util.h"

namespace moh {
namespace {

using Product = bool (*)(const float *, int64_t, int64_t, const float *,
                         int64_t, int64_t, const float *, float *);

void ExpectMatchesLinear(int64_t m, int64_t k, int64_t n, bool bias,
                         int64_t extra_columns = 0,
                         Product product = &SkinnyLinear) {
  at::manual_seed(m * 1000 + k + n);
  const at::Tensor x = at::randn({m, k});
  // W: the first k columns of a wider matrix when extra_columns > 0.
  const at::Tensor wide = at::randn({n, k + extra_columns});
  const at::Tensor w = wide.narrow(1, 0, k);
  const at::Tensor b = at::randn({n});
  const at::Tensor want = bias ? at::linear(x, w, b) : at::linear(x, w);
  at::Tensor got = at::full({m, n}, std::nanf(""));
  ASSERT_TRUE(product(x.data_ptr<float>(), m, k, w.data_ptr<float>(),
                      w.stride(0), n, bias ? b.data_ptr<float>() : nullptr,
                      got.data_ptr<float>()))
      << "the kernel refused under " << IsaName(ActiveIsa());
  EXPECT_TRUE(at::allclose(got, want, 1e-4, 1e-4))
      << "m " << m << " k " << k << " n " << n << " bias " << bias << " ldw "
      << w.stride(0) << " max error " << (got - want).abs().max().item<float>();
}

TEST(SkinnyLinearTest, EqualsLinearAtEveryRowCount) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  for (int64_t m = 1; m <= kMaxSkinnyRows; ++m) {
    ExpectMatchesLinear(m, 64, 37, m % 2 == 0);
  }
}

TEST(SkinnyLinearTest, RemaindersOfColumnsAndDepth) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  for (int64_t k : {1, 7, 8, 9, 31, 513}) {
    for (int64_t n : {1, 2, 3, 65, 130}) {
      ExpectMatchesLinear(5, k, n, true);
    }
  }
}

TEST(SkinnyLinearTest, AWeightSliceOfAWiderMatrix) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  ExpectMatchesLinear(6, 64, 33, true, /*extra_columns=*/64);
  ExpectMatchesLinear(3, 9, 5, false, /*extra_columns=*/3);
}

TEST(SkinnyLinearTest, LargeProductsOnThePool) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
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

// RowLinear has SkinnyLinear's signature but for one row.
bool OneRow(const float *x, int64_t m, int64_t k, const float *w, int64_t ldw,
            int64_t n, const float *bias, float *y) {
  return m == 1 && RowLinear(x, k, w, ldw, n, bias, y);
}

TEST(RowLinearTest, RemaindersOfRowsAndDepthOnThePool) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  // W rows around its 4-row (AVX2: 8- and 4-row) steps; depths around the
  // 8- and 16-float vectors.
  for (int64_t n : {1, 3, 4, 5, 8, 12, 13, 67}) {
    for (int64_t k : {1, 7, 8, 9, 15, 16, 17, 100}) {
      ExpectMatchesLinear(1, k, n, n % 2 == 1, 0, &OneRow);
    }
  }
  ExpectMatchesLinear(1, 64, 33, true, /*extra_columns=*/64, &OneRow);
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  ExpectMatchesLinear(1, 512, 1376, true, 0, &OneRow);
  ExpectMatchesLinear(1, 1376, 515, false, 0, &OneRow);
  at::set_num_threads(threads);
}

TEST(StreamedLinearTest, EdgesOfTilesAndVectors) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  // Rows around one and two 16-row (AVX2: 8-row) vectors and up to its
  // limit; columns around the tiles of W: 8, 4 and 1 rows against one
  // vector, 14, 4 and 1 against two (AVX2: 12-, 6-, 4-, 2- and 1-row).
  for (int64_t m : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9}, int64_t{15},
                    int64_t{16}, int64_t{17}, int64_t{25}, int64_t{32},
                    int64_t{33}, kMaxStreamedRows}) {
    ExpectMatchesLinear(m, 70, 61, m % 2 == 0, 0, &StreamedLinear);
  }
  for (int64_t n : {1,  3,  4,  5,  6,  7,  8,  9,  11, 12,
                    13, 14, 16, 17, 27, 28, 29, 64, 65, 129}) {
    ExpectMatchesLinear(20, 33, n, n % 2 == 1, 0, &StreamedLinear);
    ExpectMatchesLinear(9, 33, n, false, 0, &StreamedLinear);
    ExpectMatchesLinear(5, 33, n, true, 0, &StreamedLinear);
  }
  ExpectMatchesLinear(24, 300, 70, true, /*extra_columns=*/64, &StreamedLinear);
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  ExpectMatchesLinear(16, 512, 1376, true, 0, &StreamedLinear);
  ExpectMatchesLinear(48, 1376, 515, false, 0, &StreamedLinear);
  at::set_num_threads(threads);
  float x = 1.0f, w = 1.0f, y = 0.0f;
  EXPECT_FALSE(StreamedLinear(&x, 0, 1, &w, 1, 1, nullptr, &y));
  EXPECT_FALSE(
      StreamedLinear(&x, kMaxStreamedRows + 1, 1, &w, 1, 1, nullptr, &y));
}

TEST(BlockedLinearTest, EdgesOfTilesDepthAndBlocks) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  // Rows around the 14-row (AVX2: 6-row) micro-tile and the 112-row task
  // block; columns around the 16- and 8-float vectors, the 32- and 16-column
  // tiles and the 256-column block; depths around the 256-deep pass and the
  // transposes' 16 and 8 steps.
  for (int64_t m : {1, 5, 6, 7, 13, 14, 15, 113, 230}) {
    ExpectMatchesLinear(m, 64, 37, m % 2 == 0, 0, &BlockedLinear);
  }
  for (int64_t k : {1, 7, 9, 255, 256, 257, 600}) {
    ExpectMatchesLinear(29, k, 40, true, 0, &BlockedLinear);
  }
  for (int64_t n : {1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 255, 257, 300}) {
    ExpectMatchesLinear(20, 48, n, n % 2 == 1, 0, &BlockedLinear);
  }
}

TEST(BlockedLinearTest, AWeightSliceOfAWiderMatrix) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  ExpectMatchesLinear(40, 300, 70, true, /*extra_columns=*/64, &BlockedLinear);
}

TEST(BlockedLinearTest, PrefillShapesOnThePool) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  ExpectMatchesLinear(512, 512, 1376, true, 0, &BlockedLinear);
  ExpectMatchesLinear(300, 1376, 515, false, 0, &BlockedLinear);
  ExpectMatchesLinear(16, 512, 256, false, 0, &BlockedLinear);
  at::set_num_threads(threads);
}

TEST(BlockedLinearTest, FewColumnsSplitRowsOnThePool) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  // One or two column blocks for two threads: the rows are split too.
  ExpectMatchesLinear(700, 300, 16, true, 0, &BlockedLinear);
  ExpectMatchesLinear(141, 1024, 64, false, 0, &BlockedLinear);
  ExpectMatchesLinear(129, 64, 200, false, 0, &BlockedLinear);
  at::set_num_threads(threads);
}

// IndexedLinear: x's rows gathered out of a taller, wider matrix, y's
// scattered into the middle columns of another, written or added.
void ExpectIndexedMatches(int64_t m, int64_t k, int64_t n, bool accumulate) {
  at::manual_seed(m * 1000 + k + n + accumulate);
  const int64_t source_rows = 2 * m + 3, target_rows = 3 * m + 1;
  const at::Tensor source = at::randn({source_rows, k + 5});
  const at::Tensor x_rows = at::randperm(source_rows).narrow(0, 0, m);
  const at::Tensor y_rows = at::randperm(target_rows).narrow(0, 0, m);
  const at::Tensor w = at::randn({n, k + 3}).narrow(1, 0, k);
  const at::Tensor target = at::randn({target_rows, n + 9});
  const at::Tensor product =
      at::linear(source.narrow(1, 0, k).index_select(0, x_rows), w);
  at::Tensor want = target.clone();
  at::Tensor want_columns = want.narrow(1, 4, n);
  if (accumulate) {
    want_columns.index_add_(0, y_rows, product);
  } else {
    want_columns.index_copy_(0, y_rows, product);
  }
  at::Tensor got = target.clone();
  ASSERT_TRUE(IndexedLinear(
      {source.data_ptr<float>(), source.stride(0), x_rows.data_ptr<int64_t>()},
      m, k, w.data_ptr<float>(), w.stride(0), n,
      {got.data_ptr<float>() + 4, got.stride(0), y_rows.data_ptr<int64_t>(),
       accumulate}));
  EXPECT_TRUE(at::allclose(got, want, 1e-4, 1e-4))
      << "m " << m << " k " << k << " n " << n << " accumulate " << accumulate
      << " max error " << (got - want).abs().max().item<float>();
}

TEST(IndexedLinearTest, GathersAndScattersOnBothKernels) {
  MOH_SKIP_UNLESS_KERNELS_RUN();
  const int threads = at::get_num_threads();
  for (int pool : {1, 2}) {
    at::set_num_threads(pool);
    // Streamed tiles (up to 128 rows, 16- and 32-row blocks), then blocked:
    // x read in place (up to 64 columns) or packed.
    for (int64_t m : {1, 7, 17, 128, 129, 300}) {
      for (bool accumulate : {false, true}) {
        ExpectIndexedMatches(m, 64, 1024 / m + 33, accumulate);
        ExpectIndexedMatches(m, 600, 64, accumulate);
        ExpectIndexedMatches(m, 70, 100, accumulate);
      }
    }
  }
  at::set_num_threads(threads);
}

}  // namespace
}  // namespace moh
