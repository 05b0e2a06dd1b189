#include "service/openai_http.h"

#include <poll.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/abbreviate.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "service/http_daemon.h"
#include "service/metrics.h"
#include "service/openai_api.h"
#include "service/request_log.h"

namespace moh {
namespace {

using openai::Endpoint;

// How often a waiting request looks at its client's connection.
constexpr absl::Duration kPoll = absl::Milliseconds(50);
constexpr char kJson[] = "application/json";

// Whether the client closed its end of the connection (or it broke).
bool ClientGone(MHD_Connection* connection) {
  const MHD_ConnectionInfo* info =
      MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD);
  if (info == nullptr) return false;
  pollfd fd{info->connect_fd, POLLRDHUP, 0};
  return poll(&fd, 1, 0) > 0 &&
         (fd.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

MHD_Result RespondError(MHD_Connection* connection, const std::string& id,
                        const absl::Status& status, unsigned int http = 0) {
  return HttpRespond(connection,
                     http != 0 ? http : openai::HttpStatus(status.code()),
                     openai::ErrorJson(status), kJson, id.c_str());
}

// One generation's output as the model's callback thread delivers it; the
// connection's thread takes it.
class Sink : public GenerationObserver {
 public:
  struct Update {
    // New output since the last Take, one entry per choice that has some,
    // by index (without summaries).
    std::vector<openai::ChoiceOutput> outputs;
    // Choices that finished since the last Take.
    std::vector<GenerationSummary> finished;
    bool done = false;   // every choice finished, or the request failed
    absl::Status error;  // when it failed
  };

  void OnChunk(const GenerationChunk& chunk) override {
    absl::MutexLock lock(&mu_);
    openai::ChoiceOutput& out = pending_[chunk.index];
    out.index = chunk.index;
    out.Append(chunk.text, chunk.logprobs, chunk.prompt_logprobs);
  }
  void OnFinished(const GenerationSummary& summary) override {
    absl::MutexLock lock(&mu_);
    finished_.push_back(summary);
    if (summary.last) done_ = true;
  }
  void OnError(const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    error_ = status;
    done_ = true;
  }

  // Waits up to `timeout` for new output or the end, and takes it.
  Update Take(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(this, &Sink::Ready), timeout);
    Update update;
    for (auto& [index, out] : pending_)
      update.outputs.push_back(std::move(out));
    pending_.clear();
    update.finished.swap(finished_);
    update.done = done_;
    update.error = error_;
    return update;
  }

 private:
  bool Ready() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return done_ || !pending_.empty() || !finished_.empty();
  }

  absl::Mutex mu_;
  std::map<int32_t, openai::ChoiceOutput> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<GenerationSummary> finished_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

// A request being received (MHD's per-request pointer).
struct Incoming {
  absl::Time start = absl::Now();
  std::string request_id;  // X-Request-Id, or a fresh one (request_log.h)
  std::string body;
  bool answered = false;  // refused (or failed): the rest is not read
  // Bytes of http_body_memory_mb this request holds (given back when it is
  // answered and freed).
  size_t reserved = 0;
  std::atomic<size_t>* pool = nullptr;

  // Holds `bytes` more of `limit` in `pool`; false (nothing held) when they
  // do not fit.
  bool Reserve(std::atomic<size_t>& from, size_t bytes, size_t limit) {
    size_t used = from.load();
    do {
      if (used + bytes > limit) return false;
    } while (!from.compare_exchange_weak(used, used + bytes));
    pool = &from;
    reserved += bytes;
    return true;
  }
  // Frees the body and gives its bytes back (once it is parsed).
  void Release() {
    body = std::string();
    if (pool != nullptr) pool->fetch_sub(reserved);
    reserved = 0;
  }
  ~Incoming() { Release(); }
};

// A generation accepted by a model: the request it came from and where its
// output goes.
struct Running {
  Endpoint endpoint = Endpoint::kCompletions;
  Rpc rpc = Rpc::kCompletions;
  absl::Time start;
  std::string request_id;
  std::string model;
  Servable* servable = nullptr;
  uint64_t id = 0;
  std::shared_ptr<Sink> sink;
  std::string response_id;
  int64_t created = 0;
  bool include_usage = false;
  openai::LogprobsAsked asked;
  std::vector<GenerationSummary> summaries;  // of the choices finished
  bool recorded = false;

