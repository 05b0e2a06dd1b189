// Turns SIGINT and SIGTERM into the cancellation of the call in flight (a gRPC
// RPC or an HTTP request), so that Ctrl-C during a streaming Generate ends the
// call cleanly on both sides.
//
// Signal handlers cannot call gRPC. Instead InstallInterruptWatcher blocks the
// two signals and a dedicated thread receives them with sigwait, where calling
// the thread-safe ClientContext::TryCancel (or setting a flag) is allowed.
#ifndef MOH_CLIENT_INTERRUPT_WATCHER_H_
#define MOH_CLIENT_INTERRUPT_WATCHER_H_

#include <grpcpp/client_context.h>

#include <atomic>
#include <functional>

namespace moh::client {

// Call first thing in main, before any other thread exists: the signal mask is
// inherited, so every later thread (gRPC's included) keeps the signals blocked
// and only the watcher thread receives them. On a signal the watcher cancels
// the call registered by the live CancelOnInterrupt; with none registered,
// or on a second signal, it ends the process at once with status 128 + signal.
void InstallInterruptWatcher();

// The signal received so far (SIGINT or SIGTERM), or 0.
int InterruptSignal();

// Forgets the signal received, once the program has handled it (the chat goes
// on after a cancelled reply): the next signal cancels again instead of
// ending the process.
void ClearInterrupt();

// Registers a call for cancellation on interrupt for this object's lifetime.
// At most one may be live at a time; not thread-safe itself.
class CancelOnInterrupt {
 public:
  // ClientContext::TryCancel.
  explicit CancelOnInterrupt(grpc::ClientContext* context);
  // Sets `*cancel` to true (OpenAiHttpClient's cancel flag).
  explicit CancelOnInterrupt(std::atomic<bool>* cancel);
  ~CancelOnInterrupt();
  CancelOnInterrupt(const CancelOnInterrupt&) = delete;
  CancelOnInterrupt& operator=(const CancelOnInterrupt&) = delete;

 private:
  void Register(std::function<void()> cancel);
};

}  // namespace moh::client

#endif  // MOH_CLIENT_INTERRUPT_WATCHER_H_
