// The thread half of continuous batching: one loop per model that owns the
// inbox (submissions and cancellations from RPC threads), the requests with
// their observers, and the scheduling metrics. Each iteration drains the
// inbox into the StepPlanner, asks it for a plan at the clock's time, tells
// the family's StepExecutor who left and who was admitted, has it run the
// step, and hands the outcome back to the planner. llama.cpp server's shape:
// one owner thread, where a cancel is just another message.
//
// A model family plugs in a StepExecutor<Request>: language generation
// (language/language_executor.cc) and image generation, a diffusion sampler's
// steps (diffusion/diffusion_executor.cc).
//
// Threading: Submit/Cancel/StopAccepting/counters are thread-safe. Executor
// calls run on the loop thread; they must not block and must not call back
// into the loop except Cancel().
#pragma once

#include <pthread.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/log.h"
#include "service/engine/clock.h"
#include "service/engine/draining.h"
#include "service/engine/step_planner.h"
#include "service/metrics/metrics.h"

namespace moh {

// How a request left the loop.
enum class EndKind {
  kFinished,   // it produced its last output
  kCancelled,  // Cancel(), queued or running
  kFailed,     // deadline, model error, shutdown: see the status
};

// What one row of a step came to.
struct RowOutcome {
  bool finished = false;  // the request produced its last output
  absl::Status error;     // this row failed: its request alone ends with it
  // The token it emitted (>= 0): the planner's prefix cache registers the
  // KV blocks of generated tokens too, once computed.
  int32_t token = -1;
};

// What a model family does with the plans of its loop. Runs on the loop
// thread only.
template <typename Request>
class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  // A queued request took a slot (`admitted.lowered`: at its activation
  // floor).
  virtual void Admit(Request& request, const AdmittedRequest& admitted) = 0;
  // Computes one step: rows[i] belongs to *requests[i]; (*outcomes)[i] says
  // what became of it. A returned error (the model's forward failed) fails
  // every request of the step; the loop and the other requests go on. Out
  // of memory (RESOURCE_EXHAUSTED) in a step that StepUndone() says left its
  // requests as they were is not an error of theirs: the loop computes their
  // rows again, in smaller steps (StepPlanner::ShrinkSteps).
  virtual absl::Status Run(const std::vector<PlannedRow>& rows,
                           const std::vector<Request*>& requests,
                           std::vector<RowOutcome>* outcomes) = 0;
  // The request leaves; called exactly once per submitted request.
  virtual void End(Request& request, EndKind kind,
                   const absl::Status& status) = 0;
  // After Run() failed: whether the step left each of its requests as it
  // was before the step (nothing streamed, nothing counted, no state
  // advanced; keys and values it wrote are written again the same), so that
  // their rows can run again.
  virtual bool StepUndone() const { return false; }
  // After each iteration of the loop (and after its shutdown): where an
  // executor that queues its observers' calls hands them over.
  virtual void StepDone() {}
  // After a step failed: OK, or UNAVAILABLE once the model's device can run
  // nothing more (DeviceLost, model/core/device_context.h). The loop then
  // stops as if shut down, every request ending with that status.
  virtual absl::Status DeviceLost() { return absl::OkStatus(); }
};

struct EngineLoopOptions {
  std::string name;          // the model's: logs and the thread's name
  Rpc rpc = Rpc::kGenerate;  // the queue-time metric's label
  // The batch-size metric's kind of a step's rows without a prompt.
  BatchKind step_kind = BatchKind::kDecode;
  StepPlannerOptions planner;
  Clock* clock = RealClock();
  // When a request arrives at an idle loop, how long the loop waits for the
  // next one before its first step; each arrival restarts the wait, for at
  // most kMaxGatherSpans x idle_gather in all. A burst (clients whose
  // previous requests ended in the same step) then starts in one step, not
  // one step per arrival. The wait ends early once as many requests have
  // arrived as the loop last ran at once before it went idle (or
  // max_running): the clients of a closed loop have all come back, and a
  // lone client's next request starts at once. (Counted in rows: where a
  // request takes several, the wait ends by time as before.) Zero: no wait.
  // Real time.
  absl::Duration idle_gather = absl::ZeroDuration();
  // Called once, on the loop thread, when a failed step left the model's
  // device lost (StepExecutor::DeviceLost), with its status. May be null.
  std::function<void(const absl::Status&)> on_device_lost;
};

template <typename Request>
class EngineLoop {
 public:
  // `executor` must outlive the loop; `metrics` may be null. Options must be
  // in range. Starts the thread.
  EngineLoop(const EngineLoopOptions& options, StepExecutor<Request>* executor,
             ModelMetrics* metrics)
      : options_(options),
        executor_(executor),
        metrics_(metrics),
        planner_(options.planner) {
    thread_ = std::thread([this] { Loop(); });
    const std::string name = ("moh-loop-" + options_.name).substr(0, 15);
    pthread_setname_np(thread_.native_handle(), name.c_str());
  }

