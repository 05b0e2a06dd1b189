// CallbackThread: callbacks run off the posting thread, in order, only once
// flushed; Flush() waits for the batch before it (at most one in flight);
// the destructor runs what is left, flushed or not.
#include "service/engine/callback_thread.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace moh {
namespace {

constexpr absl::Duration kWait = absl::Seconds(30);

TEST(CallbackThreadTest, RunsFlushedCallbacksInOrderOffTheCaller) {
  absl::Mutex mu;
  std::vector<int> order;
  std::thread::id ran_on;
  absl::Notification done;
  CallbackThread thread("moh-test-cb");
  for (int i = 0; i < 100; ++i) {
    thread.Post([&, i] {
      absl::MutexLock lock(&mu);
      order.push_back(i);
      ran_on = std::this_thread::get_id();
    });
    if (i % 7 == 0) thread.Flush();
  }
  thread.Post([&] { done.Notify(); });
  thread.Flush();
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(kWait));
  absl::MutexLock lock(&mu);
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
  EXPECT_NE(ran_on, std::this_thread::get_id());
}

TEST(CallbackThreadTest, NothingRunsBeforeAFlush) {
  std::atomic<int> calls{0};
  CallbackThread thread("moh-test-cb");
  thread.Post([&] { ++calls; });
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(calls.load(), 0);
  thread.Flush();
  thread.Flush();  // waits for the batch above to have run
  EXPECT_EQ(calls.load(), 1);
}

TEST(CallbackThreadTest, FlushWaitsForTheBatchInFlight) {
  absl::Notification started, release;
  std::atomic<bool> second_flush_returned{false};
  CallbackThread thread("moh-test-cb");
  thread.Post([&] {
    started.Notify();
    release.WaitForNotificationWithTimeout(kWait);
  });
  thread.Flush();
  ASSERT_TRUE(started.WaitForNotificationWithTimeout(kWait));
  std::thread poster([&] {
    thread.Post([] {});
    thread.Flush();
    second_flush_returned = true;
  });
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(second_flush_returned.load());
  release.Notify();
  poster.join();
  EXPECT_TRUE(second_flush_returned.load());
}

TEST(CallbackThreadTest, DestructorRunsWhatIsLeft) {
  std::atomic<int> calls{0};
  {
    CallbackThread thread("moh-test-cb");
    thread.Post([&] { ++calls; });
    thread.Flush();
    thread.Post([&] { ++calls; });  // never flushed
  }
  EXPECT_EQ(calls.load(), 2);
}

}  // namespace
}  // namespace moh
