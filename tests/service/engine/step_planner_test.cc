// StepPlanner on a fake clock with a fake model: admission by slots and KV
// positions, deadlines, cancellation, adaptive lowering, prompt chunks and
// failures, step by step. No LibTorch, no threads, no sleeps.
#include "service/engine/step_planner.h"

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <vector>

#include "tests/service/engine/step_planner_test_util.h"

namespace moh {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1000);

PlannedWork Work(int32_t prompt_len, int32_t max_outputs,
                 absl::Time deadline = absl::InfiniteFuture(),
                 bool can_lower = false) {
  return PlannedWork{prompt_len, max_outputs, deadline, can_lower};
}

// The one request a plan ends: `id`, whether it held a slot, its status code.
void ExpectEnded(const StepPlan& plan, uint64_t id, bool was_running,
                 absl::StatusCode code) {
  ASSERT_EQ(plan.ended.size(), 1u);
  EXPECT_EQ(plan.ended[0].id, id);
  EXPECT_EQ(plan.ended[0].was_running, was_running);
  EXPECT_EQ(plan.ended[0].status.code(), code);
}

StepPlannerOptions Options(int32_t max_running, int32_t budget = 512,
                           int32_t depth = 0) {
  StepPlannerOptions options;
  options.max_running = max_running;
  options.max_seq_len = 64;
  options.max_queued_requests = 100;
  options.prefill_token_budget = budget;
  options.adaptive_queue_depth = depth;
  return options;
}

std::vector<uint64_t> Ids(const std::vector<AdmittedRequest>& admitted) {
  std::vector<uint64_t> ids;
  for (const AdmittedRequest& a : admitted) ids.push_back(a.id);
  return ids;
}

