// Compares the C++ models with the independent Python reference
// (tests/reference/moh_reference.py, a transcription of the official MoH code)
// on the tiny checkpoints that tests/reference/make_fixtures.py generates.
#include <algorithm>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/core/llama_model.h"
#include "model/core/vit_model.h"
#include "model/generation/generator.h"
#include "nlohmann/json.hpp"
#include "tests/base/test_paths.h"
#include "tests/model/core/golden_test_util.h"
#include "tests/model/core/llama_test_util.h"

namespace moh {
namespace {

using nlohmann::json;

const std::string kFixtures = test_paths::FixturesDir();

json ReadGolden(const std::string& model) {
  return ReadJson(kFixtures + "/" + model + "/golden.json");
}

// |actual - expected| <= 1e-4 relative to the magnitude of the expected values.
void ExpectClose(const at::Tensor& actual, const at::Tensor& expected,
                 const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  const double scale = std::max(1.0, expected.abs().max().item<double>());
  const double diff = (actual - expected).abs().max().item<double>();
  EXPECT_LE(diff, 1e-4 * scale) << what;
}

void ExpectSameHeads(const at::Tensor& gates, const at::Tensor& expected,
                     const std::string& what) {
  ASSERT_EQ(gates.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(at::equal(gates != 0, expected != 0))
      << what << ": different head selection";
  ExpectClose(gates, expected, what + " gate values");
}

const json& FindCase(const json& golden, double ratio, int index,
                     const char* key) {
  for (const json& c : golden["cases"]) {
    if (c["ratio"].get<double>() == ratio && c[key].get<int>() == index)
      return c;
  }
  ADD_FAILURE() << "no golden case ratio=" << ratio << " " << key << "="
                << index;
  static const json empty;
  return empty;
}

std::vector<int32_t> Ints(const json& j) {
  return j.get<std::vector<int32_t>>();
}

class LlamaGoldenTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    golden_ = ReadGolden(GetParam());
    auto model = LlamaModel::Load(kFixtures + "/" + GetParam(),
                                  DeviceOptions{"cpu", "float32"});
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
  }

  // Runs the prompts `prompt_index` at `ratios` as one padded batch (optionally
  // fed in two chunks) and checks every row against its golden case.
  void CheckBatch(const std::vector<int>& prompt_index,
                  const std::vector<float>& ratios, int chunks = 1) {
    const int64_t n = prompt_index.size();
    std::vector<std::vector<int32_t>> prompts;
    int64_t width = 0;
    for (int p : prompt_index) {
      prompts.push_back(Ints(golden_["prompts"][p]));
      width = std::max<int64_t>(width, prompts.back().size());
    }
    KvCache cache = model_->CreateKvCache(n + 1, 64);
    std::vector<at::Tensor> logits(n), gates_by_row(n);
    std::vector<std::vector<at::Tensor>> gates(n);
    for (int chunk = 0; chunk < chunks; ++chunk) {
      DecoderBatch batch;
      batch.all_logits = true;
      batch.record_gates = true;
      batch.token_ids = at::zeros({n, width}, at::kLong);
      std::vector<std::pair<int64_t, int64_t>> spans;
      for (int64_t b = 0; b < n; ++b) {
        const int64_t len = prompts[b].size();
        const int64_t begin = chunk == 0 ? 0 : len / 2;
        const int64_t end = chunks == 1 || chunk == 1 ? len : len / 2;
        for (int64_t t = begin; t < end; ++t) {
          batch.token_ids[b][t - begin] = prompts[b][t];
        }
        batch.num_tokens.push_back(end - begin);
        batch.slots.push_back(n - b);  // slots need not follow rows
        batch.start_positions.push_back(begin);
        batch.ratios.push_back(ratios[b]);
        spans.emplace_back(begin, end);
      }
      auto out = model_->Forward(batch, cache);
      ASSERT_TRUE(out.ok()) << out.status();
      for (int64_t b = 0; b < n; ++b) {
        const int64_t len = spans[b].second - spans[b].first;
        at::Tensor l = out->logits[b].narrow(0, 0, len);
        logits[b] = logits[b].defined() ? at::cat({logits[b], l}) : l;
        for (size_t layer = 0; layer < out->gates.size(); ++layer) {
          at::Tensor g = out->gates[layer][b].narrow(0, 0, len);
          if (gates[b].size() <= layer) {
            gates[b].push_back(g);
          } else {
            gates[b][layer] = at::cat({gates[b][layer], g});
          }
        }
      }
    }
    for (int64_t b = 0; b < n; ++b) {
      const json& expected =
          FindCase(golden_, ratios[b], prompt_index[b], "prompt");
      const std::string what = GetParam() + " prompt " +
                               std::to_string(prompt_index[b]) + " ratio " +
                               std::to_string(ratios[b]);
      ExpectClose(logits[b], ToTensor(expected["logits"]), what + " logits");
      ASSERT_EQ(gates[b].size(), expected["gates"].size());
      for (size_t layer = 0; layer < gates[b].size(); ++layer) {
        ExpectSameHeads(gates[b][layer], ToTensor(expected["gates"][layer]),
                        what + " layer " + std::to_string(layer));
      }
    }
  }

