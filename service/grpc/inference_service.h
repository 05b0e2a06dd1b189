// The moh.v1.Inference gRPC service: thin adapters on gRPC's callback API.
//
// Each handler authenticates the call (bearer tokens, when configured),
// converts the request proto into a call on a model's Servable,
// converts the deadline, converts the resulting status in one place
// (grpc_status.h), and records request metrics. Generate is a
// ServerWriteReactor that owns its outgoing queue; client cancellation enters
// the executor through OnCancel. Everything after authentication runs on the
// request workers (request_workers.h), never on gRPC's threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "moh/v1/inference.grpc.pb.h"
#include "service/serving/auth.h"
#include "service/serving/model_manager.h"
#include "service/serving/request_workers.h"

namespace moh {

class InferenceService final : public v1::Inference::CallbackService {
 public:
  // `models`, `auth` and `workers` outlive the service; `auth` null: no
  // authentication. Request work past authentication runs on `workers`.
  InferenceService(ModelManager* models, const TokenAuth* auth,
                   RequestWorkers* workers)
      : models_(models), auth_(auth), workers_(workers) {}

  // When the last moh.v1.Inference call arrived (the server's start before
  // the first): the drain waits for clients to go quiet (main.cc).
  absl::Time last_call() const {
    return absl::FromUnixNanos(last_call_ns_.load(std::memory_order_relaxed));
  }

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context,
      const v1::GenerateRequest* request) override;
  grpc::ServerWriteReactor<v1::GenerateImageResponse>* GenerateImage(
      grpc::CallbackServerContext* context,
      const v1::GenerateImageRequest* request) override;
  grpc::ServerUnaryReactor* Classify(grpc::CallbackServerContext* context,
                                     const v1::ClassifyRequest* request,
                                     v1::ClassifyResponse* response) override;
  grpc::ServerUnaryReactor* ListModels(
      grpc::CallbackServerContext* context,
      const v1::ListModelsRequest* request,
      v1::ListModelsResponse* response) override;

 private:
  // OK, or UNAUTHENTICATED when tokens are required and the call has none
  // that is known.
  absl::Status Authenticate(const grpc::CallbackServerContext* context) const;
  // Classify's work on a request worker: finds the model and hands it the
  // request (decoding, tokenizing, checks, batching).
  // `handed` is set once the request is handed to its model (which then
  // finishes the call).
  void StartClassify(grpc::CallbackServerContext* context,
                     const v1::ClassifyRequest& request,
                     v1::ClassifyResponse* response,
                     grpc::ServerUnaryReactor* reactor, absl::Time start,
                     const std::string& request_id,
                     const std::shared_ptr<std::atomic<bool>>& handed);
  // An exception escaped StartClassify: logged; INTERNAL unless handed.
  void ClassifyUnexpected(grpc::ServerUnaryReactor* reactor,
                          const v1::ClassifyRequest& request, absl::Time start,
                          const std::string& request_id, bool handed,
                          const char* what);

  ModelManager* const models_;
  const TokenAuth* const auth_;
  RequestWorkers* const workers_;
  std::atomic<int64_t> last_call_ns_{absl::ToUnixNanos(absl::Now())};
  void CallArrived() {
    last_call_ns_.store(absl::ToUnixNanos(absl::Now()),
                        std::memory_order_relaxed);
  }
};

// Tokens each head served, as the API's Routing message: head_tokens is
// [layers * H] (H the most heads of any layer of `moh`); `tokens` is what each
// layer routed, unless `layer_tokens` gives it per layer.
v1::Routing ToRouting(const std::vector<int64_t>& head_tokens,
                      const MohConfig& moh, int64_t tokens,
                      const std::vector<int64_t>& layer_tokens);

}  // namespace moh
