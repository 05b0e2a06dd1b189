#include "service/net/http_daemon.h"

#include <gnutls/gnutls.h>
#include <netdb.h>
#include <sys/socket.h>

#include <cstdarg>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/log.h"

namespace moh {
namespace {

// libmicrohttpd's messages (a client that went away, a malformed request)
// are the server's business only at debug level.
void LogDaemonMessage(void* /*cls*/, const char* format, va_list args) {
  char line[512];
  std::vsnprintf(line, sizeof(line), format, args);
  MOH_LOG(Debug) << "libmicrohttpd: "
                 << absl::StripTrailingAsciiWhitespace(line);
}

}  // namespace

absl::StatusOr<MHD_Daemon*> StartHttpDaemon(
    const HttpDaemonOptions& o, MHD_AccessHandlerCallback handler,
    void* handler_cls, MHD_RequestCompletedCallback completed,
    void* completed_cls) {
  const std::string address = absl::StrCat(o.host, ":", o.port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* resolved = nullptr;
  if (getaddrinfo(o.host.c_str(), std::to_string(o.port).c_str(), &hints,
                  &resolved) != 0 ||
      resolved == nullptr) {
    return absl::UnavailableError(
        absl::StrCat(o.what, ": cannot listen on ", address, ": unknown host"));
  }
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> owned(resolved, freeaddrinfo);
  unsigned int flags = MHD_USE_ERROR_LOG | MHD_USE_AUTO_INTERNAL_THREAD;
  if (resolved->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
  // The logger first: libmicrohttpd complains of options before it.
  std::vector<MHD_OptionItem> options = {
      {MHD_OPTION_EXTERNAL_LOGGER,
       reinterpret_cast<intptr_t>(&LogDaemonMessage), nullptr},
      {MHD_OPTION_SOCK_ADDR, 0, resolved->ai_addr},
      {MHD_OPTION_CONNECTION_LIMIT, o.max_connections, nullptr},
      {MHD_OPTION_CONNECTION_TIMEOUT,
       static_cast<intptr_t>(o.idle_timeout_seconds), nullptr},
  };
  if (o.pool_threads > 1) {
    options.push_back({MHD_OPTION_THREAD_POOL_SIZE, o.pool_threads, nullptr});
  }
  if (o.watch != nullptr) {
    flags |= MHD_ALLOW_SUSPEND_RESUME;
    options.push_back({MHD_OPTION_NOTIFY_CONNECTION,
                       reinterpret_cast<intptr_t>(&HttpConnectionWatch::Notify),
                       o.watch});
  }
  if (o.max_connections_per_client > 0) {
    options.push_back({MHD_OPTION_PER_IP_CONNECTION_LIMIT,
                       o.max_connections_per_client, nullptr});
  }
  if (completed != nullptr) {
    options.push_back({MHD_OPTION_NOTIFY_COMPLETED,
                       reinterpret_cast<intptr_t>(completed), completed_cls});
  }
  const bool https = o.tls != nullptr && o.tls->has_value();
  if (https) {
    const TlsPem& pem = **o.tls;
    flags |= MHD_USE_TLS;
    options.push_back({MHD_OPTION_HTTPS_MEM_CERT, 0,
                       const_cast<char*>(pem.cert_chain.c_str())});
    options.push_back({MHD_OPTION_HTTPS_MEM_KEY, 0,
                       const_cast<char*>(pem.private_key.c_str())});
    if (!pem.client_ca.empty()) {
      options.push_back({MHD_OPTION_HTTPS_MEM_TRUST, 0,
                         const_cast<char*>(pem.client_ca.c_str())});
    }
  }
  options.push_back({MHD_OPTION_END, 0, nullptr});
  MHD_Daemon* daemon = MHD_start_daemon(
      flags, static_cast<uint16_t>(o.port), nullptr, nullptr, handler,
      handler_cls, MHD_OPTION_ARRAY, options.data(), MHD_OPTION_END);
  if (daemon == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        o.what, ": cannot listen on ", address,
        https ? " (HTTPS: or the certificate and key do not load)" : ""));
  }
  return daemon;
}

bool HttpClientVerified(MHD_Connection* connection) {
  const MHD_ConnectionInfo* info =
      MHD_get_connection_info(connection, MHD_CONNECTION_INFO_GNUTLS_SESSION);
  if (info == nullptr || info->tls_session == nullptr) return false;
  auto session = static_cast<gnutls_session_t>(info->tls_session);
  unsigned int status = 0;
  return gnutls_certificate_verify_peers2(session, &status) ==
             GNUTLS_E_SUCCESS &&
         status == 0;
}

MHD_Result HttpRespond(MHD_Connection* connection, unsigned int code,
                       const std::string& body, const char* content_type,
                       const char* request_id) {
  MHD_Response* response = MHD_create_response_from_buffer(
      body.size(), const_cast<char*>(body.data()), MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;
  MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
  if (request_id != nullptr) {
    MHD_add_response_header(response, "X-Request-Id", request_id);
  }
  const MHD_Result result = MHD_queue_response(connection, code, response);
  MHD_destroy_response(response);
  return result;
}

}  // namespace moh