  json golden_;
  std::unique_ptr<LlamaModel> model_;
};

TEST_P(LlamaGoldenTest, EachPromptAloneMatchesReference) {
  for (const json& r : golden_["ratios"]) {
    for (size_t p = 0; p < golden_["prompts"].size(); ++p) {
      CheckBatch({static_cast<int>(p)}, {r.get<float>()});
    }
  }
}

TEST_P(LlamaGoldenTest, PaddedBatchAtOneRatioMatchesReference) {
  for (const json& r : golden_["ratios"]) {
    const float ratio = r.get<float>();
    CheckBatch({0, 1, 2}, {ratio, ratio, ratio});
  }
}

TEST_P(LlamaGoldenTest, MixedRatiosInOneBatchMatchReference) {
  CheckBatch({0, 1, 2, 1}, {0.5f, 1.0f, 0.0f, 0.75f});
  CheckBatch({2, 0, 1}, {0.75f, 0.0f, 0.5f});
}

TEST_P(LlamaGoldenTest, ChunkedPrefillMatchesReference) {
  CheckBatch({1, 2}, {0.5f, 0.0f}, /*chunks=*/2);
}

TEST_P(LlamaGoldenTest, GreedyContinuationsMatchReference) {
  Generator generator(*model_, nullptr, /*eos_ids=*/{});
  std::vector<GenerationRequest> requests;
  std::vector<const json*> expected;
  for (const json& c : golden_["cases"]) {
    GenerationRequest request;
    request.prompt_ids = Ints(golden_["prompts"][c["prompt"].get<int>()]);
    request.sampling.max_new_tokens = golden_["new_tokens"].get<int>();
    request.ratio = c["ratio"].get<float>();
    requests.push_back(request);
    expected.push_back(&c);
  }
  // All (prompt, ratio) cases in one batch: mixed ratios and lengths.
  auto results = generator.Generate(requests);
  ASSERT_TRUE(results.ok()) << results.status();
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ((*results)[i].token_ids, Ints((*expected[i])["greedy"]))
        << "prompt " << (*expected[i])["prompt"] << " ratio "
        << (*expected[i])["ratio"];
    EXPECT_EQ((*results)[i].finish_reason, FinishReason::kLength);
  }
}

