// What every finished request leaves behind, gRPC or HTTP: its metrics, its
// log line, and its id.
//
// The id is the client's `x-request-id` (gRPC metadata or HTTP header) when
// it is 1 to 128 printable ASCII characters, else a fresh random one; the
// server sends it back (initial metadata, response header) and logs it, so a
// client's report can be found in the server's log. The log line is at debug
// level (--verbose), or at info level with the access log on (access_log).
// Thread-safe.
#pragma once

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "service/metrics/metrics.h"

namespace moh {

// The header and metadata key.
inline constexpr char kRequestIdKey[] = "x-request-id";

// The client's id when it is acceptable, else 16 random hex digits.
std::string RequestId(std::optional<absl::string_view> from_client);

// `digits` random hexadecimal digits (ids, not secrets).
std::string RandomHex(int digits);

// The handlers' last resort: an exception escaped the handling of request
// `request_id` (`what_request`: "Generate", "http /v1/completions", ...). Logs
// it and returns the INTERNAL error its client gets.
absl::Status UnexpectedException(absl::string_view what_request,
                                 absl::string_view request_id,
                                 absl::string_view what);

// Info-level request lines (the access log) on or off (the default).
void SetAccessLog(bool on);

// Counts the request (`metrics`: the model's, or null when it reached no
// model; then it is counted on `server`) and logs one line.
void RecordRequest(ModelMetrics* metrics, Metrics* server, Rpc rpc,
                   absl::string_view model, absl::StatusCode code,
                   absl::Time start, absl::string_view request_id);

}  // namespace moh
