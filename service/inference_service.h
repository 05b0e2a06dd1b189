// The moh.v1.Inference gRPC service: thin adapters on gRPC's callback API.
//
// Each handler converts the request proto into a call on a HostedModel,
// converts the deadline, converts the resulting status in one place
// (grpc_status.h), and records request metrics. Generate is a
// ServerWriteReactor that owns its outgoing queue; client cancellation enters
// the scheduler through OnCancel.
#pragma once

#include "moh/v1/inference.grpc.pb.h"
#include "service/model_manager.h"

namespace moh {

class InferenceService final : public v1::Inference::CallbackService {
 public:
  // `models` outlives the service.
  explicit InferenceService(ModelManager* models) : models_(models) {}

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
  ModelManager* const models_;
};

// Tokens each head served, as the API's Routing message.
v1::Routing ToRouting(const std::vector<int64_t>& head_tokens,
                      int32_t num_layers, int64_t tokens);

}  // namespace moh