TEST_P(LlamaGoldenTest, EffectiveRatioMatchesReference) {
  for (const json& c : golden_["cases"]) {
    auto prompt = Ints(golden_["prompts"][c["prompt"].get<int>()]);
    KvCache cache = model_->CreateKvCache(1, 64);
    DecoderBatch batch;
    batch.token_ids =
        at::tensor(std::vector<int64_t>(prompt.begin(), prompt.end()))
            .view({1, -1});
    batch.num_tokens = {static_cast<int32_t>(prompt.size())};
    batch.slots = {0};
    batch.start_positions = {0};
    batch.ratios = {c["ratio"].get<float>()};
    auto out = model_->Forward(batch, cache);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_NEAR(EffectiveRatio(out->head_token_counts[0], prompt.size()),
                c["effective_ratio"].get<double>(), 1e-9);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, LlamaGoldenTest,
                         ::testing::Values("llama_qnorm", "llama_learned"));

TEST(LlamaFormatsTest, SafetensorsShardedAndBinGiveIdenticalLogits) {
  at::Tensor reference;
  for (const char* dir :
       {"llama_learned", "llama_learned_sharded", "llama_learned_bin"}) {
    auto model = LlamaModel::Load(kFixtures + "/" + dir,
                                  DeviceOptions{"cpu", "float32"});
    ASSERT_TRUE(model.ok()) << dir << ": " << model.status();
    KvCache cache = (*model)->CreateKvCache(1, 16);
    DecoderBatch batch;
    batch.token_ids = at::arange(1, 9, at::kLong).view({1, 8});
    batch.num_tokens = {8};
    batch.slots = {0};
    batch.start_positions = {0};
    batch.ratios = {0.0f};
    batch.all_logits = true;
    auto out = (*model)->Forward(batch, cache);
    ASSERT_TRUE(out.ok()) << out.status();
    if (!reference.defined()) {
      reference = out->logits;
    } else {
      EXPECT_TRUE(at::equal(reference, out->logits)) << dir;
    }
  }
}

TEST(LlamaConfigTest, ReleasedMohLlama3ConfigGetsQueryNormRouter) {
  auto model = LlamaModel::Load(kFixtures + "/llama_qnorm",
                                DeviceOptions{"cpu", "float32"});
  ASSERT_TRUE(model.ok()) << model.status();
  const MohConfig& moh = (*model)->config().moh;
  EXPECT_EQ(moh.router, RouterKind::kQueryNorm);
  for (const MohLayerConfig& layer : moh.layers) {
    EXPECT_EQ(layer.shared_heads, 4);
    EXPECT_EQ(layer.top_k, 2);
  }
  EXPECT_DOUBLE_EQ(moh.DefaultRatio(), 0.75);
}

// A graph step's rows: 1, 2 and 4, then multiples of 8.
TEST(GraphRowsTest, BucketsTheRows) {
  const std::vector<std::pair<int64_t, int64_t>> cases = {
      {1, 1}, {2, 2},  {3, 4},   {4, 4},   {5, 8},
      {8, 8}, {9, 16}, {37, 40}, {64, 64}, {65, 72}};
  for (const auto& [rows, bucket] : cases) {
    EXPECT_EQ(GraphRows(rows), bucket) << rows;
  }
}

// A shape records on its second step, and only while the model has room
// for another graph.
TEST(GraphRecordingTest, RecordsOnTheSecondStepWhileThereIsRoom) {
  GraphRecording recording;
  EXPECT_FALSE(recording.Step(true));
  EXPECT_FALSE(recording.Step(false));
  EXPECT_FALSE(recording.Step(false));
  EXPECT_TRUE(recording.Step(true));
}

// A recording that ran out of memory is tried again at step 2x, 4x, ... of
// the one that failed; one that failed otherwise never is.
TEST(GraphRecordingTest, OutOfMemoryTriesAgainEverMoreRarely) {
  GraphRecording recording;
  std::vector<int64_t> tries;
  for (int64_t step = 1; step <= 40; ++step) {
    if (!recording.Step(true)) continue;
    tries.push_back(step);
    recording.Failed(absl::ResourceExhaustedError("out of memory: CUDA"));
    EXPECT_FALSE(recording.never());
  }
  EXPECT_EQ(tries, (std::vector<int64_t>{2, 4, 8, 16, 32}));
  EXPECT_EQ(recording.next_try(), 64);

  GraphRecording other;
  other.Step(true);
  ASSERT_TRUE(other.Step(true));
  other.Failed(absl::FailedPreconditionError("capture failed: sync"));
  EXPECT_TRUE(other.never());
  for (int step = 0; step < 100; ++step) EXPECT_FALSE(other.Step(true));
}

// A graph step runs with its rows padded by copies of its first (PadRows),
// which write what the first writes. Decode steps of 5 rows (padded to 8)
// at mixed ratios, with reduced logits (each row's best, a row whole, row
// stats), give the 5 rows and the cache what the same steps give unpadded,
// on both routers' fixtures; and PadRows copies every per-row field.
TEST(GraphRowsTest, CopiesOfTheFirstRowChangeNoOtherRow) {
  for (const std::string fixture : {"llama_learned", "llama_qnorm"}) {
    SCOPED_TRACE(fixture);
    const auto models = LoadEach(kFixtures + "/" + fixture,
                                 {{"cpu", "float32"}, {"cpu", "float32"}});
    ASSERT_EQ(models.size(), 2u);
    models[0]->set_graph_rows_everywhere(true);
    std::vector<KvCache> caches = {models[0]->CreateKvCache(24, 8),
                                   models[1]->CreateKvCache(24, 8)};
    at::manual_seed(21);
    DecoderBatch batch;
    batch.token_ids = at::randint(300, {5, 9}, at::kLong);
    batch.num_tokens = {9, 4, 6, 2, 7};
    batch.start_positions = {0, 0, 0, 0, 0};
    for (int32_t r = 0; r < 5; ++r) {
      batch.block_tables.push_back({4 * r, 4 * r + 1, 4 * r + 2, 4 * r + 3});
    }
    batch.ratios = {1.0f, 0.5f, 0.75f, 0.5f, 1.0f};
    for (int step = 0; step < 6; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      auto a = models[0]->Forward(batch, caches[0]);
      auto b = models[1]->Forward(batch, caches[1]);
      ASSERT_TRUE(a.ok()) << a.status();
      ASSERT_TRUE(b.ok()) << b.status();
      auto near = [](const at::Tensor& got, const at::Tensor& want,
                     const char* what) {
        ASSERT_EQ(got.sizes(), want.sizes()) << what;
        EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-5)) << what;
      };
      near(a->logits, b->logits, "logits");
      EXPECT_TRUE(at::equal(a->head_token_counts, b->head_token_counts));
      if (step > 0) {
        near(a->top_values, b->top_values, "top values");
        EXPECT_TRUE(at::equal(a->top_ids, b->top_ids));
        near(a->row_stats, b->row_stats, "row stats");
        near(a->resident_logits, b->resident_logits, "resident logits");
      }
      NextTokenEach(batch);
      batch.top_logits = 4;
      batch.top_logits_limit = 320;
      batch.whole_logits = {false, true, false, false, false};
      batch.row_reductions = {RowReduction{}, RowReduction{0.7f},
                              RowReduction{}, RowReduction{1.3f},
                              RowReduction{}};
    }
    for (int64_t l = 0; l < models[0]->config().num_layers; ++l) {
      EXPECT_TRUE(
          at::allclose(caches[0].keys(l), caches[1].keys(l), 1e-5, 1e-5));
      EXPECT_TRUE(
          at::allclose(caches[0].values(l), caches[1].values(l), 1e-5, 1e-5));
    }
    const DecoderBatch padded = PadRows(batch, 8);
    EXPECT_EQ(padded.token_ids.size(0), 8);
    EXPECT_TRUE(at::equal(padded.token_ids.narrow(0, 5, 3),
                          batch.token_ids.narrow(0, 0, 1).expand({3, 1})));
    EXPECT_EQ(padded.block_tables[7], batch.block_tables[0]);
    EXPECT_EQ(padded.start_positions[6], batch.start_positions[0]);
    EXPECT_EQ(padded.ratios[5], batch.ratios[0]);
    EXPECT_EQ(padded.row_reductions.size(), 8u);
    EXPECT_EQ(padded.whole_logits,
              (std::vector<bool>{false, true, false, false, false, false, false,
                                 false}));
  }
}

