// Tests for Batcher<Task> (service/engine/batcher.h) and FakeClock
// (service/engine/clock.h).
//
// Timeout behaviour is tested with FakeClock only: time moves when the test
// says so, and FakeClock::BlockUntilWaiters tells the test when the batch
// thread has decided how long to wait. Wall time appears only as a guard
// against hanging (kHangGuard), never in an assertion about timing.
#include "service/engine/batcher.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/engine/clock.h"

namespace moh {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr absl::Duration kHangGuard = absl::Seconds(10);
constexpr absl::Duration kDelay = absl::Milliseconds(5);

// Move-only, like a real request that owns its RPC reactor.
struct TestTask {
  explicit TestTask(int id, size_t units = 1)
      : id(id), units(units), payload(std::make_unique<int>(id)) {}
  size_t size() const { return units; }

  int id;
  size_t units;
  std::unique_ptr<int> payload;
};

using TestBatcher = Batcher<TestTask>;
using Batches = std::vector<std::vector<int>>;

// Records the ids of every batch handed to the callback.
class Recorder {
 public:
  TestBatcher::ProcessBatchFn Fn() {
    return [this](std::vector<TestTask> batch) {
      std::vector<int> ids;
      for (const TestTask& task : batch) ids.push_back(task.id);
      absl::MutexLock lock(&mu_);
      batches_.push_back(std::move(ids));
    };
  }

  Batches Get() {
    absl::MutexLock lock(&mu_);
    return batches_;
  }

  // Waits until `n` batches have been processed (see kHangGuard).
  Batches WaitFor(size_t n) {
    return WaitUntil([n](const Batches& b) { return b.size() >= n; });
  }

  // Waits until the batches hold `n` tasks in all (see kHangGuard).
  Batches WaitForTasks(size_t n) {
    return WaitUntil([n](const Batches& batches) {
      size_t tasks = 0;
      for (const auto& batch : batches) tasks += batch.size();
      return tasks >= n;
    });
  }

 private:
  Batches WaitUntil(std::function<bool(const Batches&)> done) {
    absl::MutexLock lock(&mu_);
    auto ready = [this, &done]()
                     ABSL_SHARED_LOCKS_REQUIRED(mu_) { return done(batches_); };
    EXPECT_TRUE(mu_.AwaitWithTimeout(absl::Condition(&ready), kHangGuard))
        << "timed out; batches so far: " << batches_.size();
    return batches_;
  }