TEST(StepPlannerTest, AdmitsIntoFreeSlotsFirstComeAndFreesThemAtTheEnd) {
  StepPlanner planner(Options(/*max_running=*/2));
  FakeModel model;
  for (uint64_t id = 1; id <= 3; ++id) {
    planner.Enqueue(id, Work(4, 2), kT0);
    model.Expect(id, 2);
  }
  StepPlan plan = planner.Schedule(kT0 + absl::Seconds(1));
  EXPECT_EQ(Ids(plan.admitted), (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(plan.admitted[0].slot, 0);
  EXPECT_EQ(plan.admitted[1].slot, 1);
  EXPECT_EQ(plan.admitted[0].queued, absl::Seconds(1));
  EXPECT_EQ(planner.num_running(), 2);
  EXPECT_EQ(planner.num_waiting(), 1);
  EXPECT_EQ(planner.reserved_positions(), 2 * (4 + 2));
  EXPECT_EQ(planner.total_positions(), 2 * 64);
  // Prefill of both prompts (one output each), then one decode each.
  ASSERT_EQ(plan.rows.size(), 2u);
  EXPECT_TRUE(plan.rows[0].prefill && plan.rows[0].emits);
  EXPECT_EQ(plan.rows[0].num_tokens, 4);
  EXPECT_TRUE(planner.Update(plan, model.Run(plan)).empty());
  plan = planner.Schedule(kT0);
  EXPECT_TRUE(plan.admitted.empty());  // no free slot yet
  ASSERT_EQ(plan.rows.size(), 2u);
  EXPECT_FALSE(plan.rows[0].prefill);
  EXPECT_EQ(plan.rows[0].start, 4);
  EXPECT_EQ(plan.rows[0].num_tokens, 1);
  EXPECT_EQ(planner.Update(plan, model.Run(plan)),
            (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(planner.num_running(), 0);
  EXPECT_EQ(planner.reserved_positions(), 0);
  plan = planner.Schedule(kT0);
  EXPECT_EQ(Ids(plan.admitted), (std::vector<uint64_t>{3}));
  EXPECT_EQ(plan.admitted[0].slot, 0);  // the lowest free slot
}

TEST(StepPlannerTest, DeadlinesEndQueuedAndRunningRequests) {
  StepPlanner planner(Options(/*max_running=*/1));
  FakeModel model;
  planner.Enqueue(1, Work(2, 10, kT0 + absl::Seconds(5)), kT0);
  planner.Enqueue(2, Work(2, 10, kT0 + absl::Seconds(2)), kT0);
  model.Expect(1, 10);
  StepPlan plan = planner.Schedule(kT0);
  EXPECT_EQ(Ids(plan.admitted), (std::vector<uint64_t>{1}));
  planner.Update(plan, model.Run(plan));
  // Request 2 waits past its deadline: it leaves without being computed.
  plan = planner.Schedule(kT0 + absl::Seconds(3));
  ExpectEnded(plan, 2, false, absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(plan.ended[0].status.message().find("waiting in the queue"),
            absl::string_view::npos);
  planner.Update(plan, model.Run(plan));
  // Request 1's deadline passes while it generates: it leaves before the step.
  plan = planner.Schedule(kT0 + absl::Seconds(5));
  ExpectEnded(plan, 1, true, absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(plan.rows.empty());
  EXPECT_TRUE(planner.idle());
}

TEST(StepPlannerTest, CancelEndsQueuedAndRunningRequestsWithOk) {
  StepPlanner planner(Options(/*max_running=*/1));
  planner.Enqueue(1, Work(3, 5), kT0);
  planner.Enqueue(2, Work(3, 5), kT0);
  StepPlan plan = planner.Schedule(kT0);
  planner.Update(plan, {false});
  planner.Cancel(2);      // queued
  planner.Cancel(1);      // running
  planner.Cancel(12345);  // unknown: ignored
  plan = planner.Schedule(kT0);
  ASSERT_EQ(plan.ended.size(), 2u);
  EXPECT_EQ(plan.ended[0].id, 2u);
  EXPECT_FALSE(plan.ended[0].was_running);
  EXPECT_TRUE(plan.ended[0].status.ok());
  EXPECT_EQ(plan.ended[1].id, 1u);
  EXPECT_TRUE(plan.ended[1].was_running);
  EXPECT_TRUE(plan.ended[1].status.ok());
  EXPECT_TRUE(plan.rows.empty());
  EXPECT_TRUE(planner.idle());
  EXPECT_EQ(planner.reserved_positions(), 0);
}

TEST(StepPlannerTest, AdaptiveActivationLowersWhileTheQueueIsDeep) {
  StepPlanner planner(Options(/*max_running=*/1, 512, /*depth=*/1));
  FakeModel model;
  planner.Enqueue(1, Work(2, 1, absl::InfiniteFuture(), true), kT0);
  planner.Enqueue(2, Work(2, 1, absl::InfiniteFuture(), false), kT0);
  planner.Enqueue(3, Work(2, 1, absl::InfiniteFuture(), true), kT0);
  planner.Enqueue(4, Work(2, 1, absl::InfiniteFuture(), true), kT0);
  std::vector<bool> lowered;
  while (!planner.idle()) {
    StepPlan plan = planner.Schedule(kT0);
    for (const AdmittedRequest& a : plan.admitted) {
      lowered.push_back(a.lowered);
      model.Expect(a.id, 1);
    }
    planner.Update(plan, model.Run(plan));
  }
  // Waiting (itself included) at each admission: 4, 3, 2, 1; depth 1.
  // Request 2 does not allow lowering; request 4 is admitted alone.
  EXPECT_EQ(lowered, (std::vector<bool>{true, false, true, false}));

  StepPlanner off(Options(/*max_running=*/1, 512, /*depth=*/0));
  off.Enqueue(1, Work(2, 1, absl::InfiniteFuture(), true), kT0);
  off.Enqueue(2, Work(2, 1, absl::InfiniteFuture(), true), kT0);
  EXPECT_FALSE(off.Schedule(kT0).admitted[0].lowered);
}

TEST(StepPlannerTest, PromptsRunInChunksUnderTheBudgetBesideDecodes) {
  StepPlanner planner(Options(/*max_running=*/3, /*budget=*/5));
  FakeModel model;
  planner.Enqueue(1, Work(1, 20), kT0);
  model.Expect(1, 20);
  StepPlan plan = planner.Schedule(kT0);
  planner.Update(plan, model.Run(plan));  // 1 is decoding now
  planner.Enqueue(2, Work(7, 3), kT0);
  planner.Enqueue(3, Work(4, 3), kT0);
  model.Expect(2, 3);
  model.Expect(3, 3);
  struct Row {
    uint64_t id;
    int32_t start, tokens;
    bool prefill, emits;
    bool operator==(const Row& o) const {
      return id == o.id && start == o.start && tokens == o.tokens &&
             prefill == o.prefill && emits == o.emits;
    }
  };
  std::vector<std::vector<Row>> steps;
  for (int i = 0; i < 3; ++i) {
    plan = planner.Schedule(kT0);
    std::vector<Row> rows;
    for (const PlannedRow& r : plan.rows) {
      rows.push_back(Row{r.id, r.start, r.num_tokens, r.prefill, r.emits});
    }
    steps.push_back(rows);
    planner.Update(plan, model.Run(plan));
  }
  // Decode rows first; prompt chunks first come, first served, 5 tokens per
  // step; a prompt emits only with its last chunk.
  EXPECT_EQ(steps[0],
            (std::vector<Row>{{1, 1, 1, false, true}, {2, 0, 5, true, false}}));
  EXPECT_EQ(steps[1], (std::vector<Row>{{1, 2, 1, false, true},
                                        {2, 5, 2, true, true},
                                        {3, 0, 3, true, false}}));
  EXPECT_EQ(steps[2], (std::vector<Row>{{1, 3, 1, false, true},
                                        {2, 7, 1, false, true},
                                        {3, 3, 1, true, true}}));
}

TEST(StepPlannerTest, WorkWithoutPromptEmitsFromItsFirstStep) {
  // A diffusion sampler's shape: no prompt, one row per step.
  StepPlanner planner(Options(/*max_running=*/2));
  FakeModel model;
  planner.Enqueue(1, Work(0, 3), kT0);
  model.Expect(1, 3);
  int steps = 0;
  while (!planner.idle()) {
    StepPlan plan = planner.Schedule(kT0);
    ASSERT_EQ(plan.rows.size(), 1u);
    EXPECT_FALSE(plan.rows[0].prefill);
    EXPECT_TRUE(plan.rows[0].emits);
    EXPECT_EQ(plan.rows[0].start, steps);
    planner.Update(plan, model.Run(plan));
    ++steps;
  }
  EXPECT_EQ(steps, 3);
}

TEST(StepPlannerTest, RowBudgetAdmitsByRowsPerStep) {
  // Guided image requests take two model rows per step, unguided ones one:
  // a budget of 4 rows holds two guided, or one guided and two unguided.
  StepPlannerOptions options = Options(/*max_running=*/4);
  options.max_step_rows = 4;
  StepPlanner planner(options);
  FakeModel model;
  const int32_t rows[] = {2, 2, 1, 1, 5};
  for (uint64_t id = 1; id <= 5; ++id) {
    PlannedWork work = Work(0, id == 1 ? 1 : 2);
    work.rows_per_step = rows[id - 1];
    planner.Enqueue(id, work, kT0);
    model.Expect(id, work.max_outputs);
  }
  StepPlan plan = planner.Schedule(kT0);
  EXPECT_EQ(Ids(plan.admitted), (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(planner.Update(plan, model.Run(plan)), (std::vector<uint64_t>{1}));
  plan = planner.Schedule(kT0);  // 2 rows free: request 3 and 4 fit
  EXPECT_EQ(Ids(plan.admitted), (std::vector<uint64_t>{3, 4}));
  EXPECT_EQ(planner.Update(plan, model.Run(plan)), (std::vector<uint64_t>{2}));
  plan = planner.Schedule(kT0);  // 5 rows wait for an empty step
  EXPECT_TRUE(plan.admitted.empty());
  EXPECT_EQ(planner.Update(plan, model.Run(plan)),
            (std::vector<uint64_t>{3, 4}));
  plan = planner.Schedule(kT0);  // larger than the budget: runs alone
  EXPECT_EQ(Ids(plan.admitted), (std::vector<uint64_t>{5}));
}

TEST(StepPlannerTest, FailedStepEndsItsRequestsOnly) {
  StepPlanner planner(Options(/*max_running=*/1));
  planner.Enqueue(1, Work(3, 4), kT0);
  planner.Enqueue(2, Work(3, 4), kT0);
  StepPlan plan = planner.Schedule(kT0);
  EXPECT_EQ(planner.Fail(plan), (std::vector<uint64_t>{1}));
  EXPECT_EQ(planner.num_running(), 0);
  EXPECT_EQ(planner.num_waiting(), 1);
  plan = planner.Schedule(kT0);
  EXPECT_EQ(Ids(plan.admitted), (std::vector<uint64_t>{2}));
}

// The rows of each step: (id, tokens).
std::vector<std::pair<uint64_t, int32_t>> RowsOf(const StepPlan& plan) {
  std::vector<std::pair<uint64_t, int32_t>> rows;
  for (const PlannedRow& r : plan.rows) rows.emplace_back(r.id, r.num_tokens);
  return rows;
}

TEST(StepPlannerTest, AStepOutOfMemoryHalvesLaterStepsUntilStepsRun) {
  StepPlannerOptions options = Options(/*max_running=*/4, /*budget=*/8);
  options.max_seq_len = 1000;
  StepPlanner planner(options);
  FakeModel model;
  for (uint64_t id = 1; id <= 3; ++id) {
    planner.Enqueue(id, Work(1, 200), kT0);
    model.Expect(id, 200);
  }
  StepPlan plan = planner.Schedule(kT0);
  planner.Update(plan, model.Run(plan));  // 1-3 are decoding now
  planner.Enqueue(4, Work(10, 200), kT0);
  model.Expect(4, 200);
  plan = planner.Schedule(kT0);  // 3 decode rows and 4's first 8 tokens
  using Rows = std::vector<std::pair<uint64_t, int32_t>>;
  EXPECT_EQ(RowsOf(plan), (Rows{{1, 1}, {2, 1}, {3, 1}, {4, 8}}));
  ASSERT_TRUE(planner.ShrinkSteps(plan));  // 11 tokens: 5 a step now
  EXPECT_EQ(planner.step_token_limit(), 5);
  // The same rows again, 5 tokens a step; prompt chunks get what the
  // decode rows leave.
  plan = planner.Schedule(kT0);
  EXPECT_EQ(RowsOf(plan), (Rows{{1, 1}, {2, 1}, {3, 1}, {4, 2}}));
  ASSERT_TRUE(planner.ShrinkSteps(plan));  // out of memory too: 2 a step
  // The decode rows take the 2 tokens (4's prompt waits), round the slots:
  // those a step leaves out go first in the next.
  const std::vector<Rows> expected = {
      {{1, 1}, {2, 1}}, {{3, 1}, {1, 1}}, {{2, 1}, {3, 1}}};
  for (const Rows& rows : expected) {
    plan = planner.Schedule(kT0);
    EXPECT_EQ(RowsOf(plan), rows);
    planner.Update(plan, model.Run(plan));
  }
  // A step of one token cannot be smaller.
  StepPlan one;
  one.rows.push_back(PlannedRow{1, 0, 5, 1, false, true});
  EXPECT_FALSE(planner.ShrinkSteps(one));
  EXPECT_EQ(planner.step_token_limit(), 2);
  // Steps that run raise the limit again: doubled every
  // kStepsBeforeRaising, off once past every token a step can have (4
  // decode rows + 8 prompt tokens).
  int steps = 3;
  int64_t before = 2;
  for (int64_t limit : {4, 8, 0}) {
    for (; steps < StepPlanner::kStepsBeforeRaising; ++steps) {
      EXPECT_EQ(planner.step_token_limit(), before);
      plan = planner.Schedule(kT0);
      planner.Update(plan, model.Run(plan));
    }
    steps = 0;
    before = limit;
    EXPECT_EQ(planner.step_token_limit(), limit);
  }
  plan = planner.Schedule(kT0);  // every row, 4's whole prompt chunk
  EXPECT_EQ(plan.rows.size(), 4u);
}

TEST(StepPlannerTest, ShutdownEndsQueuedThenRunning) {
  StepPlanner planner(Options(/*max_running=*/1));
  planner.Enqueue(1, Work(3, 4), kT0);
  planner.Enqueue(2, Work(3, 4), kT0);
  planner.Schedule(kT0);
  std::vector<EndedRequest> ended = planner.Shutdown();
  ASSERT_EQ(ended.size(), 2u);
  EXPECT_EQ(ended[0].id, 2u);
  EXPECT_FALSE(ended[0].was_running);
  EXPECT_EQ(ended[1].id, 1u);
  EXPECT_TRUE(ended[1].was_running);
  for (const EndedRequest& e : ended) {
    EXPECT_EQ(e.status.code(), absl::StatusCode::kUnavailable);
  }
  EXPECT_TRUE(planner.idle());
  EXPECT_EQ(planner.reserved_positions(), 0);
}

TEST(StepPlannerTest, HigherPriorityIsAdmittedFirstFirstComeWithin) {
  StepPlanner planner(Options(/*max_running=*/1));
  FakeModel model;
  const int32_t priorities[] = {0, 5, -3, 5, 0};
  for (uint64_t id = 1; id <= 5; ++id) {
    PlannedWork work = Work(2, 1);
    work.priority = priorities[id - 1];
    planner.Enqueue(id, work, kT0);
    model.Expect(id, 1);
  }
  std::vector<uint64_t> order;
  while (!planner.idle()) {
    StepPlan plan = planner.Schedule(kT0);
    for (uint64_t id : Ids(plan.admitted)) order.push_back(id);
    planner.Update(plan, model.Run(plan));
  }
  EXPECT_EQ(order, (std::vector<uint64_t>{2, 4, 1, 5, 3}));
}

TEST(StepPlannerTest, AdaptiveActivationLowersLowerPrioritiesFirst) {
  // Depth 2: a request is lowered when more than 2 requests of its priority
  // or higher wait. Two high-priority and three low-priority ones wait.
  StepPlanner planner(Options(/*max_running=*/1, 512, /*depth=*/2));
  FakeModel model;
  for (uint64_t id = 1; id <= 5; ++id) {
    PlannedWork work = Work(2, 1, absl::InfiniteFuture(), true);
    work.priority = id <= 3 ? 0 : 1;
    planner.Enqueue(id, work, kT0);
    model.Expect(id, 1);
  }
  std::map<uint64_t, bool> lowered;
  while (!planner.idle()) {
    StepPlan plan = planner.Schedule(kT0);
    for (const AdmittedRequest& a : plan.admitted) lowered[a.id] = a.lowered;
    planner.Update(plan, model.Run(plan));
  }
  // 4 and 5 see 2 and 1 of their priority waiting: not lowered. Then 1, 2
  // and 3 see 3, 2, 1 waiting: 1 is lowered.
  EXPECT_EQ(lowered,
            (std::map<uint64_t, bool>{
                {1, true}, {2, false}, {3, false}, {4, false}, {5, false}}));
}

// Paged KV: blocks of 4 positions, kv_blocks of them.
StepPlannerOptions Paged(int32_t max_running, int32_t kv_blocks,
                         bool prefix_caching = true) {
  StepPlannerOptions options = Options(max_running);
  options.max_seq_len = 32;
  options.kv_blocks = kv_blocks;
  options.kv_block_size = 4;
  options.prefix_caching = prefix_caching;
  return options;
}

PlannedWork Prompt(std::vector<int32_t> tokens, int32_t max_outputs,
                   uint64_t key = 7) {
  PlannedWork work = Work(static_cast<int32_t>(tokens.size()), max_outputs);
  work.prompt_tokens = std::move(tokens);
  work.prefix_key = key;
  work.lowered_prefix_key = key + 1;
  return work;
}

// Runs steps until the planner is idle, checking every row's block table
// covers what it computes and that no two rows write one block.
void RunToIdle(StepPlanner& planner, FakeModel& model, int64_t kv_blocks) {
  for (int step = 0; step < 1000 && !planner.idle(); ++step) {
    StepPlan plan = planner.Schedule(kT0);
    std::map<int32_t, uint64_t> writer;
    for (const PlannedRow& row : plan.rows) {
      ASSERT_GE(static_cast<int64_t>(row.blocks.size()) * 4,
                int64_t{row.start} + row.num_tokens);
      for (int32_t p = row.start; p < row.start + row.num_tokens; ++p) {
        const int32_t block = row.blocks[p / 4];
        ASSERT_LT(block, kv_blocks);
        const auto [it, fresh] = writer.emplace(block, row.id);
        ASSERT_TRUE(fresh || it->second == row.id) << "block " << block;
      }
    }
    ASSERT_LE(planner.blocks_in_use(), kv_blocks);
    ASSERT_LE(planner.reserved_positions(), planner.total_positions());
    planner.Update(plan, model.Run(plan));
  }
  ASSERT_TRUE(planner.idle());
}

TEST(StepPlannerTest, PagedAdmitsByBlocksAndAllocatesAsSequencesGrow) {
  StepPlanner planner(Paged(/*max_running=*/4, /*kv_blocks=*/6,
                            /*prefix_caching=*/false));
  FakeModel model;
  // Each needs 3 blocks at most (6 + 6 positions): two fit, the third waits.
  for (uint64_t id = 1; id <= 3; ++id) {
    planner.Enqueue(id, Prompt({1, 2, 3, 4, 5, int32_t(id)}, 6), kT0);
    model.Expect(id, 6);
  }
  StepPlan plan = planner.Schedule(kT0);
  EXPECT_EQ(Ids(plan.admitted), (std::vector<uint64_t>{1, 2}));
  ASSERT_EQ(plan.rows.size(), 2u);
  EXPECT_EQ(plan.rows[0].blocks.size(), 2u);  // the prompt's 6 positions
  EXPECT_EQ(planner.blocks_in_use(), 4);
  EXPECT_EQ(planner.reserved_positions(), 6 * 4);  // all committed
  EXPECT_EQ(planner.total_positions(), 6 * 4);
  planner.Update(plan, model.Run(plan));
  // Decode at positions 6 and 7 stay in block 2; position 8 takes a third.
  for (int step = 0; step < 2; ++step) {
    plan = planner.Schedule(kT0);
    EXPECT_TRUE(plan.admitted.empty());
    EXPECT_EQ(plan.rows[0].blocks.size(), 2u);
    planner.Update(plan, model.Run(plan));
  }
  plan = planner.Schedule(kT0);
  EXPECT_EQ(plan.rows[0].blocks.size(), 3u);
  EXPECT_EQ(planner.blocks_in_use(), 6);
  planner.Update(plan, model.Run(plan));
  RunToIdle(planner, model, 6);
  EXPECT_EQ(planner.blocks_in_use(), 0);
  EXPECT_EQ(planner.reserved_positions(), 0);
}

TEST(StepPlannerTest, PromptBlocksAreSharedUnderTheSameKeyOnly) {
  StepPlanner planner(Paged(/*max_running=*/4, /*kv_blocks=*/16));
  FakeModel model;
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  planner.Enqueue(1, Prompt(prompt, 2), kT0);
  model.Expect(1, 2);
  StepPlan plan = planner.Schedule(kT0);
  EXPECT_EQ(plan.admitted[0].prefix_queried, 10);
  EXPECT_EQ(plan.admitted[0].prefix_hit, 0);
  const std::vector<int32_t> first_blocks = plan.rows[0].blocks;
  planner.Update(plan, model.Run(plan));  // the prompt's 2 whole blocks
  // The same prompt under the same key reads them: its row starts at 8.
  // Under another key (another activation), and with a different second
  // block, less or nothing is shared.
  planner.Enqueue(2, Prompt(prompt, 2), kT0);
  planner.Enqueue(3, Prompt(prompt, 2, /*key=*/99), kT0);
  planner.Enqueue(4, Prompt({1, 2, 3, 4, 5, 6, 7, 0, 9, 10}, 2), kT0);
  for (uint64_t id = 2; id <= 4; ++id) model.Expect(id, 2);
  plan = planner.Schedule(kT0);
  ASSERT_EQ(plan.admitted.size(), 3u);
  EXPECT_EQ(plan.admitted[0].prefix_hit, 8);
  EXPECT_EQ(plan.admitted[1].prefix_hit, 0);
  EXPECT_EQ(plan.admitted[2].prefix_hit, 4);
  std::map<uint64_t, PlannedRow> rows;
  for (const PlannedRow& row : plan.rows) rows[row.id] = row;
  EXPECT_EQ(rows[2].start, 8);
  EXPECT_EQ(rows[2].num_tokens, 2);
  EXPECT_EQ(rows[2].blocks[0], first_blocks[0]);
  EXPECT_EQ(rows[2].blocks[1], first_blocks[1]);
  EXPECT_EQ(rows[3].start, 0);
  EXPECT_NE(rows[3].blocks[0], first_blocks[0]);
  EXPECT_EQ(rows[4].start, 4);
  EXPECT_EQ(rows[4].blocks[0], first_blocks[0]);
  EXPECT_NE(rows[4].blocks[1], first_blocks[1]);
  planner.Update(plan, model.Run(plan));
  RunToIdle(planner, model, 16);
}

TEST(StepPlannerTest, LaterSamplesWaitForTheFirstsPromptAndShareIt) {
  StepPlanner planner(Paged(/*max_running=*/4, /*kv_blocks=*/16));
  FakeModel model;
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  PlannedWork first = Prompt(prompt, 2);
  first.can_lower = true;
  first.priority = 1;
  planner.Enqueue(1, first, kT0);
  PlannedWork sample = first;
  sample.after = 1;
  planner.Enqueue(2, sample, kT0);
  planner.Enqueue(3, sample, kT0);
  for (uint64_t id = 1; id <= 3; ++id) model.Expect(id, 2);
  // A budget of 4 prompt tokens a step: the first's prompt takes 3 steps,
  // and the others wait with free slots until it is done.
  StepPlannerOptions options = Paged(4, 16);
  options.prefill_token_budget = 4;
  options.adaptive_queue_depth = 1;  // 3 waiting: the first is lowered
  StepPlanner chunked(options);
  chunked.Enqueue(1, first, kT0);
  chunked.Enqueue(2, sample, kT0);
  chunked.Enqueue(3, sample, kT0);
  StepPlan plan = chunked.Schedule(kT0);
  EXPECT_EQ(Ids(plan.admitted), (std::vector<uint64_t>{1}));
  EXPECT_TRUE(plan.admitted[0].lowered);
  for (int step = 0; step < 2; ++step) {
    chunked.Update(plan, model.Run(plan));
    plan = chunked.Schedule(kT0);
    EXPECT_TRUE(plan.admitted.empty()) << step;
  }
  chunked.Update(plan, model.Run(plan));  // the prompt's last 2 tokens
  plan = chunked.Schedule(kT0);
  ASSERT_EQ(Ids(plan.admitted), (std::vector<uint64_t>{2, 3}));
  for (const AdmittedRequest& a : plan.admitted) {
    EXPECT_EQ(a.prefix_hit, 8) << a.id;  // the first's two whole blocks
    EXPECT_TRUE(a.lowered) << a.id;      // at the first's activation
  }
  chunked.Update(plan, model.Run(plan));

  // A sample whose first has left is admitted on its own.
  planner.Cancel(1);
  plan = planner.Schedule(kT0);
  EXPECT_EQ(Ids(plan.admitted), (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(plan.admitted[0].prefix_hit, 0);
}

TEST(StepPlannerTest, ARequestThatDoesNotReadThePrefixStillRegistersIt) {
  StepPlanner planner(Paged(/*max_running=*/4, /*kv_blocks=*/16));
  FakeModel model;
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  for (uint64_t id = 1; id <= 3; ++id) model.Expect(id, 2);
  planner.Enqueue(1, Prompt(prompt, 2), kT0);
  StepPlan plan = planner.Schedule(kT0);
  planner.Update(plan, model.Run(plan));
  PlannedWork computes = Prompt(prompt, 2);
  computes.read_prefix = false;
  planner.Enqueue(2, computes, kT0);
  plan = planner.Schedule(kT0);
  ASSERT_EQ(plan.admitted.size(), 1u);
  EXPECT_EQ(plan.admitted[0].prefix_hit, 0);
  EXPECT_EQ(plan.rows.back().start, 0);
  EXPECT_EQ(plan.rows.back().num_tokens, 10);
  planner.Update(plan, model.Run(plan));
  RunToIdle(planner, model, 16);
  // Its blocks (or the first's) remain matchable.
  planner.Enqueue(3, Prompt(prompt, 2), kT0);
  EXPECT_EQ(planner.Schedule(kT0).admitted[0].prefix_hit, 8);
}

TEST(StepPlannerTest, CachedPrefixOutlivesItsRequestUntilEvicted) {
  StepPlanner planner(Paged(/*max_running=*/2, /*kv_blocks=*/4));
  FakeModel model;
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6};
  planner.Enqueue(1, Prompt(prompt, 1), kT0);
  model.Expect(1, 1);
  RunToIdle(planner, model, 4);
  EXPECT_EQ(planner.blocks_in_use(), 0);
  EXPECT_EQ(planner.blocks_cached(), 1);  // the prompt's one whole block
  // A later request with the same prompt still finds it.
  planner.Enqueue(2, Prompt(prompt, 1), kT0);
  model.Expect(2, 1);
  StepPlan plan = planner.Schedule(kT0);
  EXPECT_EQ(plan.admitted[0].prefix_hit, 4);
  EXPECT_EQ(planner.blocks_cached(), 0);  // in use again
  planner.Update(plan, model.Run(plan));
  RunToIdle(planner, model, 4);
  // A request needing every block evicts it; the prompt is then computed.
  planner.Enqueue(3, Prompt({9, 9, 9, 9, 9, 9, 9, 9, 9, 9}, 6), kT0);
  model.Expect(3, 6);
  RunToIdle(planner, model, 4);
  EXPECT_EQ(planner.blocks_cached(), 2);  // request 3's two prompt blocks
  planner.Enqueue(4, Prompt(prompt, 1), kT0);
  plan = planner.Schedule(kT0);
  EXPECT_EQ(plan.admitted[0].prefix_hit, 0);
}

TEST(StepPlannerTest, BlocksOfGeneratedTokensAreSharedToo) {
  StepPlanner planner(Paged(/*max_running=*/2, /*kv_blocks=*/16));
  planner.Enqueue(1, Prompt({1, 2, 3, 4, 5, 6}, 6), kT0);
  // The prompt's step emits 10, then each decode step feeds the last token
  // and emits the next; the sixth output is the last.
  const std::vector<int32_t> outputs = {10, 11, 12, 13, 14, 15};
  for (int step = 0; step < 6; ++step) {
    StepPlan plan = planner.Schedule(kT0);
    ASSERT_EQ(plan.rows.size(), 1u);
    planner.Update(plan, {step == 5}, {outputs[step]});
  }
  EXPECT_TRUE(planner.idle());
  // Positions 0..10 were computed: blocks [1 2 3 4] and [5 6 10 11]. The
  // next turn of the conversation reads both.
  planner.Enqueue(2, Prompt({1, 2, 3, 4, 5, 6, 10, 11, 12, 13, 99}, 1), kT0);
  StepPlan plan = planner.Schedule(kT0);
  ASSERT_EQ(plan.admitted.size(), 1u);
  EXPECT_EQ(plan.admitted[0].prefix_hit, 8);
  EXPECT_EQ(plan.rows[0].start, 8);
}

// Many requests of random sizes and shared prefixes through a small pool:
// rows always have their blocks, no block has two writers, the pool is
// never over-committed, and everything admitted finishes.
TEST(StepPlannerTest, PagedNeverOverCommitsUnderRandomLoad) {
  std::mt19937 random(42);
  for (int round = 0; round < 20; ++round) {
    StepPlanner planner(Paged(/*max_running=*/4, /*kv_blocks=*/9));
    FakeModel model;
    for (uint64_t id = 1; id <= 12; ++id) {
      std::vector<int32_t> prompt(1 + random() % 20);
      for (size_t i = 0; i < prompt.size(); ++i) {
        prompt[i] = i < 8 ? int32_t(random() % 2) : int32_t(random() % 50);
      }
      const int32_t outputs = 1 + random() % 12;
      planner.Enqueue(id, Prompt(prompt, outputs, random() % 2), kT0);
      model.Expect(id, outputs);
    }
    RunToIdle(planner, model, 9);
    EXPECT_EQ(planner.blocks_in_use(), 0);
  }
}

}  // namespace
}  // namespace moh
