// GPU suite (part of gpu_model_test): the fused layer kernels
// (fused_layer_ops.h, model/kernels/cuda_layer_ops.cu) against the ATen
// chains they replace, on CUDA, on fresh random inputs in float32 and
// bfloat16, with their outputs poisoned first; and a model's steps with
// and without them. Skipped when LibTorch sees no CUDA device.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/checkpoint/checkpoint.h"
#include "model/core/fused_layer_ops.h"
#include "model/core/kv_cache.h"
#include "model/core/llama_model.h"
#include "model/core/moh_router.h"

namespace moh {
namespace {

const std::string kFixtures = MOH_FIXTURES_DIR;

at::TensorOptions Cuda(at::ScalarType type) {
  return at::TensorOptions().device(at::kCUDA).dtype(type);
}

// The caching allocator hands a freed block back to the next allocation of
// its size: a kernel that leaves an element unwritten shows NaN there, not
// a value an earlier reference computed.
void PoisonNext(int64_t numel, at::ScalarType type) {
  at::full({numel}, std::numeric_limits<float>::quiet_NaN(), Cuda(type));
}

// Elementwise |got - want| <= tolerance * max(1, |want|), NaN never passing.
void ExpectNear(const at::Tensor& got, const at::Tensor& want, double tolerance,
                const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const at::Tensor g = got.to(at::kFloat).cpu();
  const at::Tensor w = want.to(at::kFloat).cpu();
  ASSERT_FALSE(at::isnan(g).any().item<bool>()) << what;
  const at::Tensor excess =
      (g - w).abs() - tolerance * at::clamp_min(w.abs(), 1.0);
  EXPECT_LE(excess.max().item<double>(), 0.0)
      << what << ": largest difference " << (g - w).abs().max().item<double>();
}

// One rounding of the type: float32 results differ by a reduction's order.
double Tolerance(at::ScalarType type) {
  return type == at::kFloat ? 1e-5 : 8e-3;
}

std::string Name(at::ScalarType type) { return c10::toString(type); }

class GpuFusedOpsTest : public ::testing::TestWithParam<at::ScalarType> {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    at::manual_seed(31);
  }
};

TEST_P(GpuFusedOpsTest, AddRmsNormIsAddThenRmsNorm) {
  const at::ScalarType type = GetParam();
  for (const auto& [rows, width] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 4096}, {5, 1000}, {64, 256}, {3, 7}}) {
    const std::string what =
        Name(type) + " " + std::to_string(rows) + "x" + std::to_string(width);
    at::Tensor hidden = at::randn({rows, width}, Cuda(type));
    // A residual whose rows lie apart (a view of a wider product).
    const at::Tensor residual =
        at::randn({rows, width + 8}, Cuda(type)).narrow(1, 0, width);
    const at::Tensor weight = 1 + 0.1 * at::randn({width}, Cuda(type));
    at::Tensor expected_hidden = hidden.clone();
    PoisonNext(rows * width, type);
    const at::Tensor got = FusedAddRmsNorm(hidden, residual, weight, 1e-5);
    ASSERT_TRUE(got.defined()) << what;
    expected_hidden.add_(residual);
    EXPECT_TRUE(at::equal(hidden, expected_hidden)) << what;
    const at::Tensor h = expected_hidden.to(at::kFloat);
    const at::Tensor want =
        (h * at::rsqrt(h.pow(2).mean(-1, true) + 1e-5) * weight.to(at::kFloat))
            .to(type);
    ExpectNear(got, want, Tolerance(type), what);
  }
}

// rotate_half and RoPE as LlamaModel's ATen chain (x * cos + rotate_half(x)
// * sin, every op in x's type).
at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

at::Tensor RopeChain(const at::Tensor& x, const at::Tensor& positions,
                     const at::Tensor& cos, const at::Tensor& sin) {
  return x * cos.index_select(0, positions).unsqueeze(1) +
         RotateHalf(x) * sin.index_select(0, positions).unsqueeze(1);
}

struct Tables {
  at::Tensor cos, sin;
};

// Tables as the model builds them: [positions, D], the model's type.
Tables RopeTables(int64_t positions, int64_t d, at::ScalarType type) {
  const at::Tensor inv = at::pow(
      10000.0, -at::arange(0, d, 2, at::kDouble) / static_cast<double>(d));
  const at::Tensor freqs = at::outer(at::arange(positions, at::kDouble), inv);
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().to(Cuda(type)), emb.sin().to(Cuda(type))};
}

