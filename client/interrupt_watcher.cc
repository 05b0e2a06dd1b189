#include "client/interrupt_watcher.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace moh::client {
namespace {

struct WatcherState {
  absl::Mutex mu;
  std::function<void()> cancel ABSL_GUARDED_BY(mu);
  std::atomic<int> signal{0};
};

// Leaked on purpose: the detached watcher thread may outlive main's statics.
WatcherState& State() {
  static WatcherState* const state = new WatcherState;
  return *state;
}

sigset_t InterruptSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

void WatchSignals() {
  const sigset_t set = InterruptSignals();
  WatcherState& state = State();
  for (;;) {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) continue;
    if (state.signal.exchange(sig) != 0) _exit(128 + sig);
    absl::MutexLock lock(&state.mu);
    if (!state.cancel) _exit(128 + sig);
    state.cancel();
  }
}

}  // namespace

void InstallInterruptWatcher() {
  const sigset_t set = InterruptSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  State();
  std::thread(WatchSignals).detach();
}

int InterruptSignal() { return State().signal.load(); }

void ClearInterrupt() { State().signal.store(0); }

CancelOnInterrupt::CancelOnInterrupt(grpc::ClientContext* context) {
  Register([context] { context->TryCancel(); });
}

CancelOnInterrupt::CancelOnInterrupt(std::atomic<bool>* cancel) {
  Register([cancel] { cancel->store(true); });
}

void CancelOnInterrupt::Register(std::function<void()> cancel) {
  WatcherState& state = State();
  absl::MutexLock lock(&state.mu);
  state.cancel = std::move(cancel);
  // A signal that came before the call existed cancels it right away.
  if (state.signal.load() != 0) state.cancel();
}

CancelOnInterrupt::~CancelOnInterrupt() {
  WatcherState& state = State();
  absl::MutexLock lock(&state.mu);
  state.cancel = nullptr;
}

}  // namespace moh::client
