// DeviceOptions::weights: the fixture model's logits with bfloat16 linear
// weights (Bf16Linear) and int8 ones (Int8Linear), both under float32
// activations and converted as they load, against float32's, over a
// chunked prompt beside a decoding row (prefill's panel path and decode's
// few-row path), at ratio 1 and 0.5 (the head-sparse pair kernel's per-head
// slices of q_proj and o_proj), in each attention mode; and the settings it
// refuses, each naming the field.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "model/core/llama_model.h"
#include "tests/model/core/llama_test_util.h"

namespace moh {
namespace {

const std::string kFixtures = MOH_FIXTURES_DIR;

std::unique_ptr<LlamaModel> Load(const std::string& weights = "") {
  auto model = LlamaModel::Load(kFixtures + "/llama_learned",
                                DeviceOptions{"cpu", "float32", weights});
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? *std::move(model) : nullptr;
}

struct Precision {
  std::string weights;
  WeightFormat format;
  // The largest |logit error| allowed, as a fraction of the largest logit.
  // bfloat16 keeps 8 bits of mantissa (relative rounding <= 2^-9 per weight,
  // the tied embedding's too): measured at most 0.051 (chunk 1), the same
  // under avx512, avx2 and portable (LibTorch over the same bf16 weights
  // widened): the rounding's, not the kernels'. int8 rounds each weight by
  // <= half its row's largest / 127: this fixture's weights move 0.0060 of
  // their norm (bf16: 0.0016; groups of 32 as Q8_0's: 0.0053), and the
  // logits at most 0.18 (chunk 1), again the same under every ISA.
  double bound;
  double agreement;  // of the argmax; int8 measured >= 0.92
};

class LowpWeightsTest : public ::testing::TestWithParam<Precision> {};

TEST_P(LowpWeightsTest, LogitsWithinBoundOfFloat32) {
  const Precision& p = GetParam();
  for (AttentionMode mode : {AttentionMode::kAuto, AttentionMode::kDense,
                             AttentionMode::kHeadSparseAten}) {
    std::unique_ptr<LlamaModel> f32 = Load(), lowp = Load(p.weights);
    ASSERT_TRUE(f32 && lowp);
    EXPECT_EQ(lowp->linear_weights(), p.format);
    f32->set_attention_mode(mode);
    lowp->set_attention_mode(mode);
    auto want = ChunkedPromptBesideDecode(*f32, {1.0f, 0.5f});
    auto got = ChunkedPromptBesideDecode(*lowp, {1.0f, 0.5f});
    ASSERT_TRUE(want.ok() && got.ok());
    for (size_t i = 0; i < want->size(); ++i) {
      const at::Tensor& a = (*want)[i];
      const at::Tensor& b = (*got)[i];
      const double scale = a.abs().max().item<double>();
      const double error = (a - b).abs().max().item<double>();
      ASSERT_FALSE(std::isnan(error)) << "chunk " << i;
      EXPECT_LE(error, p.bound * scale)
          << "chunk " << i << " mode " << static_cast<int>(mode);
      EXPECT_GT(error, 0) << "the weights were not converted";
      const double agree =
          (a.argmax(-1) == b.argmax(-1)).to(at::kFloat).mean().item<double>();
      EXPECT_GE(agree, p.agreement) << "chunk " << i;
      std::printf(
          "%s chunk %zu: max |logit error| %.3g of %.3g (%.2g), argmax "
          "agreement %.3f\n",
          p.weights.c_str(), i, error, scale, error / scale, agree);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, LowpWeightsTest,
    ::testing::Values(Precision{"bfloat16", WeightFormat::kBfloat16, 0.08, 0.9},
                      Precision{"int8", WeightFormat::kInt8, 0.25, 0.85}),
    [](const ::testing::TestParamInfo<Precision>& info) {
      return info.param.weights;
    });

TEST(LowpWeightsRefusalTest, RefusalsNameTheField) {
  for (const char* as_loaded : {"", "auto"}) {
    std::unique_ptr<LlamaModel> model = Load(as_loaded);
    ASSERT_TRUE(model);
    EXPECT_EQ(model->linear_weights(), WeightFormat::kAsLoaded);
  }
  for (const char* bad : {"float8", "fp16", "int4"}) {
    auto model = LlamaModel::Load(kFixtures + "/llama_learned",
                                  DeviceOptions{"cpu", "float32", bad});
    ASSERT_FALSE(model.ok()) << bad;
    EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(model.status().message().find("weights"), std::string::npos)
        << model.status().message();
  }
  for (const char* format : {"bfloat16", "int8"}) {
    auto model = LlamaModel::Load(kFixtures + "/llama_learned",
                                  DeviceOptions{"cpu", "bfloat16", format});
    ASSERT_FALSE(model.ok()) << format;
    EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(model.status().message().find("dtype float32"), std::string::npos)
        << model.status().message();
  }
}

}  // namespace
}  // namespace moh
