// What every moh-client command shares: exit statuses, per-call options and
// the one place where a failed RPC becomes a message and an exit status.
#ifndef MOH_CLIENT_RPC_UTIL_H_
#define MOH_CLIENT_RPC_UTIL_H_

#include <grpcpp/client_context.h>
#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace moh::client {

inline constexpr int kExitOk = 0;
// An RPC failed, or (health) the server is not SERVING, or a local I/O error.
inline constexpr int kExitFailure = 1;
// Bad command line.
inline constexpr int kExitUsage = 2;

struct CallOptions {
  // Deadline of each RPC, from its start; zero or negative: none.
  absl::Duration timeout = absl::ZeroDuration();
  std::string token;  // bearer token; empty: none
};

// Sets the deadline and the token of `context` from `options`.
void ConfigureContext(const CallOptions& options, grpc::ClientContext* context);

// "INVALID_ARGUMENT" etc.; "UNKNOWN_CODE" for a value outside the enum.
std::string StatusCodeName(grpc::StatusCode code);

// Prints "moh-client: <CODE_NAME>: <message>" to stderr (or that the call was
// interrupted) and returns the exit status: 128 + signal after an interrupt,
// else kExitFailure. `status` must not be OK.
int ReportRpcError(const grpc::Status& status);

// The same for a failed HTTP request (client/openai_http_client.h).
int ReportError(const absl::Status& status);

// "activation: effective E, applied ratio R" on stderr.
void PrintActivation(float effective, float applied);

}  // namespace moh::client

#endif  // MOH_CLIENT_RPC_UTIL_H_
