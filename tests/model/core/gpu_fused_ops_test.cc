// GPU suite (part of gpu_model_test): the fused layer kernels
// (fused_layer_ops.h, model/kernels/cuda_layer_ops.cu) on CUDA against the
// ATen chains they replace, in float32 and bfloat16 (layer_ops_reference.h:
// the checks cuda_kernels_emulated_test runs on the CPU); and a model's
// steps with and without them. Skipped when LibTorch sees no CUDA device.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "model/core/fused_layer_ops.h"
#include "model/core/kv_cache.h"
#include "model/core/llama_model.h"
#include "tests/base/test_paths.h"
#include "tests/model/core/layer_ops_reference.h"
#include "tests/model/core/llama_test_util.h"

namespace moh {
namespace {

using namespace layer_ops_reference;

const std::string kFixtures = test_paths::FixturesDir();

at::Tensor SkinnyLinear(const at::Tensor& x, const at::Tensor& weight,
                        const at::Tensor& bias) {
  return FusedSkinnyLinear(x, weight, bias);
}

at::Tensor SiluMulLinear(const at::Tensor& both, const at::Tensor& weight) {
  return FusedSiluMulLinear(both, weight);
}

const LayerKernels kFused = {FusedAddRmsNorm,     FusedRope,
                             FusedRopeStoreKv,    FusedSiluMul,
                             FusedQueryNormGates, FusedAttentionPrologue,
                             SkinnyLinear,        SiluMulLinear};

class GpuFusedOpsTest : public ::testing::TestWithParam<at::ScalarType> {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    at::manual_seed(31);
  }
  at::TensorOptions Options() const {
    return at::TensorOptions().device(at::kCUDA).dtype(GetParam());
  }
};

TEST_P(GpuFusedOpsTest, AddRmsNormIsAddThenRmsNorm) {
  CheckAddRmsNorm(kFused, Options());
}

TEST_P(GpuFusedOpsTest, RopeIsTheChainsRotation) {
  CheckRope(kFused, Options());
}

TEST_P(GpuFusedOpsTest, RopeStoreKvWritesTheRotatedKeysAndValuesOnly) {
  CheckRopeStoreKv(kFused, Options());
}

TEST_P(GpuFusedOpsTest, SiluMulIsSiluThenMul) {
  CheckSiluMul(kFused, Options());
}

TEST_P(GpuFusedOpsTest, QueryNormGatesKeepTheRoutersHeads) {
  CheckQueryNormGates(kFused, Options());
}

TEST_P(GpuFusedOpsTest, AttentionPrologueIsRopeStoreAndGates) {
  CheckAttentionPrologue(kFused, Options());
}

TEST_P(GpuFusedOpsTest, SkinnyLinearIsTheProduct) {
  CheckSkinnyLinear(kFused, Options());
  // Past kSkinnyLinearMaxOutputs cuBLAS runs it (at bandwidth there).
  const at::Tensor x = at::randn({1, 64}, Options());
  EXPECT_FALSE(
      FusedSkinnyLinear(
          x, at::randn({kSkinnyLinearMaxOutputs + 1, 64}, Options()), {})
          .defined());
  EXPECT_TRUE(FusedSkinnyLinear(
                  x, at::randn({kSkinnyLinearMaxOutputs, 64}, Options()), {})
                  .defined());
}

INSTANTIATE_TEST_SUITE_P(Types, GpuFusedOpsTest,
                         ::testing::Values(at::kFloat, at::kBFloat16));

// A model's prefill and decode steps (CUDA graphs) with the fused kernels,
// with the ATen chains, and with cuBLAS's products in place of the skinny
// kernel, in float32: the learned router's fixture (fused norms, RoPE,
// store and SwiGLU) and the query-norm one (its gates too), at mixed ratios;
// the decode steps' 3 rows go through the skinny kernel (every product of
// these fixtures, the LM head's too, and SwiGLU inside the down
// projection). (bfloat16 is GpuModelTest's, against the CPU: there one
// rounding more or less may flip a near tie of the routing, in either path.)
TEST(GpuFusedOpsModelTest, FusedAndChainedStepsAgree) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  for (const std::string fixture : {"llama_learned", "llama_qnorm"}) {
    SCOPED_TRACE(fixture);
    const std::string dir = kFixtures + "/" + fixture;
    const auto models = LoadEach(
        dir, {{"cuda", "float32"}, {"cuda", "float32"}, {"cuda", "float32"}});
    ASSERT_EQ(models.size(), 3u);
    LlamaModel& fused = *models[0];
    models[1]->set_cuda_fused_ops(false);
    models[2]->set_cuda_skinny_linear(false);
    std::vector<KvCache> caches = {fused.CreateKvCache(16, 8),
                                   models[1]->CreateKvCache(16, 8),
                                   models[2]->CreateKvCache(16, 8)};
    at::manual_seed(14);
    DecoderBatch batch = ThreeMixedPrompts();
    for (int step = 0; step < 14; ++step) {
      auto a = fused.Forward(batch, caches[0]);
      ASSERT_TRUE(a.ok()) << a.status();
      const at::Tensor got = a->logits.to(at::kFloat);
      ASSERT_FALSE(at::isnan(got).any().item<bool>()) << "step " << step;
      for (int other : {1, 2}) {
        auto b = models[other]->Forward(batch, caches[other]);
        ASSERT_TRUE(b.ok()) << b.status();
        // Within 1e-4 of the largest logit, the same heads.
        const at::Tensor want = b->logits.to(at::kFloat);
        const double scale = std::max(1.0, want.abs().max().item<double>());
        EXPECT_LE((got - want).abs().max().item<double>(), 1e-4 * scale)
            << "step " << step << " against model " << other;
        EXPECT_TRUE(at::equal(a->head_token_counts, b->head_token_counts))
            << "step " << step << " against model " << other;
      }
      NextTokenEach(batch);
    }
    EXPECT_GE(fused.graph_replays(), 8);
  }
}

}  // namespace
}  // namespace moh
