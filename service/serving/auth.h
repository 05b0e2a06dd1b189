// Bearer-token authentication for the moh.v1.Inference RPCs and the HTTP
// API (ServerConfig.auth_token_file).
#pragma once

#include <grpcpp/support/string_ref.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moh {

class TokenAuth {
 public:
  // Reads the tokens of `path`: one per line; blank lines and lines starting
  // with '#' skipped; surrounding spaces trimmed. INVALID_ARGUMENT naming
  // auth_token_file when it cannot be read or holds no token.
  static absl::StatusOr<std::unique_ptr<TokenAuth>> FromFile(
      const std::string& path);

  // OK when `metadata` carries "authorization: Bearer <token>" with a known
  // token, else UNAUTHENTICATED. Tokens are compared in constant time (the
  // time depends on the known tokens' lengths only).
  absl::Status Check(
      const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const;
  // The same for an HTTP request's Authorization header (nullopt: absent).
  absl::Status CheckHeader(
      std::optional<absl::string_view> authorization) const;
  // The same for an HTTP request that may carry its token in an x-api-key
  // header instead (the token alone, as Anthropic's clients send it): when
  // `api_key` is present it is the one checked, else `authorization`.
  absl::Status CheckHeaders(std::optional<absl::string_view> authorization,
                            std::optional<absl::string_view> api_key) const;

 private:
  // OK when `candidate` is a known token; `what` names where it came from.
  absl::Status CheckToken(absl::string_view candidate,
                          absl::string_view what) const;

  explicit TokenAuth(std::vector<std::string> tokens)
      : tokens_(std::move(tokens)) {}
  std::vector<std::string> tokens_;
};

}  // namespace moh
