// How moh-client and moh-bench reach moh-server: the addresses, TLS
// (optionally mutual) and a bearer token, from the flags both programs share:
//   --server=HOST:PORT (gRPC)  --http=HOST:PORT (the OpenAI-compatible API)
//   --tls_ca=FILE [--tls_cert=FILE --tls_key=FILE]  --token_file=FILE
#ifndef MOH_CLIENT_CONNECTION_H_
#define MOH_CLIENT_CONNECTION_H_

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace moh::client {

struct Connection {
  std::string server;         // gRPC
  std::string http;           // the OpenAI-compatible HTTP API (HTTPS with TLS)
  std::string tls_ca_file;    // set: TLS, trusting this PEM CA
  std::string tls_cert_file;  // with tls_key_file: a client certificate
  std::string tls_key_file;
  std::string token;  // bearer token; empty: none
};

// The connection the flags describe. INVALID_ARGUMENT naming the flag when a
// file cannot be read or the TLS flags do not go together.
absl::StatusOr<Connection> ConnectionFromFlags();

// A channel to `connection.server`, over TLS when tls_ca_file is set.
absl::StatusOr<std::shared_ptr<grpc::Channel>> OpenChannel(
    const Connection& connection);

// Adds "authorization: Bearer <token>" unless `token` is empty.
void AddToken(const std::string& token, grpc::ClientContext* context);

}  // namespace moh::client

#endif  // MOH_CLIENT_CONNECTION_H_