  absl::Mutex mu_;
  Batches batches_ ABSL_GUARDED_BY(mu_);
};

TestBatcher::Options FakeOptions(FakeClock* clock, int max_batch_size) {
  TestBatcher::Options options;
  options.max_batch_size = max_batch_size;
  options.max_queue_delay = kDelay;
  options.clock = clock;
  options.name = "test";
  return options;
}

std::unique_ptr<TestBatcher> MustCreate(const TestBatcher::Options& options,
                                        TestBatcher::ProcessBatchFn fn) {
  auto batcher = TestBatcher::Create(options, std::move(fn));
  EXPECT_TRUE(batcher.ok()) << batcher.status();
  return batcher.ok() ? *std::move(batcher) : nullptr;
}

// ---------------------------------------------------------------- FakeClock

TEST(FakeClockTest, TimeMovesOnlyWhenAdvanced) {
  const absl::Time start = absl::FromUnixSeconds(1000);
  FakeClock clock(start);
  EXPECT_EQ(clock.Now(), start);
  EXPECT_EQ(clock.Now(), start);
  clock.AdvanceTime(absl::Seconds(2));
  EXPECT_EQ(clock.Now(), start + absl::Seconds(2));
}

TEST(FakeClockTest, AwaitReturnsAtOnceWhenConditionHoldsOrDeadlinePassed) {
  FakeClock clock;
  absl::Mutex mu;
  bool flag = true;
  absl::MutexLock lock(&mu);
  EXPECT_TRUE(clock.AwaitWithDeadline(&mu, absl::Condition(&flag),
                                      absl::InfiniteFuture()));
  flag = false;
  EXPECT_FALSE(
      clock.AwaitWithDeadline(&mu, absl::Condition(&flag), clock.Now()));
  EXPECT_EQ(clock.NumWaiters(), 0);
}

TEST(FakeClockTest, AwaitWakesExactlyWhenDeadlineIsReached) {
  FakeClock clock;
  absl::Mutex mu;
  bool flag = false;
  bool result = true;
  std::thread waiter([&] {
    absl::MutexLock lock(&mu);
    result = clock.AwaitWithDeadline(&mu, absl::Condition(&flag),
                                     clock.Now() + absl::Seconds(1));
  });
  ASSERT_TRUE(clock.BlockUntilWaiters(1, kHangGuard));
  clock.AdvanceTime(absl::Seconds(1) - absl::Nanoseconds(1));
  EXPECT_EQ(clock.NumWaiters(), 1);
  clock.AdvanceTime(absl::Nanoseconds(1));
  EXPECT_EQ(clock.NumWaiters(), 0);
  waiter.join();
  EXPECT_FALSE(result);
}

TEST(FakeClockTest, AwaitWakesWhenConditionBecomesTrue) {
  FakeClock clock;
  absl::Mutex mu;
  bool flag = false;
  bool result = false;
  std::thread waiter([&] {
    absl::MutexLock lock(&mu);
    result = clock.AwaitWithDeadline(&mu, absl::Condition(&flag),
                                     absl::InfiniteFuture());
  });
  ASSERT_TRUE(clock.BlockUntilWaiters(1, kHangGuard));
  {
    absl::MutexLock lock(&mu);
    flag = true;
  }
  waiter.join();
  EXPECT_TRUE(result);
  EXPECT_EQ(clock.NumWaiters(), 0);
}

// ------------------------------------------------------------ Batch forming

TEST(BatcherTest, FullBatchIsProcessedWithoutWaitingForTheDelay) {
  FakeClock clock;
  Recorder recorder;
  auto batcher = MustCreate(FakeOptions(&clock, 3), recorder.Fn());
  ASSERT_NE(batcher, nullptr);
  for (int id : {1, 2, 3}) ASSERT_TRUE(batcher->Schedule(TestTask(id)).ok());
  // The fake clock never moves: only fullness can have formed this batch.
  EXPECT_THAT(recorder.WaitFor(1), ElementsAre(ElementsAre(1, 2, 3)));
}

TEST(BatcherTest, PartialBatchIsProcessedExactlyAtMaxQueueDelay) {
  FakeClock clock;
  Recorder recorder;
  auto batcher = MustCreate(FakeOptions(&clock, 4), recorder.Fn());
  ASSERT_NE(batcher, nullptr);
  ASSERT_TRUE(batcher->Schedule(TestTask(1)).ok());
  ASSERT_TRUE(batcher->Schedule(TestTask(2)).ok());
  ASSERT_TRUE(clock.BlockUntilWaiters(1, kHangGuard));

  clock.AdvanceTime(kDelay - absl::Nanoseconds(1));
  // Had the deadline been reached, AdvanceTime would have released the
  // batch thread from its wait before returning.
  EXPECT_EQ(clock.NumWaiters(), 1);
  EXPECT_THAT(recorder.Get(), IsEmpty());
  EXPECT_EQ(batcher->NumQueued(), 2u);

  clock.AdvanceTime(absl::Nanoseconds(1));
  EXPECT_EQ(clock.NumWaiters(), 0);
  EXPECT_THAT(recorder.WaitFor(1), ElementsAre(ElementsAre(1, 2)));
  EXPECT_EQ(batcher->NumQueued(), 0u);
}

TEST(BatcherTest, DelayCountsFromTheOldestTaskOfTheBatch) {
  FakeClock clock;
  Recorder recorder;
  auto batcher = MustCreate(FakeOptions(&clock, 4), recorder.Fn());
  ASSERT_NE(batcher, nullptr);
  ASSERT_TRUE(batcher->Schedule(TestTask(1)).ok());
  ASSERT_TRUE(clock.BlockUntilWaiters(1, kHangGuard));
  clock.AdvanceTime(kDelay - absl::Milliseconds(1));
  ASSERT_TRUE(batcher->Schedule(TestTask(2)).ok());
  clock.AdvanceTime(absl::Milliseconds(1));
  EXPECT_THAT(recorder.WaitFor(1), ElementsAre(ElementsAre(1, 2)));
}

TEST(BatcherTest, TaskThatWouldOverflowStartsTheNextBatch) {
  FakeClock clock;
  Recorder recorder;
  auto batcher = MustCreate(FakeOptions(&clock, 4), recorder.Fn());
  ASSERT_NE(batcher, nullptr);
  ASSERT_TRUE(batcher->Schedule(TestTask(1, /*units=*/3)).ok());
  ASSERT_TRUE(batcher->Schedule(TestTask(2, /*units=*/2)).ok());
  // The first batch closed when task 2 did not fit: no delay needed.
  EXPECT_THAT(recorder.WaitFor(1), ElementsAre(ElementsAre(1)));
  // Task 2 waits for its own deadline, counted from when it was scheduled.
  ASSERT_TRUE(clock.BlockUntilWaiters(1, kHangGuard));
  EXPECT_EQ(batcher->NumQueued(), 1u);
  EXPECT_THAT(recorder.Get(), ElementsAre(ElementsAre(1)));
  clock.AdvanceTime(kDelay);
  EXPECT_THAT(recorder.WaitFor(2), ElementsAre(ElementsAre(1), ElementsAre(2)));
}

TEST(BatcherTest, TasksAreBatchedAndProcessedInFifoOrder) {
  FakeClock clock;
  Recorder recorder;
  auto batcher = MustCreate(FakeOptions(&clock, 3), recorder.Fn());
  ASSERT_NE(batcher, nullptr);
  for (int id = 0; id < 7; ++id) {
    ASSERT_TRUE(batcher->Schedule(TestTask(id)).ok());
  }
  EXPECT_THAT(recorder.WaitFor(2),
              ElementsAre(ElementsAre(0, 1, 2), ElementsAre(3, 4, 5)));
  ASSERT_TRUE(clock.BlockUntilWaiters(1, kHangGuard));
  clock.AdvanceTime(kDelay);
  EXPECT_THAT(
      recorder.WaitFor(3),
      ElementsAre(ElementsAre(0, 1, 2), ElementsAre(3, 4, 5), ElementsAre(6)));
}

// -------------------------------------------------------- Schedule's errors

TEST(BatcherTest, OversizeTaskIsRejectedAndLeftWithTheCaller) {
  FakeClock clock;
  Recorder recorder;
  auto batcher = MustCreate(FakeOptions(&clock, 4), recorder.Fn());
  ASSERT_NE(batcher, nullptr);
  TestTask too_big(1, /*units=*/5);
  absl::Status status = batcher->Schedule(std::move(too_big));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("max_batch_size=4"));
  ASSERT_NE(too_big.payload, nullptr);  // Not moved from.
  EXPECT_EQ(batcher->NumQueued(), 0u);

