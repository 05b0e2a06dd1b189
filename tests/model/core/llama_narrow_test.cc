// The ratio ceiling in the model: rows stored narrow (DecoderBatch::narrow,
// only the shared heads' KV heads, in blocks holding narrow_fold() times
// their positions) give the logits the same rows give stored wide, in mixed
// batches, with blocks shared between rows, rows at different lengths and
// prompt chunks, in every attention mode and cache type; the routed KV
// heads' projections are never computed for them.
#include <gtest/gtest.h>

#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "model/checkpoint/checkpoint.h"
#include "model/core/llama_model.h"
#include "tests/model/core/llama_test_util.h"

namespace moh {
namespace {

TEST(NarrowKvHeadsTest, SharedHeadsAlignedToKvGroups) {
  EXPECT_EQ(NarrowKvHeads(NarrowConfig(8, 4, {4, 4})), 2);  // w = 2, fold 2
  EXPECT_EQ(NarrowKvHeads(NarrowConfig(8, 4, {2, 2})), 1);  // fold 4
  EXPECT_EQ(NarrowKvHeads(NarrowConfig(32, 8, {16})), 4);   // MoH-LLaMA3-8B
  EXPECT_EQ(NarrowKvHeads(NarrowConfig(8, 8, {4, 4})), 4);  // no GQA
  EXPECT_EQ(NarrowKvHeads(NarrowConfig(8, 4, {2, 4})), 2);  // the widest layer
  EXPECT_EQ(NarrowKvHeads(NarrowConfig(8, 4, {3, 3})), 0);  // inside a group
  EXPECT_EQ(NarrowKvHeads(NarrowConfig(8, 4, {6, 6})), 0);  // 4 % 3 != 0
  EXPECT_EQ(NarrowKvHeads(NarrowConfig(8, 4, {4, 8})), 0);  // a dense layer
  LlamaConfig dense = NarrowConfig(8, 4, {4, 4});
  dense.moh.layers.clear();
  EXPECT_EQ(NarrowKvHeads(dense), 0);
}

// Row r of a scenario: its tokens and when it runs.
struct Scenario {
  LlamaModel& model;
  std::vector<bool> narrow;  // per row: A, B, C, D
  AttentionMode mode;
};

// Four rows over a paged cache of blocks of 4 positions (a narrow row's
// hold 4 * fold): A a 13-token prompt in chunks of 5 and 8, then decodes;
// B (always wide, every head) a 3-token prompt, then decodes; C (K = 0) a
// 6-token prompt, then decodes; D (K = 0) joins at step 3 reading
// A's first 8 positions from A's blocks (a shared prefix) and prefills 6
// more. Returns every valid position's logits, step by step.
std::vector<at::Tensor> RunScenario(const Scenario& s,
                                    at::ScalarType cache_type) {
  LlamaModel& model = s.model;
  model.set_attention_mode(s.mode);
  EXPECT_TRUE(model.set_kv_cache_dtype(cache_type).ok());
  at::manual_seed(17);
  const at::Tensor tokens = at::randint(64, {4, 24}, at::kLong);
  const int64_t fold = model.narrow_fold();
  KvCache cache = model.CreateKvCache(64, 4);
  int32_t next_block = 0;
  std::vector<std::vector<int32_t>> tables(4);
  auto span = [&](int r) { return s.narrow[r] ? 4 * fold : 4; };
  auto cover = [&](int r, int64_t positions) {
    while (int64_t(tables[r].size()) * span(r) < positions) {
      tables[r].push_back(next_block++);
    }
  };
  // D shares A's blocks holding positions [0, 8): one block narrow at fold
  // 2, two wide (D and A are both narrow or both wide). At fold 4 a block
  // holds 16 positions, more than A's prompt: D stays out.
  const bool with_d = 8 % (4 * fold) == 0;
  std::vector<int32_t> start(4, 0);
  const std::vector<std::vector<int32_t>> steps = {{5, 3, 6, 0},
                                                   {8, 1, 1, 0},
                                                   {1, 1, 1, with_d ? 6 : 0},
                                                   {1, 1, 1, with_d ? 1 : 0},
                                                   {1, 1, 1, with_d ? 1 : 0}};
  // A, C and D at the ratio of the shared heads alone (K = 0: 0.5 at
  // S = 4 of 8), B at 1.0.
  const float low =
      static_cast<float>(model.config().moh.layers[0].shared_heads) /
      static_cast<float>(model.config().num_heads);
  const std::vector<float> ratio = {low, 1.0f, low, low};
  std::vector<at::Tensor> logits;
  for (size_t step = 0; step < steps.size(); ++step) {
    if (step == 2 && with_d) {
      tables[3].assign(tables[0].begin(), tables[0].begin() + 8 / span(0));
      start[3] = 8;
    }
    std::vector<int> rows;
    for (int r = 0; r < 4; ++r) {
      if (steps[step][r] > 0) rows.push_back(r);
    }
    DecoderBatch batch;
    batch.all_logits = true;
    int64_t width = 0;
    for (int r : rows) width = std::max<int64_t>(width, steps[step][r]);
    batch.token_ids = at::zeros({int64_t(rows.size()), width}, at::kLong);
    for (size_t b = 0; b < rows.size(); ++b) {
      const int r = rows[b];
      const int32_t n = steps[step][r];
      // D's first 8 positions are A's (read from A's blocks).
      batch.token_ids[b].narrow(0, 0, n).copy_(
          tokens[r].narrow(0, start[r], n));
      cover(r, start[r] + n);
      batch.num_tokens.push_back(n);
      batch.block_tables.push_back(tables[r]);
      batch.start_positions.push_back(start[r]);
      batch.ratios.push_back(ratio[r]);
      batch.narrow.push_back(s.narrow[r]);
    }
    auto out = model.Forward(batch, cache);
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return {};
    for (size_t b = 0; b < rows.size(); ++b) {
      logits.push_back(out->logits[b].narrow(0, 0, steps[step][rows[b]]));
      start[rows[b]] += steps[step][rows[b]];
    }
  }
  return logits;
}

void ExpectSameLogits(const std::vector<at::Tensor>& got,
                      const std::vector<at::Tensor>& want, double tolerance) {
  ASSERT_EQ(got.size(), want.size());
  ASSERT_FALSE(got.empty());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(at::isfinite(got[i]).all().item<bool>()) << "logits " << i;
    const double diff = (got[i] - want[i]).abs().max().item<double>();
    EXPECT_LE(diff, tolerance) << "logits " << i;
  }
}

struct ModeCase {
  AttentionMode mode;
  at::ScalarType cache;
};

class NarrowRowsTest : public testing::TestWithParam<ModeCase> {};

// A, C and D narrow (C: ratio 0.5 too; B wide beside them), and A and D
// narrow with C wide at K = 0: the logits of the same rows stored wide.
TEST_P(NarrowRowsTest, EqualTheSameRowsStoredWide) {
  for (const std::vector<int32_t>& shared :
       {std::vector<int32_t>{4, 4}, std::vector<int32_t>{2, 2}}) {
    std::unique_ptr<LlamaModel> model =
        NarrowRandomModel(NarrowConfig(8, 4, shared));
    ASSERT_NE(model, nullptr);
    ASSERT_GT(model->narrow_kv_heads(), 0);
    const std::vector<at::Tensor> wide =
        RunScenario({*model, {false, false, false, false}, GetParam().mode},
                    GetParam().cache);
    for (const std::vector<bool>& narrow :
         {std::vector<bool>{true, false, true, true},
          std::vector<bool>{true, false, false, true}}) {
      SCOPED_TRACE(testing::Message()
                   << "S " << shared[0] << " C narrow " << narrow[2]);
      ExpectSameLogits(
          RunScenario({*model, narrow, GetParam().mode}, GetParam().cache),
          wide, 2e-4);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Modes, NarrowRowsTest,
    testing::Values(ModeCase{AttentionMode::kAuto, at::kFloat},
                    ModeCase{AttentionMode::kAuto, at::kBFloat16},
                    ModeCase{AttentionMode::kDense, at::kFloat},
                    ModeCase{AttentionMode::kHeadSparseAten, at::kFloat},
                    ModeCase{AttentionMode::kHeadSparseAten, at::kBFloat16}));

// With the routed KV heads' projection rows NaN, narrow rows still give
// finite logits equal to the clean model's: those rows are never computed
// for them (nor read).
TEST(NarrowKvTest, NeverComputeTheRoutedKvProjections) {
  const LlamaConfig config = NarrowConfig(8, 4, {4, 4});
  std::unique_ptr<LlamaModel> clean = NarrowRandomModel(config);
  std::unique_ptr<LlamaModel> poisoned = NarrowRandomModel(config, true);
  ASSERT_NE(clean, nullptr);
  ASSERT_NE(poisoned, nullptr);
  // Every row narrow but B, which reads every head: B leaves out.
  for (const AttentionMode mode :
       {AttentionMode::kAuto, AttentionMode::kDense}) {
    std::vector<at::Tensor> want =
        RunScenario({*clean, {false, false, false, false}, mode}, at::kFloat);
    std::vector<at::Tensor> got =
        RunScenario({*poisoned, {true, false, true, true}, mode}, at::kFloat);
    ASSERT_EQ(got.size(), want.size());
    // B's logits (NaN in the poisoned model) are every step's second.
    std::vector<at::Tensor> got_narrow, want_narrow;
    for (size_t i = 0; i < got.size(); ++i) {
      if (i == 1 || i == 4 || (i >= 6 && (i - 6) % 4 == 1)) continue;
      got_narrow.push_back(got[i]);
      want_narrow.push_back(want[i]);
    }
    ExpectSameLogits(got_narrow, want_narrow, 2e-4);
  }
}

TEST(NarrowKvTest, ValidationNamesTheProblem) {
  std::unique_ptr<LlamaModel> model =
      NarrowRandomModel(NarrowConfig(8, 4, {4, 4}));
  ASSERT_NE(model, nullptr);
  KvCache cache = model->CreateKvCache(8, 4);
  DecoderBatch batch;
  batch.token_ids = at::zeros({1, 2}, at::kLong);
  batch.num_tokens = {2};
  batch.block_tables = {{0}};
  batch.start_positions = {0};
  batch.top_k = {{1, 0}};
  batch.narrow = {true};
  auto out = model->Forward(batch, cache);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(out.status().message().find("routed K must be 0"),
            std::string::npos)
      << out.status();
  batch.top_k = {{0, 0}};
  batch.start_positions = {7};  // a narrow block holds 8 positions
  EXPECT_TRUE(model->Forward(batch, cache).status().code() ==
              absl::StatusCode::kInvalidArgument);
  batch.start_positions = {6};
  EXPECT_TRUE(model->Forward(batch, cache).ok());
  std::unique_ptr<LlamaModel> unaligned =
      NarrowRandomModel(NarrowConfig(8, 4, {3, 3}));
  ASSERT_NE(unaligned, nullptr);
  KvCache other = unaligned->CreateKvCache(8, 4);
  batch.start_positions = {0};
  out = unaligned->Forward(batch, other);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(out.status().message().find("no narrow KV width"),
            std::string::npos)
      << out.status();
}

}  // namespace
}  // namespace moh
