// The one status every entry point answers once the server drains (SIGTERM)
// or shuts down: UNAVAILABLE, so that clients retry on another replica.
#pragma once

#include "absl/status/status.h"

namespace moh {

inline absl::Status DrainingError() {
  return absl::UnavailableError("server is draining: no new requests accepted");
}

}  // namespace moh
