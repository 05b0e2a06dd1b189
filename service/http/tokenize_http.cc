#include "service/http/tokenize_http.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/status_macros.h"
#include "service/http/openai_api.h"
#include "service/http/tokenize_api.h"
#include "service/metrics/request_log.h"
#include "service/net/http_daemon.h"
#include "service/serving/dispatch.h"

namespace moh {
namespace {

constexpr char kJson[] = "application/json";

}  // namespace

bool TokenizerPath(absl::string_view path, Rpc* rpc) {
  if (path == "/tokenize") {
    *rpc = Rpc::kTokenize;
  } else if (path == "/detokenize") {
    *rpc = Rpc::kDetokenize;
  } else if (path == "/tokenizer_info") {
    *rpc = Rpc::kTokenizerInfo;
  } else {
    return false;
  }
  return true;
}

struct HttpTokenizerRequest::Call {
  HttpGeneration::Env env;
  std::shared_ptr<HttpWaker> waker;
  Request request;
  bool recorded = false;  // the connection's thread's

  // Set by the worker; the connection's thread reads them once `done`.
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::StatusOr<std::string> answer ABSL_GUARDED_BY(mu) =
      absl::UnknownError("not run");
  Dispatched dispatched ABSL_GUARDED_BY(mu);

  // On a request worker: the body to the answer's JSON.
  absl::StatusOr<std::string> Run(Dispatched* dispatched) {
    const ModelManager& models = *env.models;
    std::string body = std::move(request.body);
    request.reservation.Release();
    switch (request.rpc) {
      case Rpc::kTokenize: {
        MOH_ASSIGN_OR_RETURN(tokenize_api::TokenizeRequest parsed,
                             tokenize_api::ParseTokenizeRequest(body));
        MOH_ASSIGN_OR_RETURN(
            const TokenizeResult result,
            DispatchTokenize(models, parsed.model, std::move(parsed.call),
                             parsed.chat, dispatched));
        return tokenize_api::TokenizeJson(result);
      }
      case Rpc::kDetokenize: {
        MOH_ASSIGN_OR_RETURN(const tokenize_api::DetokenizeRequest parsed,
                             tokenize_api::ParseDetokenizeRequest(body));
        MOH_ASSIGN_OR_RETURN(const std::string text,
                             DispatchDetokenize(models, parsed.model,
                                                parsed.tokens, dispatched));
        return tokenize_api::DetokenizeJson(text);
      }
      default: {
        MOH_ASSIGN_OR_RETURN(
            const TokenizerInfo info,
            DispatchTokenizerInfo(models, request.model, dispatched));
        return tokenize_api::TokenizerInfoJson(info);
      }
    }
  }

  // On a request worker: runs, then hands the answer to the handler.
  void RunAndWake() {
    Dispatched found;
    absl::StatusOr<std::string> result;
    // The worker's own last resort: an exception is this request's error.
    try {
      result = Run(&found);
    } catch (const std::exception& e) {
      result = UnexpectedException(absl::StrCat("http ", RpcName(request.rpc)),
                                   request.request_id, e.what());
    }
    {
      absl::MutexLock lock(&mu);
      answer = std::move(result);
      dispatched = std::move(found);
      done = true;
    }
    waker->Wake();
  }

  // Counts the request once: on its model when one was found (and the
  // worker is done), else on the server.
  void Record(absl::StatusCode code) {
    if (recorded) return;
    recorded = true;
    Servable* servable = nullptr;
    std::string model;
    {
      absl::MutexLock lock(&mu);
      if (done) {
        servable = dispatched.servable;
        model = dispatched.model;
      }
    }
    RecordRequest(servable != nullptr ? servable->metrics() : nullptr,
                  servable != nullptr ? nullptr : env.models->metrics(),
                  request.rpc, model, code, request.start, request.request_id);
  }
};

absl::StatusOr<std::unique_ptr<HttpTokenizerRequest>>
HttpTokenizerRequest::Start(const HttpGeneration::Env& env,
                            MHD_Connection* connection, Request request) {
  auto call = std::make_shared<Call>();
  call->env = env;
  call->waker = env.watch->NewWaker(connection);
  call->request = std::move(request);
  if (call->request.draining) {
    call->Record(absl::StatusCode::kUnavailable);
    return absl::UnavailableError(
        "the server is draining; retry on another replica");
  }
  env.in_flight->Add();
  const absl::Status queued = env.workers->Run([call] {
    call->RunAndWake();
    call->env.in_flight->Done();
  });
  if (!queued.ok()) {
    env.in_flight->Done();
    call->Record(queued.code());
    return queued;
  }
  return std::unique_ptr<HttpTokenizerRequest>(
      new HttpTokenizerRequest(std::move(call)));
}

void HttpTokenizerRequest::Abandon(absl::StatusCode code) {
  call_->Record(code);
}

MHD_Result HttpTokenizerRequest::Continue(MHD_Connection* connection,
                                          bool* answered) {
  Call& call = *call_;
  for (;;) {
    if (call.waker->Departed()) {
      Abandon(absl::StatusCode::kCancelled);
      *answered = true;
      return MHD_NO;  // closes the connection
    }
    std::optional<absl::StatusOr<std::string>> answer;
    {
      absl::MutexLock lock(&call.mu);
      if (call.done) answer = std::move(call.answer);
    }
    if (answer.has_value()) {
      *answered = true;
      const absl::Status status = answer->status();
      call.Record(status.code());
      const char* id = call.request.request_id.c_str();
      if (!status.ok()) {
        return HttpRespond(connection, openai::HttpStatus(status.code()),
                           openai::ErrorJson(status), kJson, id);
      }
      return HttpRespond(connection, 200, **answer, kJson, id);
    }
    if (call.waker->Suspend()) return MHD_YES;
  }
}

}  // namespace moh
