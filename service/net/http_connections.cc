#include "service/net/http_connections.h"

#include <poll.h>
#include <sys/socket.h>

#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "base/log.h"

namespace moh {
namespace {

int ConnectionFd(MHD_Connection* connection) {
  const MHD_ConnectionInfo* info =
      MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD);
  return info != nullptr ? info->connect_fd : -1;
}

}  // namespace

HttpConnectionWatch::HttpConnectionWatch(Options options)
    : options_(options), thread_([this] { Run(); }) {}

HttpConnectionWatch::~HttpConnectionWatch() {
  done_.Notify();
  thread_.join();
}

void HttpConnectionWatch::Notify(void* cls, MHD_Connection* connection,
                                 void** /*socket_context*/,
                                 enum MHD_ConnectionNotificationCode code) {
  auto* watch = static_cast<HttpConnectionWatch*>(cls);
  absl::MutexLock lock(&watch->mu_);
  if (code == MHD_CONNECTION_NOTIFY_STARTED) {
    Tracked& tracked = watch->connections_[connection];
    tracked.fd = ConnectionFd(connection);
    tracked.deadline = absl::Now() + watch->options_.header_timeout;
  } else {
    // Before libmicrohttpd closes the socket: the watch never shuts a
    // descriptor that another connection has since been given.
    watch->connections_.erase(connection);
  }
}

void HttpConnectionWatch::SetDeadline(MHD_Connection* connection,
                                      absl::Duration after) {
  const absl::Time deadline = after == absl::InfiniteDuration()
                                  ? absl::InfiniteFuture()
                                  : absl::Now() + after;
  absl::MutexLock lock(&mu_);
  auto it = connections_.find(connection);
  if (it != connections_.end()) it->second.deadline = deadline;
}

void HttpConnectionWatch::HeadersReceived(MHD_Connection* connection) {
  SetDeadline(connection, options_.body_timeout);
}

void HttpConnectionWatch::BodyReceived(MHD_Connection* connection) {
  SetDeadline(connection, absl::InfiniteDuration());
}

void HttpConnectionWatch::RequestEnded(MHD_Connection* connection) {
  SetDeadline(connection, options_.header_timeout);
}

std::shared_ptr<HttpWaker> HttpConnectionWatch::NewWaker(
    MHD_Connection* connection) {
  return std::make_shared<HttpWaker>(shared_, connection,
                                     ConnectionFd(connection));
}

void HttpConnectionWatch::Stop() {
  absl::MutexLock lock(&shared_->mu);
  shared_->stopping = true;
  // ResumeLocked erases from the set: iterate over a copy.
  const std::vector<HttpWaker*> suspended(shared_->suspended.begin(),
                                          shared_->suspended.end());
  for (HttpWaker* waker : suspended) {
    waker->departed_ = true;
    waker->ResumeLocked();
  }
}

void HttpConnectionWatch::Run() {
  while (!done_.WaitForNotificationWithTimeout(options_.poll)) {
    CloseLate(absl::Now());
    WakeDeparted();
  }
}

void HttpConnectionWatch::CloseLate(absl::Time now) {
  absl::MutexLock lock(&mu_);
  for (auto& [connection, tracked] : connections_) {
    if (tracked.shut || tracked.fd < 0 || tracked.deadline > now) continue;
    // libmicrohttpd sees the socket end and closes the connection (and its
    // request, whose completion callback runs as for any other close).
    shutdown(tracked.fd, SHUT_RDWR);
    tracked.shut = true;
    MOH_LOG(Debug) << "http: a connection passed its header or body deadline "
                      "and was closed";
  }
}

void HttpConnectionWatch::WakeDeparted() {
  absl::MutexLock lock(&shared_->mu);
  if (shared_->suspended.empty()) return;
  std::vector<HttpWaker*> wakers(shared_->suspended.begin(),
                                 shared_->suspended.end());
  std::vector<pollfd> fds;
  fds.reserve(wakers.size());
  for (HttpWaker* waker : wakers) {
    fds.push_back({waker->fd_, POLLRDHUP, 0});
  }
  if (poll(fds.data(), fds.size(), 0) <= 0) return;
  for (size_t i = 0; i < fds.size(); ++i) {
    if ((fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) == 0) {
      continue;
    }
    wakers[i]->departed_ = true;
    wakers[i]->ResumeLocked();
  }
}

bool HttpWaker::Suspend() {
  absl::MutexLock lock(&shared_->mu);
  if (shared_->stopping) departed_ = true;
  if (woken_ || departed_) {
    woken_ = false;
    return false;
  }
  suspended_ = true;
  shared_->suspended.insert(this);
  MHD_suspend_connection(connection_);
  return true;
}

void HttpWaker::Wake() {
  absl::MutexLock lock(&shared_->mu);
  ResumeLocked();
}

void HttpWaker::ResumeLocked() {
  woken_ = true;
  if (!suspended_) return;
  suspended_ = false;
  woken_ = false;  // the handler runs again and looks
  shared_->suspended.erase(this);
  MHD_resume_connection(connection_);
}

}  // namespace moh
