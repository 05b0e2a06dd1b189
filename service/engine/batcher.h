// Batcher<Task>: the dynamic batcher behind Classify (SPEC §4), after TF
// Serving's BatchScheduler<TaskType>. It knows nothing of models or RPCs: a
// task only needs to be movable and to have `size_t size() const`; the model
// plugs in through a callback that receives whole batches.
//
// Batching policy (all of it lives here):
//   - Tasks are batched in arrival order (FIFO); batch threads take batches
//     in the order they formed (with one thread, they are processed in it).
//   - The sizes of a batch's tasks add up to at most `max_batch_size`. A task
//     that would overflow the current batch closes it and starts the next one.
//   - A batch is handed to the callback as soon as it is full or closed, or
//     when its oldest task has waited `max_queue_delay` on `options.clock`.
//   - `Stop()` (and the destructor) stops admission, then hands every queued
//     task to the callback without waiting for any delay, then joins.
//
// Ownership and errors of `Schedule(Task&&)`:
//   - Never blocks on batch processing or on the queue.
//   - Takes ownership of the task (moves from it) only when it returns OK.
//     On any error the caller's task is untouched, so it can answer it.
//   - INVALID_ARGUMENT: `task.size() > max_batch_size` (can never be batched).
//     A task of size 0 is accepted; it still counts toward
//     `max_queued_requests`.
//   - UNAVAILABLE: `Stop()` has begun (the server is draining).
//   - RESOURCE_EXHAUSTED: `max_queued_requests` tasks are already waiting.
//
// Threading:
//   - `Schedule`, `NumQueued` and `Stop` are thread-safe.
//   - `ProcessBatchFn` runs on one of the `num_batch_threads` batch threads,
//     without any batcher lock held; with several threads, batches are
//     processed concurrently. It may call `Schedule` and `NumQueued`, but must
//     not call `Stop` or destroy the batcher (it would join its own thread).
//   - `options.clock` must outlive the batcher.
#ifndef MOH_SERVICE_BATCHER_H_
#define MOH_SERVICE_BATCHER_H_

#if defined(__linux__)
#include <pthread.h>
#endif

#include <climits>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "service/config/config_limits.h"
#include "service/engine/clock.h"
#include "service/engine/draining.h"

namespace moh {

template <typename Task>
class Batcher {
 public:
  static constexpr int kMaxBatchThreads = 256;

  // Defaults are an unconfigured server's (service/config/config_limits.h).
  struct Options {
    // Largest sum of task sizes in one batch. Range [1, 2^31 - 1].
    int max_batch_size = config_limits::kMaxBatchSize.default_value;
    // How long the oldest task of a batch that is not full may wait before
    // the batch is processed anyway. Range [0, absl::InfiniteDuration()];
    // infinite means batches form only when full (or on Stop).
    absl::Duration max_queue_delay =
        absl::Milliseconds(config_limits::kMaxQueueDelayMs.default_value);
    // Most tasks waiting in the queue (not yet handed to the callback);
    // beyond it Schedule answers RESOURCE_EXHAUSTED. Range [1, 2^31 - 1].
    int max_queued_requests =
        config_limits::kBatchingMaxQueuedRequests.default_value;
    // Threads that call ProcessBatchFn. Range [1, kMaxBatchThreads = 256].
    int num_batch_threads = 1;
    // Time source for max_queue_delay; not owned, must outlive the batcher.
    Clock* clock = RealClock();
    // Names the batcher in error messages and thread names (e.g. the model).
    std::string name = "batcher";
  };

  // Receives a non-empty batch, in FIFO order, and owns it.
  using ProcessBatchFn = std::function<void(std::vector<Task> batch)>;

  // INVALID_ARGUMENT naming the option and its allowed range when an option
  // is out of range, or when `process_batch` is empty. Starts the threads.
  static absl::StatusOr<std::unique_ptr<Batcher>> Create(
      const Options& options, ProcessBatchFn process_batch);

  Batcher(const Batcher&) = delete;
  Batcher& operator=(const Batcher&) = delete;

  // Calls Stop().
  ~Batcher() { Stop(); }

  // See the file comment for the ownership contract and the errors.
  absl::Status Schedule(Task&& task) ABSL_LOCKS_EXCLUDED(mu_);

  // Stops admission, processes every queued task, joins the batch threads.
  // Idempotent; returns once the last batch has been processed.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_, stop_mu_);

  // Tasks waiting in the queue, not yet handed to ProcessBatchFn (the queue
  // depth to export as a metric).
  size_t NumQueued() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return num_queued_;
  }

  const Options& options() const { return options_; }

 private:
  struct PendingBatch {
    std::vector<Task> tasks;
    size_t size = 0;      // Sum of the tasks' sizes.
    absl::Time oldest;    // When its first task was scheduled.
    uint64_t id = 0;      // Distinguishes batches across waits.
    bool closed = false;  // Full, or the next task did not fit.
  };

  Batcher(const Options& options, ProcessBatchFn process_batch)
      : options_(options), process_batch_(std::move(process_batch)) {}

  static absl::Status ValidateOptions(const Options& options);

  void BatchThreadLoop();

  // The next batch to process, or an empty vector once stopping with nothing
  // left to process.
  std::vector<Task> NextBatch() ABSL_LOCKS_EXCLUDED(mu_);

  bool HasWorkOrStopping() const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return stopping_ || !batches_.empty();
  }

  const Options options_;
  const ProcessBatchFn process_batch_;

  mutable absl::Mutex mu_;
  std::deque<PendingBatch> batches_ ABSL_GUARDED_BY(mu_);
  size_t num_queued_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_batch_id_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;

  // Serialises Stop() so that the threads are joined exactly once.
  absl::Mutex stop_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(stop_mu_);
};

