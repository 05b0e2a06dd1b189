// DeviceOptions::weights for MoH-ViT: the fixture classifier's logits with
// bfloat16 linear weights (qkv, proj, fc1, fc2, head; Bf16Linear) and int8
// ones (Int8Linear), converted as they load under float32 activations,
// against float32's, over a batch at mixed activation ratios in each
// attention mode (the head-sparse pair kernel reads qkv's query rows and
// proj per head); and the settings it refuses, each naming the field.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "model/core/vit_model.h"
#include "tests/model/core/lowp_weights_test_util.h"

namespace moh {
namespace {

const std::string kFixtures = MOH_FIXTURES_DIR;

// Over 64 images of standard normal pixels at ratios 0.25 to 1: bfloat16
// measured 0.018 of the largest logit and argmax agreement 0.984, int8
// 0.051 and 0.953 (3 of 64 differ), the same in each attention mode and
// under avx512, avx2 and portable (the rounding's, not the kernels').
class VitLowpWeightsTest : public ::testing::TestWithParam<WeightsPrecision> {};

TEST_P(VitLowpWeightsTest, LogitsWithinBoundOfFloat32) {
  const WeightsPrecision& p = GetParam();
  const std::string dir = kFixtures + "/vit_learned";
  std::unique_ptr<VitModel> f32 = LoadWithWeights<VitModel>(dir),
                            lowp = LoadWithWeights<VitModel>(dir, p.weights);
  ASSERT_TRUE(f32 && lowp);
  EXPECT_EQ(lowp->linear_weights(), p.format);
  at::manual_seed(11);
  const int64_t rows = 64;
  const at::Tensor pixels = at::randn({rows, 3, 16, 16});
  std::vector<float> ratios;
  for (int64_t i = 0; i < rows; ++i) ratios.push_back(0.25f * (1 + i % 4));
  for (AttentionMode mode : {AttentionMode::kAuto, AttentionMode::kDense,
                             AttentionMode::kHeadSparseAten}) {
    f32->set_attention_mode(mode);
    lowp->set_attention_mode(mode);
    auto want = f32->Forward(pixels, ratios);
    auto got = lowp->Forward(pixels, ratios);
    ASSERT_TRUE(want.ok() && got.ok());
    ExpectLogitsWithinBound(want->logits, got->logits, p,
                            "mode " + std::to_string(static_cast<int>(mode)));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, VitLowpWeightsTest,
    ::testing::Values(WeightsPrecision{"bfloat16", WeightFormat::kBfloat16,
                                       0.04, 0.95},
                      WeightsPrecision{"int8", WeightFormat::kInt8, 0.1, 0.9}),
    [](const ::testing::TestParamInfo<WeightsPrecision>& info) {
      return info.param.weights;
    });

TEST(VitLowpWeightsRefusalTest, RefusalsNameTheField) {
  ExpectWeightsRefusalsNameTheField<VitModel>(kFixtures + "/vit_learned");
}

}  // namespace
}  // namespace moh
