// The moh-client commands. Each makes its RPC(s) through the given stub,
// prints the result (data to stdout, summaries and errors to stderr) and
// returns the process exit status (see rpc_util.h).
#ifndef MOH_CLIENT_COMMANDS_H_
#define MOH_CLIENT_COMMANDS_H_

#include <string>

#include "client/rpc_util.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "moh/v1/inference.grpc.pb.h"

namespace moh::client {

// ListModels as a table, one row per model.
int RunListModels(moh::v1::Inference::StubInterface& stub,
                  const CallOptions& call);

// Streams the generated text to stdout as it arrives, then prints the finish
// reason, usage and activation ratios, and with request.include_routing() the
// head-load table, to stderr. Ctrl-C cancels the call (exit 130).
int RunGenerate(moh::v1::Inference::StubInterface& stub,
                const moh::v1::GenerateRequest& request,
                const CallOptions& call);

// Prints label, index and score (and the log-likelihood for text requests)
// of each class, best first, then the activation ratios to stderr.
int RunClassify(moh::v1::Inference::StubInterface& stub,
                const moh::v1::ClassifyRequest& request,
                const CallOptions& call);

// Streams GenerateImage, printing progress to stderr when asked, writes the
// PNG to `out` and prints what made it (class, seed, steps, guidance, ratios,
// timings; with request.include_routing() the head-load table) to stderr.
// Ctrl-C cancels the call (exit 130).
int RunGenerateImage(moh::v1::Inference::StubInterface& stub,
                     const moh::v1::GenerateImageRequest& request,
                     const std::string& out, const CallOptions& call);

// grpc.health.v1.Health/Check: prints the serving status; kExitOk only when
// SERVING.
int RunHealthCheck(grpc::health::v1::Health::StubInterface& stub,
                   const std::string& service, const CallOptions& call);

}  // namespace moh::client

#endif  // MOH_CLIENT_COMMANDS_H_
