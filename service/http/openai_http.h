// The OpenAI-compatible HTTP API, in moh-server's process on its own port
// (ServerConfig.http_port): GET /v1/models, POST /v1/completions,
// POST /v1/chat/completions (streamed as server-sent events, or not) and
// GET /health. The JSON is openai_api.h's; this file is the transport, on
// GNU libmicrohttpd, event-driven: `threads` polling threads serve every
// connection and never wait. A request that waits (for a request worker, for
// its model's output) suspends its connection and is resumed when there is
// something to do (http_connections.h), so a connection costs a socket and a
// little memory, not a thread, and a slow client cannot take a thread.
//
// Requests go to the same servables as gRPC's, so they share batching,
// limits, adaptive activation, metrics (rpc="Completions" and
// "ChatCompletions") and the drain; they are prepared (parsed, templated,
// tokenized, admitted) on gRPC's request workers, under the same queue
// bound. A client that disconnects cancels its generation: suspended
// connections are watched for it. Headers and bodies have deadlines that
// bytes do not reset. Authentication: with auth tokens configured, /v1/*
// needs "Authorization: Bearer <token>"; /health stays open (probes).
// vLLM's tokenizer endpoints are routed here too (tokenize_http.h).
#pragma once

#include <microhttpd.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "service/http/openai_http_generation.h"
#include "service/net/http_connections.h"
#include "service/net/tls_pem.h"
#include "service/serving/auth.h"
#include "service/serving/model_manager.h"
#include "service/serving/request_workers.h"

namespace moh {

class OpenAiHttpServer {
 public:
  struct Options {
    std::string host;
    int port = 0;
    std::optional<TlsPem> tls;  // HTTPS, as the gRPC port
    int max_connections = 256;
    int max_connections_per_client = 64;
    int threads = 2;  // libmicrohttpd's polling threads
    // A request's headers must be whole this long after its connection
    // opens (or the previous request on it ends), and its body this long
    // after its headers; bytes do not reset them.
    absl::Duration header_timeout = absl::Seconds(30);
    absl::Duration body_timeout = absl::Seconds(60);
    size_t max_body_bytes = size_t{64} << 20;
    // Bodies being received at once (http_body_memory_mb).
    size_t body_memory_bytes = size_t{1} << 30;
  };

  // Listens; `models`, `workers` (gRPC's request workers: HTTP requests are
  // prepared there too) and `auth` (null: no authentication) outlive the
  // server. UNAVAILABLE "http: cannot listen on ..." when the port is taken.
  static absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> Start(
      Options options, ModelManager* models, RequestWorkers* workers,
      const TokenAuth* auth);
  // Stops listening, cancels what still runs and waits for its connections.
  ~OpenAiHttpServer();

  OpenAiHttpServer(const OpenAiHttpServer&) = delete;
  OpenAiHttpServer& operator=(const OpenAiHttpServer&) = delete;

  // Drain: /health answers 503 and new requests UNAVAILABLE; requests
  // already running complete.
  void StopAccepting() { accepting_ = false; }

 private:
  OpenAiHttpServer(Options options, ModelManager* models,
                   RequestWorkers* workers, const TokenAuth* auth)
      : options_(std::move(options)),
        models_(models),
        workers_(workers),
        auth_(auth) {}
  struct Handler;

  const Options options_;
  ModelManager* const models_;
  RequestWorkers* const workers_;
  const TokenAuth* const auth_;
  std::atomic<bool> accepting_{true};
  std::atomic<size_t> body_bytes_{0};  // reserved by requests being received
  // Requests on request workers (the destructor waits for them).
  InFlight in_flight_;
  std::unique_ptr<HttpConnectionWatch> watch_;
  HttpGeneration::Env env_;  // for the generation requests
  MHD_Daemon* daemon_ = nullptr;
};

}  // namespace moh
