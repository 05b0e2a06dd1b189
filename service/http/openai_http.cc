#include "service/http/openai_http.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/abbreviate.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "service/http/openai_api.h"
#include "service/http/tokenize_http.h"
#include "service/metrics/metrics.h"
#include "service/metrics/request_log.h"
#include "service/net/http_daemon.h"

namespace moh {
namespace {

using openai::Endpoint;

constexpr char kJson[] = "application/json";

MHD_Result RespondError(MHD_Connection* connection, const std::string& id,
                        const absl::Status& status, unsigned int http = 0) {
  return HttpRespond(connection,
                     http != 0 ? http : openai::HttpStatus(status.code()),
                     openai::ErrorJson(status), kJson, id.c_str());
}

// A request being received (MHD's per-request pointer).
struct Incoming {
  absl::Time start = absl::Now();
  std::string request_id;  // X-Request-Id, or a fresh one (request_log.h)
  std::string body;
  bool answered = false;  // answered (or closing): nothing more is served
  // Refused (from its headers, or as its body passed a limit): the body is
  // read and dropped, never held, and the refusal answered once it is whole,
  // so that a client that sends its whole body before reading (as most do)
  // reads the answer rather than a broken pipe. A body that passes
  // Handler::DiscardLimit closes the connection instead.
  absl::Status refusal;  // OUT_OF_RANGE (the body's size) is a 413
  size_t discarded = 0;
  // Bytes of http_body_memory_mb the body holds.
  BodyReservation reservation;
  // A generation, once its body is whole.
  std::unique_ptr<HttpGeneration> generation;
  // A tokenizer request (tokenize_http.h), once its body is whole.
  std::unique_ptr<HttpTokenizerRequest> tokenizer;
  // Whose error objects its answers hold (Anthropic's on /v1/messages).
  Endpoint api = Endpoint::kCompletions;

  // Frees the body and gives its bytes back.
  void Release() {
    body = std::string();
    reservation.Release();
  }
};

// An error answered to `incoming`, in its API's shape.
MHD_Result RespondError(MHD_Connection* connection, const Incoming& incoming,
                        const absl::Status& status, unsigned int http = 0) {
  return HttpRespond(
      connection, http != 0 ? http : openai::HttpStatus(status.code()),
      HttpErrorJson(incoming.api, status), kJson, incoming.request_id.c_str());
}

}  // namespace

struct OpenAiHttpServer::Handler {
  static MHD_Result Access(void* cls, MHD_Connection* connection,
                           const char* url, const char* method,
                           const char* /*version*/, const char* upload_data,
                           size_t* upload_data_size, void** con_cls) {
    auto* server = static_cast<OpenAiHttpServer*>(cls);
    auto* incoming = static_cast<Incoming*>(*con_cls);
    // The last resort: whatever a request makes throw is its own 500, logged
    // with its request id; the server and every other request go on.
    try {
      if (incoming == nullptr) {  // the headers: the body follows
        incoming = new Incoming;
        const char* id = MHD_lookup_connection_value(
            connection, MHD_HEADER_KIND, kRequestIdKey);
        incoming->request_id =
            RequestId(id != nullptr ? std::optional<absl::string_view>(id)
                                    : std::nullopt);
        *con_cls = incoming;
        if (std::strcmp(url, "/v1/messages") == 0) {
          incoming->api = Endpoint::kMessages;
        }
        server->watch_->HeadersReceived(connection);
        const absl::Status refused = Refuse(server, connection, *incoming, url);
        if (refused.ok()) return MHD_YES;
        Refused(server, url, *incoming, refused);
        // A client waiting for "100 Continue", or a body too large to drop,
        // is answered now (MHD then closes the connection unread).
        const char* expect = MHD_lookup_connection_value(
            connection, MHD_HEADER_KIND, MHD_HTTP_HEADER_EXPECT);
        uint64_t length = 0;
        if ((expect != nullptr &&
             absl::EqualsIgnoreCase(expect, "100-continue")) ||
            (ContentLength(connection, &length) &&
             length > DiscardLimit(server))) {
          return AnswerRefusal(connection, *incoming);
        }
        return MHD_YES;
      }
      if (incoming->answered) return MHD_NO;
      if (!incoming->refusal.ok()) {  // refused: its body is dropped
        if (*upload_data_size == 0) return AnswerRefusal(connection, *incoming);
        incoming->discarded += *upload_data_size;
        *upload_data_size = 0;
        return incoming->discarded + incoming->body.size() >
                       DiscardLimit(server)
                   ? MHD_NO
                   : MHD_YES;
      }
      if (incoming->generation != nullptr) {  // resumed: it may go on
        return incoming->generation->Continue(connection, &incoming->answered);
      }
      if (incoming->tokenizer != nullptr) {
        return incoming->tokenizer->Continue(connection, &incoming->answered);
      }
      if (*upload_data_size != 0) {
        // A body without a Content-Length (chunked) holds its bytes as they
        // come, and is refused when it passes a limit.
        const size_t total = incoming->body.size() + *upload_data_size;
        const size_t held = incoming->reservation.bytes();
        absl::Status refused;
        if (total > server->options_.max_body_bytes) {
          refused = BodyTooLarge(server, total);
        } else if (total > held && !incoming->reservation.Add(
                                       server->body_bytes_, total - held,
                                       server->options_.body_memory_bytes)) {
          refused = BodiesFull(server);
        }
        if (!refused.ok()) {
          Refused(server, url, *incoming, refused);
          incoming->discarded += *upload_data_size;
          *upload_data_size = 0;
          return MHD_YES;
        }
        incoming->body.append(upload_data, *upload_data_size);
        *upload_data_size = 0;
        return MHD_YES;
      }
      server->watch_->BodyReceived(connection);
      return Serve(server, connection, url, method, *incoming);
    } catch (const std::exception& e) {
      return Internal(server, connection, url, incoming, e.what());
    } catch (...) {
      return Internal(server, connection, url, incoming, "unknown exception");
    }
  }

