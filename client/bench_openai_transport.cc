// The OpenAI-API BenchTransport: each request is a blocking libcurl transfer
// (client/openai_http_client.h) on a thread of a pool that grows to the
// number of requests in flight.
#include <atomic>
#include <chrono>
#include <deque>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/bench_transport.h"
#include "client/openai_http_client.h"

namespace moh::client {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// Runs each job on an idle thread, starting a new one when none is idle.
// The destructor waits for the jobs queued and the threads.
class GrowingPool {
 public:
  GrowingPool() = default;
  GrowingPool(const GrowingPool&) = delete;
  GrowingPool& operator=(const GrowingPool&) = delete;

  ~GrowingPool() {
    std::vector<std::thread> threads;
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      threads.swap(threads_);
    }
    for (std::thread& thread : threads) thread.join();
  }

  void Run(std::function<void()> job) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    jobs_.push_back(std::move(job));
    if (idle_ < static_cast<int>(jobs_.size())) {
      threads_.emplace_back([this] { Work(); });
    }
  }

 private:
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !jobs_.empty();
  }

  void Work() ABSL_LOCKS_EXCLUDED(mu_) {
    mu_.Lock();
    for (;;) {
      ++idle_;
      mu_.Await(absl::Condition(this, &GrowingPool::HasWork));
      --idle_;
      if (jobs_.empty()) break;  // stopping
      std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      mu_.Unlock();
      job();
      job = nullptr;
      mu_.Lock();
    }
    mu_.Unlock();
  }

  absl::Mutex mu_;
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(mu_);
  int idle_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

// The /v1/completions body of a planned Generate.
json CompletionBody(const moh::v1::GenerateRequest& g) {
  json body = {{"stream", true}, {"stream_options", {{"include_usage", true}}}};
  if (!g.model().empty()) body["model"] = g.model();
  if (g.token_ids_size() > 0) {
    body["prompt"] =
        std::vector<int32_t>(g.token_ids().begin(), g.token_ids().end());
  } else {
    body["prompt"] = g.prompt();
  }
  const moh::v1::SamplingParams& s = g.sampling();
  if (s.has_max_new_tokens()) body["max_tokens"] = s.max_new_tokens();
  if (s.has_temperature()) body["temperature"] = Decimal(s.temperature());
  if (g.activation().ratio() != 0) {
    body["activation_ratio"] = Decimal(g.activation().ratio());
  }
  if (g.activation().min_ratio() != 0) {
    body["min_activation_ratio"] = Decimal(g.activation().min_ratio());
  }
  return body;
}

// Reads one streamed chunk into `result`: `last_text` is when the previous
// chunk with text came.
void TakeChunk(const json& chunk, Clock::time_point start,
               Clock::time_point now, Clock::time_point* last_text,
               RequestResult* result) {
  const json& choices = chunk.value("choices", json::array());
  if (choices.is_array() && !choices.empty()) {
    const json& text = choices[0].value("text", json());
    if (text.is_string() && !text.get<std::string>().empty()) {
      if (!result->ttft_s) {
        result->ttft_s = Seconds(now - start);
      } else {
        result->itl_s.push_back(Seconds(now - *last_text));
      }
      *last_text = now;
    }
  }
  const json& usage = chunk.value("usage", json());
  if (usage.is_object()) result->tokens = usage.value("completion_tokens", 0);
  const json& moh = chunk.value("moh", json());
  if (moh.is_object()) {
    const float effective = moh.value("effective_activation_ratio", 0.0f);
    const float ran_at = moh.value("activation_ratio", 0.0f);
    if (effective > 0) result->effective_activation_ratio = effective;
    if (ran_at > 0) result->activation_ratio = ran_at;
  }
}

class OpenAiBenchCall : public BenchCall {
 public:
  OpenAiBenchCall(const OpenAiHttpClient* client, GrowingPool* pool,
                  PlannedRequest planned, BenchDoneFn done)
      : client_(client),
        pool_(pool),
        body_(CompletionBody(planned.generate)),
        ratio_index_(planned.ratio_index),
        done_(std::move(done)),
        cancel_(std::make_shared<std::atomic<bool>>(false)) {}

  void Start() override {
    const Clock::time_point start = Clock::now();
    pool_->Run([client = client_, body = std::move(body_),
                ratio_index = ratio_index_, done = std::move(done_),
                cancel = cancel_, start] {
      RequestResult result;
      result.ratio_index = ratio_index;
      Clock::time_point last_text;
      const absl::Status status = client->Stream(
          "/v1/completions", body,
          [&](const json& chunk) {
            TakeChunk(chunk, start, Clock::now(), &last_text, &result);
          },
          cancel.get());
      // gRPC and Abseil number the canonical codes alike.
      result.code = static_cast<grpc::StatusCode>(status.code());
      result.e2e_s = Seconds(Clock::now() - start);
      done(result);
    });
  }

  void Cancel() override { cancel_->store(true); }

 private:
  const OpenAiHttpClient* const client_;
  GrowingPool* const pool_;
  json body_;
  const int ratio_index_;
  BenchDoneFn done_;
  // Shared with the job, which may outlive this call object.
  std::shared_ptr<std::atomic<bool>> cancel_;
};

class OpenAiBenchTransport : public BenchTransport {
 public:
  OpenAiBenchTransport(const BenchConfig& config, const Connection& connection)
      : client_(connection, config.timeout),
        models_client_(connection, absl::Seconds(10)) {}

  absl::StatusOr<std::vector<std::string>> ModelNames() override {
    absl::StatusOr<json> models = models_client_.Get("/v1/models");
    if (!models.ok()) return models.status();
    std::vector<std::string> names;
    const json& data = models->value("data", json::array());
    if (!data.is_array()) {
      return absl::UnavailableError(
          absl::StrCat(client_.base_url(), "/v1/models: no \"data\" list"));
    }
    for (const json& model : data) {
      if (model.is_object() && model.value("id", json()).is_string()) {
        names.push_back(model["id"].get<std::string>());
      }
    }
    return names;
  }

  std::shared_ptr<BenchCall> NewCall(PlannedRequest planned,
                                     BenchDoneFn done) override {
    return std::make_shared<OpenAiBenchCall>(
        &client_, &pool_, std::move(planned), std::move(done));
  }

 private:
  const OpenAiHttpClient client_;
  const OpenAiHttpClient models_client_;
  GrowingPool pool_;  // last: joined before the clients go
};

}  // namespace

std::unique_ptr<BenchTransport> NewOpenAiBenchTransport(
    const BenchConfig& config, const Connection& connection) {
  return std::make_unique<OpenAiBenchTransport>(config, connection);
}

}  // namespace moh::client
