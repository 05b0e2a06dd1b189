// StepPlanner on a fake clock with a fake model: admission by slots and KV
// positions, deadlines, cancellation, adaptive lowering, prompt chunks and
// failures, step by step. No LibTorch, no threads, no sleeps.
#include "service/step_planner.h"

#include <gtest/gtest.h>

#include <map>
#include <vector>

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

// The fake model: a request finishes after `max_outputs` outputs.
class FakeModel {
 public:
  void Expect(uint64_t id, int32_t outputs) { remaining_[id] = outputs; }
  std::vector<bool> Run(const StepPlan& plan) {
    std::vector<bool> finished;
    for (const PlannedRow& row : plan.rows) {
      finished.push_back(row.emits && --remaining_[row.id] == 0);
    }
    return finished;
  }

 private:
  std::map<uint64_t, int32_t> remaining_;
};

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

}  // namespace
}  // namespace moh
