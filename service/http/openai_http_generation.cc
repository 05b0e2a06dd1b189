#include "service/http/openai_http_generation.h"

#include <algorithm>
#include <atomic>
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
#include "service/http/generation_stream.h"
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
  // A generation per prompt.
  absl::StatusOr<std::vector<uint64_t>> ids =
      absl::UnknownError("not prepared");
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

  // On a request worker: the body to the generations submitted to its model
  // (their ids); `run` and `request` are filled as far as it got.
  absl::StatusOr<std::vector<uint64_t>> Prepare() {
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
    run.samples = request->call.n;
    return Submit(chat);
  }

  // Submits a generation per prompt (completions may hold several; the
  // others one); on an error, what was submitted stops.
  absl::StatusOr<std::vector<uint64_t>> Submit(
      const std::optional<ChatConversation>& chat) {
    const int32_t prompts =
        std::max<int32_t>(1, static_cast<int32_t>(request->prompts.size()));
    auto prompts_left = std::make_shared<std::atomic<int32_t>>(prompts);
    std::vector<uint64_t> ids;
    for (int32_t p = 0; p < prompts; ++p) {
      GenerateCall call = request->call;
      if (p > 0) {
        call.prompt = request->prompts[p].text;
        call.token_ids = request->prompts[p].token_ids;
      }
      std::shared_ptr<GenerationObserver> observer = run.sink;
      if (prompts > 1) {
        observer = std::make_shared<PromptObserver>(run.sink, p * call.n,
                                                    prompts_left);
      }
      Dispatched dispatched;
      absl::StatusOr<uint64_t> submitted =
          DispatchGenerate(*env.models, request->model, std::move(call), chat,
                           std::move(observer), &dispatched);
      run.model = std::move(dispatched.model);
      run.answered_model =
          dispatched.alias.empty() ? run.model : dispatched.alias;
      run.servable = dispatched.servable;
      if (!submitted.ok()) {
        for (uint64_t id : ids) run.servable->CancelGenerate(id);
        return submitted.status();
      }
      ids.push_back(*submitted);
    }
    return ids;
  }

  // On a request worker: prepares, then hands the result to the handler
  // (or cancels what it submitted for a handler that gave up).
  void PrepareAndWake() {
    absl::StatusOr<std::vector<uint64_t>> prepared_ids;
    // The worker's own last resort: an exception is this request's error.
    try {
      prepared_ids = Prepare();
    } catch (const std::exception& e) {
      prepared_ids = UnexpectedException(
          absl::StrCat("http ", RpcName(run.rpc)), run.request_id, e.what());
    }
    bool given_up;
    {
      absl::MutexLock lock(&mu);
      ids = std::move(prepared_ids);
      prepared = true;
      given_up = abandoned;
    }
    // Given up while it was prepared (and counted then): what was submitted
    // stops.
    if (given_up && ids.ok()) {
      for (uint64_t id : *ids) run.servable->CancelGenerate(id);
    }
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
  } else if (call.ids.ok()) {
    call.run.ids = *call.ids;
    call.run.StopGenerations();
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
      if (!call.ids.ok()) {
        call.RecordUnrun(call.ids.status().code());
        *answered = true;
        return RespondError(connection, run.endpoint, run.request_id,
                            call.ids.status());
      }
      run.ids = *call.ids;
      run.response_id = run.endpoint == Endpoint::kMessages
                            ? anthropic::NewId()
                            : openai::NewId(run.endpoint);
      run.created = absl::ToUnixSeconds(absl::Now());
      run.include_usage = call.request->include_usage;
      const int32_t n =
          call.request->call.n *
          std::max<int32_t>(1,
                            static_cast<int32_t>(call.request->prompts.size()));
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
        run.StopGenerations();  // the other prompts'
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
      openai::Finished finished{
          run.response_id,
          run.created,
          run.answered_model,
          std::move(choices),
          openai::CombineSummaries(run.summaries, run.samples),
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
