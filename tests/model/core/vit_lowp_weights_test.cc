// DeviceOptions::weights for the image models: the fixture classifiers,
// MoH-ViT (timm layout) and MoH-ViT TransNeXt, and the image generator
// MoH-DiT (the tiny fixture and the shipped demo), with bfloat16 linear
// weights (Bf16Linear) and int8 ones (Int8Linear), converted as they load
// under float32 activations, against float32's, over a batch at mixed
// activation ratios in each attention mode (the pair kernels read the query
// projection per head); and the settings they refuse, each naming the field.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "model/core/activation.h"
#include "model/core/dit_model.h"
#include "model/core/transnext_model.h"
#include "model/core/vit_model.h"
#include "tests/base/test_paths.h"
#include "tests/model/core/lowp_weights_test_util.h"

namespace moh {
namespace {

const std::string kFixtures = test_paths::FixturesDir();

// Model of `dir` with p.weights against float32 on 64 images of standard
// normal pixels, ratios 0.25 to 1.
template <typename Model>
void ExpectCloseToFloat32(const std::string& dir, const WeightsPrecision& p) {
  std::unique_ptr<Model> f32 = LoadWithWeights<Model>(dir),
                         lowp = LoadWithWeights<Model>(dir, p.weights);
  ASSERT_TRUE(f32 && lowp);
  EXPECT_EQ(lowp->linear_weights(), p.format);
  at::manual_seed(11);
  const int64_t rows = 64;
  const int64_t side = f32->config().image_size;
  const at::Tensor pixels = at::randn({rows, 3, side, side});
  std::vector<float> ratios;
  for (int64_t i = 0; i < rows; ++i) ratios.push_back(0.25f * (1 + i % 4));
  for (AttentionMode mode : {AttentionMode::kAuto, AttentionMode::kDense,
                             AttentionMode::kHeadSparseAten}) {
    f32->set_attention_mode(mode);
    lowp->set_attention_mode(mode);
    auto want = f32->Forward(pixels, ratios);
    auto got = lowp->Forward(pixels, ratios);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectLogitsWithinBound(want->logits, got->logits, p,
                            "mode " + std::to_string(static_cast<int>(mode)));
  }
}

// A fixture classifier and a precision with its bounds.
struct FamilyPrecision {
  std::string fixture;  // vit_learned or transnext_tiny_b
  WeightsPrecision precision;
};

class ImageLowpWeightsTest : public ::testing::TestWithParam<FamilyPrecision> {
};

TEST_P(ImageLowpWeightsTest, LogitsWithinBoundOfFloat32) {
  const FamilyPrecision& c = GetParam();
  const std::string dir = kFixtures + "/" + c.fixture;
  if (c.fixture == "vit_learned") {
    ExpectCloseToFloat32<VitModel>(dir, c.precision);
  } else {
    ExpectCloseToFloat32<TransNextModel>(dir, c.precision);
  }
}

// The ViT: bfloat16 measured 0.018 of the largest logit and argmax agreement
// 0.984, int8 0.051 and 0.953 (3 of 64 differ). The random-weight TransNeXt
// (96 px, 4 stages of 2 to 8 heads of 4 to 8) has logits within 1.8 of each
// other: bfloat16 measured 0.077 and 0.969, int8 0.14 and 0.891 (7 of 64
// differ). Each the same in every attention mode and under avx512f, avx2 and
// portable (the rounding's, not the kernels'). Where the prefill products
// round x as well (cpu_isa.h's extensions): bfloat16 on AVX512_BF16
// (Bf16DotLinear) measured 0.032 (ViT, agreement 0.984) and 0.095
// (TransNeXt, 0.953); int8 on AVX512_VNNI, x rounded per 32 values
// (Int8DotLinear), the ViT 0.046 to 0.056 by mode and 0.953, the TransNeXt
// 0.22 and 0.844 (10 of 64).
INSTANTIATE_TEST_SUITE_P(
    Formats, ImageLowpWeightsTest,
    ::testing::Values(
        FamilyPrecision{"vit_learned",
                        {"bfloat16", WeightFormat::kBfloat16, 0.04, 0.95}},
        FamilyPrecision{"vit_learned", {"int8", WeightFormat::kInt8, 0.1, 0.9}},
        FamilyPrecision{"transnext_tiny_b",
                        {"bfloat16", WeightFormat::kBfloat16, 0.15, 0.9}},
        FamilyPrecision{"transnext_tiny_b",
                        {"int8", WeightFormat::kInt8, 0.25, 0.8}}),
    [](const ::testing::TestParamInfo<FamilyPrecision>& info) {
      return info.param.fixture + "_" + info.param.precision.weights;
    });

// A MoH-DiT and a precision with its bound: the prediction's (noise and
// variance) error, |got - want| / |want| over the whole batch. Not the
// largest single error: where a token's router scores nearly tie, the
// converted weights may pick another head, a discrete change to its row.
struct DitPrecision {
  std::string dir;
  std::string name;  // of the test
  std::string weights;
  WeightFormat format;
  double bound;
};

class DitLowpWeightsTest : public ::testing::TestWithParam<DitPrecision> {};

// 32 rows of standard normal latents at timesteps across [0, 1000), every
// class and the null one, ratios 0.25 to 1, in each attention mode.
TEST_P(DitLowpWeightsTest, PredictionWithinBoundOfFloat32) {
  const DitPrecision& p = GetParam();
  std::unique_ptr<DitModel> f32 = LoadWithWeights<DitModel>(p.dir),
                            lowp = LoadWithWeights<DitModel>(p.dir, p.weights);
  ASSERT_TRUE(f32 && lowp);
  EXPECT_EQ(lowp->linear_weights(), p.format);
  const DitConfig& c = f32->config();
  at::manual_seed(13);
  const int64_t rows = 32;
  const at::Tensor x =
      at::randn({rows, c.in_channels, c.input_size, c.input_size});
  const at::Tensor t = at::arange(rows, at::kFloat) * (999.0 / (rows - 1));
  const at::Tensor classes = at::arange(rows, at::kLong) % (c.num_classes + 1);
  std::vector<float> ratios;
  for (int64_t i = 0; i < rows; ++i) ratios.push_back(0.25f * (1 + i % 4));
  const std::vector<LayerTopK> top_k = TopKForRatios(c.moh, ratios);
  for (AttentionMode mode : {AttentionMode::kAuto, AttentionMode::kDense,
                             AttentionMode::kHeadSparseAten}) {
    f32->set_attention_mode(mode);
    lowp->set_attention_mode(mode);
    auto want = f32->Forward(x, t, classes, top_k);
    auto got = lowp->Forward(x, t, classes, top_k);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_TRUE(got.ok()) << got.status();
    const at::Tensor diff = want->out - got->out;
    const double error =
        diff.norm().item<double>() / want->out.norm().item<double>();
    const std::string what =
        p.name + " mode " + std::to_string(static_cast<int>(mode));
    ASSERT_FALSE(std::isnan(error)) << what;
    EXPECT_LE(error, p.bound) << what;
    EXPECT_GT(error, 0) << what << ": the weights were not converted";
    // Tokens each head served: a near tie may move a few.
    const double moved = (want->head_token_counts - got->head_token_counts)
                             .abs()
                             .sum()
                             .item<double>() /
                         want->head_token_counts.sum().item<double>();
    EXPECT_LE(moved, 0.01) << what;
    std::printf(
        "%s %s: |error| / |float32| %.3g, largest |error| %.3g of %.3g, "
        "head loads moved %.4f\n",
        p.weights.c_str(), what.c_str(), error, diff.abs().max().item<double>(),
        want->out.abs().max().item<double>(), moved);
  }
}

const std::string kDemoDit = test_paths::ModelsDir() + "/demo-dit";

// Measured, the largest over the three modes (the same under avx512f, avx2
// and portable; AVX512_BF16 and VNNI round x too): dit_tiny bfloat16 0.0043
// (0.0082 with x rounded), int8 0.017 (0.022); demo-dit bfloat16 0.0052
// (0.0053), int8 0.0058 (0.0068). Head loads moved by at most 0.0015.
INSTANTIATE_TEST_SUITE_P(
    Formats, DitLowpWeightsTest,
    ::testing::Values(DitPrecision{kFixtures + "/dit_tiny", "dit_tiny_bfloat16",
                                   "bfloat16", WeightFormat::kBfloat16, 0.02},
                      DitPrecision{kFixtures + "/dit_tiny", "dit_tiny_int8",
                                   "int8", WeightFormat::kInt8, 0.05},
                      DitPrecision{kDemoDit, "demo_dit_bfloat16", "bfloat16",
                                   WeightFormat::kBfloat16, 0.02},
                      DitPrecision{kDemoDit, "demo_dit_int8", "int8",
                                   WeightFormat::kInt8, 0.05}),
    [](const ::testing::TestParamInfo<DitPrecision>& info) {
      return info.param.name;
    });

TEST(ImageLowpWeightsRefusalTest, RefusalsNameTheField) {
  ExpectWeightsRefusalsNameTheField<VitModel>(kFixtures + "/vit_learned");
  ExpectWeightsRefusalsNameTheField<TransNextModel>(kFixtures +
                                                    "/transnext_tiny_b");
  ExpectWeightsRefusalsNameTheField<DitModel>(kFixtures + "/dit_tiny");
}

}  // namespace
}  // namespace moh
