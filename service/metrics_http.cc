#include "service/metrics_http.h"

#include <gnutls/gnutls.h>
#include <microhttpd.h>
#include <netdb.h>
#include <prometheus/text_serializer.h>
#include <sys/socket.h>

#include <cstring>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"

namespace moh {

struct MetricsHttpServer::Handler {
  static MHD_Result Respond(MHD_Connection* connection, unsigned int code,
                            const std::string& body, const char* type) {
    MHD_Response* response = MHD_create_response_from_buffer(
        body.size(), const_cast<char*>(body.data()), MHD_RESPMEM_MUST_COPY);
    if (response == nullptr) return MHD_NO;
    MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    const MHD_Result result = MHD_queue_response(connection, code, response);
    MHD_destroy_response(response);
    return result;
  }

  // Whether the client presented a certificate the client CA signed.
  static bool ClientVerified(MHD_Connection* connection) {
    const MHD_ConnectionInfo* info =
        MHD_get_connection_info(connection, MHD_CONNECTION_INFO_GNUTLS_SESSION);
    if (info == nullptr || info->tls_session == nullptr) return false;
    auto session = static_cast<gnutls_session_t>(info->tls_session);
    unsigned int status = 0;
    return gnutls_certificate_verify_peers2(session, &status) ==
               GNUTLS_E_SUCCESS &&
           status == 0;
  }

  // MHD_AccessHandlerCallback: GET /metrics, nothing else.
  static MHD_Result Access(void* cls, MHD_Connection* connection,
                           const char* url, const char* method,
                           const char* /*version*/, const char* /*upload_data*/,
                           size_t* upload_data_size, void** /*con_cls*/) {
    const auto* server = static_cast<const MetricsHttpServer*>(cls);
    constexpr char kText[] = "text/plain; charset=utf-8";
    if (server->tls_ && !server->tls_->client_ca.empty() &&
        !ClientVerified(connection)) {
      return Respond(connection, MHD_HTTP_FORBIDDEN,
                     "a client certificate signed by the client CA is "
                     "required\n",
                     kText);
    }
    if (std::strcmp(method, MHD_HTTP_METHOD_GET) != 0 ||
        *upload_data_size != 0) {
      return Respond(connection, MHD_HTTP_METHOD_NOT_ALLOWED, "GET only\n",
                     kText);
    }
    if (std::strcmp(url, "/metrics") != 0) {
      return Respond(connection, MHD_HTTP_NOT_FOUND, "see /metrics\n", kText);
    }
    return Respond(connection, MHD_HTTP_OK, server->Render(),
                   "text/plain; version=0.0.4; charset=utf-8");
  }
};

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& host, int port, const std::optional<TlsPem>& tls,
    std::vector<std::weak_ptr<prometheus::Collectable>> collectables) {
  std::unique_ptr<MetricsHttpServer> server(
      new MetricsHttpServer(tls, std::move(collectables)));
  const std::string address = absl::StrCat(host, ":", port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* resolved = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints,
                  &resolved) != 0 ||
      resolved == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot listen on ", address, ": unknown host"));
  }
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> owned(resolved, freeaddrinfo);
  unsigned int flags = MHD_USE_AUTO_INTERNAL_THREAD | MHD_USE_ERROR_LOG;
  if (resolved->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
  std::vector<MHD_OptionItem> options = {
      {MHD_OPTION_SOCK_ADDR, 0, resolved->ai_addr},
      {MHD_OPTION_THREAD_POOL_SIZE, 2, nullptr},
      {MHD_OPTION_CONNECTION_LIMIT, 64, nullptr},
      {MHD_OPTION_CONNECTION_TIMEOUT, 30, nullptr},
  };
  if (server->tls_) {
    const TlsPem& pem = *server->tls_;
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
  server->daemon_ = MHD_start_daemon(
      flags, static_cast<uint16_t>(port), nullptr, nullptr, &Handler::Access,
      server.get(), MHD_OPTION_ARRAY, options.data(), MHD_OPTION_END);
  if (server->daemon_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "metrics: cannot listen on ", address,
        tls ? " (HTTPS: or the certificate and key do not load)" : ""));
  }
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
}

std::string MetricsHttpServer::Render() const {
  std::vector<prometheus::MetricFamily> families;
  for (const auto& weak : collectables_) {
    if (auto collectable = weak.lock()) {
      std::vector<prometheus::MetricFamily> collected = collectable->Collect();
      families.insert(families.end(),
                      std::make_move_iterator(collected.begin()),
                      std::make_move_iterator(collected.end()));
    }
  }
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, families);
  return out.str();
}

}  // namespace moh
