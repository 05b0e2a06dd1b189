// EngineLoop with a fake executor on a fake clock: requests run to the end,
// cancellations and deadlines are messages the loop applies between steps,
// limits and drain answer at once, a failed step fails its requests only
// (unless it left the device lost: then everything ends with the loss), and
// shutdown ends everything. No LibTorch; steps are gated by the test, so
// nothing sleeps.
#include "service/engine/engine_loop.h"

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"

namespace moh {
namespace {

// What the test reads: it outlives the request, which the loop deletes.
struct Outcome {
  int32_t outputs = 0;  // produced so far
  bool admitted = false;
  absl::Notification ended;
  EndKind kind = EndKind::kFinished;
  absl::Status status;
};

struct FakeRequest {
  std::shared_ptr<Outcome> outcome = std::make_shared<Outcome>();
  int32_t fail_at = -1;      // the output count at which a step fails
  int32_t row_fail_at = -1;  // ... at which only this request's row fails
};

// Emits one output per row; a request finishes after its max_outputs. Each
// Run waits until the test allows another step.
class FakeExecutor : public StepExecutor<FakeRequest> {
 public:
  explicit FakeExecutor(int32_t max_outputs) : max_outputs_(max_outputs) {}
  ~FakeExecutor() override { Allow(1 << 30); }

  void Allow(int steps) {
    absl::MutexLock lock(&mu_);
    allowed_ += steps;
  }
  // Blocks until the loop is inside Run() waiting for permission.
  void AwaitWaitingStep() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&waiting_));
  }

  // Called on the loop thread as each step starts. Set before the loop.
  std::function<void()> on_step;
  // What DeviceLost() says after a failed step. Set before the loop.
  absl::Status lost;
  // What a failing step (FakeRequest::fail_at) returns. Set before the loop.
  absl::Status failure = absl::InternalError("fake failure");
  // The step (from 0) that runs out of memory, leaving its requests as they
  // were; -1: none. Set before the loop.
  int out_of_memory_at_step = -1;
  // The tokens of each step run so far.
  std::vector<int32_t> step_tokens() {
    absl::MutexLock lock(&mu_);
    return step_tokens_;
  }

  void Admit(FakeRequest& request, const AdmittedRequest&) override {
    request.outcome->admitted = true;
  }
  absl::Status Run(const std::vector<PlannedRow>& rows,
                   const std::vector<FakeRequest*>& requests,
                   std::vector<RowOutcome>* outcomes) override {
    {
      absl::MutexLock lock(&mu_);
      waiting_ = true;
      mu_.Await(absl::Condition(
          +[](int* allowed) { return *allowed > 0; }, &allowed_));
      --allowed_;
      waiting_ = false;
    }
    if (on_step) on_step();
    int32_t tokens = 0;
    for (const PlannedRow& row : rows) tokens += row.num_tokens;
    int step = 0;
    {
      absl::MutexLock lock(&mu_);
      step = static_cast<int>(step_tokens_.size());
      step_tokens_.push_back(tokens);
    }
    undone_ = step == out_of_memory_at_step;
    if (undone_) return absl::ResourceExhaustedError("out of memory: fake");
    for (size_t i = 0; i < rows.size(); ++i) {
      Outcome& r = *requests[i]->outcome;
      if (r.outputs == requests[i]->fail_at) return failure;
      if (r.outputs == requests[i]->row_fail_at) {
        (*outcomes)[i].error = absl::InvalidArgumentError("fake row failure");
        continue;
      }
      if (!rows[i].emits) continue;
      (*outcomes)[i].finished = ++r.outputs == max_outputs_;
    }
    return absl::OkStatus();
  }
  void End(FakeRequest& request, EndKind kind,
           const absl::Status& status) override {
    request.outcome->kind = kind;
    request.outcome->status = status;
    request.outcome->ended.Notify();
  }
  absl::Status DeviceLost() override { return lost; }
  bool StepUndone() const override { return undone_; }

 private:
  const int32_t max_outputs_;
  absl::Mutex mu_;
  int allowed_ ABSL_GUARDED_BY(mu_) = 0;
  bool waiting_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<int32_t> step_tokens_ ABSL_GUARDED_BY(mu_);
  bool undone_ = false;  // loop thread
};

class EngineLoopTest : public ::testing::Test {
 protected:
  static constexpr int32_t kOutputs = 3;

  EngineLoopTest() : clock_(absl::FromUnixSeconds(1000)), executor_(kOutputs) {
    options_.name = "fake";
    options_.planner.max_running = 2;
    options_.planner.max_seq_len = 64;
    options_.planner.max_queued_requests = 2;
    options_.planner.prefill_token_budget = 16;
    options_.clock = &clock_;
  }

