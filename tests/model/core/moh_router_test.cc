// MohRouter's query-norm router (MoH-LLaMA3) decides in float32 whatever the
// queries' type: bfloat16 queries route to the heads the same values route to
// in float32, including where rounding the router's norms to bfloat16 would
// tie two heads.
#include "model/core/moh_router.h"

#include <gtest/gtest.h>

#include <utility>

#include "tests/model/core/layer_ops_reference.h"

namespace moh {
namespace {

MohRouter Router(int32_t shared, int32_t routed,
                 const at::TensorOptions& options) {
  auto router = layer_ops_reference::QueryNormRouter(shared, routed, options);
  EXPECT_TRUE(router.ok()) << router.status();
  return *std::move(router);
}

TEST(QueryNormRouterTest, BFloat16QueriesRouteAsTheirFloat32Values) {
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  const MohRouter router = Router(4, 12, bf16);
  const MohRouter router32 = Router(4, 12, at::kFloat);
  at::manual_seed(5);
  const at::Tensor q = at::randn({200, 16, 64}, bf16);
  const at::Tensor top_k = at::randint(13, {200}, at::kLong);
  const int64_t max_k = top_k.max().item<int64_t>();
  const at::Tensor got = router.Gates(at::Tensor(), q, top_k, max_k);
  ASSERT_EQ(got.scalar_type(), at::kBFloat16);
  const at::Tensor want =
      router32.Gates(at::Tensor(), q.to(at::kFloat), top_k, max_k);
  EXPECT_TRUE(at::equal(got.to(at::kFloat), want));
  EXPECT_TRUE(at::equal(got.narrow(1, 4, 12).sum(1).to(at::kLong), top_k));
}

// layer_ops_reference::NearTieQueries at K = 1: two routed norms that
// bfloat16 rounds to one value; the larger in float32 is kept.
TEST(QueryNormRouterTest, BFloat16NearTieKeepsTheLargerNorm) {
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  const MohRouter router = Router(1, 3, bf16);
  const at::Tensor gates =
      router.Gates(at::Tensor(), layer_ops_reference::NearTieQueries(bf16),
                   at::ones({1}, at::kLong), 1);
  EXPECT_TRUE(
      at::equal(gates.to(at::kFloat), layer_ops_reference::NearTieGates()))
      << gates;
}

}  // namespace
}  // namespace moh