  // A refused request's body is dropped up to four times max_message_mb or
  // 16 MiB, whichever is less (a client that sent a little too much still
  // reads why); a larger one is answered from its headers (or closed when it
  // passes this, chunked).
  static uint64_t DiscardLimit(const OpenAiHttpServer* server) {
    return std::min(4 * uint64_t{server->options_.max_body_bytes},
                    uint64_t{16} << 20);
  }

  static bool ContentLength(MHD_Connection* connection, uint64_t* bytes) {
    const char* length = MHD_lookup_connection_value(
        connection, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    return length != nullptr && absl::SimpleAtoi(length, bytes);
  }

  static absl::Status BodyTooLarge(const OpenAiHttpServer* server,
                                   uint64_t bytes) {
    return absl::OutOfRangeError(absl::StrCat(
        "the body (", bytes, " bytes) is larger than ",
        server->options_.max_body_bytes >> 20, " MiB (max_message_mb)"));
  }

  // `incoming` is refused with `status` (OUT_OF_RANGE is a 413): counted
  // now, its body's memory given back; the answer waits for its body.
  static void Refused(OpenAiHttpServer* server, const char* url,
                      Incoming& incoming, const absl::Status& status) {
    Count(server, url, incoming, status.code());
    incoming.refusal = status;
    incoming.discarded += incoming.body.size();
    incoming.Release();
  }

  static MHD_Result AnswerRefusal(MHD_Connection* connection,
                                  Incoming& incoming) {
    incoming.answered = true;
    const bool too_large =
        incoming.refusal.code() == absl::StatusCode::kOutOfRange;
    return RespondError(connection, incoming, incoming.refusal,
                        too_large ? 413 : 0);
  }

  // What a request's headers alone refuse: a missing or wrong token on a
  // path that needs one (UNAUTHENTICATED), a Content-Length over
  // max_message_mb (OUT_OF_RANGE, answered 413) or over what
  // http_body_memory_mb has left (UNAVAILABLE, 503); else the body's bytes
  // are reserved.
  static absl::Status Refuse(OpenAiHttpServer* server,
                             MHD_Connection* connection, Incoming& incoming,
                             const char* url) {
    if (server->auth_ != nullptr && std::strcmp(url, "/health") != 0) {
      // Bearer, or x-api-key (Anthropic's clients) on every path alike.
      auto header = [&](const char* name) {
        const char* v =
            MHD_lookup_connection_value(connection, MHD_HEADER_KIND, name);
        return v != nullptr ? std::optional<absl::string_view>(v)
                            : std::nullopt;
      };
      MOH_RETURN_IF_ERROR(server->auth_->CheckHeaders(
          header(MHD_HTTP_HEADER_AUTHORIZATION), header("x-api-key")));
    }
    uint64_t bytes = 0;
    if (!ContentLength(connection, &bytes)) {
      return absl::OkStatus();  // none, or chunked: counted as it arrives
    }
    if (bytes > server->options_.max_body_bytes) {
      return BodyTooLarge(server, bytes);
    }
    if (!incoming.reservation.Add(server->body_bytes_, bytes,
                                  server->options_.body_memory_bytes)) {
      return BodiesFull(server);
    }
    return absl::OkStatus();
  }

  static absl::Status BodiesFull(OpenAiHttpServer* server) {
    return absl::UnavailableError(absl::StrCat(
        "the server is receiving ", server->options_.body_memory_bytes >> 20,
        " MiB of request bodies already (http_body_memory_mb); retry later"));
  }

  // Counts a request answered before it reached a model (refused from its
  // headers, or failed), as gRPC counts its own: the generation endpoints,
  // by path.
  static void Count(OpenAiHttpServer* server, const char* url,
                    const Incoming& incoming, absl::StatusCode code) {
    Rpc rpc;
    if (std::strcmp(url, "/v1/completions") == 0) {
      rpc = Rpc::kCompletions;
    } else if (std::strcmp(url, "/v1/chat/completions") == 0) {
      rpc = Rpc::kChatCompletions;
    } else if (std::strcmp(url, "/v1/messages") == 0) {
      rpc = Rpc::kMessages;
    } else if (!TokenizerPath(url, &rpc)) {
      return;
    }
    RecordRequest(nullptr, server->models_->metrics(), rpc, "", code,
                  incoming.start, incoming.request_id);
  }

  static MHD_Result Internal(OpenAiHttpServer* server,
                             MHD_Connection* connection, const char* url,
                             Incoming* incoming, const char* what) {
    const std::string id =
        incoming != nullptr ? incoming->request_id : std::string("-");
    const absl::Status error =
        UnexpectedException(absl::StrCat("http ", Abbreviate(url)), id, what);
    if (incoming == nullptr || incoming->answered) return MHD_NO;
    incoming->answered = true;
    if (incoming->generation != nullptr) {  // it may have started: it stops
      incoming->generation->Abandon(absl::StatusCode::kInternal);
      return MHD_NO;
    }
    if (incoming->tokenizer != nullptr) {
      incoming->tokenizer->Abandon(absl::StatusCode::kInternal);
      return MHD_NO;
    }
    Count(server, url, *incoming, absl::StatusCode::kInternal);
    return RespondError(connection, *incoming, error);
  }

  static MHD_Result Serve(OpenAiHttpServer* server, MHD_Connection* connection,
                          const char* url, const char* method,
                          Incoming& incoming);
  static MHD_Result Generate(OpenAiHttpServer* server,
                             MHD_Connection* connection, Endpoint endpoint,
                             const char* url, Incoming& incoming);
  // vLLM's tokenizer endpoints (tokenize_http.h).
  static MHD_Result Tokenizer(OpenAiHttpServer* server,
                              MHD_Connection* connection, Rpc rpc,
                              const char* method, Incoming& incoming);
  static absl::Status MethodNotAllowed(const char* allowed) {
    return absl::InvalidArgumentError(
        absl::StrCat("method not allowed: this endpoint takes ", allowed));
  }

  // MHD_RequestCompletedCallback: frees the per-request state; the next
  // request's header deadline starts. A generation not yet answered stops:
  // its connection closed (MHD may see a client that left as it resumes the
  // connection, and close it without calling the handler again).
  static void Completed(void* cls, MHD_Connection* connection, void** con_cls,
                        MHD_RequestTerminationCode /*code*/) {
    auto* server = static_cast<OpenAiHttpServer*>(cls);
    auto* incoming = static_cast<Incoming*>(*con_cls);
    if (incoming != nullptr && !incoming->answered &&
        (incoming->generation != nullptr || incoming->tokenizer != nullptr)) {
      try {
        if (incoming->generation != nullptr) {
          incoming->generation->Abandon(absl::StatusCode::kCancelled);
        } else {
          incoming->tokenizer->Abandon(absl::StatusCode::kCancelled);
        }
      } catch (const std::exception& e) {
        UnexpectedException("http request end", incoming->request_id, e.what())
            .IgnoreError();  // logged; the connection is gone
      }
    }
    delete incoming;
    *con_cls = nullptr;
    server->watch_->RequestEnded(connection);
  }
};

absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> OpenAiHttpServer::Start(
    Options options, ModelManager* models, RequestWorkers* workers,
    const TokenAuth* auth) {
  std::unique_ptr<OpenAiHttpServer> server(
      new OpenAiHttpServer(std::move(options), models, workers, auth));
  HttpDaemonOptions daemon;
  daemon.what = "http";
  daemon.host = server->options_.host;
  daemon.port = server->options_.port;
  daemon.tls = &server->options_.tls;
  daemon.pool_threads = server->options_.threads;
  daemon.max_connections = server->options_.max_connections;
  daemon.max_connections_per_client =
      server->options_.max_connections_per_client;
  daemon.idle_timeout_seconds = 60;
  HttpConnectionWatch::Options watch;
  watch.header_timeout = server->options_.header_timeout;
  watch.body_timeout = server->options_.body_timeout;
  server->watch_ = std::make_unique<HttpConnectionWatch>(watch);
  daemon.watch = server->watch_.get();
  server->env_ = {server->models_, server->workers_, server->watch_.get(),
                  &server->in_flight_};
  MOH_ASSIGN_OR_RETURN(server->daemon_,
                       StartHttpDaemon(daemon, &Handler::Access, server.get(),
                                       &Handler::Completed, server.get()));
  return server;
}

OpenAiHttpServer::~OpenAiHttpServer() {
  // Suspended requests resume, see that the server stops, cancel and
  // close; MHD_stop_daemon then finds none suspended.
  if (watch_ != nullptr) watch_->Stop();
  if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
  // Workers still preparing requests use this server: wait for them.
  in_flight_.WaitForNone();
}

MHD_Result OpenAiHttpServer::Handler::Serve(OpenAiHttpServer* server,
                                            MHD_Connection* connection,
                                            const char* url, const char* method,
                                            Incoming& incoming) {
  const std::string path = url;
  const bool get = std::strcmp(method, MHD_HTTP_METHOD_GET) == 0;
  const bool post = std::strcmp(method, MHD_HTTP_METHOD_POST) == 0;
  if (server->options_.tls && !server->options_.tls->client_ca.empty() &&
      !HttpClientVerified(connection)) {
    return RespondError(connection, incoming,
                        absl::PermissionDeniedError(
                            "a client certificate signed by the client CA is "
                            "required"));
  }
  if (path == "/health") {
    if (!get)
      return RespondError(connection, incoming.request_id,
                          MethodNotAllowed("GET"), 405);
    const bool draining = !server->accepting_;
    const bool ready = server->models_->AllReady();
    const char* status = draining ? "draining" : (ready ? "ok" : "not ready");
    return HttpRespond(connection, !draining && ready ? 200 : 503,
                       absl::StrCat("{\"status\": \"", status, "\"}"), kJson,
                       incoming.request_id.c_str());
  }
  Endpoint endpoint = Endpoint::kCompletions;
  if (Rpc rpc; TokenizerPath(path, &rpc)) {
    return Tokenizer(server, connection, rpc, method, incoming);
  }
  if (path == "/v1/models") {
    if (!get)
      return RespondError(connection, incoming.request_id,
                          MethodNotAllowed("GET"), 405);
  } else if (path == "/v1/completions") {
    endpoint = Endpoint::kCompletions;
  } else if (path == "/v1/chat/completions") {
    endpoint = Endpoint::kChatCompletions;
  } else if (path == "/v1/messages") {
    endpoint = Endpoint::kMessages;
  } else {
    return RespondError(
        connection, incoming.request_id,
        absl::NotFoundError(absl::StrCat(
            "no such endpoint: ", Abbreviate(path),
            " (endpoints: GET /v1/models, POST /v1/completions, POST "
            "/v1/chat/completions, POST /v1/messages, GET /health, POST "
            "/tokenize, POST /detokenize, GET /tokenizer_info)")));
  }
  // Authentication was checked from the headers (Handler::Refuse).
  if (path == "/v1/models") {
    return HttpRespond(connection, 200,
                       openai::ModelsJson(server->models_->List()), kJson,
                       incoming.request_id.c_str());
  }
  if (!post)
    return RespondError(connection, incoming, MethodNotAllowed("POST"), 405);
  return Generate(server, connection, endpoint, url, incoming);
}

MHD_Result OpenAiHttpServer::Handler::Generate(OpenAiHttpServer* server,
                                               MHD_Connection* connection,
                                               Endpoint endpoint,
                                               const char* url,
                                               Incoming& incoming) {
  if (!server->accepting_) {
    Count(server, url, incoming, absl::StatusCode::kUnavailable);
    incoming.answered = true;
    return RespondError(connection, incoming,
                        absl::UnavailableError("the server is draining; retry "
                                               "on another replica"));
  }
  HttpGeneration::Request request;
  request.endpoint = endpoint;
  request.body = std::move(incoming.body);
  request.reservation = std::move(incoming.reservation);
  request.start = incoming.start;
  request.request_id = incoming.request_id;
  absl::StatusOr<std::unique_ptr<HttpGeneration>> started =
      HttpGeneration::Start(server->env_, connection, std::move(request));
  if (!started.ok()) {
    incoming.answered = true;
    return RespondError(connection, incoming, started.status());
  }
  incoming.generation = std::move(*started);
  return incoming.generation->Continue(connection, &incoming.answered);
}

MHD_Result OpenAiHttpServer::Handler::Tokenizer(OpenAiHttpServer* server,
                                                MHD_Connection* connection,
                                                Rpc rpc, const char* method,
                                                Incoming& incoming) {
  // Authentication was checked from the headers (Handler::Refuse).
  const char* allowed =
      rpc == Rpc::kTokenizerInfo ? MHD_HTTP_METHOD_GET : MHD_HTTP_METHOD_POST;
  if (std::strcmp(method, allowed) != 0) {
    return RespondError(connection, incoming.request_id,
                        MethodNotAllowed(allowed), 405);
  }
  HttpTokenizerRequest::Request request;
  request.rpc = rpc;
  request.body = std::move(incoming.body);
  request.reservation = std::move(incoming.reservation);
  const char* model =
      MHD_lookup_connection_value(connection, MHD_GET_ARGUMENT_KIND, "model");
  if (model != nullptr) request.model = model;
  request.start = incoming.start;
  request.request_id = incoming.request_id;
  request.draining = !server->accepting_;
  absl::StatusOr<std::unique_ptr<HttpTokenizerRequest>> started =
      HttpTokenizerRequest::Start(server->env_, connection, std::move(request));
  if (!started.ok()) {
    incoming.answered = true;
    return RespondError(connection, incoming.request_id, started.status());
  }
  incoming.tokenizer = std::move(*started);
  return incoming.tokenizer->Continue(connection, &incoming.answered);
}

}  // namespace moh
