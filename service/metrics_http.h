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
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moh/v1/server_config.pb.h"

struct MHD_Daemon;

namespace moh {

class MetricsHttpServer {
 public:
  // Listens on `host`:`port` and serves what `collectables` hold (those
  // gone by then are skipped). HTTPS when `tls` has cert_file and key_file.
  // UNAVAILABLE "metrics: cannot listen on ..." when the address is taken;
  // INVALID_ARGUMENT when a PEM file cannot be read.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& host, int port, const v1::TlsConfig& tls,
      std::vector<std::weak_ptr<prometheus::Collectable>> collectables);
  ~MetricsHttpServer();

  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  bool https() const { return https_; }

  // The exposition text of every collectable (what GET /metrics returns).
  std::string Render() const;

 private:
  MetricsHttpServer(bool https, bool client_certificates,
                    std::vector<std::weak_ptr<prometheus::Collectable>> c)
      : https_(https),
        client_certificates_(client_certificates),
        collectables_(std::move(c)) {}
  struct Handler;

  const bool https_;
  const bool client_certificates_;
  const std::vector<std::weak_ptr<prometheus::Collectable>> collectables_;
  // PEM text the daemon reads from (it keeps the pointers).
  std::string cert_, key_, trust_;
  MHD_Daemon* daemon_ = nullptr;
};

}  // namespace moh
