#include "service/http/openai_http_generation.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "service/http/anthropic_api.h"
#include "service/http/generation_sink.h"
#include "service/metrics/metrics.h"
#include "service/metrics/request_log.h"
#include "service/net/http_daemon.h"
#include "service/serving/dispatch.h"

namespace moh {
namespace {

using openai::Endpoint;
using Sink = GenerationSink;

constexpr char kJson[] = "application/json";

MHD_Result RespondError(MHD_Connection* connection, Endpoint endpoint,
                        const std::string& id, const absl::Status& status) {
  return HttpRespond(connection, openai::HttpStatus(status.code()),
                     HttpErrorJson(endpoint, status), kJson, id.c_str());
}

// A generation accepted by a model: the request it came from and where its
// output goes.
struct Running {
  Endpoint endpoint = Endpoint::kCompletions;
  Rpc rpc = Rpc::kCompletions;
  absl::Time start;
  std::string request_id;
  std::string model;
  std::string answered_model;  // the alias asked for, else `model`
  Servable* servable = nullptr;
  uint64_t id = 0;
  std::shared_ptr<Sink> sink;
  std::string response_id;
  int64_t created = 0;
  bool include_usage = false;
  openai::LogprobsAsked asked;
  openai::Echo echo;
  std::vector<std::string> stops;            // Messages: its stop_sequences
  std::vector<GenerationSummary> summaries;  // of the choices finished
  bool recorded = false;

  // Messages: the finished message of choice 0.
  anthropic::Message Message(std::string text) const {
    anthropic::Message m{
        response_id, model, std::move(text),
        summaries.empty() ? GenerationSummary() : summaries.front()};
    if (m.summary.finish_reason == FinishReason::kStop) {
      // Which stop string matched: the sampler says only that one did.
      std::vector<std::string> texts;
      for (int32_t id : sink->TokenIds(0)) {
        texts.push_back(servable->TokenText(id));
      }
      m.stop_sequence = anthropic::MatchedStopSequence(texts, stops);
      if (!m.stop_sequence && stops.size() == 1) m.stop_sequence = stops[0];
    }
    return m;
  }