  // Submits a request whose outcome the test reads through the pointer.
  std::shared_ptr<Outcome> Submit(EngineLoop<FakeRequest>& loop,
                                  absl::Time deadline, uint64_t* id = nullptr,
                                  int32_t fail_at = -1) {
    auto request = std::make_unique<FakeRequest>();
    request->fail_at = fail_at;
    std::shared_ptr<Outcome> outcome = request->outcome;
    PlannedWork work;
    work.prompt_len = 4;
    work.max_outputs = kOutputs;
    work.deadline = deadline;
    auto submitted = loop.Submit(work, std::move(request));
    EXPECT_TRUE(submitted.ok()) << submitted.status();
    if (id != nullptr && submitted.ok()) *id = *submitted;
    return outcome;
  }

  // A step that fails (the executor's `failure`) fails the requests in it
  // with `code` and "model error: <failure's message>"; the next request runs.
  void ExpectAFailedStepFailsItsRequestsOnly(const absl::Status& failure,
                                             absl::StatusCode code) {
    EngineLoopOptions options = options_;
    options.planner.max_running = 1;
    FakeExecutor executor(kOutputs);
    executor.failure = failure;
    EngineLoop<FakeRequest> loop(options, &executor, nullptr);
    executor.Allow(1 << 20);
    auto bad = Submit(loop, absl::InfiniteFuture(), nullptr, 1);
    auto good = Submit(loop, absl::InfiniteFuture());
    bad->ended.WaitForNotification();
    good->ended.WaitForNotification();
    EXPECT_EQ(bad->kind, EndKind::kFailed);
    EXPECT_EQ(bad->status.code(), code);
    EXPECT_EQ(bad->status.message(),
              absl::StrCat("model error: ", failure.message()));
    EXPECT_EQ(good->kind, EndKind::kFinished);
    EXPECT_EQ(good->outputs, kOutputs);
  }

  FakeClock clock_;
  FakeExecutor executor_;
  EngineLoopOptions options_;
};

TEST_F(EngineLoopTest, RequestsRunToTheirLastOutput) {
  EngineLoop<FakeRequest> loop(options_, &executor_, nullptr);
  executor_.Allow(1 << 20);
  auto a = Submit(loop, absl::InfiniteFuture());
  auto b = Submit(loop, absl::InfiniteFuture());
  a->ended.WaitForNotification();
  b->ended.WaitForNotification();
  for (const std::shared_ptr<Outcome>& r : {a, b}) {
    EXPECT_TRUE(r->admitted);
    EXPECT_EQ(r->kind, EndKind::kFinished);
    EXPECT_EQ(r->outputs, kOutputs);
  }
  EXPECT_EQ(loop.num_running(), 0);
  EXPECT_TRUE(loop.idle());
}

TEST_F(EngineLoopTest, CancelIsAppliedAtTheNextStep) {
  EngineLoop<FakeRequest> loop(options_, &executor_, nullptr);
  uint64_t id = 0;
  auto r = Submit(loop, absl::InfiniteFuture(), &id);
  executor_.AwaitWaitingStep();  // the loop is inside the first step
  loop.Cancel(id);
  loop.Cancel(id + 100);  // unknown: ignored
  executor_.Allow(1 << 20);
  r->ended.WaitForNotification();
  EXPECT_EQ(r->kind, EndKind::kCancelled);
  EXPECT_TRUE(r->status.ok());
  EXPECT_EQ(r->outputs, 1);  // the step under way completed
}

TEST_F(EngineLoopTest, DeadlinePassingBetweenStepsEndsTheRequest) {
  EngineLoop<FakeRequest> loop(options_, &executor_, nullptr);
  auto r = Submit(loop, clock_.Now() + absl::Seconds(1));
  executor_.AwaitWaitingStep();
  clock_.AdvanceTime(absl::Seconds(2));
  executor_.Allow(1 << 20);
  r->ended.WaitForNotification();
  EXPECT_EQ(r->kind, EndKind::kFailed);
  EXPECT_EQ(r->status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(r->outputs, 1);
}

TEST_F(EngineLoopTest, FullQueueAndDrainAnswerAtOnce) {
  options_.planner.max_running = 1;
  EngineLoop<FakeRequest> loop(options_, &executor_, nullptr);
  auto running = Submit(loop, absl::InfiniteFuture());
  executor_.AwaitWaitingStep();  // holds the only slot
  Submit(loop, absl::InfiniteFuture());
  Submit(loop, absl::InfiniteFuture());
  EXPECT_EQ(loop.num_waiting(), 2);
  auto full = loop.Submit(PlannedWork(), std::make_unique<FakeRequest>());
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("max_queued_requests = 2"),
            std::string::npos);
  loop.StopAccepting();
  auto drained = loop.Submit(PlannedWork(), std::make_unique<FakeRequest>());
  EXPECT_EQ(drained.status().code(), absl::StatusCode::kUnavailable);
  executor_.Allow(1 << 20);
  running->ended.WaitForNotification();
  EXPECT_EQ(running->kind, EndKind::kFinished);
}

