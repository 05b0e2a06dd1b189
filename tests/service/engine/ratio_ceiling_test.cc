// The ratio ceiling's accounting, without a model: narrow requests
// (PlannedWork::kv_fold > 1) take kv_fold times fewer blocks, so twice the
// sequences fit the same kv_blocks at fold 2; their blocks never match wide
// ones (the pool and the prefix key); lowering keeps a request's fold.
#include "service/engine/ratio_ceiling.h"

#include <gtest/gtest.h>

#include <map>
#include <vector>

#include "service/engine/kv_block_pool.h"
#include "service/engine/step_planner.h"
#include "tests/service/engine/step_planner_test_util.h"

namespace moh {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1000);
constexpr int32_t kBlockSize = 4;

TEST(RatioCeilingTest, FoldAndPrefixKey) {
  EXPECT_EQ(KvFold(true, 2), 2);
  EXPECT_EQ(KvFold(false, 2), 1);
  EXPECT_EQ(KvFold(true, 1), 1);  // a model without a narrow width
  const std::vector<int32_t> zero = {0, 0}, two = {2, 2};
  // A wide request lowered to K = 0 computes the same heads as a narrow
  // one, but stores them in another layout: another key.
  EXPECT_NE(PrefixKey(zero, 1), PrefixKey(zero, 2));
  EXPECT_NE(PrefixKey(zero, 1), PrefixKey(two, 1));
  EXPECT_EQ(PrefixKey(zero, 2), PrefixKey(zero, 2));
}

TEST(RatioCeilingTest, PoolNeverMatchesAcrossFolds) {
  KvBlockPool pool(8, kBlockSize);
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  // A narrow block (fold 2) holds 8 positions; under the same key a wide
  // lookup (fold 1, 4 positions a block) finds nothing, and the reverse.
  const int32_t narrow = pool.Allocate();
  ASSERT_TRUE(pool.Register(narrow, -1, tokens.data(), /*key=*/5, 2));
  EXPECT_TRUE(pool.Match(tokens.data(), 9, 5, 4, 1).empty());
  EXPECT_EQ(pool.Match(tokens.data(), 9, 5, 4, 2),
            (std::vector<int32_t>{narrow}));
  EXPECT_TRUE(pool.Match(tokens.data(), 7, 5, 4, 2).empty());  // < 8 tokens
  const int32_t wide = pool.Allocate();
  ASSERT_TRUE(pool.Register(wide, -1, tokens.data(), 5, 1));
  EXPECT_EQ(pool.Match(tokens.data(), 9, 5, 4, 1),
            (std::vector<int32_t>{wide}));
  EXPECT_EQ(pool.Match(tokens.data(), 9, 5, 4, 2),
            (std::vector<int32_t>{narrow}));
  // A wide block never chains after a narrow one.
  const int32_t next = pool.Allocate();
  EXPECT_FALSE(pool.Register(next, narrow, tokens.data() + 8, 5, 1));
  EXPECT_FALSE(pool.Register(next, -1, tokens.data(), 5, 0));
}

StepPlannerOptions Paged(int32_t kv_blocks, int32_t depth = 0) {
  StepPlannerOptions options;
  options.max_running = 16;
  options.max_seq_len = 32;
  options.max_queued_requests = 100;
  options.prefill_token_budget = 512;
  options.adaptive_queue_depth = depth;
  options.kv_blocks = kv_blocks;
  options.kv_block_size = kBlockSize;
  options.prefix_caching = true;
  return options;
}

// A request of `prompt` then `outputs` tokens, stored at `fold`, its blocks
// keyed as the language executor keys them (K per layer at full ratio or
// at 0, with a floor at 0 when `can_lower`).
PlannedWork Work(std::vector<int32_t> prompt, int32_t outputs, int32_t fold,
                 bool can_lower = false) {
  PlannedWork work;
  work.prompt_len = static_cast<int32_t>(prompt.size());
  work.max_outputs = outputs;
  work.prompt_tokens = std::move(prompt);
  work.kv_fold = fold;
  work.can_lower = can_lower;
  const std::vector<int32_t> k =
      fold > 1 ? std::vector<int32_t>{0, 0} : std::vector<int32_t>{2, 2};
  work.prefix_key = PrefixKey(k, fold);
  work.lowered_prefix_key = PrefixKey({0, 0}, fold);
  return work;
}

std::vector<int32_t> Tokens(int32_t n, int32_t first = 1) {
  std::vector<int32_t> tokens;
  for (int32_t i = 0; i < n; ++i) tokens.push_back(first + i);
  return tokens;
}

// Runs steps until idle; returns the most requests that ran at once, and
// checks each row's blocks cover what it computes at its fold and that no
// two rows write one block.
int64_t RunToIdle(StepPlanner& planner, FakeModel& model,
                  const std::map<uint64_t, int32_t>& fold) {
  int64_t most = 0;
  for (int step = 0; step < 1000 && !planner.idle(); ++step) {
    StepPlan plan = planner.Schedule(kT0);
    most = std::max(most, planner.num_running());
    std::map<int32_t, uint64_t> writer;
    for (const PlannedRow& row : plan.rows) {
      const int32_t span = kBlockSize * fold.at(row.id);
      EXPECT_GE(static_cast<int64_t>(row.blocks.size()) * span,
                int64_t{row.start} + row.num_tokens);
      for (int32_t p = row.start; p < row.start + row.num_tokens; ++p) {
        const auto [it, fresh] = writer.emplace(row.blocks[p / span], row.id);
        EXPECT_TRUE(fresh || it->second == row.id);
      }
    }
    EXPECT_LE(planner.blocks_in_use(), 16);
    planner.Update(plan, model.Run(plan));
  }
  EXPECT_TRUE(planner.idle());
  return most;
}