TEST(LlamaForwardTest, RejectsBadBatchesWithoutTouchingTheCache) {
  auto model = LlamaModel::Load(kFixtures + "/llama_learned",
                                DeviceOptions{"cpu", "float32"});
  ASSERT_TRUE(model.ok()) << model.status();
  KvCache cache = (*model)->CreateKvCache(2, 16);
  auto make = [] {
    DecoderBatch b;
    b.token_ids = at::ones({1, 4}, at::kLong);
    b.num_tokens = {4};
    b.slots = {0};
    b.start_positions = {0};
    b.ratios = {0.0f};
    return b;
  };
  struct Case {
    std::function<void(DecoderBatch&)> mutate;
    std::string message;
  } cases[] = {
      {[](DecoderBatch& b) { b.token_ids[0][1] = 320; },
       "token_ids must be in [0, 320)"},
      {[](DecoderBatch& b) { b.token_ids[0][1] = -1; },
       "token_ids must be in [0, 320)"},
      {[](DecoderBatch& b) { b.num_tokens = {5}; },
       "num_tokens[0] must be in [1, 4]"},
      {[](DecoderBatch& b) { b.slots = {2}; }, "slots[0] must be in [0, 2)"},
      {[](DecoderBatch& b) { b.start_positions = {13}; },
       "must lie in [0, 16)"},
      {[](DecoderBatch& b) { b.ratios = {std::nanf("")}; },
       "ratios[0] must be in (0, 1]"},
      {[](DecoderBatch& b) { b.ratios = {1.5f}; },
       "ratios[0] must be in (0, 1]"},
      {[](DecoderBatch& b) { b.ratios = {}; }, "one entry per row"},
      {[](DecoderBatch& b) {
         b.block_tables = {{0, 1}, {1}};
       },
       "one entry per row"},
      {[](DecoderBatch& b) { b.block_tables = {{2}}; },
       "block_tables[0][0] must be in [0, 2)"},
      {[](DecoderBatch& b) { b.block_tables = {{}}; },
       "must lie in [0, 0) (its block table)"},
      {[](DecoderBatch& b) {
         b.token_ids = at::ones({2, 4}, at::kLong);
         b.num_tokens = {4, 4};
         b.start_positions = {0, 12};
         b.ratios = {0.0f, 0.0f};
         b.block_tables = {{1}, {1}};  // both write block 1
       },
       "rows 0 and 1 both write block 1"},
  };
  for (auto& c : cases) {
    DecoderBatch batch = make();
    c.mutate(batch);
    auto out = (*model)->Forward(batch, cache);
    ASSERT_FALSE(out.ok()) << c.message;
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(out.status().message()),
                ::testing::HasSubstr(c.message));
  }
  EXPECT_EQ(cache.keys(0).abs().sum().item<float>(), 0.0f);
}

class VitGoldenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    golden_ = ReadGolden("vit_learned");
    auto model = VitModel::Load(kFixtures + "/vit_learned",
                                DeviceOptions{"cpu", "float32"});
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
  }
  void CheckBatch(const std::vector<int>& images,
                  const std::vector<float>& ratios) {
    std::vector<at::Tensor> pixels;
    for (int i : images) pixels.push_back(ToTensor(golden_["images"][i]));
    auto out =
        model_->Forward(at::stack(pixels), ratios, /*record_gates=*/true);
    ASSERT_TRUE(out.ok()) << out.status();
    for (size_t b = 0; b < images.size(); ++b) {
      const json& expected = FindCase(golden_, ratios[b], images[b], "image");
      const std::string what = "image " + std::to_string(images[b]) +
                               " ratio " + std::to_string(ratios[b]);
      ExpectClose(out->logits[b], ToTensor(expected["logits"]),
                  what + " logits");
      for (size_t layer = 0; layer < out->gates.size(); ++layer) {
        ExpectSameHeads(out->gates[layer][b],
                        ToTensor(expected["gates"][layer]),
                        what + " layer " + std::to_string(layer));
      }
      const int64_t tokens = 1 + model_->config().num_patches();
      EXPECT_NEAR(EffectiveRatio(out->head_token_counts[b], tokens),
                  expected["effective_ratio"].get<double>(), 1e-9)
          << what;
    }
  }
  json golden_;
  std::unique_ptr<VitModel> model_;
};

TEST_F(VitGoldenTest, EachRatioMatchesReference) {
  for (const json& r : golden_["ratios"]) {
    const float ratio = r.get<float>();
    CheckBatch({0, 1, 2}, {ratio, ratio, ratio});
    CheckBatch({1}, {ratio});
  }
}

TEST_F(VitGoldenTest, MixedRatiosInOneBatchMatchReference) {
  CheckBatch({0, 1, 2, 0}, {0.5f, 1.0f, 0.0f, 0.75f});
}

TEST_F(VitGoldenTest, RejectsWrongPixelShape) {
  auto out = model_->Forward(at::zeros({1, 3, 8, 8}), {0.0f});
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(std::string(out.status().message()),
              ::testing::HasSubstr("pixels must have shape [B, 3, 16, 16]"));
}

}  // namespace
}  // namespace moh

