#include "service/http/metrics_http.h"

#include <microhttpd.h>
#include <prometheus/text_serializer.h>

#include <cstring>
#include <sstream>
#include <utility>

#include "base/status_macros.h"
#include "service/net/http_daemon.h"

namespace moh {

struct MetricsHttpServer::Handler {
  // MHD_AccessHandlerCallback: GET /metrics, nothing else.
  static MHD_Result Access(void* cls, MHD_Connection* connection,
                           const char* url, const char* method,
                           const char* /*version*/, const char* /*upload_data*/,
                           size_t* upload_data_size, void** /*con_cls*/) {
    const auto* server = static_cast<const MetricsHttpServer*>(cls);
    server->watch_->BodyReceived(connection);  // served now: no deadline
    constexpr char kText[] = "text/plain; charset=utf-8";
    if (server->tls_ && !server->tls_->client_ca.empty() &&
        !HttpClientVerified(connection)) {
      return HttpRespond(connection, MHD_HTTP_FORBIDDEN,
                         "a client certificate signed by the client CA is "
                         "required\n",
                         kText);
    }
    if (std::strcmp(method, MHD_HTTP_METHOD_GET) != 0 ||
        *upload_data_size != 0) {
      return HttpRespond(connection, MHD_HTTP_METHOD_NOT_ALLOWED, "GET only\n",
                         kText);
    }
    if (std::strcmp(url, "/metrics") != 0) {
      return HttpRespond(connection, MHD_HTTP_NOT_FOUND, "see /metrics\n",
                         kText);
    }
    return HttpRespond(connection, MHD_HTTP_OK, server->Render(),
                       "text/plain; version=0.0.4; charset=utf-8");
  }

  // MHD_RequestCompletedCallback: the next scrape's header deadline starts.
  static void Completed(void* cls, MHD_Connection* connection,
                        void** /*con_cls*/,
                        MHD_RequestTerminationCode /*code*/) {
    static_cast<const MetricsHttpServer*>(cls)->watch_->RequestEnded(
        connection);
  }
};

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& host, int port, const std::optional<TlsPem>& tls,
    std::vector<std::weak_ptr<prometheus::Collectable>> collectables,
    absl::Duration header_timeout) {
  std::unique_ptr<MetricsHttpServer> server(
      new MetricsHttpServer(tls, std::move(collectables)));
  HttpConnectionWatch::Options watch;
  watch.header_timeout = header_timeout;
  server->watch_ = std::make_unique<HttpConnectionWatch>(watch);
  HttpDaemonOptions options;
  options.what = "metrics";
  options.host = host;
  options.port = port;
  options.tls = &server->tls_;
  options.watch = server->watch_.get();
  MOH_ASSIGN_OR_RETURN(server->daemon_,
                       StartHttpDaemon(options, &Handler::Access, server.get(),
                                       &Handler::Completed, server.get()));
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
