// BenchTransport: how moh-bench's requests reach the server, so that
// BenchRunner drives gRPC (the Inference service) and the OpenAI-compatible
// HTTP API alike and both fill the same RequestResult.
#ifndef MOH_CLIENT_BENCH_TRANSPORT_H_
#define MOH_CLIENT_BENCH_TRANSPORT_H_

#include <grpcpp/channel.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/bench_config.h"
#include "client/bench_stats.h"
#include "client/connection.h"

namespace moh::client {

// One request, created unstarted so that its owner can register it first.
class BenchCall {
 public:
  virtual ~BenchCall() = default;
  // Sends the request without blocking on it; call once.
  virtual void Start() = 0;
  // Ends the request early (its result: CANCELLED); any thread, after Start.
  virtual void Cancel() = 0;
};

// Called exactly once per call with its result, on any thread.
using BenchDoneFn = std::function<void(const RequestResult&)>;

class BenchTransport {
 public:
  virtual ~BenchTransport() = default;
  // The names of the models the server lists (blocks; bounded in time).
  virtual absl::StatusOr<std::vector<std::string>> ModelNames() = 0;
  // A call sending `planned`. The transport must outlive its calls' `done`.
  virtual std::shared_ptr<BenchCall> NewCall(PlannedRequest planned,
                                             BenchDoneFn done) = 0;
};

// Generate (streamed) and Classify through the gRPC callback API.
std::unique_ptr<BenchTransport> NewGrpcBenchTransport(
    const BenchConfig& config, std::shared_ptr<grpc::Channel> channel);

// Generate as POST /v1/completions, streamed with include_usage, one thread
// per request in flight (client/openai_http_client.h). TTFT is the first
// chunk with text; tokens are the usage's completion_tokens; the text's token
// count per chunk is not sent, so each chunk after the first is one
// inter-token sample (the gap since the previous one).
std::unique_ptr<BenchTransport> NewOpenAiBenchTransport(
    const BenchConfig& config, const Connection& connection);

}  // namespace moh::client

#endif  // MOH_CLIENT_BENCH_TRANSPORT_H_