  openai::TokenTextFn TokenText() const {
    return [model = servable](int32_t id) { return model->TokenText(id); };
  }

  // Counts the request once.
  void Record(absl::StatusCode code) {
    if (recorded) return;
    recorded = true;
    RecordRequest(servable->metrics(), nullptr, rpc, model, code, start,
                  request_id);
  }
  // Counts the request as its end says: its error, or OK (CANCELLED when
  // the generation was cancelled).
  void RecordEnd(const Sink::Update& end) {
    const bool cancelled = std::any_of(
        summaries.begin(), summaries.end(), [](const GenerationSummary& s) {
          return s.finish_reason == FinishReason::kCancelled;
        });
    Record(!end.error.ok() ? end.error.code()
           : cancelled     ? absl::StatusCode::kCancelled
                           : absl::StatusCode::kOk);
  }
  // The client went (or the server stops): the generation stops, counted
  // as CANCELLED.
  void Cancel() {
    servable->CancelGenerate(id);
    Record(absl::StatusCode::kCancelled);
  }
};

// Whether a running request's client is gone, or the server stops.
bool Abandoned(const std::atomic<bool>& stopping, MHD_Connection* connection) {
  return stopping.load() || ClientGone(connection);
}

// A streamed response: MHD pulls server-sent events from Read on the
// connection's thread.
struct Stream {
  Running run;
  MHD_Connection* connection = nullptr;
  const std::atomic<bool>* stopping = nullptr;
  std::string pending;  // bytes not yet handed to MHD
  size_t sent = 0;
  // Per choice: whether its first chunk went out, and the length of its
  // tokens' text so far (completions' text_offset).
  std::vector<bool> started;
  std::vector<int64_t> offsets;
  bool ended = false;      // the last event is in `pending`
  bool cancelled = false;  // the client went (or the server stops)

  void Event(const std::string& json) {
    absl::StrAppend(&pending, "data: ", json, "\n\n");
  }

  openai::Chunk NewChunk(openai::ChoiceOutput choice) {
    const size_t i = static_cast<size_t>(choice.index);
    openai::Chunk chunk{run.response_id, run.created, run.model,
                        std::move(choice)};
    chunk.first = !started[i];
    chunk.asked = run.asked;
    chunk.offset = offsets[i];
    return chunk;
  }

  // Waits a little for output and turns it into events.
  void Fill() {
    if (Abandoned(*stopping, connection)) {
      run.Cancel();
      cancelled = true;
      return;
    }
    Sink::Update update = run.sink->Take(kPoll);
    // A token's text is needed twice (the offsets, the chunk's JSON): it is
    // decoded once.
    absl::flat_hash_map<int32_t, std::string> texts;
    const openai::TokenTextFn token_text = [&](int32_t id) {
      auto [it, fresh] = texts.try_emplace(id);
      if (fresh) it->second = run.servable->TokenText(id);
      return it->second;
    };
    for (openai::ChoiceOutput& out : update.outputs) {
      const size_t i = static_cast<size_t>(out.index);
      int64_t length = 0;
      for (const LogprobEntry& e : out.logprobs) {
        length += token_text(e.token.id).size();
      }
      openai::Chunk chunk = NewChunk(std::move(out));
      const openai::ChoiceOutput& c = chunk.choice;
      if (!c.text.empty() || !c.logprobs.empty() ||
          !c.prompt_logprobs.empty() ||
          (chunk.first && run.endpoint == Endpoint::kChatCompletions)) {
        Event(openai::ChunkJson(run.endpoint, chunk, token_text));
        started[i] = true;
        offsets[i] += length;
      }
    }
    for (const GenerationSummary& summary : update.finished) {
      run.summaries.push_back(summary);
      openai::ChoiceOutput last;
      last.index = summary.index;
      last.summary = &run.summaries.back();
      openai::Chunk chunk = NewChunk(std::move(last));
      chunk.first = false;
      Event(openai::ChunkJson(run.endpoint, chunk, token_text));
    }
    if (!update.done) return;
    run.RecordEnd(update);
    if (!update.error.ok()) {
      // The status line went out with the first bytes: the error is an event.
      Event(openai::ErrorJson(update.error));
    } else if (run.include_usage) {
      openai::Chunk chunk{run.response_id, run.created, run.model};
      Event(openai::UsageChunkJson(run.endpoint, chunk,
                                   openai::CombineSummaries(run.summaries)));
    }
    absl::StrAppend(&pending, "data: [DONE]\n\n");
    ended = true;
  }

