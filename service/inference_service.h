// The moh.v1.Inference gRPC service: thin adapters on gRPC's callback API.
//
// Each handler authenticates the call (bearer tokens, when configured),
// converts the request proto into a call on a model's Servable,
// converts the deadline, converts the resulting status in one place
// (grpc_status.h), and records request metrics. Generate is a
// ServerWriteReactor that owns its outgoing queue; client cancellation enters
// the scheduler through OnCancel.
#pragma once

#include "moh/v1/inference.grpc.pb.h"
#include "service/auth.h"
#include "service/model_manager.h"

namespace moh {

class InferenceService final : public v1::Inference::CallbackService {
 public:
  // `models` and `auth` outlive the service; `auth` null: no authentication.
  InferenceService(ModelManager* models, const TokenAuth* auth)
      : models_(models), auth_(auth) {}

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context,
      const v1::GenerateRequest* request) override;
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

  ModelManager* const models_;
  const TokenAuth* const auth_;
};

// Tokens each head served, as the API's Routing message.
v1::Routing ToRouting(const std::vector<int64_t>& head_tokens,
                      int32_t num_layers, int64_t tokens);

}  // namespace moh