  // Exactly max_batch_size fits, and is a full batch by itself.
  ASSERT_TRUE(batcher->Schedule(TestTask(2, /*units=*/4)).ok());
  EXPECT_THAT(recorder.WaitFor(1), ElementsAre(ElementsAre(2)));
}

TEST(BatcherTest, FullQueueRejectsAtOnceWhileAdmittedTasksComplete) {
  FakeClock clock;
  absl::Notification first_started;
  absl::Notification release_first;
  Recorder recorder;
  auto record = recorder.Fn();
  TestBatcher::Options options = FakeOptions(&clock, 1);
  options.max_queued_requests = 2;
  auto batcher = MustCreate(options, [&](std::vector<TestTask> batch) {
    if (batch[0].id == 1) {
      first_started.Notify();
      EXPECT_TRUE(release_first.WaitForNotificationWithTimeout(kHangGuard));
    }
    record(std::move(batch));
  });
  ASSERT_NE(batcher, nullptr);

  ASSERT_TRUE(batcher->Schedule(TestTask(1)).ok());
  ASSERT_TRUE(first_started.WaitForNotificationWithTimeout(kHangGuard));
  // Task 1 is being processed, so it no longer counts as queued.
  ASSERT_TRUE(batcher->Schedule(TestTask(2)).ok());
  ASSERT_TRUE(batcher->Schedule(TestTask(3)).ok());
  EXPECT_EQ(batcher->NumQueued(), 2u);

  TestTask rejected(4);
  absl::Status status = batcher->Schedule(std::move(rejected));
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(status.message(), "queue of test is full (max_queued_requests=2)");
  ASSERT_NE(rejected.payload, nullptr);  // Not moved from.

  release_first.Notify();
  EXPECT_THAT(recorder.WaitFor(3),
              ElementsAre(ElementsAre(1), ElementsAre(2), ElementsAre(3)));
  // Room again once the queue has drained.
  ASSERT_TRUE(batcher->Schedule(std::move(rejected)).ok());
  EXPECT_THAT(recorder.WaitFor(4).back(), ElementsAre(4));
}

// ------------------------------------------------------------- Stop / drain

TEST(BatcherTest, StopDrainsQueuedTasksThenRejectsNewOnes) {
  FakeClock clock;
  Recorder recorder;
  TestBatcher::Options options = FakeOptions(&clock, 10);
  options.max_queue_delay = absl::Hours(1);
  auto batcher = MustCreate(options, recorder.Fn());
  ASSERT_NE(batcher, nullptr);
  for (int id : {1, 2, 3}) ASSERT_TRUE(batcher->Schedule(TestTask(id)).ok());
  ASSERT_TRUE(clock.BlockUntilWaiters(1, kHangGuard));

  batcher->Stop();  // Returns only after the drain; time never moved.
  EXPECT_THAT(recorder.Get(), ElementsAre(ElementsAre(1, 2, 3)));
  EXPECT_EQ(batcher->NumQueued(), 0u);

  TestTask late(4);
  absl::Status status = batcher->Schedule(std::move(late));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(late.payload, nullptr);
  batcher->Stop();  // Idempotent.
  EXPECT_THAT(recorder.Get(), ElementsAre(ElementsAre(1, 2, 3)));
}

