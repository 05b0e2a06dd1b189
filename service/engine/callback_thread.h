// A thread that runs, in order, the callbacks another thread hands it: an
// engine loop's observers (building each streamed message and starting its
// gRPC write, whose send runs inline on the calling thread) run here, off the
// loop thread, so they no longer delay the next step. vLLM's asynchronous
// output processing, for the same reason: on a small model those calls had
// been a tenth of the loop thread's time.
//
// Callbacks posted are queued until Flush() hands the batch over (one wake-up
// per step rather than one per message). At most one batch is in flight:
// Flush() first waits for the previous batch to have run, so the queue never
// holds more than two steps' output however slow the callbacks are, and a
// callback that blocks holds the posting thread from its next Flush() on.
// Thread-safe; callbacks run one at a time, in the order posted.
#pragma once

#include <pthread.h>

#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace moh {

class CallbackThread {
 public:
  // `name`: the thread's (at most 15 characters are kept).
  explicit CallbackThread(const std::string& name) {
    thread_ = std::thread([this] { Run(); });
    pthread_setname_np(thread_.native_handle(), name.substr(0, 15).c_str());
  }

  // Runs every callback posted so far (flushed or not), then joins.
  ~CallbackThread() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    thread_.join();
  }

  CallbackThread(const CallbackThread&) = delete;
  CallbackThread& operator=(const CallbackThread&) = delete;

  // Queues `callback`; it runs after the next Flush().
  void Post(std::function<void()> callback) {
    absl::MutexLock lock(&mu_);
    posted_.push_back(std::move(callback));
  }

  // Waits for the batch handed over before (if any) to have run, then hands
  // over what was posted since.
  void Flush() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &CallbackThread::Idle));
    if (!posted_.empty()) flushed_ = true;
  }

 private:
  bool Ready() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return flushed_ || stopping_;
  }
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !flushed_ && !running_;
  }

  void Run() {
    std::vector<std::function<void()>> batch;
    while (true) {
      bool last;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &CallbackThread::Ready));
        batch.swap(posted_);
        flushed_ = false;
        running_ = true;
        last = stopping_;
      }
      for (std::function<void()>& callback : batch) callback();
      batch.clear();
      absl::MutexLock lock(&mu_);
      running_ = false;
      if (last) return;
    }
  }

  absl::Mutex mu_;
  std::vector<std::function<void()>> posted_ ABSL_GUARDED_BY(mu_);
  bool flushed_ ABSL_GUARDED_BY(mu_) = false;  // a batch waits to be taken
  bool running_ ABSL_GUARDED_BY(mu_) = false;  // a batch is being run
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace moh