  ~EngineLoop() {
    Stop();
    thread_.join();
  }

  // Stops the loop after the step under way: requests still queued or
  // running end kFailed with UNAVAILABLE; later Submit() calls get
  // UNAVAILABLE. Idempotent; the destructor calls it. (A lost device stops
  // it so too, with its own status.)
  void Stop() {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    accepting_ = false;
  }

  // Queues `request` (its planner view `work`) and returns its id. Never
  // blocks. RESOURCE_EXHAUSTED when max_queued_requests wait; UNAVAILABLE
  // after StopAccepting(). On error the request is dropped unseen.
  absl::StatusOr<uint64_t> Submit(const PlannedWork& work,
                                  std::unique_ptr<Request> request) {
    std::vector<std::unique_ptr<Request>> requests;
    requests.push_back(std::move(request));
    return SubmitGroup(work, std::move(requests));
  }

  // Queues the samples of one request as a group: all or none. They get
  // consecutive ids from the returned one, the first's; every later one
  // comes after the first (PlannedWork::after), and Cancel() of the first id
  // cancels them all. Errors as Submit's, counting every sample. `on_queued`
  // (may be null) gets the first id before any sample can run.
  absl::StatusOr<uint64_t> SubmitGroup(
      const PlannedWork& work, std::vector<std::unique_ptr<Request>> requests,
      const std::function<void(uint64_t)>& on_queued = nullptr) {
    absl::MutexLock lock(&mu_);
    if (!accepting_) return lost_.ok() ? DrainingError() : lost_;
    const int64_t n = requests.size();
    if (WaitingLocked() + n > options_.planner.max_queued_requests) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "too many requests waiting (max_queued_requests = ",
          options_.planner.max_queued_requests, ")",
          n > 1 ? absl::StrCat(" for ", n, " samples") : "", "; retry later"));
    }
    const uint64_t first = next_id_;
    const absl::Time now = options_.clock->Now();
    for (std::unique_ptr<Request>& request : requests) {
      const uint64_t id = next_id_++;
      PlannedWork sample = work;
      if (id != first) sample.after = first;
      inbox_.push_back(
          Incoming{id, std::move(sample), std::move(request), now});
      live_.insert(id);
      if (n > 1) group_of_[id] = first;
    }
    if (n > 1) groups_[first] = Group{n, n};
    if (on_queued) on_queued(first);
    // Set under the lock, as the loop does: set after it, this count could
    // land after the loop's newer one and leave the gauge stale while idle.
    if (metrics_ != nullptr) metrics_->SetWaiting(WaitingLocked());
    return first;
  }
  // Request `id` (with a group's first id: every sample still live) leaves
  // at the next step (EndKind::kCancelled). No-op for unknown or ended ids.
  void Cancel(uint64_t id) {
    absl::MutexLock lock(&mu_);
    auto group = groups_.find(id);
    const uint64_t n = group == groups_.end() ? 1 : group->second.size;
    for (uint64_t member = id; member < id + n; ++member) {
      if (live_.count(member) != 0) cancels_.insert(member);
    }
  }

  // Drain: later Submit() calls get UNAVAILABLE; accepted requests complete.
  void StopAccepting() {
    absl::MutexLock lock(&mu_);
    accepting_ = false;
  }

  int64_t num_running() const {
    absl::MutexLock lock(&mu_);
    return planner_.num_running();
  }
  int64_t num_waiting() const {
    absl::MutexLock lock(&mu_);
    return WaitingLocked();
  }
  // Nothing queued or running, read under one lock.
  bool idle() const {
    absl::MutexLock lock(&mu_);
    return inbox_.empty() && planner_.idle();
  }

 private:
  struct Incoming {
    uint64_t id;
    PlannedWork work;
    std::unique_ptr<Request> request;
    absl::Time submitted;
  };

  // The samples of one SubmitGroup: how many, and how many have not ended.
  struct Group {
    int64_t size;
    int64_t live;
  };

  // Request `id` has ended: it can no longer be cancelled.
  void Forget(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    live_.erase(id);
    auto member = group_of_.find(id);
    if (member == group_of_.end()) return;
    auto group = groups_.find(member->second);
    if (--group->second.live == 0) groups_.erase(group);
    group_of_.erase(member);
  }

  // See EngineLoopOptions::idle_gather.
  static constexpr int kMaxGatherSpans = 4;
  void GatherArrivals() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (options_.idle_gather <= absl::ZeroDuration()) return;
    const int64_t enough =
        busy_peak_rows_ > 0
            ? std::min<int64_t>(busy_peak_rows_, options_.planner.max_running)
            : options_.planner.max_running;
    busy_peak_rows_ = 0;
    const absl::Time deadline =
        absl::Now() + kMaxGatherSpans * options_.idle_gather;
    while (!stopping_ && static_cast<int64_t>(inbox_.size()) < enough) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return;
      arrivals_seen_ = inbox_.size();
      if (!mu_.AwaitWithTimeout(absl::Condition(this, &EngineLoop::Arrived),
                                std::min(left, options_.idle_gather))) {
        return;  // quiet for idle_gather, or out of time
      }
    }
  }
  bool Arrived() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || inbox_.size() > arrivals_seen_;
  }

  int64_t WaitingLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return static_cast<int64_t>(inbox_.size()) + planner_.num_waiting();
  }
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !inbox_.empty();
  }

  void Loop() {
    while (true) {
      StepPlan plan;
      {
        absl::MutexLock lock(&mu_);
        if (planner_.idle()) {
          mu_.Await(absl::Condition(this, &EngineLoop::HasWork));
          GatherArrivals();
        }
        if (stopping_) break;
        for (Incoming& in : inbox_) {
          planner_.Enqueue(in.id, in.work, in.submitted);
          requests_[in.id] = std::move(in.request);
        }
        inbox_.clear();
        for (uint64_t id : cancels_) planner_.Cancel(id);
        cancels_.clear();
        plan = planner_.Schedule(options_.clock->Now());
        for (const EndedRequest& ended : plan.ended) Forget(ended.id);
        if (metrics_ != nullptr) metrics_->SetWaiting(WaitingLocked());
      }
      for (const EndedRequest& ended : plan.ended) {
        End(ended.id,
            ended.status.ok() ? EndKind::kCancelled : EndKind::kFailed,
            ended.status);
      }
      for (const AdmittedRequest& admitted : plan.admitted) {
        if (metrics_ != nullptr) {
          metrics_->QueueTime(options_.rpc, admitted.queued);
          if (admitted.lowered) metrics_->RatioLowered();
          metrics_->PrefixCache(admitted.prefix_queried, admitted.prefix_hit);
        }
        executor_->Admit(*requests_.at(admitted.id), admitted);
      }
      if (!plan.rows.empty()) {
        RunStep(plan);
        busy_peak_rows_ = std::max<int64_t>(busy_peak_rows_, plan.rows.size());
      }
      executor_->StepDone();
      PublishGauges();
    }
    // Shutdown: every request, in the inbox, queued or running.
    std::vector<EndedRequest> ended;
    {
      absl::MutexLock lock(&mu_);
      for (Incoming& in : inbox_) {
        requests_[in.id] = std::move(in.request);
        ended.push_back(EndedRequest{in.id, {}, false});
      }
      inbox_.clear();
      for (const EndedRequest& e : planner_.Shutdown()) ended.push_back(e);
      live_.clear();
      groups_.clear();
      group_of_.clear();
    }
    absl::Status shutdown = absl::UnavailableError("server shutting down");
    {
      absl::MutexLock lock(&mu_);
      if (!lost_.ok()) shutdown = lost_;
    }
    for (const EndedRequest& e : ended) End(e.id, EndKind::kFailed, shutdown);
    executor_->StepDone();
    PublishGauges();
  }

  void RunStep(const StepPlan& plan) {
    if (metrics_ != nullptr) {
      if (plan.prefill_rows() > 0) {
        metrics_->BatchSize(BatchKind::kPrefill, plan.prefill_rows());
      }
      if (plan.decode_rows() > 0) {
        metrics_->BatchSize(options_.step_kind, plan.decode_rows());
      }
    }
    std::vector<Request*> requests;
    for (const PlannedRow& row : plan.rows) {
      requests.push_back(requests_.at(row.id).get());
    }
    std::vector<RowOutcome> outcomes(plan.rows.size());
    const absl::Status status = executor_->Run(plan.rows, requests, &outcomes);
    std::vector<bool> finished;
    std::vector<int32_t> emitted;
    std::unordered_map<uint64_t, absl::Status> row_errors;
    for (size_t i = 0; i < outcomes.size(); ++i) {
      finished.push_back(outcomes[i].finished || !outcomes[i].error.ok());
      emitted.push_back(outcomes[i].token);
      if (!outcomes[i].error.ok()) {
        row_errors[plan.rows[i].id] = outcomes[i].error;
      }
    }
    if (!status.ok() && RetrySmaller(plan, status)) return;
    std::vector<uint64_t> done;
    {
      absl::MutexLock lock(&mu_);
      done = status.ok() ? planner_.Update(plan, finished, emitted)
                         : planner_.Fail(plan);
      for (uint64_t id : done) Forget(id);
    }
    if (status.ok()) {
      for (uint64_t id : done) {
        auto error = row_errors.find(id);
        if (error == row_errors.end()) {
          End(id, EndKind::kFinished, status);
          continue;
        }
        // One failing row fails its request only; the batch goes on.
        MOH_LOG(Warning) << "model " << options_.name
                         << ": request failed: " << error->second.message();
        End(id, EndKind::kFailed, error->second);
      }
      return;
    }
    MOH_LOG(Error) << "model " << options_.name
                   << ": step failed: " << status.message();
    const absl::Status lost = executor_->DeviceLost();
    if (lost.ok()) {
      // Only this step's requests fail; the loop and the queue go on. Out
      // of memory stays RESOURCE_EXHAUSTED (StatusFromException): a retry,
      // in a smaller batch or later, may fit.
      const absl::Status error(
          status.code() == absl::StatusCode::kResourceExhausted
              ? absl::StatusCode::kResourceExhausted
              : absl::StatusCode::kInternal,
          absl::StrCat("model error: ", status.message()));
      for (uint64_t id : done) End(id, EndKind::kFailed, error);
      return;
    }
    // Nothing more can run: the loop stops, every request ends with the
    // loss, and the model's owner is told.
    MOH_LOG(Error) << "model " << options_.name << ": " << lost.message();
    const absl::Status error = absl::UnavailableError(
        absl::StrCat("model '", options_.name, "': ", lost.message()));
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      accepting_ = false;
      lost_ = error;
    }
    for (uint64_t id : done) End(id, EndKind::kFailed, error);
    if (options_.on_device_lost) options_.on_device_lost(error);
  }

  // A step that ran out of memory but left its requests as they were runs
  // again in smaller steps: true. False (its requests fail) where it cannot
  // be smaller, or was not undone.
  bool RetrySmaller(const StepPlan& plan, const absl::Status& status) {
    if (!absl::IsResourceExhausted(status) || !executor_->StepUndone()) {
      return false;
    }
    int64_t limit = 0;
    {
      absl::MutexLock lock(&mu_);
      if (!planner_.ShrinkSteps(plan)) return false;
      limit = planner_.step_token_limit();
    }
    MOH_LOG(Warning) << "model " << options_.name
                     << ": step failed: " << status.message() << "; its "
                     << PlannedTokens(plan.rows)
                     << " tokens run again, in steps of at most " << limit
                     << " tokens for a while";
    if (metrics_ != nullptr) metrics_->StepsRetried();
    return true;
  }

  void End(uint64_t id, EndKind kind, const absl::Status& status) {
    auto it = requests_.find(id);
    std::unique_ptr<Request> request = std::move(it->second);
    requests_.erase(it);
    executor_->End(*request, kind, status);
  }

  void PublishGauges() {
    if (metrics_ == nullptr) return;
    absl::MutexLock lock(&mu_);
    metrics_->SetRunning(planner_.num_running());
    metrics_->SetKvCacheUsage(
        static_cast<double>(planner_.reserved_positions()) /
        static_cast<double>(planner_.total_positions()));
    metrics_->SetKvBlocks(planner_.blocks_in_use(), planner_.blocks_cached());
  }

  const EngineLoopOptions options_;
  StepExecutor<Request>* const executor_;
  ModelMetrics* const metrics_;

  // Loop thread only.
  std::unordered_map<uint64_t, std::unique_ptr<Request>> requests_;

  mutable absl::Mutex mu_;
  // Changed by the loop thread only, under mu_ (the counters read it).
  StepPlanner planner_ ABSL_GUARDED_BY(mu_);
  std::vector<Incoming> inbox_ ABSL_GUARDED_BY(mu_);
  std::unordered_set<uint64_t> cancels_ ABSL_GUARDED_BY(mu_);
  std::unordered_set<uint64_t> live_ ABSL_GUARDED_BY(mu_);  // not yet ended
  // Groups of samples by their first id, and the group of each sample.
  std::unordered_map<uint64_t, Group> groups_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<uint64_t, uint64_t> group_of_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  size_t arrivals_seen_ ABSL_GUARDED_BY(mu_) = 0;  // GatherArrivals' count
  // The most rows of one step since the loop was last idle (0: none yet);
  // the loop thread's only.
  int64_t busy_peak_rows_ = 0;
  bool accepting_ ABSL_GUARDED_BY(mu_) = true;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status lost_ ABSL_GUARDED_BY(mu_);  // the device's loss, once lost
  std::thread thread_;
};

}  // namespace moh