namespace moh {
namespace {

// The bf16 path (the default on CUDA) runs on CPU too: close to fp32.
TEST(LlamaDtypeTest, BFloat16StaysCloseToFloat32) {
  at::Tensor logits[2];
  const char* dtypes[] = {"float32", "bfloat16"};
  for (int i = 0; i < 2; ++i) {
    auto model = LlamaModel::Load(kFixtures + "/llama_qnorm",
                                  DeviceOptions{"cpu", dtypes[i]});
    ASSERT_TRUE(model.ok()) << model.status();
    KvCache cache = (*model)->CreateKvCache(1, 16);
    EXPECT_EQ(cache.keys(0).scalar_type(), i == 0 ? at::kFloat : at::kBFloat16);
    DecoderBatch batch;
    batch.token_ids = at::arange(3, 11, at::kLong).view({1, 8});
    batch.num_tokens = {8};
    batch.slots = {0};
    batch.start_positions = {0};
    batch.ratios = {0.0f};
    auto out = (*model)->Forward(batch, cache);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->logits.scalar_type(), at::kFloat);
    logits[i] = out->logits;
  }
  const double scale = logits[0].abs().max().item<double>();
  EXPECT_LE((logits[1] - logits[0]).abs().max().item<double>(), 0.1 * scale);
}

// A prefill of rows of `num_tokens` random ids (right-padded) into `slots`,
// at `ratios`.
DecoderBatch RaggedPrefill(std::vector<int32_t> num_tokens,
                           std::vector<int32_t> slots,
                           std::vector<float> ratios) {
  const int64_t rows = static_cast<int64_t>(num_tokens.size());
  DecoderBatch batch;
  batch.token_ids = at::randint(
      300, {rows, *std::max_element(num_tokens.begin(), num_tokens.end())},
      at::kLong);
  batch.num_tokens = std::move(num_tokens);
  batch.slots = std::move(slots);
  batch.start_positions.assign(rows, 0);
  batch.ratios = std::move(ratios);
  return batch;
}

// The ATen path CUDA runs (bfloat16, dense attention; here on the CPU)
// over prefill rows of different widths, then decode steps (rows without
// padding): it routes as float32 does (llama_qnorm's top-k margins are
// far above bf16 rounding) and its logits stay within 5%.
TEST(LlamaDtypeTest, BFloat16DenseStepsFollowFloat32) {
  auto bf16 = LlamaModel::Load(kFixtures + "/llama_qnorm",
                               DeviceOptions{"cpu", "bfloat16"});
  auto fp32 = LlamaModel::Load(kFixtures + "/llama_qnorm",
                               DeviceOptions{"cpu", "float32"});
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  (*bf16)->set_attention_mode(AttentionMode::kDense);
  KvCache bf16_cache = (*bf16)->CreateKvCache(3, 16);
  KvCache fp32_cache = (*fp32)->CreateKvCache(3, 16);
  at::manual_seed(4);
  DecoderBatch batch = RaggedPrefill({6, 3, 1}, {2, 0, 1}, {0.5f, 1.0f, 0.75f});
  for (int step = 0; step < 6; ++step) {
    auto a = (*bf16)->Forward(batch, bf16_cache);
    auto b = (*fp32)->Forward(batch, fp32_cache);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    const std::string what = "step " + std::to_string(step);
    EXPECT_TRUE(at::equal(a->head_token_counts, b->head_token_counts)) << what;
    ASSERT_FALSE(at::isnan(a->logits).any().item<bool>()) << what;
    const double scale = b->logits.abs().max().item<double>();
    EXPECT_LE((a->logits - b->logits).abs().max().item<double>(), 0.05 * scale)
        << what;
    NextTokenEach(batch);
  }
}

// Dense attention (CUDA's path) with every row at K = 0 reads only the KV
// groups of the shared heads: the routed groups' cache entries, NaN here,
// never reach the logits, which equal the pair kernel's (which reads only
// the selected heads' groups) over a prefill of ragged rows and decode steps.
TEST(DenseSharedHeadsTest, KZeroReadsOnlyTheSharedKvGroups) {
  for (const std::string fixture : {"llama_qnorm", "llama_learned"}) {
    auto dense = LlamaModel::Load(kFixtures + "/" + fixture,
                                  DeviceOptions{"cpu", "float32"});
    auto pairs = LlamaModel::Load(kFixtures + "/" + fixture,
                                  DeviceOptions{"cpu", "float32"});
    ASSERT_TRUE(dense.ok()) << dense.status();
    ASSERT_TRUE(pairs.ok()) << pairs.status();
    (*dense)->set_attention_mode(AttentionMode::kDense);
    const LlamaConfig& config = (*dense)->config();
    const int64_t group = config.num_heads / config.num_kv_heads;
    const int64_t shared_kv = config.moh.layers[0].shared_heads / group;
    ASSERT_GT(shared_kv, 0) << fixture;
    ASSERT_LT(shared_kv, config.num_kv_heads) << fixture;
    KvCache caches[2] = {(*dense)->CreateKvCache(3, 32),
                         (*pairs)->CreateKvCache(3, 32)};
    at::manual_seed(6);
    // K = 0 in every layer.
    DecoderBatch batch =
        RaggedPrefill({5, 3, 1}, {1, 2, 0}, {0.1f, 0.1f, 0.1f});
    for (int step = 0; step < 4; ++step) {
      const std::string what = fixture + " step " + std::to_string(step);
      if (step > 0) {  // the routed KV groups of what is cached: NaN
        for (KvCache& cache : caches) {
          for (int64_t l = 0; l < config.num_layers; ++l) {
            cache.keys(l)
                .narrow(2, shared_kv, config.num_kv_heads - shared_kv)
                .fill_(std::numeric_limits<float>::quiet_NaN());
            cache.values(l)
                .narrow(2, shared_kv, config.num_kv_heads - shared_kv)
                .fill_(std::numeric_limits<float>::quiet_NaN());
          }
        }
      }
      auto a = (*dense)->Forward(batch, caches[0]);
      auto b = (*pairs)->Forward(batch, caches[1]);
      ASSERT_TRUE(a.ok()) << a.status();
      ASSERT_TRUE(b.ok()) << b.status();
      ASSERT_FALSE(at::isnan(a->logits).any().item<bool>()) << what;
      ASSERT_FALSE(at::isnan(b->logits).any().item<bool>()) << what;
      const double scale = std::max(1.0, b->logits.abs().max().item<double>());
      EXPECT_LE((a->logits - b->logits).abs().max().item<double>(),
                1e-4 * scale)
          << what;
      EXPECT_TRUE(at::equal(a->head_token_counts, b->head_token_counts))
          << what;
      NextTokenEach(batch);
    }
  }
}

TEST(DeviceOptionsTest, RejectsUnknownDevicesAndDtypes) {
  auto fp16 = ResolveTensorOptions(DeviceOptions{"cpu", "float16"});
  ASSERT_FALSE(fp16.ok());
  EXPECT_THAT(std::string(fp16.status().message()),
              ::testing::HasSubstr("needs a CUDA device"));
  auto tpu = ResolveTensorOptions(DeviceOptions{"tpu", "auto"});
  ASSERT_FALSE(tpu.ok());
  EXPECT_THAT(std::string(tpu.status().message()),
              ::testing::HasSubstr("device must be"));
  auto f64 = ResolveTensorOptions(DeviceOptions{"cpu", "float64"});
  ASSERT_FALSE(f64.ok());
  EXPECT_THAT(std::string(f64.status().message()),
              ::testing::HasSubstr("dtype must be"));
  if (!at::hasCUDA()) {
    auto cuda = ResolveTensorOptions(DeviceOptions{"cuda", "auto"});
    ASSERT_FALSE(cuda.ok());
    EXPECT_EQ(cuda.status().code(), absl::StatusCode::kFailedPrecondition);
    auto automatic = ResolveTensorOptions(DeviceOptions{"auto", "auto"});
    ASSERT_TRUE(automatic.ok());
    EXPECT_EQ(automatic->device().type(), at::kCPU);
    EXPECT_EQ(at::typeMetaToScalarType(automatic->dtype()), at::kFloat);
  }
}

}  // namespace
}  // namespace moh

