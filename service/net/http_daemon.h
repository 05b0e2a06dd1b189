// Starting a GNU libmicrohttpd daemon on host:port, plain HTTP or HTTPS with
// the server's TLS files, for the Prometheus exporter (metrics_http.h) and
// the OpenAI-compatible API (openai_http.h).
#pragma once

#include <microhttpd.h>

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "service/net/http_connections.h"
#include "service/net/tls_pem.h"

namespace moh {

struct HttpDaemonOptions {
  std::string what;  // names the server in errors: "metrics", "http"
  std::string host;
  int port = 0;
  // HTTPS with these (clients need a certificate its client CA signed, when
  // it has one; see HttpClientVerified); the daemon keeps pointers into it,
  // so it must outlive the daemon. Null or empty: plain HTTP.
  const std::optional<TlsPem>* tls = nullptr;
  // Polling threads, each serving its share of the connections (handlers
  // must not block).
  int pool_threads = 2;
  int max_connections = 64;
  // Connections one client address may hold at once (0: no limit beyond
  // max_connections); more are closed as they arrive.
  int max_connections_per_client = 0;
  int idle_timeout_seconds = 30;
  // Header and body deadlines, and suspended requests (handlers that wait
  // suspend their connection): null for neither. It must outlive the
  // daemon.
  HttpConnectionWatch* watch = nullptr;
};

// Starts the daemon with `handler` (and `completed`, called when a request
// ends, may be null). UNAVAILABLE "<what>: cannot listen on host:port" when
// the address is taken or unknown (or the TLS files do not load).
absl::StatusOr<MHD_Daemon*> StartHttpDaemon(
    const HttpDaemonOptions& options, MHD_AccessHandlerCallback handler,
    void* handler_cls, MHD_RequestCompletedCallback completed,
    void* completed_cls);

// Whether the client presented a certificate the client CA signed.
bool HttpClientVerified(MHD_Connection* connection);

// Answers `body` with `code` and `content_type` (and the X-Request-Id
// header, when `request_id` is given).
MHD_Result HttpRespond(MHD_Connection* connection, unsigned int code,
                       const std::string& body, const char* content_type,
                       const char* request_id = nullptr);

}  // namespace moh
