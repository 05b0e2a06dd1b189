// BatchedClassifier: tasks past their deadline or whose client has gone are
// finished before compute (DEADLINE_EXCEEDED, CANCELLED), in the batch and,
// for families that compute task by task, between tasks; live ones run.
#include "service/engine/batched_classifier.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "prometheus/registry.h"

namespace moh {
namespace {

struct Outcome {
  absl::Notification done;
  absl::Status status;
};

class BatchedClassifierTest : public ::testing::Test {
 protected:
  BatchedClassifierTest()
      : metrics_(std::make_shared<prometheus::Registry>()),
        model_metrics_(metrics_.ForModel("m", 1, 1, false)) {
    config_.set_name("m");
    config_.mutable_batching()->set_max_batch_size(8);
    config_.mutable_batching()->set_max_queue_delay_ms(50);
    config_.mutable_batching()->set_max_queued_requests(16);
  }

  // Runs every task of a batch task by task, checking each first (as label
  // scoring does); `before_each` runs before each check.
  std::unique_ptr<BatchedClassifier> Make(std::function<void()> before_each) {
    auto made = BatchedClassifier::Create(
        config_, moh_, model_metrics_,
        [this, before_each](std::vector<ClassifyTask>& batch) {
          for (ClassifyTask& task : batch) {
            if (before_each) before_each();
            if (classifier_->FinishIfGone(task)) continue;
            ++computed_;
            classifier_->Finish(task, ClassifyResult());
          }
          return absl::OkStatus();
        });
    EXPECT_TRUE(made.ok()) << made.status();
    return std::move(made).value();
  }

  // Batches of more than `fits` tasks run out of memory; the others are
  // computed. Records every batch's size.
  std::unique_ptr<BatchedClassifier> MakeOutOfMemoryOver(size_t fits) {
    auto made = BatchedClassifier::Create(
        config_, moh_, model_metrics_,
        [this, fits](std::vector<ClassifyTask>& batch) {
          {
            absl::MutexLock lock(&mu_);
            sizes_.push_back(batch.size());
          }
          if (batch.size() > fits) {
            return absl::ResourceExhaustedError("out of memory: fake");
          }
          for (ClassifyTask& task : batch) {
            ++computed_;
            classifier_->Finish(task, ClassifyResult());
          }
          return absl::OkStatus();
        });
    EXPECT_TRUE(made.ok()) << made.status();
    return std::move(made).value();
  }

  std::shared_ptr<Outcome> Submit(absl::Time deadline,
                                  std::function<bool()> cancelled = nullptr) {
    auto outcome = std::make_shared<Outcome>();
    ClassifyCall call;
    call.deadline = deadline;
    call.cancelled = std::move(cancelled);
    auto done = [outcome](absl::StatusOr<ClassifyResult> result) {
      outcome->status = result.status();
      outcome->done.Notify();
    };
    EXPECT_TRUE(
        classifier_->Submit(ClassifyTask(), std::move(call), done).ok());
    return outcome;
  }

  v1::ModelConfig config_;
  MohConfig moh_;
  Metrics metrics_;
  ModelMetrics* model_metrics_;
  std::unique_ptr<BatchedClassifier> classifier_;
  std::atomic<int> computed_{0};
  absl::Mutex mu_;
  std::vector<size_t> sizes_ ABSL_GUARDED_BY(mu_);
};

TEST_F(BatchedClassifierTest, ExpiredAndCancelledTasksAreNeverComputed) {
  classifier_ = Make(nullptr);
  auto expired = Submit(absl::Now() - absl::Seconds(1));
  auto gone = Submit(absl::InfiniteFuture(), [] { return true; });
  auto live = Submit(absl::InfiniteFuture(), [] { return false; });
  for (const auto& o : {expired, gone, live}) o->done.WaitForNotification();
  EXPECT_EQ(expired->status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(gone->status.code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(live->status.ok()) << live->status;
  EXPECT_EQ(computed_, 1);
}

TEST_F(BatchedClassifierTest, AClientLeavingDuringTheBatchSkipsItsTask) {
  std::atomic<bool> left{false};
  std::atomic<int> checks{0};
  // The second task's client leaves while the first one is computed.
  classifier_ = Make([&] {
    if (++checks == 2) left = true;
  });
  auto first = Submit(absl::InfiniteFuture());
  auto second = Submit(absl::InfiniteFuture(), [&] { return left.load(); });
  first->done.WaitForNotification();
  second->done.WaitForNotification();
  EXPECT_TRUE(first->status.ok());
  EXPECT_EQ(second->status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(computed_, 1);
}

// A batch out of memory runs again in halves, down to single tasks; a single
// task out of memory fails with it (RESOURCE_EXHAUSTED, retryable).
TEST_F(BatchedClassifierTest, ABatchOutOfMemoryRunsAgainInHalves) {
  config_.mutable_batching()->set_max_batch_size(3);
  config_.mutable_batching()->set_max_queue_delay_ms(10000);  // full: 3
  classifier_ = MakeOutOfMemoryOver(1);
  std::vector<std::shared_ptr<Outcome>> outcomes;
  for (int i = 0; i < 3; ++i)
    outcomes.push_back(Submit(absl::InfiniteFuture()));
  for (const auto& o : outcomes) {
    o->done.WaitForNotification();
    EXPECT_TRUE(o->status.ok()) << o->status;
  }
  EXPECT_EQ(computed_, 3);
  {
    absl::MutexLock lock(&mu_);
    EXPECT_EQ(sizes_, (std::vector<size_t>{3, 1, 2, 1, 1}));
  }
  classifier_ = nullptr;
  config_.mutable_batching()->set_max_batch_size(1);
  classifier_ = MakeOutOfMemoryOver(0);
  auto alone = Submit(absl::InfiniteFuture());
  alone->done.WaitForNotification();
  EXPECT_EQ(alone->status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(alone->status.message(), "out of memory: fake");
  EXPECT_EQ(computed_, 3);
}

}  // namespace
}  // namespace moh
