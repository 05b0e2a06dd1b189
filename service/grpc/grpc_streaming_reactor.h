// The gRPC door's server-streaming calls (Generate, GenerateImage): one
// reactor template that takes a call from its request worker to its model
// and streams the model's output back, and the per-call helpers the unary
// calls share (the deadline, the request id). inference_service.cc gives it
// each RPC's traits.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <exception>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "service/grpc/grpc_status.h"
#include "service/metrics/metrics.h"
#include "service/metrics/request_log.h"
#include "service/servable/servable.h"
#include "service/serving/dispatch.h"
#include "service/serving/model_manager.h"
#include "service/serving/request_workers.h"

namespace moh {

// The call's deadline (InfiniteFuture when it has none).
inline absl::Time Deadline(const grpc::CallbackServerContext* context) {
  const auto deadline = context->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(deadline);
}

// The call's request id (the client's x-request-id, or a fresh one), sent
// back in the initial metadata.
inline std::string CallRequestId(grpc::CallbackServerContext* context) {
  const auto& metadata = context->client_metadata();
  auto it = metadata.find(kRequestIdKey);
  std::optional<absl::string_view> given;
  if (it != metadata.end()) {
    given = absl::string_view(it->second.data(), it->second.size());
  }
  std::string id = RequestId(given);
  context->AddInitialMetadata(kRequestIdKey, id);
  return id;
}

// Streams one server-streaming call (Generate, GenerateImage). The model's
// threads produce messages through the RPC's observer (Generate: its
// callback thread, after each step); gRPC completes writes on its own
// threads. The reactor finishes only after the observer's final
// callback (or when the submission failed), so the observer never outlives it
// in use. It is deleted when both gRPC (OnDone) and the request worker (after
// Start) are done with it: once the request is submitted, the loop can finish
// the call, and gRPC end it, before Start returns.
//
// Traits: Request, Response, kRpc (metrics), Dispatch(models, request,
// deadline, reactor, dispatched) -> id (builds the call and its observer and
// hands them to dispatch.h), Cancel(servable, id), CanCoalesce(queued,
// response) (whether they belong to one output: one sample of a Generate) and
// Coalesce(queued, response) (merges a message produced while another is
// written into the queued one).
template <typename Traits>
class StreamingReactor
    : public grpc::ServerWriteReactor<typename Traits::Response> {
 public:
  using Request = typename Traits::Request;
  using Response = typename Traits::Response;

  // `auth`: the call's authentication (OK, or why it is refused). The rest
  // of the work (Start) runs on a request worker.
  StreamingReactor(ModelManager* models, RequestWorkers* workers,
                   grpc::CallbackServerContext* context, const Request* request,
                   const absl::Status& auth)
      : start_(absl::Now()),
        deadline_(Deadline(context)),
        request_id_(CallRequestId(context)),
        server_metrics_(models->metrics()),
        include_routing_(request->include_routing()) {
    if (!auth.ok()) {
      FinishWith(auth);
      return;
    }
    // gRPC keeps `request` until the call is done, and Start reads it only
    // before it submits the job or finishes the call.
    holds_.fetch_add(1, std::memory_order_relaxed);  // Start's
    absl::Status queued = workers->Run([this, models, request] {
      // The last resort: what a request makes throw ends that call alone.
      try {
        Start(models, *request);
      } catch (const std::exception& e) {
        Unexpected(e.what());
      } catch (...) {
        Unexpected("unknown exception");
      }
      Release();
    });
    if (!queued.ok()) {
      holds_.fetch_sub(1, std::memory_order_relaxed);  // Start will not run
      FinishWith(queued);
    }
  }

  void OnCancel() override {
    bool submitted;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      submitted = submitted_;
    }
    // The loop answers with its final callback; Finish happens there.
    if (submitted) Traits::Cancel(dispatched_.servable, id_);
  }
  void OnWriteDone(bool ok) override {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      queue_.pop_front();  // the message just written
      writing_ = false;
      if (!ok) DropUnsent();  // the stream is gone; nothing more to send
      if (!queue_.empty()) {
        writing_ = true;
        this->StartWrite(&queue_.front());
      } else if (final_status_) {
        finish = final_status_;
      }
    }
    if (finish) FinishWith(*finish);
  }

  void OnDone() override { Release(); }

  // For the observers (on the model's threads).
  bool include_routing() const { return include_routing_; }
  const Servable& model() const { return *dispatched_.servable; }

  // Queues `response` (if any); with `done`, finishes the call once every
  // queued message has been written.
  void Send(std::optional<Response> response,
            std::optional<absl::Status> done) {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      if (cancelled_) {
        if (!done) return;
        DropUnsent();
        response.reset();
        // An expiry is counted as one.
        if (done->ok()) done = GoneStatus();
      }
      if (response) Enqueue(std::move(*response));
      if (done) final_status_ = ToGrpcStatus(*done);
      if (!writing_ && !queue_.empty()) {
        writing_ = true;
        this->StartWrite(&queue_.front());
      } else if (!writing_ && final_status_) {
        finish = final_status_;
      }
    }
    if (finish) FinishWith(*finish);
  }

 private:
  // An exception escaped Start: logged with the request id; the call ends
  // INTERNAL unless its job was submitted (the loop then ends it).
  void Unexpected(const char* what) {
    const absl::Status error =
        UnexpectedException(RpcName(Traits::kRpc), request_id_, what);
    bool submitted;
    {
      absl::MutexLock lock(&mu_);
      submitted = submitted_;
    }
    if (!submitted) FinishWith(error);
  }

  // Drops one of the holds; the last one deletes the reactor.
  void Release() {
    if (holds_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  // On a request worker: finds the model and hands it the request
  // (tokenizing, checks, admission).
  void Start(ModelManager* models, const Request& request) {
    {
      absl::MutexLock lock(&mu_);
      if (cancelled_) {
        // Gone while it waited for a worker: nothing to prepare.
        FinishWith(GoneStatus());
        return;
      }
    }
    // dispatch.h; `dispatched_` holds the model before the call is
    // submitted, for the observer's callbacks.
    auto id = Traits::Dispatch(*models, request, deadline_, this, &dispatched_);
    if (!id.ok()) {
      FinishWith(id.status());
      return;
    }
    bool cancelled;
    {
      absl::MutexLock lock(&mu_);
      id_ = *id;
      submitted_ = true;
      cancelled = cancelled_;
    }
    // A cancellation that arrived while the request was being submitted.
    if (cancelled) Traits::Cancel(dispatched_.servable, id_);
  }

  // The status of a call gRPC cancelled: its deadline passed (gRPC cancels a
  // call whose deadline passed; its timer may fire a little before our clock
  // reaches the deadline it reported: allow for it), or the client went.
  absl::Status GoneStatus() const {
    constexpr absl::Duration kTimerSlack = absl::Milliseconds(50);
    return absl::Now() + kTimerSlack >= deadline_
               ? absl::DeadlineExceededError("deadline exceeded")
               : absl::CancelledError("cancelled by the client");
  }

  // Queues `response` for writing. While gRPC writes one message, what the
  // loop produces meanwhile is coalesced into the next one, so that a slow
  // reader or a busy server costs one write per backlog, not one per output.
  // Messages that cannot be merged (another sample's) queue beside it: at
  // most one per sample.
  void Enqueue(Response response) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (queue_.size() >= (writing_ ? 2u : 1u)) {
      // Every message but the front one, if being written, is only queued.
      const auto unsent = writing_ ? std::next(queue_.begin()) : queue_.begin();
      for (auto it = queue_.end(); it != unsent;) {
        --it;
        if (Traits::CanCoalesce(*it, response)) {
          Traits::Coalesce(*it, std::move(response));
          return;
        }
      }
    }
    queue_.push_back(std::move(response));
  }

  // Discards queued messages, but never the one gRPC is writing (it holds a
  // pointer to it until OnWriteDone).
  void DropUnsent() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    queue_.erase(writing_ ? std::next(queue_.begin()) : queue_.begin(),
                 queue_.end());
  }

  void FinishWith(const absl::Status& status) {
    FinishWith(ToGrpcStatus(status));
  }
  // Records the request and finishes; the reactor may be deleted right after.
  void FinishWith(const grpc::Status& status) {
    RecordRequest(dispatched_.servable != nullptr
                      ? dispatched_.servable->metrics()
                      : nullptr,
                  server_metrics_, Traits::kRpc, dispatched_.model,
                  static_cast<absl::StatusCode>(status.error_code()), start_,
                  request_id_);
    this->Finish(status);
  }

  const absl::Time start_;
  const absl::Time deadline_;
  const std::string request_id_;
  Metrics* const server_metrics_;
  const bool include_routing_;
  // The model, once the worker found it (before submitting: read by the
  // callbacks after).
  Dispatched dispatched_;
  uint64_t id_ = 0;
  // gRPC's (until OnDone) and, while it is queued or runs, Start's.
  std::atomic<int> holds_{1};

  absl::Mutex mu_;
  bool submitted_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Response> queue_ ABSL_GUARDED_BY(mu_);
  std::optional<grpc::Status> final_status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moh
