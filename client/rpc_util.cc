#include "client/rpc_util.h"

#include <chrono>
#include <cstdio>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "client/connection.h"
#include "client/interrupt_watcher.h"

namespace moh::client {

void ConfigureContext(const CallOptions& options,
                      grpc::ClientContext* context) {
  if (options.timeout > absl::ZeroDuration()) {
    context->set_deadline(std::chrono::system_clock::now() +
                          absl::ToChronoNanoseconds(options.timeout));
  }
  AddToken(options.token, context);
}

std::string StatusCodeName(grpc::StatusCode code) {
  // gRPC and Abseil number the canonical codes alike.
  std::string name =
      absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
  return name.empty() ? "UNKNOWN_CODE" : name;
}

int ReportRpcError(const grpc::Status& status) {
  return ReportError(
      absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                   status.error_message()));
}

int ReportError(const absl::Status& status) {
  const std::string code =
      StatusCodeName(static_cast<grpc::StatusCode>(status.code()));
  const int signal = InterruptSignal();
  if (signal != 0) {
    absl::FPrintF(stderr, "moh-client: interrupted (%s)\n", code);
    return 128 + signal;
  }
  absl::FPrintF(stderr, "moh-client: %s: %s\n", code, status.message());
  return kExitFailure;
}

void PrintActivation(float effective, float applied) {
  absl::FPrintF(stderr, "activation: effective %.3f, applied ratio %.3f\n",
                effective, applied);
}

}  // namespace moh::client
