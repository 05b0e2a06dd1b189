// One generation request over HTTP (OpenAI's POST /v1/completions,
// /v1/chat/completions, Anthropic's POST /v1/messages: openai::Endpoint says
// which) from the moment its body is whole until it is
// answered: prepared (parsed, model found, chat template, tokenized,
// admitted) on a request worker, run by its model, answered whole or
// streamed as server-sent events. Its connection is suspended whenever it
// waits, and its HttpWaker (http_connections.h) resumes it when there is
// something to do. The transport around it (headers, bodies, refusals,
// routes) is openai_http.cc's; the JSON is openai_api.h's (anthropic_api.h's
// for Messages).
#pragma once

#include <microhttpd.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "service/http/openai_api.h"
#include "service/net/http_connections.h"
#include "service/serving/model_manager.h"
#include "service/serving/request_workers.h"

namespace moh {

// An error's body as `endpoint`'s API writes it: OpenAI's error object, or
// Anthropic's for kMessages.
std::string HttpErrorJson(openai::Endpoint endpoint,
                          const absl::Status& status);

// Work on request workers that uses the HTTP server: its destructor waits
// until none is left.
class InFlight {
 public:
  void Add() {
    absl::MutexLock lock(&mu_);
    ++count_;
  }
  void Done() {
    absl::MutexLock lock(&mu_);
    --count_;
  }
  void WaitForNone() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int* count) { return *count == 0; }, &count_));
  }

 private:
  absl::Mutex mu_;
  int count_ ABSL_GUARDED_BY(mu_) = 0;
};

// Bytes a request's body holds of a shared budget (http_body_memory_mb),
// given back when it is destroyed (or Released).
class BodyReservation {
 public:
  BodyReservation() = default;
  BodyReservation(BodyReservation&& other) noexcept
      : pool_(other.pool_), bytes_(other.bytes_) {
    other.bytes_ = 0;
  }
  BodyReservation& operator=(BodyReservation&& other) noexcept {
    if (this != &other) {
      Release();
      pool_ = other.pool_;
      bytes_ = other.bytes_;
      other.bytes_ = 0;
    }
    return *this;
  }
  ~BodyReservation() { Release(); }

  // Holds `bytes` more of `limit` in `pool`; false (nothing more held) when
  // they do not fit.
  bool Add(std::atomic<size_t>& pool, size_t bytes, size_t limit) {
    size_t used = pool.load();
    do {
      if (used + bytes > limit) return false;
    } while (!pool.compare_exchange_weak(used, used + bytes));
    pool_ = &pool;
    bytes_ += bytes;
    return true;
  }
  size_t bytes() const { return bytes_; }
  void Release() {
    if (pool_ != nullptr && bytes_ > 0) pool_->fetch_sub(bytes_);
    bytes_ = 0;
  }

 private:
  std::atomic<size_t>* pool_ = nullptr;
  size_t bytes_ = 0;
};

class HttpGeneration {
 public:
  // What it uses of the server; all outlive every request (`in_flight`
  // counts the work on request workers, which the server waits for).
  struct Env {
    ModelManager* models = nullptr;
    RequestWorkers* workers = nullptr;
    HttpConnectionWatch* watch = nullptr;
    InFlight* in_flight = nullptr;
  };
  // A request whose body is whole.
  struct Request {
    openai::Endpoint endpoint = openai::Endpoint::kCompletions;
    std::string body;
    BodyReservation reservation;  // given back once the body is parsed
    absl::Time start;
    std::string request_id;
  };

  // Queues `request`'s preparation on a request worker (the connection's
  // thread then calls Continue). A full queue (RESOURCE_EXHAUSTED) is
  // counted here; the caller answers it.
  static absl::StatusOr<std::unique_ptr<HttpGeneration>> Start(
      const Env& env, MHD_Connection* connection, Request request);

  // On the connection's thread, right after Start and whenever MHD calls the
  // handler again: answers (the whole response, or the stream's start),
  // suspends the connection until there is more to do (MHD_YES), or gives up
  // when the client left or the server stops (MHD_NO). Sets `*answered` once
  // nothing more is to be done for the request on this connection.
  MHD_Result Continue(MHD_Connection* connection, bool* answered);

  // The connection ended before the answer, or its handler failed: the
  // generation stops, counted with `code`.
  void Abandon(absl::StatusCode code);

  // The request's state (openai_http_generation.cc), shared with its
  // request worker.
  struct Call;

 private:
  explicit HttpGeneration(std::shared_ptr<Call> call)
      : call_(std::move(call)) {}

  const std::shared_ptr<Call> call_;
};

}  // namespace moh
