#include "client/rpc_util.h"

#include <chrono>
#include <cstdio>

#include "absl/strings/str_format.h"
#include "client/interrupt_watcher.h"

namespace moh::client {

void ConfigureContext(const CallOptions& options,
                      grpc::ClientContext* context) {
  if (options.timeout > absl::ZeroDuration()) {
    context->set_deadline(std::chrono::system_clock::now() +
                          absl::ToChronoNanoseconds(options.timeout));
  }
}

const char* StatusCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN_CODE";
  }
}

int ReportRpcError(const grpc::Status& status) {
  const int signal = InterruptSignal();
  if (signal != 0) {
    absl::FPrintF(stderr, "moh-client: interrupted (%s)\n",
                  StatusCodeName(status.error_code()));
    return 128 + signal;
  }
  absl::FPrintF(stderr, "moh-client: %s: %s\n",
                StatusCodeName(status.error_code()), status.error_message());
  return kExitFailure;
}

}  // namespace moh::client
