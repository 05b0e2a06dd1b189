#include "client/connection.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <sstream>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "base/read_file.h"

ABSL_FLAG(std::string, server, "localhost:50051", "Server address HOST:PORT");
ABSL_FLAG(std::string, http, "localhost:8000",
          "Address HOST:PORT of the server's OpenAI-compatible HTTP API");
ABSL_FLAG(std::string, tls_ca, "",
          "Connect over TLS, trusting this PEM CA certificate");
ABSL_FLAG(std::string, tls_cert, "",
          "Mutual TLS: this client's PEM certificate (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "Mutual TLS: this client's PEM key");
ABSL_FLAG(std::string, token_file, "",
          "Send the bearer token in this file's first line");

namespace moh::client {
absl::StatusOr<Connection> ConnectionFromFlags() {
  Connection c;
  c.server = absl::GetFlag(FLAGS_server);
  c.http = absl::GetFlag(FLAGS_http);
  c.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  c.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  c.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  if (c.tls_cert_file.empty() != c.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert and --tls_key must be given together");
  }
  if (!c.tls_cert_file.empty() && c.tls_ca_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert needs --tls_ca");
  }
  const std::string token_file = absl::GetFlag(FLAGS_token_file);
  if (!token_file.empty()) {
    absl::StatusOr<std::string> text =
        ReadSmallFile(token_file, "--token_file");
    if (!text.ok()) return text.status();
    std::istringstream lines(*text);
    std::string first;
    std::getline(lines, first);
    c.token = std::string(absl::StripAsciiWhitespace(first));
    if (c.token.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--token_file: ", token_file, " has no token"));
    }
  }
  return c;
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> OpenChannel(
    const Connection& connection) {
  if (connection.tls_ca_file.empty()) {
    return grpc::CreateChannel(connection.server,
                               grpc::InsecureChannelCredentials());
  }
  grpc::SslCredentialsOptions options;
  absl::StatusOr<std::string> ca =
      ReadSmallFile(connection.tls_ca_file, "--tls_ca");
  if (!ca.ok()) return ca.status();
  options.pem_root_certs = *ca;
  if (!connection.tls_cert_file.empty()) {
    absl::StatusOr<std::string> cert =
        ReadSmallFile(connection.tls_cert_file, "--tls_cert");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key =
        ReadSmallFile(connection.tls_key_file, "--tls_key");
    if (!key.ok()) return key.status();
    options.pem_cert_chain = *cert;
    options.pem_private_key = *key;
  }
  return grpc::CreateChannel(connection.server, grpc::SslCredentials(options));
}

void AddToken(const std::string& token, grpc::ClientContext* context) {
  if (!token.empty()) context->AddMetadata("authorization", "Bearer " + token);
}

}  // namespace moh::client