  // MHD_ContentReaderCallback.
  static ssize_t Read(void* cls, uint64_t /*pos*/, char* buf, size_t max) {
    auto* s = static_cast<Stream*>(cls);
    while (s->sent == s->pending.size()) {
      s->pending.clear();
      s->sent = 0;
      if (s->ended) return MHD_CONTENT_READER_END_OF_STREAM;
      s->Fill();
      if (s->cancelled) return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    const size_t n = std::min(max, s->pending.size() - s->sent);
    std::memcpy(buf, s->pending.data() + s->sent, n);
    s->sent += n;
    return static_cast<ssize_t>(n);
  }

  // MHD_ContentReaderFreeCallback: the response is done with, sent or not.
  static void Free(void* cls) {
    auto* s = static_cast<Stream*>(cls);
    if (!s->ended && !s->cancelled) s->run.Cancel();
    delete s;
  }
};

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
        // Refused from its headers, the body never read (MHD then closes
        // the connection).
        const absl::Status refused =
            Refuse(server, connection, *incoming, url);
        if (!refused.ok()) {
          incoming->answered = true;
          Count(server, url, *incoming, refused.code());
          return RespondError(
              connection, incoming->request_id, refused,
              refused.code() == absl::StatusCode::kOutOfRange ? 413 : 0);
        }
        return MHD_YES;
      }
      if (incoming->answered) {  // refused: what still arrives is dropped
        *upload_data_size = 0;
        return MHD_YES;
      }
      if (*upload_data_size != 0) {
        // A body without a Content-Length holds its bytes as they come.
        const size_t unreserved =
            incoming->body.size() + *upload_data_size > incoming->reserved
                ? incoming->body.size() + *upload_data_size - incoming->reserved
                : 0;
        if (unreserved > 0 &&
            !incoming->Reserve(server->body_bytes_, unreserved,
                               server->options_.body_memory_bytes)) {
          Count(server, url, *incoming, absl::StatusCode::kUnavailable);
          incoming->answered = true;
          return MHD_NO;
        }
        if (incoming->body.size() + *upload_data_size >
            server->options_.max_body_bytes) {
          // A body without a Content-Length (chunked) that passes the
          // limit: no answer can be queued while it uploads, so the
          // connection closes now rather than reading on.
          Count(server, url, *incoming, absl::StatusCode::kOutOfRange);
          incoming->answered = true;
          return MHD_NO;
        }
        incoming->body.append(upload_data, *upload_data_size);
        *upload_data_size = 0;
        return MHD_YES;
      }
      return Serve(server, connection, url, method, *incoming);
    } catch (const std::exception& e) {
      return Internal(server, connection, url, incoming, e.what());
    } catch (...) {
      return Internal(server, connection, url, incoming, "unknown exception");
    }
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
      const char* header = MHD_lookup_connection_value(
          connection, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
      MOH_RETURN_IF_ERROR(server->auth_->CheckHeader(
          header != nullptr ? std::optional<absl::string_view>(header)
                            : std::nullopt));
    }
    const char* length = MHD_lookup_connection_value(
        connection, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    uint64_t bytes = 0;
    if (length == nullptr || !absl::SimpleAtoi(length, &bytes)) {
      return absl::OkStatus();  // none, or chunked: counted as it arrives
    }
    if (bytes > server->options_.max_body_bytes) {
      return absl::OutOfRangeError(absl::StrCat(
          "the body (", bytes, " bytes) is larger than ",
          server->options_.max_body_bytes >> 20, " MiB (max_message_mb)"));
    }
    if (!incoming.Reserve(server->body_bytes_, bytes,
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
    } else {
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
    const absl::Status error = UnexpectedException(
        absl::StrCat("http ", Abbreviate(url)), id, what);
    if (incoming == nullptr || incoming->answered) return MHD_NO;
    Count(server, url, *incoming, absl::StatusCode::kInternal);
    incoming->answered = true;
    return RespondError(connection, id, error);
  }

  // On a request worker: `body` to a generation submitted to its model (its
  // id); `run` and `request` are filled as far as it got.
  static absl::StatusOr<uint64_t> Prepare(
      OpenAiHttpServer* server, Endpoint endpoint, const std::string& body,
      Running& run, std::optional<openai::GenerationRequest>& request) {
    absl::StatusOr<openai::GenerationRequest> parsed =
        openai::ParseGenerationRequest(endpoint, body);
    if (!parsed.ok()) return parsed.status();
    request = std::move(*parsed);
    run.model = request->model;
    MOH_ASSIGN_OR_RETURN(HostedModel * found,
                         server->models_->Find(request->model, Task::kGenerate));
    run.model = found->name();
    MOH_ASSIGN_OR_RETURN(run.servable, found->Ready());
    if (endpoint == Endpoint::kChatCompletions) {
      MOH_ASSIGN_OR_RETURN(
          std::string prompt,
          run.servable->ChatPrompt(request->messages,
                                   request->add_generation_prompt));
      request->call.prompt = std::move(prompt);
      request->call.add_special_tokens = false;  // the template wrote them
    }
    run.sink = std::make_shared<Sink>();
    run.asked = {request->call.sampling.logprobs.has_value(),
                 request->call.sampling.prompt_logprobs.has_value()};
    // `n` stays readable: an int survives the move.
    return run.servable->Generate(std::move(request->call), run.sink);
  }

  static MHD_Result Serve(OpenAiHttpServer* server, MHD_Connection* connection,
                          const char* url, const char* method,
                          Incoming& incoming);
  static MHD_Result Generate(OpenAiHttpServer* server,
                             MHD_Connection* connection, Endpoint endpoint,
                             Incoming& incoming);
  static MHD_Result StartStream(OpenAiHttpServer* server,
                                MHD_Connection* connection, Running run,
                                int32_t n);
  static absl::Status MethodNotAllowed(const char* allowed) {
    return absl::InvalidArgumentError(
        absl::StrCat("method not allowed: this endpoint takes ", allowed));
  }

  // MHD_RequestCompletedCallback: frees the per-request state.
  static void Completed(void* /*cls*/, MHD_Connection* /*connection*/,
                        void** con_cls, MHD_RequestTerminationCode /*code*/) {
    delete static_cast<Incoming*>(*con_cls);
    *con_cls = nullptr;
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
  daemon.thread_per_connection = true;
  daemon.max_connections = server->options_.max_connections;
  daemon.max_connections_per_client =
      server->options_.max_connections_per_client;
  daemon.idle_timeout_seconds = 60;
  MOH_ASSIGN_OR_RETURN(server->daemon_,
                       StartHttpDaemon(daemon, &Handler::Access, server.get(),
                                       &Handler::Completed, nullptr));
  return server;
}

OpenAiHttpServer::~OpenAiHttpServer() {
  stopping_ = true;  // waiting requests cancel and return
  if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
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
    return RespondError(connection, incoming.request_id,
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
  if (path == "/v1/models") {
    if (!get)
      return RespondError(connection, incoming.request_id,
                          MethodNotAllowed("GET"), 405);
  } else if (path == "/v1/completions") {
    endpoint = Endpoint::kCompletions;
  } else if (path == "/v1/chat/completions") {
    endpoint = Endpoint::kChatCompletions;
  } else {
    return RespondError(
        connection, incoming.request_id,
        absl::NotFoundError(absl::StrCat(
            "no such endpoint: ", Abbreviate(path),
            " (endpoints: GET /v1/models, POST /v1/completions, POST "
            "/v1/chat/completions, GET /health)")));
  }
  // Authentication was checked from the headers (Handler::Refuse).
  if (path == "/v1/models") {
    return HttpRespond(connection, 200,
                       openai::ModelsJson(server->models_->List()), kJson,
                       incoming.request_id.c_str());
  }
  if (!post)
    return RespondError(connection, incoming.request_id,
                        MethodNotAllowed("POST"), 405);
  return Generate(server, connection, endpoint, incoming);
}

MHD_Result OpenAiHttpServer::Handler::Generate(OpenAiHttpServer* server,
                                               MHD_Connection* connection,
                                               Endpoint endpoint,
                                               Incoming& incoming) {
  Running run;
  run.endpoint = endpoint;
  run.rpc = endpoint == Endpoint::kCompletions ? Rpc::kCompletions
                                               : Rpc::kChatCompletions;
  run.start = incoming.start;
  run.request_id = incoming.request_id;
  // Errors before the request reaches a model.
  auto fail = [&](const absl::Status& status, unsigned int http = 0) {
    if (run.servable != nullptr) {
      run.Record(status.code());
    } else {
      RecordRequest(nullptr, server->models_->metrics(), run.rpc, run.model,
                    status.code(), run.start, run.request_id);
    }
    return RespondError(connection, incoming.request_id, status, http);
  };
  if (!server->accepting_) {
    return fail(
        absl::UnavailableError("the server is draining; retry on "
                               "another replica"));
  }
  // Preparing the request (parsing, finding the model, the chat template,
  // tokenizing and admission) runs on a request worker, as gRPC's calls do:
  // the same threads and the same bound on waiting requests (a full queue is
  // RESOURCE_EXHAUSTED, 429). This thread waits for it, then answers.
  std::optional<openai::GenerationRequest> request;
  absl::StatusOr<uint64_t> id = absl::UnknownError("not prepared");
  absl::Notification prepared;
  const absl::Status queued = server->workers_->Run([&] {
    // The worker's own last resort: an exception is this request's error.
    try {
      id = Prepare(server, endpoint, incoming.body, run, request);
    } catch (const std::exception& e) {
      id = UnexpectedException(absl::StrCat("http ", RpcName(run.rpc)),
                               run.request_id, e.what());
    }
    prepared.Notify();
  });
  if (!queued.ok()) return fail(queued);
  prepared.WaitForNotification();
  incoming.Release();  // parsed: the body's memory goes back
  if (!id.ok()) return fail(id.status());
  run.id = *id;
  const int32_t n = request->call.n;
  run.response_id = openai::NewId(endpoint);
  run.created = absl::ToUnixSeconds(absl::Now());
  run.include_usage = request->include_usage;
  if (request->stream) {
    return StartStream(server, connection, std::move(run), n);
  }

  // Not streamed: every choice whole, once all are done.
  std::vector<openai::ChoiceOutput> choices(n);
  for (;;) {
    Sink::Update update = run.sink->Take(kPoll);
    for (const openai::ChoiceOutput& out : update.outputs) {
      choices[out.index].Append(out.text, out.logprobs, out.prompt_logprobs);
    }
    run.summaries.insert(run.summaries.end(), update.finished.begin(),
                         update.finished.end());
    if (update.done) {
      if (!update.error.ok()) return fail(update.error);
      run.RecordEnd(update);
      for (size_t i = 0; i < choices.size(); ++i) {
        choices[i].index = static_cast<int32_t>(i);
      }
      for (const GenerationSummary& summary : run.summaries) {
        choices[summary.index].summary = &summary;
      }
      openai::Finished finished{run.response_id,
                                run.created,
                                run.model,
                                std::move(choices),
                                openai::CombineSummaries(run.summaries),
                                run.asked};
      return HttpRespond(
          connection, 200,
          openai::ResponseJson(endpoint, finished, run.TokenText()), kJson,
          run.request_id.c_str());
    }
    if (Abandoned(server->stopping_, connection)) {
      run.Cancel();
      return MHD_NO;  // closes the connection
    }
  }
}

MHD_Result OpenAiHttpServer::Handler::StartStream(OpenAiHttpServer* server,
                                                  MHD_Connection* connection,
                                                  Running run, int32_t n) {
  auto* stream = new Stream;
  stream->run = std::move(run);
  stream->started.assign(n, false);
  stream->offsets.assign(n, 0);
  stream->connection = connection;
  stream->stopping = &server->stopping_;
  MHD_Response* response = MHD_create_response_from_callback(
      MHD_SIZE_UNKNOWN, 16 << 10, &Stream::Read, stream, &Stream::Free);
  if (response == nullptr) {
    Stream::Free(stream);
    return MHD_NO;
  }
  MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE,
                          "text/event-stream");
  MHD_add_response_header(response, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
  MHD_add_response_header(response, "X-Request-Id",
                          stream->run.request_id.c_str());
  const MHD_Result result = MHD_queue_response(connection, 200, response);
  MHD_destroy_response(response);
  return result;
}

}  // namespace moh
