// Injected time for the server's batchers (TF Serving's `Env*` habit).
//
// Production code takes a `Clock*` (default `RealClock()`); tests pass a
// `FakeClock`, whose time moves only when the test says so, which makes
// timeout behaviour deterministic without any `sleep`.
//
// Contract for every `Clock`:
//   - `Now()` is thread-safe.
//   - `AwaitWithDeadline(mu, cond, deadline)` must be called with `*mu` held
//     exclusively. Like `absl::Mutex::AwaitWithDeadline` it may release and
//     reacquire `*mu`, and it returns (with `*mu` held) once `cond` is true or
//     once `Now() >= deadline` on this clock. It returns `cond`'s value at
//     return. `cond` must depend only on state guarded by `*mu`.
//   - A clock must outlive every object that uses it. `RealClock()` lives for
//     the whole process.
#ifndef MOH_SERVICE_CLOCK_H_
#define MOH_SERVICE_CLOCK_H_

#include <algorithm>
#include <atomic>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace moh {

class Clock {
 public:
  virtual ~Clock() = default;

  virtual absl::Time Now() = 0;

  // See the file comment. `deadline` is measured on this clock;
  // `absl::InfiniteFuture()` waits for `cond` alone.
  virtual bool AwaitWithDeadline(absl::Mutex* mu, const absl::Condition& cond,
                                 absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) = 0;
};

namespace clock_internal {

class SystemClock final : public Clock {
 public:
  absl::Time Now() override { return absl::Now(); }

  bool AwaitWithDeadline(absl::Mutex* mu, const absl::Condition& cond,
                         absl::Time deadline) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return mu->AwaitWithDeadline(cond, deadline);
  }
};

}  // namespace clock_internal

// The wall clock (absl::Now()). A process-wide singleton; never deleted.
inline Clock* RealClock() {
  static Clock* const clock = new clock_internal::SystemClock();
  return clock;
}

// A clock for tests. Time starts at `start` and advances only through
// `AdvanceTime`. All methods are thread-safe.
//
// A thread blocked in `AwaitWithDeadline` is a "waiter" from the moment it has
// registered its deadline until it is released: either `AdvanceTime` reaches
// its deadline (it stops counting as a waiter before `AdvanceTime` returns) or
// its condition became true and it has woken up. `BlockUntilWaiters` lets a
// test wait until the code under test has decided how long it will wait.
//
// Lock order: a FakeClock never acquires a caller's mutex `*mu` while the
// caller's thread could be holding it and waiting for the clock.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::UnixEpoch()) : now_(start) {}
  FakeClock(const FakeClock&) = delete;
  FakeClock& operator=(const FakeClock&) = delete;

  absl::Time Now() override ABSL_LOCKS_EXCLUDED(now_mu_) {
    absl::MutexLock lock(&now_mu_);
    return now_;
  }

  // Moves time forward by `d` (negative counts as zero) and releases every
  // waiter whose deadline is now reached. Must not be called while holding a
  // mutex that a waiter waits on.
  void AdvanceTime(absl::Duration d) ABSL_LOCKS_EXCLUDED(waiters_mu_) {
    absl::MutexLock lock(&waiters_mu_);
    absl::Time now;
    {
      absl::MutexLock now_lock(&now_mu_);
      now_ += std::max(d, absl::ZeroDuration());
      now = now_;
    }
    auto expired = std::stable_partition(
        waiters_.begin(), waiters_.end(),
        [now](const Waiter* w) { return w->deadline > now; });
    for (auto it = expired; it != waiters_.end(); ++it) {
      (*it)->expired.store(true, std::memory_order_release);
      // The waiter's condition reads `expired`, which `*mu` does not guard;
      // releasing `*mu` makes absl re-evaluate it. The waiter cannot return
      // (and its caller cannot destroy `*mu`) until it can take
      // `waiters_mu_`, which we hold.
      (*it)->mu->Lock();
      (*it)->mu->Unlock();
    }
    waiters_.erase(expired, waiters_.end());
  }

  // Number of threads currently waiting in `AwaitWithDeadline`.
  int NumWaiters() ABSL_LOCKS_EXCLUDED(waiters_mu_) {
    absl::MutexLock lock(&waiters_mu_);
    return static_cast<int>(waiters_.size());
  }

  // Blocks until at least `n` threads are waiting in `AwaitWithDeadline`.
  // `real_timeout` (wall time) only guards tests against hanging; returns
  // false if it expired first.
  bool BlockUntilWaiters(int n,
                         absl::Duration real_timeout = absl::InfiniteDuration())
      ABSL_LOCKS_EXCLUDED(waiters_mu_) {
    absl::MutexLock lock(&waiters_mu_);
    auto enough = [this, n]() ABSL_SHARED_LOCKS_REQUIRED(waiters_mu_) {
      return static_cast<int>(waiters_.size()) >= n;
    };
    return waiters_mu_.AwaitWithTimeout(absl::Condition(&enough), real_timeout);
  }

  bool AwaitWithDeadline(absl::Mutex* mu, const absl::Condition& cond,
                         absl::Time deadline) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (cond.Eval()) return true;
    if (Now() >= deadline) return false;

    Waiter waiter{mu, deadline};
    // Register without holding *mu: AdvanceTime locks *mu under waiters_mu_.
    mu->Unlock();
    {
      absl::MutexLock lock(&waiters_mu_);
      if (Now() >= deadline) {
        waiter.expired.store(true, std::memory_order_relaxed);
      } else {
        waiters_.push_back(&waiter);
      }
    }
    mu->Lock();
    auto released = [&waiter, &cond]() {
      return waiter.expired.load(std::memory_order_acquire) || cond.Eval();
    };
    mu->Await(absl::Condition(&released));
    mu->Unlock();
    {
      absl::MutexLock lock(&waiters_mu_);
      waiters_.erase(std::remove(waiters_.begin(), waiters_.end(), &waiter),
                     waiters_.end());
    }
    mu->Lock();
    return cond.Eval();
  }

 private:
  struct Waiter {
    Waiter(absl::Mutex* m, absl::Time d) : mu(m), deadline(d) {}
    absl::Mutex* const mu;
    const absl::Time deadline;
    std::atomic<bool> expired{false};
  };

  // Leaf lock: held only to read or write `now_`.
  absl::Mutex now_mu_;
  absl::Time now_ ABSL_GUARDED_BY(now_mu_);

  // Acquired before any waiter's `*mu`, never while holding one.
  absl::Mutex waiters_mu_ ABSL_ACQUIRED_BEFORE(now_mu_);
  std::vector<Waiter*> waiters_ ABSL_GUARDED_BY(waiters_mu_);
};

}  // namespace moh

#endif  // MOH_SERVICE_CLOCK_H_