TEST_P(GpuFusedOpsTest, RopeIsTheChainsRotation) {
  const at::ScalarType type = GetParam();
  for (const int64_t d : {8, 64, 128}) {
    const std::string what = Name(type) + " D=" + std::to_string(d);
    const int64_t tokens = 9, heads = 6;
    const Tables tables = RopeTables(300, d, type);
    // Queries as a view of a wider product: tokens lie 2 * H * D apart.
    const at::Tensor x = at::randn({tokens, 2 * heads * d}, Cuda(type))
                             .narrow(1, 0, heads * d)
                             .view({tokens, heads, d});
    const at::Tensor positions = at::randint(300, {tokens}, Cuda(at::kLong));
    PoisonNext(tokens * heads * d, type);
    const at::Tensor got = FusedRope(x, positions, tables.cos, tables.sin);
    ASSERT_TRUE(got.defined()) << what;
    ExpectNear(got, RopeChain(x, positions, tables.cos, tables.sin),
               Tolerance(type), what);
  }
}

TEST_P(GpuFusedOpsTest, RopeStoreKvWritesTheRotatedKeysAndValuesOnly) {
  const at::ScalarType type = GetParam();
  constexpr int64_t kBlocks = 6, kBlock = 4, kKv = 4, kD = 32, kTokens = 7;
  const Tables tables = RopeTables(64, kD, type);
  // The whole cache, and the narrow view of its first 2 KV heads (a block
  // of twice the positions).
  for (const int64_t width : {kKv, int64_t{2}}) {
    const std::string what = Name(type) + " width " + std::to_string(width);
    const at::Tensor sentinel =
        at::full({kBlocks, kBlock, kKv, kD}, 7.0, Cuda(type));
    at::Tensor keys = sentinel.clone(), values = sentinel.clone();
    at::Tensor key_view = width == kKv ? keys : NarrowView(keys, width);
    at::Tensor value_view = width == kKv ? values : NarrowView(values, width);
    const int64_t span = key_view.size(1);
    // Distinct (block, offset) places, in no order.
    const at::Tensor place =
        at::randperm(kBlocks * span, Cuda(at::kLong)).narrow(0, 0, kTokens);
    const at::Tensor block = place.div(span, "floor");
    const at::Tensor offset = place.remainder(span);
    const at::Tensor positions = at::randint(64, {kTokens}, Cuda(at::kLong));
    const at::Tensor kv = at::randn({kTokens, 2 * width * kD}, Cuda(type));
    const at::Tensor k = kv.narrow(1, 0, width * kD).view({kTokens, width, kD});
    const at::Tensor v =
        kv.narrow(1, width * kD, width * kD).view({kTokens, width, kD});
    ASSERT_TRUE(FusedRopeStoreKv(k, v, positions, tables.cos, tables.sin, block,
                                 offset, key_view, value_view))
        << what;
    at::Tensor want_keys = sentinel.clone(), want_values = sentinel.clone();
    at::Tensor want_key_view =
        width == kKv ? want_keys : NarrowView(want_keys, width);
    at::Tensor want_value_view =
        width == kKv ? want_values : NarrowView(want_values, width);
    want_key_view.index_put_({block, offset},
                             RopeChain(k, positions, tables.cos, tables.sin));
    want_value_view.index_put_({block, offset}, v);
    // The whole caches: elsewhere still the sentinel.
    ExpectNear(keys, want_keys, Tolerance(type), what + " keys");
    EXPECT_TRUE(at::equal(values, want_values)) << what << " values";
  }
}

TEST_P(GpuFusedOpsTest, SiluMulIsSiluThenMul) {
  const at::ScalarType type = GetParam();
  for (const auto& [rows, inter] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 14336}, {3, 100}, {70, 33}}) {
    const std::string what =
        Name(type) + " " + std::to_string(rows) + "x" + std::to_string(inter);
    const at::Tensor both = 3 * at::randn({rows, 2 * inter}, Cuda(type));
    PoisonNext(rows * inter, type);
    const at::Tensor got = FusedSiluMul(both);
    ASSERT_TRUE(got.defined()) << what;
    const at::Tensor want =
        at::silu(both.narrow(1, 0, inter)).mul(both.narrow(1, inter, inter));
    ExpectNear(got, want, Tolerance(type), what);
  }
}

