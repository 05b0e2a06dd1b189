// The one place where the core's absl::Status becomes a gRPC status.
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace moh {

// Same code (absl and gRPC share the numbering), same message, made valid
// UTF-8 (base/utf8.h: a message may quote bytes read from a file).
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace moh
