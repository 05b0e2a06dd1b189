// The PEM files of the server's TLS (config `tls`), read and checked once at
// start-up, for the gRPC port (main.cc) and the metrics endpoint
// (metrics_http.h) alike.
#pragma once

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "moh/v1/server_config.pb.h"

namespace moh {

struct TlsPem {
  std::string cert_chain;   // tls.cert_file
  std::string private_key;  // tls.key_file
  std::string client_ca;    // tls.client_ca_file; empty: no client certificates
};

// nullopt when TLS is off (no file set). INVALID_ARGUMENT naming the field
// when cert_file and key_file are not set together, client_ca_file comes
// without them, or a file cannot be read.
absl::StatusOr<std::optional<TlsPem>> ReadTlsPem(const v1::TlsConfig& tls);

}  // namespace moh
