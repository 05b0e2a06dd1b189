#include "service/net/tls_pem.h"

#include "base/read_file.h"
#include "base/status_macros.h"

namespace moh {

absl::StatusOr<std::optional<TlsPem>> ReadTlsPem(const v1::TlsConfig& tls) {
  if (tls.cert_file().empty() && tls.key_file().empty()) {
    if (!tls.client_ca_file().empty()) {
      return absl::InvalidArgumentError(
          "tls.client_ca_file needs tls.cert_file and tls.key_file");
    }
    return std::nullopt;
  }
  if (tls.cert_file().empty() || tls.key_file().empty()) {
    return absl::InvalidArgumentError(
        "tls.cert_file and tls.key_file must be set together");
  }
  TlsPem pem;
  MOH_ASSIGN_OR_RETURN(pem.cert_chain,
                       ReadSmallFile(tls.cert_file(), "tls.cert_file"));
  MOH_ASSIGN_OR_RETURN(pem.private_key,
                       ReadSmallFile(tls.key_file(), "tls.key_file"));
  if (!tls.client_ca_file().empty()) {
    MOH_ASSIGN_OR_RETURN(pem.client_ca, ReadSmallFile(tls.client_ca_file(),
                                                      "tls.client_ca_file"));
  }
  return pem;
}

}  // namespace moh