namespace moh {
namespace {

// Head-sparse execution (only selected (token, head) pairs) equals the dense
// computation of every head, for prefill and decode, mixed ratios, both
// routers: the CPU pair kernel, the ATen pair path and kAuto (the kernel even
// where every head is used).
constexpr AttentionMode kPairModes[] = {AttentionMode::kHeadSparse,
                                        AttentionMode::kHeadSparseAten,
                                        AttentionMode::kAuto};

class HeadSparseTest : public ::testing::TestWithParam<std::string> {};

// Four rows at mixed ratios and lengths: a prefill step, then three decode
// steps, in `mode`; the outputs of every step.
constexpr int32_t kMixedLengths[] = {7, 3, 5, 1};

// With `paged`, the cache has blocks of 4 positions and each row's blocks
// are scattered out of order (row 3's adjacent: one run for the pair kernel).
std::vector<DecoderOutput> MixedSteps(LlamaModel& model, AttentionMode mode,
                                      bool paged = false) {
  model.set_attention_mode(mode);
  KvCache cache =
      paged ? model.CreateKvCache(40, 4) : model.CreateKvCache(4, 32);
  at::manual_seed(3);
  at::Tensor prompt = at::randint(300, {4, 7}, at::kLong);
  const std::vector<int32_t> lengths(std::begin(kMixedLengths),
                                     std::end(kMixedLengths));
  std::vector<int32_t> start(4, 0);
  std::vector<DecoderOutput> outputs;
  for (int step = 0; step < 4; ++step) {
    DecoderBatch batch;
    batch.all_logits = true;
    batch.token_ids = step == 0 ? prompt : at::randint(300, {4, 1}, at::kLong);
    batch.num_tokens = step == 0 ? lengths : std::vector<int32_t>(4, 1);
    if (paged) {
      batch.block_tables = {
          {39, 20, 3}, {38, 22, 8}, {37, 24, 13}, {10, 11, 12}};
    } else {
      batch.slots = {3, 0, 2, 1};
    }
    batch.start_positions = start;
    batch.ratios = {0.5f, 0.0f, 1.0f, 0.75f};
    auto out = model.Forward(batch, cache);
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return outputs;
    outputs.push_back(*out);
    for (int b = 0; b < 4; ++b) start[b] += batch.num_tokens[b];
  }
  return outputs;
}

// Every step's real logits of `got` within `tolerance` x max(1, |want|) of
// `want`, and the same heads computed.
void ExpectSameSteps(const std::vector<DecoderOutput>& want,
                     const std::vector<DecoderOutput>& got, double tolerance,
                     const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  for (size_t step = 0; step < want.size(); ++step) {
    EXPECT_TRUE(
        at::equal(want[step].head_token_counts, got[step].head_token_counts))
        << what << " step " << step;
    for (int b = 0; b < 4; ++b) {
      const int64_t len = step == 0 ? kMixedLengths[b] : 1;
      at::Tensor w = want[step].logits[b].narrow(0, 0, len);
      at::Tensor g = got[step].logits[b].narrow(0, 0, len);
      const double scale = std::max(1.0, w.abs().max().item<double>());
      EXPECT_LE((w - g).abs().max().item<double>(), tolerance * scale)
          << what << " step " << step << " row " << b;
    }
  }
}

TEST_P(HeadSparseTest, MatchesDenseForPrefillAndDecode) {
  auto model = LlamaModel::Load(kFixtures + "/" + GetParam(),
                                DeviceOptions{"cpu", "float32"});
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<DecoderOutput> dense =
      MixedSteps(**model, AttentionMode::kDense);
  for (int mode = 0; mode < 3; ++mode) {
    ExpectSameSteps(dense, MixedSteps(**model, kPairModes[mode]), 1e-4,
                    "mode " + std::to_string(mode));
  }
}

// A bfloat16 KV cache: half the bytes; every attention path (dense, the pair
// kernel widening it item by item or, for decode items, row by row as its
// products load them, the ATen pair path) reads the same
// rounded keys and values, so they agree as closely as with float32; and the
// rounding moves the logits little from the float32 cache's.
TEST_P(HeadSparseTest, BFloat16KvCacheAgreesOnEveryPath) {
  auto model = LlamaModel::Load(kFixtures + "/" + GetParam(),
                                DeviceOptions{"cpu", "float32"});
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<DecoderOutput> f32 =
      MixedSteps(**model, AttentionMode::kDense);
  const int64_t f32_bytes = (*model)->CreateKvCache(4, 32).total_bytes();
  ASSERT_TRUE((*model)->set_kv_cache_dtype(at::kBFloat16).ok());
  KvCache cache = (*model)->CreateKvCache(4, 32);
  EXPECT_EQ(cache.keys(0).scalar_type(), at::kBFloat16);
  EXPECT_EQ(cache.total_bytes() * 2, f32_bytes);
  const std::vector<DecoderOutput> dense =
      MixedSteps(**model, AttentionMode::kDense);
  ExpectSameSteps(f32, dense, 2e-2, "bf16 cache vs f32 cache");
  for (int mode = 0; mode < 3; ++mode) {
    ExpectSameSteps(dense, MixedSteps(**model, kPairModes[mode]), 1e-4,
                    "bf16 cache, mode " + std::to_string(mode));
  }
}

// A paged cache (blocks scattered, read in several runs) gives what slots
// give, on every attention path, in float32 and bfloat16.
TEST_P(HeadSparseTest, PagedCacheEqualsSlots) {
  auto model = LlamaModel::Load(kFixtures + "/" + GetParam(),
                                DeviceOptions{"cpu", "float32"});
  ASSERT_TRUE(model.ok()) << model.status();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    ASSERT_TRUE((*model)->set_kv_cache_dtype(dtype).ok());
    for (AttentionMode mode :
         {AttentionMode::kDense, AttentionMode::kHeadSparse,
          AttentionMode::kHeadSparseAten, AttentionMode::kAuto}) {
      ExpectSameSteps(MixedSteps(**model, mode),
                      MixedSteps(**model, mode, /*paged=*/true), 1e-5,
                      std::string(c10::toString(dtype)) + " mode " +
                          std::to_string(static_cast<int>(mode)));
    }
  }
}

// Rows continue a prompt prefix that another row computed, reading its
// blocks without writing them: their logits equal computing the whole
// sequence alone, at the ratio the prefix was computed at.
TEST_P(HeadSparseTest, RowsReadAPrefixAnotherRowComputed) {
  auto model = LlamaModel::Load(kFixtures + "/" + GetParam(),
                                DeviceOptions{"cpu", "float32"});
  ASSERT_TRUE(model.ok()) << model.status();
  at::manual_seed(5);
  const at::Tensor prefix = at::randint(300, {1, 8}, at::kLong);
  const at::Tensor tails = at::randint(300, {2, 3}, at::kLong);
  for (AttentionMode mode : {AttentionMode::kDense, AttentionMode::kAuto}) {
    (*model)->set_attention_mode(mode);
    KvCache paged = (*model)->CreateKvCache(16, 4);
    DecoderBatch first;
    first.token_ids = prefix;
    first.num_tokens = {8};
    first.block_tables = {{5, 2}};
    first.start_positions = {0};
    first.ratios = {0.5f};
    ASSERT_TRUE((*model)->Forward(first, paged).ok());
    DecoderBatch rest;
    rest.all_logits = true;
    rest.token_ids = tails;
    rest.num_tokens = {3, 3};
    rest.block_tables = {{5, 2, 7}, {5, 2, 9}};
    rest.start_positions = {8, 8};
    rest.ratios = {0.5f, 0.5f};
    auto got = (*model)->Forward(rest, paged);
    ASSERT_TRUE(got.ok()) << got.status();

    KvCache slots = (*model)->CreateKvCache(2, 16);
    DecoderBatch whole;
    whole.all_logits = true;
    whole.token_ids = at::cat({prefix.expand({2, 8}), tails}, 1);
    whole.num_tokens = {11, 11};
    whole.slots = {0, 1};
    whole.start_positions = {0, 0};
    whole.ratios = {0.5f, 0.5f};
    auto want = (*model)->Forward(whole, slots);
    ASSERT_TRUE(want.ok()) << want.status();
    const at::Tensor w = want->logits.narrow(1, 8, 3);
    EXPECT_LE((w - got->logits).abs().max().item<double>(),
              1e-4 * std::max(1.0, w.abs().max().item<double>()))
        << "mode " << static_cast<int>(mode);
  }
}

// Why a prompt's KV blocks are shared only between requests at the same
// activation: keys of the first layer depend on the tokens alone, but every
// later layer's depend on the heads earlier layers routed (the residual
// stream), so a prefix computed at ratio 1.0 is not the one ratio 0.5 would
// compute.
TEST(PrefixSharingTest, KeysBeyondTheFirstLayerDependOnTheRatio) {
  auto model = LlamaModel::Load(kFixtures + "/llama_learned",
                                DeviceOptions{"cpu", "float32"});
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_GE((*model)->config().num_layers, 2);
  at::manual_seed(6);
  const at::Tensor prompt = at::randint(300, {1, 12}, at::kLong);
  std::vector<KvCache> caches;
  for (float ratio : {0.5f, 1.0f}) {
    caches.push_back((*model)->CreateKvCache(1, 16));
    DecoderBatch batch;
    batch.token_ids = prompt;
    batch.num_tokens = {12};
    batch.slots = {0};
    batch.start_positions = {0};
    batch.ratios = {ratio};
    ASSERT_TRUE((*model)->Forward(batch, caches.back()).ok());
  }
  EXPECT_TRUE(at::allclose(caches[0].keys(0), caches[1].keys(0)));
  EXPECT_GT((caches[0].keys(1) - caches[1].keys(1)).abs().max().item<float>(),
            1e-3);
}

TEST(KvCacheDtypeTest, Float16NeedsCudaAndAutoIsTheModels) {
  auto model = LlamaModel::Load(kFixtures + "/llama_learned",
                                DeviceOptions{"cpu", "float32"});
  ASSERT_TRUE(model.ok()) << model.status();
  absl::Status fp16 = (*model)->set_kv_cache_dtype(at::kHalf);
  EXPECT_EQ(fp16.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(fp16.message()),
              ::testing::HasSubstr("needs a CUDA device"));
  auto automatic = ResolveKvCacheDtype("auto", (*model)->options());
  ASSERT_TRUE(automatic.ok());
  EXPECT_EQ(*automatic, at::kFloat);
  auto bad = ResolveKvCacheDtype("int8", (*model)->options(),
                                 "generation.kv_cache_dtype");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              ::testing::HasSubstr("generation.kv_cache_dtype must be"));
}

