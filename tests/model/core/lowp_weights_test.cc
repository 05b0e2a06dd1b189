// LlamaModel::set_linear_weights: the fixture model's logits with bfloat16
// linear weights (Bf16Linear, float32 activations) against float32's, over a
// chunked prompt beside a decoding row (prefill's panel path and decode's
// few-row path), at ratio 1 and 0.5 (the head-sparse pair kernel's per-head
// slices of q_proj and o_proj), in each attention mode; and the settings it
// refuses, each naming the field.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "model/core/llama_model.h"
#include "tests/model/core/llama_test_util.h"

namespace moh {
namespace {

const std::string kFixtures = MOH_FIXTURES_DIR;

std::unique_ptr<LlamaModel> Load() {
  auto model = LlamaModel::Load(kFixtures + "/llama_learned",
                                DeviceOptions{"cpu", "float32"});
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? *std::move(model) : nullptr;
}

TEST(LowpWeightsTest, Bf16LogitsWithinBoundOfFloat32) {
  for (AttentionMode mode : {AttentionMode::kAuto, AttentionMode::kDense,
                             AttentionMode::kHeadSparseAten}) {
    std::unique_ptr<LlamaModel> f32 = Load(), bf16 = Load();
    ASSERT_TRUE(f32 && bf16);
    ASSERT_TRUE(bf16->set_linear_weights("bfloat16", "weights").ok());
    EXPECT_EQ(bf16->linear_weights(), "bfloat16");
    f32->set_attention_mode(mode);
    bf16->set_attention_mode(mode);
    auto want = ChunkedPromptBesideDecode(*f32, {1.0f, 0.5f});
    auto got = ChunkedPromptBesideDecode(*bf16, {1.0f, 0.5f});
    ASSERT_TRUE(want.ok() && got.ok());
    for (size_t i = 0; i < want->size(); ++i) {
      const at::Tensor& a = (*want)[i];
      const at::Tensor& b = (*got)[i];
      const double scale = a.abs().max().item<double>();
      const double error = (a - b).abs().max().item<double>();
      // bf16 keeps 8 bits of mantissa (relative rounding <= 2^-9 per
      // weight, the tied embedding's too). Measured on this fixture: at most
      // 0.051 of the largest logit (chunk 1), the same under avx512, avx2
      // and portable (LibTorch over the same bf16 weights widened): the
      // rounding's, not the kernels'.
      EXPECT_LE(error, 0.08 * scale)
          << "chunk " << i << " mode " << static_cast<int>(mode);
      const double agree =
          (a.argmax(-1) == b.argmax(-1)).to(at::kFloat).mean().item<double>();
      EXPECT_GE(agree, 0.9) << "chunk " << i;
      std::printf(
          "chunk %zu: max |logit error| %.3g of %.3g (%.2g), argmax "
          "agreement %.3f\n",
          i, error, scale, error / scale, agree);
    }
  }
}

TEST(LowpWeightsTest, RefusalsNameTheField) {
  std::unique_ptr<LlamaModel> model = Load();
  ASSERT_TRUE(model);
  EXPECT_TRUE(model->set_linear_weights("", "weights").ok());
  EXPECT_TRUE(model->set_linear_weights("auto", "weights").ok());
  EXPECT_EQ(model->linear_weights(), "");
  for (const char* bad : {"int8", "float8", "fp16"}) {
    const absl::Status status = model->set_linear_weights(bad, "--weights");
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(status.message().find("--weights"), std::string::npos)
        << status.message();
  }
  auto bf16_model = LlamaModel::Load(kFixtures + "/llama_learned",
                                     DeviceOptions{"cpu", "bfloat16"});
  ASSERT_TRUE(bf16_model.ok());
  EXPECT_EQ((*bf16_model)->set_linear_weights("bfloat16", "weights").code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moh
