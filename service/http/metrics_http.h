// The Prometheus endpoint: GET /metrics in the text exposition format, over
// plain HTTP, or HTTPS with the server's TLS certificate when TLS is
// configured (and then only for clients with a certificate the client CA
// signed, when one is). On GNU libmicrohttpd (Debian's, with GnuTLS): the
// civetweb under prometheus-cpp's Exposer crashes on Debian 12 as soon as
// it serves HTTPS (its OpenSSL 1.x bindings against OpenSSL 3).
// Thread-safe; stops in the destructor.
#pragma once

#include <prometheus/collectable.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "service/net/http_connections.h"
#include "service/net/tls_pem.h"

struct MHD_Daemon;

namespace moh {

class MetricsHttpServer {
 public:
  // Listens on `host`:`port` and serves what `collectables` hold (those
  // gone by then are skipped). HTTPS with `tls` when it is set, and then only
  // to clients whose certificate its client CA signed, when it has one.
  // A request's headers must be whole `header_timeout` after its connection
  // opens (or the previous scrape on it ends): a client sending a byte at a
  // time cannot hold a connection. UNAVAILABLE "metrics: cannot listen on
  // ..." when the address is taken.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& host, int port, const std::optional<TlsPem>& tls,
      std::vector<std::weak_ptr<prometheus::Collectable>> collectables,
      absl::Duration header_timeout = absl::Seconds(30));
  ~MetricsHttpServer();

  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // The exposition text of every collectable (what GET /metrics returns).
  std::string Render() const;

 private:
  MetricsHttpServer(std::optional<TlsPem> tls,
                    std::vector<std::weak_ptr<prometheus::Collectable>> c)
      : tls_(std::move(tls)), collectables_(std::move(c)) {}
  struct Handler;

  // The daemon reads the PEM text from here (it keeps the pointers).
  const std::optional<TlsPem> tls_;
  const std::vector<std::weak_ptr<prometheus::Collectable>> collectables_;
  std::unique_ptr<HttpConnectionWatch> watch_;
  MHD_Daemon* daemon_ = nullptr;
};

}  // namespace moh
