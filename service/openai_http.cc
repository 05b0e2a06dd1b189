#include "service/openai_http.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
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

constexpr char kJson[] = "application/json";

MHD_Result RespondError(MHD_Connection* connection, const std::string& id,
                        const absl::Status& status, unsigned int http = 0) {
  return HttpRespond(connection,
                     http != 0 ? http : openai::HttpStatus(status.code()),
                     openai::ErrorJson(status), kJson, id.c_str());
}

// One generation's output as the model's callback thread delivers it; the
// connection's handler takes it when its waker resumes it.
class Sink : public GenerationObserver {
 public:
  // `every_chunk`: wake for each chunk (a stream), else only at the end.
  Sink(std::shared_ptr<HttpWaker> waker, bool every_chunk)
      : waker_(std::move(waker)), every_chunk_(every_chunk) {}

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
    {
      absl::MutexLock lock(&mu_);
      openai::ChoiceOutput& out = pending_[chunk.index];
      out.index = chunk.index;
      out.Append(chunk.text, chunk.logprobs, chunk.prompt_logprobs);
    }
    if (every_chunk_) waker_->Wake();
  }
  void OnFinished(const GenerationSummary& summary) override {
    {
      absl::MutexLock lock(&mu_);
      finished_.push_back(summary);
      if (summary.last) done_ = true;
    }
    waker_->Wake();
  }
  void OnError(const absl::Status& status) override {
    {
      absl::MutexLock lock(&mu_);
      error_ = status;
      done_ = true;
    }
    waker_->Wake();
  }

  // Takes the output since the last Take (none, when there is none yet).
  Update Take() {
    absl::MutexLock lock(&mu_);
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
  const std::shared_ptr<HttpWaker> waker_;
  const bool every_chunk_;
  absl::Mutex mu_;
  std::map<int32_t, openai::ChoiceOutput> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<GenerationSummary> finished_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

struct Call;

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
  absl::Status refusal;
  unsigned int refusal_http = 0;
  size_t discarded = 0;
  std::shared_ptr<Call> call;  // a generation, once its body is whole
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

// A generation request from the moment its body is whole: prepared on a
// request worker, then run by its model. Its connection is suspended while
// it waits for either; `waker` resumes it.
struct Call {
  Endpoint endpoint = Endpoint::kCompletions;
  std::shared_ptr<HttpWaker> waker;
  std::string body;  // until the worker has parsed it
  Running run;       // the worker's until `prepared`
  std::optional<openai::GenerationRequest> request;
  absl::StatusOr<uint64_t> id = absl::UnknownError("not prepared");
  // Not streamed: the output so far, once it runs.
  std::vector<openai::ChoiceOutput> choices;
  bool started = false;  // the handler has taken the prepared request

  // Set by the worker when it has prepared the request (`run`, `request`
  // and `id` are then the handler's), or by the handler when it gives the
  // request up (the client left, the server stops): whichever comes second
  // cancels a generation that was submitted.
  absl::Mutex mu;
  bool prepared ABSL_GUARDED_BY(mu) = false;
  bool abandoned ABSL_GUARDED_BY(mu) = false;

  bool Prepared() {
    absl::MutexLock lock(&mu);
    return prepared;
  }
};

// A streamed response: MHD pulls server-sent events from Read on the
// connection's polling thread; with none ready, Read suspends the connection
// until the model has more.
struct Stream {
  Running run;
  std::shared_ptr<HttpWaker> waker;
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

  // Turns the output so far into events.
  void Fill() {
    Sink::Update update = run.sink->Take();
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
      if (s->waker->Departed()) {
        s->run.Cancel();
        s->cancelled = true;
        return MHD_CONTENT_READER_END_WITH_ERROR;
      }
      s->Fill();
      // Nothing yet: MHD calls again once the model's output resumes it.
      if (s->pending.empty() && !s->ended && s->waker->Suspend()) return 0;
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
        server->watch_->HeadersReceived(connection);
        const absl::Status refused =
            Refuse(server, connection, *incoming, url);
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
      if (incoming->call != nullptr) {  // resumed: it may go on
        return Continue(server, connection, *incoming);
      }
      if (*upload_data_size != 0) {
        // A body without a Content-Length holds its bytes as they come.
        const size_t unreserved =
            incoming->body.size() + *upload_data_size > incoming->reserved
                ? incoming->body.size() + *upload_data_size - incoming->reserved
                : 0;
        if (incoming->body.size() + *upload_data_size >
            server->options_.max_body_bytes) {
          // A body without a Content-Length (chunked) that passes the limit.
          Refused(
              server, url, *incoming,
              BodyTooLarge(server, incoming->body.size() + *upload_data_size));
          incoming->discarded += *upload_data_size;
          *upload_data_size = 0;
          return MHD_YES;
        }
        if (unreserved > 0 &&
            !incoming->Reserve(server->body_bytes_, unreserved,
                               server->options_.body_memory_bytes)) {
          Refused(server, url, *incoming, BodiesFull(server));
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
    incoming.refusal_http =
        status.code() == absl::StatusCode::kOutOfRange ? 413 : 0;
    incoming.discarded += incoming.body.size();
    incoming.Release();
  }

  static MHD_Result AnswerRefusal(MHD_Connection* connection,
                                  Incoming& incoming) {
    incoming.answered = true;
    return RespondError(connection, incoming.request_id, incoming.refusal,
                        incoming.refusal_http);
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
    uint64_t bytes = 0;
    if (!ContentLength(connection, &bytes)) {
      return absl::OkStatus();  // none, or chunked: counted as it arrives
    }
    if (bytes > server->options_.max_body_bytes) {
      return BodyTooLarge(server, bytes);
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
    incoming->answered = true;
    if (incoming->call != nullptr) {  // it may have started: it stops
      Abandon(server, *incoming->call, absl::StatusCode::kInternal);
      return MHD_NO;
    }
    Count(server, url, *incoming, absl::StatusCode::kInternal);
    return RespondError(connection, id, error);
  }

  // On a request worker: `call`'s body to a generation submitted to its
  // model (its id); `call.run` and `call.request` are filled as far as it
  // got.
  static absl::StatusOr<uint64_t> Prepare(OpenAiHttpServer* server,
                                          Call& call) {
    absl::StatusOr<openai::GenerationRequest> parsed =
        openai::ParseGenerationRequest(call.endpoint, call.body);
    call.body = std::string();
    if (!parsed.ok()) return parsed.status();
    std::optional<openai::GenerationRequest>& request = call.request;
    Running& run = call.run;
    request = std::move(*parsed);
    run.model = request->model;
    MOH_ASSIGN_OR_RETURN(HostedModel * found,
                         server->models_->Find(request->model, Task::kGenerate));
    run.model = found->name();
    MOH_ASSIGN_OR_RETURN(run.servable, found->Ready());
    if (call.endpoint == Endpoint::kChatCompletions) {
      MOH_ASSIGN_OR_RETURN(
          std::string prompt,
          run.servable->ChatPrompt(request->messages,
                                   request->add_generation_prompt));
      request->call.prompt = std::move(prompt);
      request->call.add_special_tokens = false;  // the template wrote them
    }
    run.sink = std::make_shared<Sink>(call.waker, request->stream);
    run.asked = {request->call.sampling.logprobs.has_value(),
                 request->call.sampling.prompt_logprobs.has_value()};
    // `n` stays readable: an int survives the move.
    return run.servable->Generate(std::move(request->call), run.sink);
  }

  // Counts a generation request that ended before its model ran it.
  static void RecordUnrun(OpenAiHttpServer* server, Running& run,
                          absl::StatusCode code) {
    if (run.servable != nullptr) {
      run.Record(code);
    } else {
      RecordRequest(nullptr, server->models_->metrics(), run.rpc, run.model,
                    code, run.start, run.request_id);
    }
  }

  // The handler gives `call` up (its client left, the server stops, or it
  // failed): its generation, if the worker submitted one, is cancelled, and
  // the request is counted with `code` (CANCELLED for a client that left).
  static void Abandon(OpenAiHttpServer* server, Call& call,
                      absl::StatusCode code) {
    bool prepared;
    {
      absl::MutexLock lock(&call.mu);
      call.abandoned = true;
      prepared = call.prepared;
    }
    const Running& run = call.run;
    if (!prepared) {
      // The worker still fills `run` (and cancels what it submits): the
      // request is counted without its model.
      RecordRequest(nullptr, server->models_->metrics(), run.rpc, "", code,
                    run.start, run.request_id);
    } else if (call.id.ok()) {
      call.run.servable->CancelGenerate(*call.id);
      call.run.Record(code);
    } else {
      RecordUnrun(server, call.run, code);
    }
  }

  static MHD_Result Serve(OpenAiHttpServer* server, MHD_Connection* connection,
                          const char* url, const char* method,
                          Incoming& incoming);
  static MHD_Result Generate(OpenAiHttpServer* server,
                             MHD_Connection* connection, Endpoint endpoint,
                             Incoming& incoming);
  static MHD_Result Continue(OpenAiHttpServer* server,
                             MHD_Connection* connection, Incoming& incoming);
  static MHD_Result StartStream(MHD_Connection* connection, Call& call,
                                int32_t n);
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
    if (incoming != nullptr && incoming->call != nullptr &&
        !incoming->answered) {
      try {
        Abandon(server, *incoming->call, absl::StatusCode::kCancelled);
      } catch (const std::exception& e) {
        UnexpectedException("http request end", incoming->request_id, e.what());
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
  absl::MutexLock lock(&preparing_mu_);
  preparing_mu_.Await(absl::Condition(
      +[](int* n) { return *n == 0; }, &preparing_));
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
  auto call = std::make_shared<Call>();
  call->endpoint = endpoint;
  Running& run = call->run;
  run.endpoint = endpoint;
  run.rpc = endpoint == Endpoint::kCompletions ? Rpc::kCompletions
                                               : Rpc::kChatCompletions;
  run.start = incoming.start;
  run.request_id = incoming.request_id;
  if (!server->accepting_) {
    RecordUnrun(server, run, absl::StatusCode::kUnavailable);
    return RespondError(connection, incoming.request_id,
                        absl::UnavailableError("the server is draining; retry "
                                               "on another replica"));
  }
  call->waker = server->watch_->NewWaker(connection);
  call->body = std::move(incoming.body);
  // Preparing the request (parsing, finding the model, the chat template,
  // tokenizing and admission) runs on a request worker, as gRPC's calls do:
  // the same threads and the same bound on waiting requests (a full queue is
  // RESOURCE_EXHAUSTED, 429). The connection is suspended meanwhile.
  {
    absl::MutexLock lock(&server->preparing_mu_);
    ++server->preparing_;
  }
  const absl::Status queued = server->workers_->Run([server, call] {
    absl::StatusOr<uint64_t> id;
    // The worker's own last resort: an exception is this request's error.
    try {
      id = Prepare(server, *call);
    } catch (const std::exception& e) {
      id = UnexpectedException(absl::StrCat("http ", RpcName(call->run.rpc)),
                               call->run.request_id, e.what());
    }
    bool abandoned;
    {
      absl::MutexLock lock(&call->mu);
      call->id = std::move(id);
      call->prepared = true;
      abandoned = call->abandoned;
    }
    // Given up while it was prepared (and counted then): what was submitted
    // stops.
    if (abandoned && call->id.ok()) {
      call->run.servable->CancelGenerate(*call->id);
    }
    call->waker->Wake();
    absl::MutexLock lock(&server->preparing_mu_);
    --server->preparing_;
  });
  if (!queued.ok()) {
    {
      absl::MutexLock lock(&server->preparing_mu_);
      --server->preparing_;
    }
    RecordUnrun(server, run, queued.code());
    return RespondError(connection, incoming.request_id, queued);
  }
  incoming.call = std::move(call);
  return Continue(server, connection, incoming);
}

MHD_Result OpenAiHttpServer::Handler::Continue(OpenAiHttpServer* server,
                                               MHD_Connection* connection,
                                               Incoming& incoming) {
  Call& call = *incoming.call;
  Running& run = call.run;
  for (;;) {
    if (call.waker->Departed()) {
      Abandon(server, call, absl::StatusCode::kCancelled);
      incoming.answered = true;
      return MHD_NO;  // closes the connection
    }
    if (!call.started) {
      if (!call.Prepared()) {
        if (call.waker->Suspend()) return MHD_YES;
        continue;
      }
      call.started = true;
      incoming.Release();  // parsed: the body's memory goes back
      if (!call.id.ok()) {
        RecordUnrun(server, run, call.id.status().code());
        incoming.answered = true;
        return RespondError(connection, incoming.request_id, call.id.status());
      }
      run.id = *call.id;
      run.response_id = openai::NewId(call.endpoint);
      run.created = absl::ToUnixSeconds(absl::Now());
      run.include_usage = call.request->include_usage;
      const int32_t n = call.request->call.n;
      if (call.request->stream) {
        incoming.answered = true;
        return StartStream(connection, call, n);
      }
      call.choices.resize(n);
    }
    // Not streamed: every choice whole, once all are done.
    Sink::Update update = run.sink->Take();
    for (const openai::ChoiceOutput& out : update.outputs) {
      call.choices[out.index].Append(out.text, out.logprobs,
                                     out.prompt_logprobs);
    }
    run.summaries.insert(run.summaries.end(), update.finished.begin(),
                         update.finished.end());
    if (update.done) {
      incoming.answered = true;
      if (!update.error.ok()) {
        run.Record(update.error.code());
        return RespondError(connection, incoming.request_id, update.error);
      }
      run.RecordEnd(update);
      std::vector<openai::ChoiceOutput>& choices = call.choices;
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
          openai::ResponseJson(call.endpoint, finished, run.TokenText()), kJson,
          run.request_id.c_str());
    }
    if (call.waker->Suspend()) return MHD_YES;
  }
}

MHD_Result OpenAiHttpServer::Handler::StartStream(MHD_Connection* connection,
                                                  Call& call, int32_t n) {
  auto* stream = new Stream;
  stream->run = std::move(call.run);
  stream->waker = call.waker;
  stream->started.assign(n, false);
  stream->offsets.assign(n, 0);
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
