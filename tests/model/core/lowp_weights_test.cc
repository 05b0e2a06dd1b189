// DeviceOptions::weights: the fixture model's logits with bfloat16 linear
// weights (Bf16Linear) and int8 ones (Int8Linear), converted as they load,
// against float32's, over a chunked prompt beside a decoding row (prefill's
// panel path and decode's few-row path, float32 activations) and a prompt
// in one chunk (the prefill product: activations rounded to bfloat16 on
// AVX512_BF16 CPUs, to int8 per 32 values on AVX512_VNNI), at ratio 1 and 0.5
// (the head-sparse pair kernel's per-head slices of q_proj and o_proj), in each
// attention mode; and the settings it refuses, each naming the field.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "model/core/llama_model.h"
#include "tests/model/core/llama_test_util.h"
#include "tests/model/core/lowp_weights_test_util.h"

namespace moh {
namespace {

const std::string kFixtures = MOH_FIXTURES_DIR;

std::unique_ptr<LlamaModel> Load(const std::string& weights = "") {
  return LoadWithWeights<LlamaModel>(kFixtures + "/llama_learned", weights);
}

// bfloat16 keeps 8 bits of mantissa (relative rounding <= 2^-9 per weight,
// the tied embedding's too): measured at most 0.051 of the largest logit
// (chunk 1), the same under avx512f, avx2 and portable (LibTorch over the
// same bf16 weights widened): the rounding's, not the kernels'; 0.067 where
// AVX512_BF16 rounds the activations of 9-128-row products too (these
// 53-row chunks: Bf16DotRowsLinear), argmax agreement 0.941. int8 rounds each
// weight by <= half its row's largest / 127: this fixture's weights move
// 0.0060 of their norm (bf16: 0.0016; groups of 32 as Q8_0's: 0.0053), and
// the logits at most 0.18 (chunk 1), again the same under every ISA; its
// argmax agreement measured >= 0.92. Where AVX512_VNNI quantizes x per 32
// values as well (Q8_0's activations: these chunks through
// Int8DotRowsLinear), 0.24 (chunk 1) with agreement >= 0.882; the bound
// keeps a margin over that. The one-chunk prefill below: bfloat16
// 0.049 widening W (avx512f, avx2, portable), 0.063 (agreement 0.973) where
// AVX512_BF16 rounds the activations as well; int8 0.17 widening W, 0.21
// (agreement 0.913) where AVX512_VNNI quantizes x (Int8DotLinear).
class LowpWeightsTest : public ::testing::TestWithParam<WeightsPrecision> {};

TEST_P(LowpWeightsTest, LogitsWithinBoundOfFloat32) {
  const WeightsPrecision& p = GetParam();
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
      ExpectLogitsWithinBound((*want)[i], (*got)[i], p,
                              "chunk " + std::to_string(i) + " mode " +
                                  std::to_string(static_cast<int>(mode)));
    }
  }
}

// One 150-token prompt in a single step: every projection takes the
// prefill product (past kMaxStreamedRows rows), which rounds the
// activations too where the CPU has the dot-product extension (bfloat16 on
// AVX512_BF16, int8 per 32 values on AVX512_VNNI). The chunks above (53
// rows) never reach it.
TEST_P(LowpWeightsTest, OneChunkPrefillWithinBoundOfFloat32) {
  const WeightsPrecision& p = GetParam();
  std::unique_ptr<LlamaModel> f32 = Load(), lowp = Load(p.weights);
  ASSERT_TRUE(f32 && lowp);
  at::manual_seed(11);
  const at::Tensor prompt = at::randint(300, {1, 150}, at::kLong);
  std::vector<at::Tensor> logits;
  for (const LlamaModel* model : {f32.get(), lowp.get()}) {
    KvCache cache = model->CreateKvCache(1, 160);
    DecoderBatch batch;
    batch.all_logits = true;
    batch.token_ids = prompt;
    batch.num_tokens = {150};
    batch.slots = {0};
    batch.start_positions = {0};
    batch.ratios = {1.0f};
    auto out = model->Forward(batch, cache);
    ASSERT_TRUE(out.ok()) << out.status();
    logits.push_back(out->logits[0]);
  }
  ExpectLogitsWithinBound(logits[0], logits[1], p, "one 150-token chunk");
}

INSTANTIATE_TEST_SUITE_P(
    Formats, LowpWeightsTest,
    ::testing::Values(
        WeightsPrecision{"bfloat16", WeightFormat::kBfloat16, 0.08, 0.9},
        WeightsPrecision{"int8", WeightFormat::kInt8, 0.3, 0.85}),
    [](const ::testing::TestParamInfo<WeightsPrecision>& info) {
      return info.param.weights;
    });

TEST(LowpWeightsRefusalTest, RefusalsNameTheField) {
  ExpectWeightsRefusalsNameTheField<LlamaModel>(kFixtures + "/llama_learned");
}

}  // namespace
}  // namespace moh
