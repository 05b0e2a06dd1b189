// What an event-driven libmicrohttpd daemon (a few polling threads for all
// its connections, handlers that never block) needs around it:
//
// - Deadlines that bytes do not reset: a request's headers must be whole
//   within `header_timeout` of its connection opening (or of the previous
//   request on that connection ending), and its body within `body_timeout`
//   of its headers. libmicrohttpd's own timeout is an idle one, which a
//   client sending a byte at a time resets forever.
// - Suspended requests: a request waiting for a request worker or for its
//   model suspends its connection (no thread waits) and an HttpWaker resumes
//   it when there is something to do; a client that leaves while suspended
//   is noticed (libmicrohttpd does not watch suspended connections).
//
// One thread looks at both every `poll` (100 ms): it shuts the socket of a
// connection past its deadline (libmicrohttpd then closes it) and wakes a
// suspended request whose client hung up.
#pragma once

#include <microhttpd.h>

#include <atomic>
#include <memory>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace moh {

class HttpWaker;

class HttpConnectionWatch {
 public:
  struct Options {
    absl::Duration header_timeout = absl::Seconds(30);
    absl::Duration body_timeout = absl::Seconds(60);
    absl::Duration poll = absl::Milliseconds(100);
  };

  explicit HttpConnectionWatch(Options options);
  // Stops the thread (after Stop, or with no suspended request left).
  ~HttpConnectionWatch();

  HttpConnectionWatch(const HttpConnectionWatch&) = delete;
  HttpConnectionWatch& operator=(const HttpConnectionWatch&) = delete;

  // MHD_NotifyConnectionCallback (cls: this), for MHD_OPTION_NOTIFY_CONNECTION:
  // a connection opens (its header deadline starts) or closes.
  static void Notify(void* cls, MHD_Connection* connection,
                     void** socket_context,
                     enum MHD_ConnectionNotificationCode code);

  // A request's phases, from the daemon's callbacks: its headers are whole
  // (the body's deadline starts), its body is whole (no deadline while it is
  // served), it ended (the next request's header deadline starts).
  void HeadersReceived(MHD_Connection* connection);
  void BodyReceived(MHD_Connection* connection);
  void RequestEnded(MHD_Connection* connection);

  // A waker for the request now on `connection` (from its handler).
  std::shared_ptr<HttpWaker> NewWaker(MHD_Connection* connection);

  // Resumes every suspended request, and no request suspends any more (they
  // see Stopping()): call before MHD_stop_daemon, which must find none.
  void Stop();

  // What wakers share with the watch; they may outlive it (a model's
  // callbacks may wake a request after the server is gone).
  struct Shared {
    absl::Mutex mu;
    bool stopping ABSL_GUARDED_BY(mu) = false;
    absl::flat_hash_set<HttpWaker*> suspended ABSL_GUARDED_BY(mu);
  };

 private:
  struct Tracked {
    int fd = -1;
    absl::Time deadline = absl::InfiniteFuture();
    bool shut = false;  // its socket was shut for the deadline
  };

  void SetDeadline(MHD_Connection* connection, absl::Duration after);
  void Run();
  void CloseLate(absl::Time now);
  void WakeDeparted();

  const Options options_;
  const std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
  absl::Mutex mu_;
  absl::flat_hash_map<MHD_Connection*, Tracked> connections_
      ABSL_GUARDED_BY(mu_);
  absl::Notification done_;
  std::thread thread_;
};

// Wakes one request's suspended connection. Shared by the request's handler
// (which suspends), the request worker and the model's callbacks (which
// wake, and may do so after the connection closed: a waker touches its
// connection only while it is suspended, and a suspended connection stays
// open).
class HttpWaker {
 public:
  HttpWaker(std::shared_ptr<HttpConnectionWatch::Shared> shared,
            MHD_Connection* connection, int fd)
      : shared_(std::move(shared)), connection_(connection), fd_(fd) {}

  // On the connection's thread, in its access handler or content reader:
  // suspends the connection unless something happened since the last call
  // (a Wake, the client leaving, the server stopping). True: it is
  // suspended, return to libmicrohttpd, which calls again once it resumes.
  // False: look again at what there is to do.
  bool Suspend();

  // From any thread, once there is something to do (after making it
  // visible): resumes the connection if it is suspended, else the next
  // Suspend returns false.
  void Wake();

  // Whether the client hung up while the connection was suspended, or the
  // server stops.
  bool Departed() const { return departed_.load(); }

 private:
  friend class HttpConnectionWatch;
  // With shared_->mu held.
  void ResumeLocked();

  const std::shared_ptr<HttpConnectionWatch::Shared> shared_;
  MHD_Connection* const connection_;
  const int fd_;
  bool suspended_ = false;  // guarded by shared_->mu
  bool woken_ = false;      // guarded by shared_->mu
  std::atomic<bool> departed_{false};
};

}  // namespace moh