// A long prompt in chunks (several query blocks per head, causal key blocks
// skipped) next to a decoding row: the pair kernel equals dense.
TEST(HeadSparseKernelTest, LongChunkedPromptMatchesDense) {
  auto model = LlamaModel::Load(kFixtures + "/llama_learned",
                                DeviceOptions{"cpu", "float32"});
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<at::Tensor> logits[2];
  for (int mode = 0; mode < 2; ++mode) {
    (*model)->set_attention_mode(mode == 0 ? AttentionMode::kDense
                                           : AttentionMode::kHeadSparse);
    auto out = ChunkedPromptBesideDecode(**model, {0.5f, 0.75f});
    ASSERT_TRUE(out.ok()) << out.status();
    logits[mode] = *out;
  }
  for (size_t i = 0; i < logits[0].size(); ++i) {
    const at::Tensor& d = logits[0][i];
    const double scale = std::max(1.0, d.abs().max().item<double>());
    EXPECT_LE((d - logits[1][i]).abs().max().item<double>(), 1e-4 * scale)
        << "chunk " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HeadSparseTest,
                         ::testing::Values("llama_qnorm", "llama_learned"));

}  // namespace
}  // namespace moh

namespace moh {
namespace {

TEST(VitHeadSparseTest, MatchesDenseOnMixedRatios) {
  auto model = VitModel::Load(kFixtures + "/vit_learned",
                              DeviceOptions{"cpu", "float32"});
  ASSERT_TRUE(model.ok()) << model.status();
  at::manual_seed(5);
  at::Tensor pixels = at::randn({4, 3, 16, 16});
  const std::vector<float> ratios = {0.5f, 0.0f, 1.0f, 0.75f};
  (*model)->set_attention_mode(AttentionMode::kDense);
  auto dense = (*model)->Forward(pixels, ratios);
  ASSERT_TRUE(dense.ok());
  const double scale = std::max(1.0, dense->logits.abs().max().item<double>());
  for (AttentionMode mode : kPairModes) {
    (*model)->set_attention_mode(mode);
    auto sparse = (*model)->Forward(pixels, ratios);
    ASSERT_TRUE(sparse.ok());
    EXPECT_TRUE(at::equal(dense->head_token_counts, sparse->head_token_counts));
    EXPECT_LE((dense->logits - sparse->logits).abs().max().item<double>(),
              1e-4 * scale)
        << "mode " << static_cast<int>(mode);
  }
}

}  // namespace
}  // namespace moh