TEST_F(EngineLoopTest, GroupsQueueAllOrNoneAndCancelTogether) {
  options_.planner.max_running = 4;
  options_.planner.max_queued_requests = 3;
  EngineLoop<FakeRequest> loop(options_, &executor_, nullptr);
  PlannedWork work;
  work.prompt_len = 4;
  work.max_outputs = kOutputs;
  auto group = [&](EngineLoop<FakeRequest>& target, int n,
                   std::vector<std::shared_ptr<Outcome>>* outcomes) {
    std::vector<std::unique_ptr<FakeRequest>> requests;
    for (int i = 0; i < n; ++i) {
      requests.push_back(std::make_unique<FakeRequest>());
      if (outcomes != nullptr) outcomes->push_back(requests.back()->outcome);
    }
    uint64_t seen = 0;
    auto id = target.SubmitGroup(work, std::move(requests),
                                 [&seen](uint64_t first) { seen = first; });
    if (id.ok()) EXPECT_EQ(seen, *id);
    return id;
  };
  // Four samples do not fit a queue of three: none is queued.
  auto full = group(loop, 4, nullptr);
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("for 4 samples"), std::string::npos);
  EXPECT_EQ(loop.num_waiting(), 0);
  std::vector<std::shared_ptr<Outcome>> samples;
  auto id = group(loop, 3, &samples);
  ASSERT_TRUE(id.ok()) << id.status();
  executor_.AwaitWaitingStep();  // the first computes its prompt
  loop.Cancel(*id);              // the first id cancels every sample
  executor_.Allow(1 << 20);
  for (const std::shared_ptr<Outcome>& sample : samples) {
    sample->ended.WaitForNotification();
    EXPECT_EQ(sample->kind, EndKind::kCancelled);
  }
  // The later samples waited for the first's prompt: never admitted.
  EXPECT_TRUE(samples[0]->admitted);
  EXPECT_FALSE(samples[1]->admitted);
  EXPECT_FALSE(samples[2]->admitted);
  EXPECT_TRUE(loop.idle());
  // Cancelling a later sample's id cancels that one only (on a loop whose
  // steps are held again).
  FakeExecutor gated(kOutputs);
  EngineLoop<FakeRequest> second(options_, &gated, nullptr);
  std::vector<std::shared_ptr<Outcome>> more;
  auto next = group(second, 2, &more);
  ASSERT_TRUE(next.ok());
  gated.AwaitWaitingStep();
  second.Cancel(*next + 1);
  gated.Allow(1 << 20);
  more[0]->ended.WaitForNotification();
  more[1]->ended.WaitForNotification();
  EXPECT_EQ(more[0]->kind, EndKind::kFinished);
  EXPECT_EQ(more[1]->kind, EndKind::kCancelled);
  EXPECT_FALSE(more[1]->admitted);
  EXPECT_TRUE(second.idle());
}

TEST_F(EngineLoopTest, FailedStepFailsItsRequestsOnly) {
  ExpectAFailedStepFailsItsRequestsOnly(absl::InternalError("fake failure"),
                                        absl::StatusCode::kInternal);
}

// Out of memory stays RESOURCE_EXHAUSTED, which a client may retry; any
// other failure is INTERNAL.
TEST_F(EngineLoopTest, AStepOutOfMemoryFailsRetryably) {
  ExpectAFailedStepFailsItsRequestsOnly(
      absl::ResourceExhaustedError("out of memory: fake"),
      absl::StatusCode::kResourceExhausted);
  ExpectAFailedStepFailsItsRequestsOnly(
      absl::InvalidArgumentError("a shape the model refused"),
      absl::StatusCode::kInternal);
}