// The query-norm router's gates against MohRouter's ATen chain on CUDA:
// equal in float32; in bfloat16, whose rounded softmax ties heads, every
// routed head kept ranks at or above every head left out by the chain's own
// rounded gates, and each token keeps K.
TEST_P(GpuFusedOpsTest, QueryNormGatesKeepTheRoutersHeads) {
  const at::ScalarType type = GetParam();
  constexpr int64_t kTokens = 50, kD = 64;
  for (const auto& [shared, routed] :
       std::vector<std::pair<int32_t, int32_t>>{{16, 16}, {0, 12}, {2, 3}}) {
    const std::string what = Name(type) + " S=" + std::to_string(shared) +
                             " R=" + std::to_string(routed);
    MohLayerConfig layer;
    layer.num_heads = shared + routed;
    layer.shared_heads = shared;
    layer.top_k = routed / 2;
    TensorStore store;
    auto router = MohRouter::Load(RouterKind::kQueryNorm, layer, kD, "", store,
                                  Cuda(type));
    ASSERT_TRUE(router.ok()) << router.status();
    // Queries as a view of a wider product.
    const at::Tensor q =
        at::randn({kTokens, 2 * layer.num_heads * kD}, Cuda(type))
            .narrow(1, 0, layer.num_heads * kD)
            .view({kTokens, layer.num_heads, kD});
    const at::Tensor top_k =
        at::randint(routed + 1, {kTokens}, Cuda(at::kLong));
    const int64_t max_top_k = top_k.max().item<int64_t>();
    PoisonNext(kTokens * layer.num_heads, type);
    const at::Tensor got = FusedQueryNormGates(q, top_k, shared, routed);
    ASSERT_TRUE(got.defined()) << what;
    const at::Tensor want = router->Gates(at::Tensor(), q, top_k, max_top_k);
    const at::Tensor g = got.to(at::kFloat).cpu();
    ASSERT_FALSE(at::isnan(g).any().item<bool>()) << what;
    if (shared > 0) {
      EXPECT_TRUE(
          at::equal(g.narrow(1, 0, shared), at::ones({kTokens, shared})))
          << what;
    }
    const at::Tensor kept = g.narrow(1, shared, routed);
    EXPECT_TRUE(at::equal(kept.sum(1).to(at::kLong), top_k.cpu())) << what;
    EXPECT_TRUE(((kept == 0) | (kept == 1)).all().item<bool>()) << what;
    if (type == at::kFloat) {
      EXPECT_TRUE(at::equal(g, want.cpu())) << what;
      continue;
    }
    // The chain's rounded gates, softmax(norm / std) in the queries' type.
    const at::Tensor norms = at::linalg_vector_norm(
        q.narrow(1, shared, routed), 2, {-1}, false, c10::nullopt);
    const at::Tensor std = at::std(norms, {1}, true, true);
    const at::Tensor chain = at::softmax(norms / std, 1).to(at::kFloat).cpu();
    const at::Tensor lowest_kept =
        at::where(kept.to(at::kBool), chain, at::full_like(chain, INFINITY))
            .amin(1);
    const at::Tensor highest_left =
        at::where(kept.to(at::kBool), at::full_like(chain, -INFINITY), chain)
            .amax(1);
    EXPECT_TRUE((lowest_kept >= highest_left).all().item<bool>()) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Types, GpuFusedOpsTest,
                         ::testing::Values(at::kFloat, at::kBFloat16));

// A model's prefill and decode steps (CUDA graphs) with the fused kernels
// and with the ATen chains, in float32: the learned router's fixture (fused
// norms, RoPE, store and SwiGLU) and the query-norm one (its gates too), at
// mixed ratios. (bfloat16 is GpuModelTest's, against the CPU: there one
// rounding more or less may flip a near tie of the routing, in either path.)
TEST(GpuFusedOpsModelTest, FusedAndChainedStepsAgree) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  for (const std::string fixture : {"llama_learned", "llama_qnorm"}) {
    SCOPED_TRACE(fixture);
    const std::string dir = kFixtures + "/" + fixture;
    auto fused = LlamaModel::Load(dir, DeviceOptions{"cuda", "float32"});
    auto chained = LlamaModel::Load(dir, DeviceOptions{"cuda", "float32"});
    ASSERT_TRUE(fused.ok()) << fused.status();
    ASSERT_TRUE(chained.ok()) << chained.status();
    (*chained)->set_cuda_fused_ops(false);
    std::vector<KvCache> caches = {(*fused)->CreateKvCache(16, 8),
                                   (*chained)->CreateKvCache(16, 8)};
    at::manual_seed(14);
    DecoderBatch batch;
    batch.token_ids = at::randint(300, {3, 9}, at::kLong);
    batch.num_tokens = {9, 4, 6};
    batch.start_positions = {0, 0, 0};
    batch.block_tables = {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}};
    batch.ratios = {1.0f, 0.5f, 0.75f};
    for (int step = 0; step < 14; ++step) {
      auto a = (*fused)->Forward(batch, caches[0]);
      auto b = (*chained)->Forward(batch, caches[1]);
      ASSERT_TRUE(a.ok()) << a.status();
      ASSERT_TRUE(b.ok()) << b.status();
      // Within 1e-4 of the largest logit, the same heads.
      const at::Tensor want = b->logits.to(at::kFloat);
      const double scale = std::max(1.0, want.abs().max().item<double>());
      const at::Tensor got = a->logits.to(at::kFloat);
      ASSERT_FALSE(at::isnan(got).any().item<bool>()) << "step " << step;
      EXPECT_LE((got - want).abs().max().item<double>(), 1e-4 * scale)
          << "step " << step;
      EXPECT_TRUE(at::equal(a->head_token_counts, b->head_token_counts))
          << "step " << step;
      for (int r = 0; r < 3; ++r) {
        batch.start_positions[r] += batch.num_tokens[r];
      }
      batch.token_ids = at::randint(300, {3, 1}, at::kLong);
      batch.num_tokens = {1, 1, 1};
    }
    EXPECT_GE((*fused)->graph_replays(), 8);
  }
}

}  // namespace
}  // namespace moh