template <typename Task>
absl::Status Batcher<Task>::ValidateOptions(const Options& options) {
  auto out_of_range = [&options](const char* option, auto value,
                                 const std::string& range) {
    return absl::InvalidArgumentError(
        absl::StrCat("batcher '", options.name, "': ", option, " must be in ",
                     range, ", got ", value));
  };
  // The config's minimums; above them, any value the type holds (the config
  // caps what an operator may ask for, service/config/config_limits.h).
  const int min_batch_size = config_limits::kMaxBatchSize.min;
  const int min_queued = config_limits::kBatchingMaxQueuedRequests.min;
  if (options.max_batch_size < min_batch_size) {
    return out_of_range("max_batch_size", options.max_batch_size,
                        absl::StrCat("[", min_batch_size, ", ", INT_MAX, "]"));
  }
  if (options.max_queue_delay < absl::ZeroDuration()) {
    return out_of_range("max_queue_delay",
                        absl::FormatDuration(options.max_queue_delay),
                        "[0, inf]");
  }
  if (options.max_queued_requests < min_queued) {
    return out_of_range("max_queued_requests", options.max_queued_requests,
                        absl::StrCat("[", min_queued, ", ", INT_MAX, "]"));
  }
  if (options.num_batch_threads < 1 ||
      options.num_batch_threads > kMaxBatchThreads) {
    return out_of_range("num_batch_threads", options.num_batch_threads,
                        absl::StrCat("[1, ", kMaxBatchThreads, "]"));
  }
  if (options.clock == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("batcher '", options.name, "': clock must not be null"));
  }
  if (options.name.empty()) {
    return absl::InvalidArgumentError("batcher: name must not be empty");
  }
  return absl::OkStatus();
}

template <typename Task>
absl::StatusOr<std::unique_ptr<Batcher<Task>>> Batcher<Task>::Create(
    const Options& options, ProcessBatchFn process_batch) {
  absl::Status status = ValidateOptions(options);
  if (!status.ok()) return status;
  if (!process_batch) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batcher '", options.name, "': process_batch must not be empty"));
  }

  std::unique_ptr<Batcher> batcher(
      new Batcher(options, std::move(process_batch)));
  absl::MutexLock lock(&batcher->stop_mu_);
  for (int i = 0; i < options.num_batch_threads; ++i) {
    batcher->threads_.emplace_back(
        [b = batcher.get()] { b->BatchThreadLoop(); });
#if defined(__linux__)
    // Linux limits thread names to 15 characters.
    const std::string thread_name = options.name.substr(0, 15);
    pthread_setname_np(batcher->threads_.back().native_handle(),
                       thread_name.c_str());
#endif
  }
  return batcher;
}

template <typename Task>
absl::Status Batcher<Task>::Schedule(Task&& task) {
  const size_t task_size = task.size();
  if (task_size > static_cast<size_t>(options_.max_batch_size)) {
    return absl::InvalidArgumentError(
        absl::StrCat("task of size ", task_size, " exceeds max_batch_size=",
                     options_.max_batch_size, " of ", options_.name));
  }
  absl::MutexLock lock(&mu_);
  if (stopping_) {
    return DrainingError();
  }
  if (num_queued_ >= static_cast<size_t>(options_.max_queued_requests)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "queue of ", options_.name,
        " is full (max_queued_requests=", options_.max_queued_requests, ")"));
  }
  const size_t max_size = static_cast<size_t>(options_.max_batch_size);
  if (!batches_.empty() && !batches_.back().closed &&
      batches_.back().size + task_size > max_size) {
    batches_.back().closed = true;
  }
  if (batches_.empty() || batches_.back().closed) {
    batches_.emplace_back();
    batches_.back().oldest = options_.clock->Now();
    batches_.back().id = next_batch_id_++;
  }
  PendingBatch& batch = batches_.back();
  batch.tasks.push_back(std::move(task));
  batch.size += task_size;
  if (batch.size >= max_size) batch.closed = true;
  ++num_queued_;
  return absl::OkStatus();
}

template <typename Task>
void Batcher<Task>::Stop() {
  absl::MutexLock stop_lock(&stop_mu_);
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& thread : threads_) thread.join();
  threads_.clear();
}

template <typename Task>
void Batcher<Task>::BatchThreadLoop() {
  for (;;) {
    std::vector<Task> batch = NextBatch();
    if (batch.empty()) return;
    process_batch_(std::move(batch));
  }
}

template <typename Task>
std::vector<Task> Batcher<Task>::NextBatch() {
  absl::MutexLock lock(&mu_);
  for (;;) {
    mu_.Await(absl::Condition(this, &Batcher::HasWorkOrStopping));
    if (batches_.empty()) return {};  // Stopping, and drained.
    PendingBatch& front = batches_.front();
    const absl::Time deadline = front.oldest + options_.max_queue_delay;
    if (front.closed || stopping_ || options_.clock->Now() >= deadline) {
      std::vector<Task> tasks = std::move(front.tasks);
      batches_.pop_front();
      num_queued_ -= tasks.size();
      return tasks;
    }
    // The front batch is the open one. Wait until it closes, times out, is
    // taken by another thread, or Stop begins; then look again.
    const uint64_t id = front.id;
    auto changed = [this, id]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return stopping_ || batches_.empty() || batches_.front().id != id ||
             batches_.front().closed;
    };
    options_.clock->AwaitWithDeadline(&mu_, absl::Condition(&changed),
                                      deadline);
  }
}

}  // namespace moh

#endif  // MOH_SERVICE_BATCHER_H_
