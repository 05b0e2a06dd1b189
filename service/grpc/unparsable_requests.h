// Requests gRPC cannot parse into their method's message never reach a
// handler: gRPC (1.51) answers them UNIMPLEMENTED with an empty message and
// nothing counts them. This server interceptor (registered in main.cc)
// answers them INVALID_ARGUMENT naming the message type instead, and counts
// them as requests that reached no model (moh_requests_total{model=""}).
#pragma once

#include <grpcpp/support/server_interceptor.h>

#include <string>
#include <vector>

#include "service/metrics/metrics.h"

namespace moh {

class UnparsableRequestCounter
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  // `metrics` outlives the server.
  explicit UnparsableRequestCounter(Metrics* metrics);

  // An interceptor for moh.v1.Inference's Generate, Classify and
  // GenerateImage; null (no interception) for ListModels, whose request has
  // no field to get wrong.
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

 private:
  // A method the counter watches: its path ("/moh.v1.Inference/Generate"),
  // its Rpc and its request message type, written once.
  struct Method {
    std::string path;
    Rpc rpc;
    std::string message_type;
  };

  Metrics* const metrics_;
  const std::vector<Method> methods_;
};

}  // namespace moh
