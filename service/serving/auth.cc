#include "service/serving/auth.h"

#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace moh {
namespace {

// Whether `candidate` equals `token`, reading every byte of `token` whatever
// the answer: no early exit on the first difference.
bool ConstantTimeEquals(absl::string_view token, absl::string_view candidate) {
  unsigned char diff = token.size() == candidate.size() ? 0 : 1;
  for (size_t i = 0; i < token.size(); ++i) {
    const unsigned char c =
        i < candidate.size() ? static_cast<unsigned char>(candidate[i]) : 0;
    diff |= static_cast<unsigned char>(token[i]) ^ c;
  }
  return diff == 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TokenAuth>> TokenAuth::FromFile(
    const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("auth_token_file: cannot read ", path));
  }
  std::vector<std::string> tokens;
  std::string line;
  while (std::getline(in, line)) {
    const absl::string_view token = absl::StripAsciiWhitespace(line);
    if (token.empty() || token[0] == '#') continue;
    tokens.emplace_back(token);
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("auth_token_file: ", path, " holds no token"));
  }
  return std::unique_ptr<TokenAuth>(new TokenAuth(std::move(tokens)));
}

absl::Status TokenAuth::Check(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const {
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return absl::UnauthenticatedError(
        "authorization: send the metadata \"authorization: Bearer <token>\"");
  }
  return CheckHeader(absl::string_view(it->second.data(), it->second.size()));
}

absl::Status TokenAuth::CheckHeader(
    std::optional<absl::string_view> authorization) const {
  if (!authorization) {
    return absl::UnauthenticatedError(
        "authorization: send the header \"Authorization: Bearer <token>\"");
  }
  const absl::string_view value = *authorization;
  constexpr absl::string_view kBearer = "Bearer ";
  if (!absl::StartsWith(value, kBearer)) {
    return absl::UnauthenticatedError(
        "authorization: must be \"Bearer <token>\"");
  }
  return CheckToken(value.substr(kBearer.size()), "authorization");
}

absl::Status TokenAuth::CheckHeaders(
    std::optional<absl::string_view> authorization,
    std::optional<absl::string_view> api_key) const {
  if (api_key) return CheckToken(*api_key, "x-api-key");
  if (!authorization) {
    return absl::UnauthenticatedError(
        "authorization: send the header \"Authorization: Bearer <token>\" "
        "or \"x-api-key: <token>\"");
  }
  return CheckHeader(authorization);
}

absl::Status TokenAuth::CheckToken(absl::string_view candidate,
                                   absl::string_view what) const {
  bool known = false;
  for (const std::string& token : tokens_) {
    known |= ConstantTimeEquals(token, candidate);
  }
  if (!known) {
    return absl::UnauthenticatedError(absl::StrCat(what, ": unknown token"));
  }
  return absl::OkStatus();
}

}  // namespace moh