// A step that runs out of memory but left its requests as they were is
// planned again in smaller steps (at most half its tokens): its requests run
// to their end. A step of a single token cannot be smaller: it fails its
// request, retryably.
TEST_F(EngineLoopTest, AStepOutOfMemoryRunsAgainInSmallerSteps) {
  FakeExecutor executor(kOutputs);
  executor.out_of_memory_at_step = 0;
  EngineLoop<FakeRequest> loop(options_, &executor, nullptr);
  auto a = Submit(loop, absl::InfiniteFuture());
  executor.AwaitWaitingStep();  // step 0: a's prompt, 4 tokens
  auto b = Submit(loop, absl::InfiniteFuture());
  executor.Allow(1 << 20);
  for (const std::shared_ptr<Outcome>& r : {a, b}) {
    r->ended.WaitForNotification();
    EXPECT_EQ(r->kind, EndKind::kFinished) << r->status;
    EXPECT_EQ(r->outputs, kOutputs);
  }
  const std::vector<int32_t> tokens = executor.step_tokens();
  ASSERT_GT(tokens.size(), 2u);
  EXPECT_EQ(tokens[0], 4);
  // a's prompt in two chunks of 2, then at most 2 tokens a step: a's decode
  // row beside b's prompt chunks of 1, then both decode rows.
  EXPECT_EQ(tokens[1], 2);
  EXPECT_EQ(tokens[2], 2);
  for (size_t i = 1; i < tokens.size(); ++i) EXPECT_LE(tokens[i], 2) << i;

  FakeExecutor single(kOutputs);
  single.out_of_memory_at_step = 1;  // a's first decode row
  EngineLoop<FakeRequest> second(options_, &single, nullptr);
  single.Allow(1 << 20);
  auto c = Submit(second, absl::InfiniteFuture());
  c->ended.WaitForNotification();
  EXPECT_EQ(c->kind, EndKind::kFailed);
  EXPECT_EQ(c->status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(c->status.message(), "model error: out of memory: fake");
  EXPECT_EQ(c->outputs, 1);
  EXPECT_EQ(single.step_tokens(), (std::vector<int32_t>{4, 1}));
}

TEST_F(EngineLoopTest, FailedRowFailsItsRequestOnly) {
  EngineLoop<FakeRequest> loop(options_, &executor_, nullptr);
  auto request = std::make_unique<FakeRequest>();
  request->row_fail_at = 1;
  auto bad = request->outcome;
  PlannedWork work{4, kOutputs, absl::InfiniteFuture(), false};
  ASSERT_TRUE(loop.Submit(work, std::move(request)).ok());
  auto good = Submit(loop, absl::InfiniteFuture());
  executor_.Allow(1 << 20);
  bad->ended.WaitForNotification();
  good->ended.WaitForNotification();
  EXPECT_EQ(bad->kind, EndKind::kFailed);
  EXPECT_EQ(bad->status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad->outputs, 1);
  EXPECT_EQ(good->kind, EndKind::kFinished);
  EXPECT_EQ(good->outputs, kOutputs);
}

TEST_F(EngineLoopTest, StopEndsQueuedAndRunningRequests) {
  options_.planner.max_running = 1;
  EngineLoop<FakeRequest> loop(options_, &executor_, nullptr);
  executor_.on_step = [&loop] { loop.Stop(); };
  auto running = Submit(loop, absl::InfiniteFuture());
  executor_.AwaitWaitingStep();
  auto queued = Submit(loop, absl::InfiniteFuture());
  executor_.Allow(1);  // the step under way completes; then the loop stops
  running->ended.WaitForNotification();
  queued->ended.WaitForNotification();
  for (const auto& r : {running, queued}) {
    EXPECT_EQ(r->kind, EndKind::kFailed);
    EXPECT_EQ(r->status.code(), absl::StatusCode::kUnavailable);
  }
  EXPECT_EQ(running->outputs, 1);
  auto late = loop.Submit(PlannedWork(), std::make_unique<FakeRequest>());
  EXPECT_EQ(late.status().code(), absl::StatusCode::kUnavailable);
}

// A failed step that left the device lost ends every request, running or
// queued, with the loss (UNAVAILABLE, naming the model), stops the loop,
// refuses later requests with it, and tells the model's owner once.
TEST_F(EngineLoopTest, LostDeviceEndsEverythingWithTheLoss) {
  options_.planner.max_running = 1;
  absl::Notification told;
  absl::Status told_status;
  int told_count = 0;
  options_.on_device_lost = [&](const absl::Status& status) {
    told_status = status;
    ++told_count;
    told.Notify();
  };
  executor_.lost =
      absl::UnavailableError("cuda:0 lost: an illegal memory access");
  EngineLoop<FakeRequest> loop(options_, &executor_, nullptr);
  auto running = Submit(loop, absl::InfiniteFuture(), nullptr, 1);
  auto queued = Submit(loop, absl::InfiniteFuture());
  executor_.Allow(1 << 20);  // both in before the loss
  running->ended.WaitForNotification();
  queued->ended.WaitForNotification();
  ASSERT_TRUE(told.WaitForNotificationWithTimeout(absl::Seconds(60)));
  for (const auto& r : {running, queued}) {
    EXPECT_EQ(r->kind, EndKind::kFailed);
    EXPECT_EQ(r->status.code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ(r->status.message(),
              "model 'fake': cuda:0 lost: an illegal memory access");
  }
  EXPECT_EQ(running->outputs, 1);
  EXPECT_EQ(queued->outputs, 0);  // never ran
  EXPECT_EQ(told_status, running->status);
  auto late = loop.Submit(PlannedWork(), std::make_unique<FakeRequest>());
  EXPECT_EQ(late.status(), running->status);
  loop.Stop();
  EXPECT_EQ(told_count, 1);
}

}  // namespace
}  // namespace moh