  openai::TokenTextFn TokenText() const {
    return [model = servable](int32_t id) { return model->TokenText(id); };
  }
  // Echo's text of a prompt sent as token ids.
  openai::DecodeFn Decode() const {
    return [model = servable](const std::vector<int32_t>& ids) {
      std::string text;
      for (int32_t id : ids) text += model->TokenText(id);
      return text;
    };
  }
  // A choice's output, echo applied (`first`: the choice's first output).
  void Echo(bool first, openai::ChoiceOutput* out) const {
    openai::ApplyEcho(echo, asked.prompt, Decode(), first, out);
  }
  // A choice's summary arrived.
  void Finished(GenerationSummary summary) {
    openai::ApplyEcho(echo, &summary);
    summaries.push_back(std::move(summary));
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
  std::vector<bool> echoed;  // its first output had the echo put before it
  std::vector<int64_t> offsets;
  bool ended = false;      // the last event is in `pending`
  bool cancelled = false;  // the client went (or the server stops)

  void Event(const std::string& json) {
    absl::StrAppend(&pending, "data: ", json, "\n\n");
  }

  openai::Chunk NewChunk(openai::ChoiceOutput choice) {
    const size_t i = static_cast<size_t>(choice.index);
    openai::Chunk chunk{run.response_id, run.created, run.answered_model,
                        std::move(choice)};
    chunk.first = !started[i];
    chunk.asked = run.asked;
    chunk.offset = offsets[i];
    return chunk;
  }

  // Messages: each piece of text a content_block_delta; once done, the end
  // events (or an error event).
  void FillMessages() {
    Sink::Update update = run.sink->Take();
    for (const openai::ChoiceOutput& out : update.outputs) {
      if (!out.text.empty()) pending += anthropic::TextDeltaEvent(out.text);
    }
    run.summaries.insert(run.summaries.end(), update.finished.begin(),
                         update.finished.end());
    if (!update.done) return;
    run.RecordEnd(update);
    pending += update.error.ok() ? anthropic::StreamEndEvents(run.Message(""))
                                 : anthropic::ErrorEvent(update.error);
    ended = true;
  }

  // Turns the output so far into events.
  void Fill() {
    if (run.endpoint == Endpoint::kMessages) return FillMessages();
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
      run.Echo(!echoed[i], &out);
      echoed[i] = true;
      int64_t length = 0;
      if (out.leading_token) length += token_text(*out.leading_token).size();
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
      run.Finished(summary);
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
      openai::Chunk chunk{run.response_id, run.created, run.answered_model};
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

// Answers with a stream of `n` choices, `run` moved into it.
MHD_Result StartStream(MHD_Connection* connection, Running run,
                       std::shared_ptr<HttpWaker> waker, int32_t n) {
  auto* stream = new Stream;
  stream->run = std::move(run);
  stream->waker = std::move(waker);
  stream->started.assign(n, false);
  stream->echoed.assign(n, false);
  stream->offsets.assign(n, 0);
  if (stream->run.endpoint == Endpoint::kMessages) {
    stream->pending = anthropic::StreamStartEvents(stream->run.response_id,
                                                   stream->run.model);
  }
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

}  // namespace

std::string HttpErrorJson(Endpoint endpoint, const absl::Status& status) {
  return endpoint == Endpoint::kMessages ? anthropic::ErrorJson(status)
                                         : openai::ErrorJson(status);
}

struct HttpGeneration::Call {
  HttpGeneration::Env env;
  std::shared_ptr<HttpWaker> waker;
  std::string body;  // until the worker has parsed it
  BodyReservation reservation;
  Running run;  // the worker's until `prepared` (but for what Start set)
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

  // On a request worker: the body to a generation submitted to its model
  // (its id); `run` and `request` are filled as far as it got.
  absl::StatusOr<uint64_t> Prepare() {
    const bool messages = run.endpoint == Endpoint::kMessages;
    absl::StatusOr<openai::GenerationRequest> parsed =
        messages ? anthropic::ParseMessagesRequest(body)
                 : openai::ParseGenerationRequest(run.endpoint, body);
    body = std::string();
    reservation.Release();  // parsed: the body's memory goes back
    if (!parsed.ok()) return parsed.status();
    request = std::move(*parsed);
    std::optional<ChatConversation> chat;
    if (run.endpoint != Endpoint::kCompletions) {
      chat = ChatConversation{std::move(request->messages),
                              request->add_generation_prompt};
    }
    // Messages names the stop string that matched: from the tokens.
    if (messages) run.stops = request->call.sampling.stop;
    run.sink = std::make_shared<Sink>(waker, request->stream,
                                      /*keep_tokens=*/!run.stops.empty());
    run.asked = {request->call.sampling.logprobs.has_value(),
                 request->call.sampling.prompt_logprobs.has_value() &&
                     !request->echo.prompt_logprobs_unasked};
    run.echo = request->echo;
    Dispatched dispatched;
    // `n` stays readable: an int survives the move.
    absl::StatusOr<uint64_t> submitted =
        DispatchGenerate(*env.models, request->model, std::move(request->call),
                         chat, run.sink, &dispatched);
    run.model = std::move(dispatched.model);
    run.answered_model =
        dispatched.alias.empty() ? run.model : dispatched.alias;
    run.servable = dispatched.servable;
    return submitted;
  }

  // On a request worker: prepares, then hands the result to the handler
  // (or cancels what it submitted for a handler that gave up).
  void PrepareAndWake() {
    absl::StatusOr<uint64_t> prepared_id;
    // The worker's own last resort: an exception is this request's error.
    try {
      prepared_id = Prepare();
    } catch (const std::exception& e) {
      prepared_id = UnexpectedException(absl::StrCat("http ", RpcName(run.rpc)),
                                        run.request_id, e.what());
    }
    bool given_up;
    {
      absl::MutexLock lock(&mu);
      id = std::move(prepared_id);
      prepared = true;
      given_up = abandoned;
    }
    // Given up while it was prepared (and counted then): what was submitted
    // stops.
    if (given_up && id.ok()) run.servable->CancelGenerate(*id);
    waker->Wake();
  }

  // Counts the request, ended before its model ran it.
  void RecordUnrun(absl::StatusCode code) {
    if (run.servable != nullptr) {
      run.Record(code);
    } else {
      RecordRequest(nullptr, env.models->metrics(), run.rpc, run.model, code,
                    run.start, run.request_id);
    }
  }
};

absl::StatusOr<std::unique_ptr<HttpGeneration>> HttpGeneration::Start(
    const Env& env, MHD_Connection* connection, Request request) {
  auto call = std::make_shared<Call>();
  call->env = env;
  call->body = std::move(request.body);
  call->reservation = std::move(request.reservation);
  call->waker = env.watch->NewWaker(connection);
  Running& run = call->run;
  run.endpoint = request.endpoint;
  run.rpc = request.endpoint == Endpoint::kCompletions ? Rpc::kCompletions
            : request.endpoint == Endpoint::kMessages  ? Rpc::kMessages
                                                       : Rpc::kChatCompletions;
  run.start = request.start;
  run.request_id = std::move(request.request_id);
  // Preparing the request (parsing, finding the model, the chat template,
  // tokenizing and admission) runs on a request worker, as gRPC's calls do:
  // the same threads and the same bound on waiting requests (a full queue is
  // RESOURCE_EXHAUSTED, 429). The connection is suspended meanwhile.
  env.in_flight->Add();
  const absl::Status queued = env.workers->Run([call] {
    call->PrepareAndWake();
    call->env.in_flight->Done();
  });
  if (!queued.ok()) {
    env.in_flight->Done();
    call->RecordUnrun(queued.code());
    return queued;
  }
  return std::unique_ptr<HttpGeneration>(new HttpGeneration(std::move(call)));
}

void HttpGeneration::Abandon(absl::StatusCode code) {
  Call& call = *call_;
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
    RecordRequest(nullptr, call.env.models->metrics(), run.rpc, "", code,
                  run.start, run.request_id);
  } else if (call.id.ok()) {
    call.run.servable->CancelGenerate(*call.id);
    call.run.Record(code);
  } else {
    call.RecordUnrun(code);
  }
}

MHD_Result HttpGeneration::Continue(MHD_Connection* connection,
                                    bool* answered) {
  Call& call = *call_;
  Running& run = call.run;
  for (;;) {
    if (call.waker->Departed()) {
      Abandon(absl::StatusCode::kCancelled);
      *answered = true;
      return MHD_NO;  // closes the connection
    }
    if (!call.started) {
      if (!call.Prepared()) {
        if (call.waker->Suspend()) return MHD_YES;
        continue;
      }
      call.started = true;
      if (!call.id.ok()) {
        call.RecordUnrun(call.id.status().code());
        *answered = true;
        return RespondError(connection, run.endpoint, run.request_id,
                            call.id.status());
      }
      run.id = *call.id;
      run.response_id = run.endpoint == Endpoint::kMessages
                            ? anthropic::NewId()
                            : openai::NewId(run.endpoint);
      run.created = absl::ToUnixSeconds(absl::Now());
      run.include_usage = call.request->include_usage;
      const int32_t n = call.request->call.n;
      if (call.request->stream) {
        *answered = true;
        return StartStream(connection, std::move(run), call.waker, n);
      }
      call.choices.resize(n);
    }
    // Not streamed: every choice whole, once all are done.
    Sink::Update update = run.sink->Take();
    for (const openai::ChoiceOutput& out : update.outputs) {
      call.choices[out.index].Append(out);
    }
    for (const GenerationSummary& summary : update.finished) {
      run.Finished(summary);
    }
    if (update.done) {
      *answered = true;
      if (!update.error.ok()) {
        run.Record(update.error.code());
        return RespondError(connection, run.endpoint, run.request_id,
                            update.error);
      }
      run.RecordEnd(update);
      if (run.endpoint == Endpoint::kMessages) {
        return HttpRespond(connection, 200,
                           anthropic::MessageJson(
                               run.Message(std::move(call.choices[0].text))),
                           kJson, run.request_id.c_str());
      }
      std::vector<openai::ChoiceOutput>& choices = call.choices;
      for (size_t i = 0; i < choices.size(); ++i) {
        choices[i].index = static_cast<int32_t>(i);
        run.Echo(/*first=*/true, &choices[i]);
      }
      for (const GenerationSummary& summary : run.summaries) {
        choices[summary.index].summary = &summary;
      }
      openai::Finished finished{run.response_id,
                                run.created,
                                run.answered_model,
                                std::move(choices),
                                openai::CombineSummaries(run.summaries),
                                run.asked};
      return HttpRespond(
          connection, 200,
          openai::ResponseJson(run.endpoint, finished, run.TokenText()), kJson,
          run.request_id.c_str());
    }
    if (call.waker->Suspend()) return MHD_YES;
  }
}

}  // namespace moh