// At a fixed kv_blocks, requests at ratio 0.5 on an aligned layout (fold 2)
// run twice as many at once as the same requests stored wide.
TEST(RatioCeilingTest, NarrowRequestsFitTwiceAsManyInTheSameBlocks) {
  for (const int32_t fold : {1, 2}) {
    StepPlanner planner(Paged(/*kv_blocks=*/16));
    FakeModel model;
    std::map<uint64_t, int32_t> folds;
    // 8 + 8 positions: 4 blocks wide, 2 narrow.
    for (uint64_t id = 1; id <= 10; ++id) {
      planner.Enqueue(id, Work(Tokens(8, int32_t(id) * 100), 8, fold), kT0);
      model.Expect(id, 8);
      folds[id] = fold;
    }
    StepPlan plan = planner.Schedule(kT0);
    EXPECT_EQ(plan.admitted.size(), fold == 1 ? 4u : 8u) << "fold " << fold;
    EXPECT_EQ(planner.num_running(), fold == 1 ? 4 : 8);
    // Each narrow prompt of 8 positions fills one block.
    EXPECT_EQ(plan.rows[0].blocks.size(), fold == 1 ? 2u : 1u);
    EXPECT_EQ(planner.blocks_in_use(), fold == 1 ? 8 : 8);
    planner.Update(plan, model.Run(plan));
    EXPECT_EQ(RunToIdle(planner, model, folds), fold == 1 ? 4 : 8);
    EXPECT_EQ(planner.blocks_in_use(), 0);
  }
}

TEST(RatioCeilingTest, NarrowAndWideBesideEachOther) {
  StepPlanner planner(Paged(/*kv_blocks=*/16));
  FakeModel model;
  std::map<uint64_t, int32_t> folds;
  // 3 wide (12 blocks) and the rest narrow (2 blocks each): 2 narrow fit.
  for (uint64_t id = 1; id <= 6; ++id) {
    const int32_t fold = id <= 3 ? 1 : 2;
    planner.Enqueue(id, Work(Tokens(8, int32_t(id) * 100), 8, fold), kT0);
    model.Expect(id, 8);
    folds[id] = fold;
  }
  StepPlan plan = planner.Schedule(kT0);
  EXPECT_EQ(plan.admitted.size(), 5u);
  EXPECT_EQ(planner.blocks_in_use(), 3 * 2 + 2 * 1);
  planner.Update(plan, model.Run(plan));
  RunToIdle(planner, model, folds);
}

// Narrow and wide requests with the same prompt never share blocks; a wide
// request lowered to K = 0 by adaptive activation stays wide (its fold, its
// key) and never reads a narrow one's blocks either. Narrow ones share
// among themselves.
TEST(RatioCeilingTest, PrefixBlocksAreSharedWithinAFoldOnly) {
  StepPlanner planner(Paged(/*kv_blocks=*/16, /*depth=*/1));
  FakeModel model;
  std::map<uint64_t, int32_t> folds = {{1, 2}, {2, 1}, {3, 1}, {4, 2}};
  const std::vector<int32_t> prompt = Tokens(10);
  planner.Enqueue(1, Work(prompt, 2, 2), kT0);
  model.Expect(1, 2);
  StepPlan plan = planner.Schedule(kT0);
  const std::vector<int32_t> narrow_blocks = plan.rows[0].blocks;
  ASSERT_EQ(narrow_blocks.size(), 2u);    // 10 positions, 8 a block
  planner.Update(plan, model.Run(plan));  // registers the first block
  // Three wait (queue depth 1 lowers the one that can): 2 is wide, 3 is
  // wide and lowered to K = 0, 4 is narrow.
  planner.Enqueue(2, Work(prompt, 2, 1), kT0);
  planner.Enqueue(3, Work(prompt, 2, 1, /*can_lower=*/true), kT0);
  planner.Enqueue(4, Work(prompt, 2, 2), kT0);
  for (uint64_t id = 2; id <= 4; ++id) model.Expect(id, 2);
  plan = planner.Schedule(kT0);
  ASSERT_EQ(plan.admitted.size(), 3u);
  EXPECT_FALSE(plan.admitted[0].lowered);
  EXPECT_TRUE(plan.admitted[1].lowered);
  EXPECT_EQ(plan.admitted[0].prefix_hit, 0);
  EXPECT_EQ(plan.admitted[1].prefix_hit, 0);
  EXPECT_EQ(plan.admitted[2].prefix_hit, 8);
  std::map<uint64_t, PlannedRow> rows;
  for (const PlannedRow& row : plan.rows) rows[row.id] = row;
  EXPECT_EQ(rows[4].blocks[0], narrow_blocks[0]);
  EXPECT_EQ(rows[4].start, 8);
  for (uint64_t id : {2, 3}) {
    EXPECT_EQ(rows[id].start, 0);
    EXPECT_EQ(rows[id].blocks.size(), 3u);  // 10 positions, 4 a block
    for (int32_t block : rows[id].blocks) {
      EXPECT_NE(block, narrow_blocks[0]);
      EXPECT_NE(block, narrow_blocks[1]);
    }
  }
  planner.Update(plan, model.Run(plan));
  RunToIdle(planner, model, folds);
}

}  // namespace
}  // namespace moh