TEST(BatcherTest, DestructorDrainsQueuedTasks) {
  FakeClock clock;
  Recorder recorder;
  {
    TestBatcher::Options options = FakeOptions(&clock, 2);
    options.max_queue_delay = absl::InfiniteDuration();
    auto batcher = MustCreate(options, recorder.Fn());
    ASSERT_NE(batcher, nullptr);
    for (int id : {1, 2, 3}) ASSERT_TRUE(batcher->Schedule(TestTask(id)).ok());
  }
  EXPECT_THAT(recorder.Get(), ElementsAre(ElementsAre(1, 2), ElementsAre(3)));
}

// ------------------------------------------------------------------ Threads

TEST(BatcherTest, SeveralBatchThreadsProcessBatchesConcurrently) {
  FakeClock clock;
  absl::Mutex mu;
  int entered = 0;
  int saw_other = 0;
  TestBatcher::Options options = FakeOptions(&clock, 1);
  options.num_batch_threads = 2;
  auto batcher = MustCreate(options, [&](std::vector<TestTask>) {
    absl::MutexLock lock(&mu);
    ++entered;
    // Returns only once the other batch is in its callback too; with a
    // single processing thread this would wait for kHangGuard and fail.
    auto both = [&entered]() { return entered >= 2; };
    if (mu.AwaitWithTimeout(absl::Condition(&both), kHangGuard)) ++saw_other;
  });
  ASSERT_NE(batcher, nullptr);
  ASSERT_TRUE(batcher->Schedule(TestTask(1)).ok());
  ASSERT_TRUE(batcher->Schedule(TestTask(2)).ok());
  batcher->Stop();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(entered, 2);
  EXPECT_EQ(saw_other, 2);
}

TEST(BatcherTest, CompletesWithTheRealClock) {
  Recorder recorder;
  TestBatcher::Options options;  // RealClock() by default.
  options.max_batch_size = 4;
  options.max_queue_delay = absl::Microseconds(100);
  options.num_batch_threads = 1;
  auto batcher = MustCreate(options, recorder.Fn());
  ASSERT_NE(batcher, nullptr);
  std::vector<int> want;
  for (int id = 0; id < 10; ++id) {
    ASSERT_TRUE(batcher->Schedule(TestTask(id)).ok());
    want.push_back(id);
  }
  // No assertion on timing: the last (partial) batch must complete by
  // itself, before Stop, and the order must be FIFO.
  std::vector<int> got;
  for (const auto& batch : recorder.WaitForTasks(want.size())) {
    EXPECT_LE(batch.size(), 4u);
    got.insert(got.end(), batch.begin(), batch.end());
  }
  EXPECT_EQ(got, want);
  EXPECT_EQ(batcher->NumQueued(), 0u);
}

// ------------------------------------------------------------------ Options

TEST(BatcherTest, CreateRejectsBadOptionsNamingTheOption) {
  FakeClock clock;
  struct Case {
    std::function<void(TestBatcher::Options&)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](auto& o) { o.max_batch_size = 0; },
       "max_batch_size must be in [1, 2147483647], got 0"},
      {[](auto& o) { o.max_queue_delay = absl::Milliseconds(-1); },
       "max_queue_delay must be in [0, inf], got -1ms"},
      {[](auto& o) { o.max_queued_requests = -3; },
       "max_queued_requests must be in [1, 2147483647], got -3"},
      {[](auto& o) { o.num_batch_threads = 0; },
       "num_batch_threads must be in [1, 256], got 0"},
      {[](auto& o) { o.num_batch_threads = 257; },
       "num_batch_threads must be in [1, 256], got 257"},
      {[](auto& o) { o.clock = nullptr; }, "clock must not be null"},
      {[](auto& o) { o.name.clear(); }, "name must not be empty"},
  };
  for (const Case& c : cases) {
    TestBatcher::Options options = FakeOptions(&clock, 4);
    c.mutate(options);
    auto batcher = TestBatcher::Create(options, [](std::vector<TestTask>) {});
    ASSERT_FALSE(batcher.ok()) << c.message;
    EXPECT_EQ(batcher.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(batcher.status().message()), HasSubstr(c.message));
  }
  auto no_fn = TestBatcher::Create(FakeOptions(&clock, 4), nullptr);
  EXPECT_EQ(no_fn.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(no_fn.status().message()),
              HasSubstr("process_batch must not be empty"));

  TestBatcher::Options edge = FakeOptions(&clock, 1);
  edge.max_queue_delay = absl::ZeroDuration();
  edge.max_queued_requests = 1;
  edge.num_batch_threads = TestBatcher::kMaxBatchThreads;
  EXPECT_TRUE(TestBatcher::Create(edge, [](std::vector<TestTask>) {}).ok());
}

}  // namespace
}  // namespace moh
