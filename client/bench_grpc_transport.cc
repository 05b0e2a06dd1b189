// The gRPC BenchTransport: streaming Generate and unary Classify reactors of
// the callback API, so that sending never waits on a request in flight.
#include <grpcpp/client_context.h>

#include <chrono>
#include <utility>

#include "client/bench_transport.h"
#include "client/rpc_util.h"
#include "moh/v1/inference.grpc.pb.h"

namespace moh::client {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// Records the ratios a response reports (0 means not reported).
void TakeRatios(float effective, float ran_at, RequestResult* result) {
  if (effective > 0) result->effective_activation_ratio = effective;
  if (ran_at > 0) result->activation_ratio = ran_at;
}

// What a benchmarked call records, from its start to its completion.
struct CallRecord {
  CallRecord(int ratio_index, BenchDoneFn done_fn) : done(std::move(done_fn)) {
    result.ratio_index = ratio_index;
  }

  // Stamps the outcome and hands the result over. Called on a record moved
  // out of a call that has deleted itself (`done` may start the next call).
  void Finish(const grpc::Status& status) {
    result.code = status.error_code();
    result.e2e_s = Seconds(Clock::now() - start);
    done(result);
  }

  BenchDoneFn done;
  RequestResult result;
  Clock::time_point start;
};

// What a call owns until it completes: its context, request and response,
// and its record.
template <typename Request, typename Response>
struct CallParts {
  CallParts(std::shared_ptr<grpc::ClientContext> call_context,
            Request call_request, int ratio_index, BenchDoneFn done)
      : context(std::move(call_context)),
        request(std::move(call_request)),
        record(ratio_index, std::move(done)) {}

  std::shared_ptr<grpc::ClientContext> context;
  Request request;
  Response response;
  CallRecord record;
};

using GenerateParts =
    CallParts<moh::v1::GenerateRequest, moh::v1::GenerateResponse>;
using ClassifyParts =
    CallParts<moh::v1::ClassifyRequest, moh::v1::ClassifyResponse>;

// One streaming Generate; deletes itself when done, after calling `done`.
class GenerateCall : public grpc::ClientReadReactor<moh::v1::GenerateResponse> {
 public:
  explicit GenerateCall(GenerateParts call) : call_(std::move(call)) {}

  void Start(moh::v1::Inference::Stub* stub) {
    call_.record.start = Clock::now();
    stub->async()->Generate(call_.context.get(), &call_.request, this);
    StartRead(&call_.response);
    StartCall();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows.
    const Clock::time_point now = Clock::now();
    const int tokens = call_.response.token_ids_size();
    RequestResult& result = call_.record.result;
    if (tokens > 0) {
      if (!result.ttft_s) {
        result.ttft_s = Seconds(now - call_.record.start);
      } else {
        const double gap = Seconds(now - last_tokens_) / tokens;
        result.itl_s.insert(result.itl_s.end(), tokens, gap);
      }
      last_tokens_ = now;
      result.tokens += tokens;
    }
    TakeRatios(call_.response.effective_activation_ratio(),
               call_.response.activation_ratio(), &result);
    StartRead(&call_.response);
  }

  void OnDone(const grpc::Status& status) override {
    CallRecord record = std::move(call_.record);
    delete this;
    record.Finish(status);
  }

 private:
  GenerateParts call_;
  Clock::time_point last_tokens_;
};

// One unary Classify; deletes itself when done, after calling `done`.
class ClassifyCall {
 public:
  explicit ClassifyCall(ClassifyParts call) : call_(std::move(call)) {}

  void Start(moh::v1::Inference::Stub* stub) {
    call_.record.start = Clock::now();
    stub->async()->Classify(call_.context.get(), &call_.request,
                            &call_.response,
                            [this](grpc::Status status) { OnDone(status); });
  }

 private:
  void OnDone(const grpc::Status& status) {
    if (status.ok()) {
      TakeRatios(call_.response.effective_activation_ratio(),
                 call_.response.activation_ratio(), &call_.record.result);
    }
    CallRecord record = std::move(call_.record);
    delete this;
    record.Finish(status);
  }

  ClassifyParts call_;
};

// Holds the call's context (and through it the channel) until the runner
// releases it: see BenchRunner::finished_.
class GrpcBenchCall : public BenchCall {
 public:
  GrpcBenchCall(std::shared_ptr<grpc::ClientContext> context,
                std::function<void()> start)
      : context_(std::move(context)), start_(std::move(start)) {}

  void Start() override { std::exchange(start_, nullptr)(); }
  void Cancel() override { context_->TryCancel(); }

 private:
  std::shared_ptr<grpc::ClientContext> context_;
  std::function<void()> start_;
};

class GrpcBenchTransport : public BenchTransport {
 public:
  GrpcBenchTransport(const BenchConfig& config,
                     std::shared_ptr<grpc::Channel> channel)
      : config_(config), stub_(moh::v1::Inference::NewStub(channel)) {}

  absl::StatusOr<std::vector<std::string>> ModelNames() override {
    grpc::ClientContext context;
    ConfigureContext({absl::Seconds(10), config_.token}, &context);
    moh::v1::ListModelsResponse response;
    const grpc::Status status =
        stub_->ListModels(&context, moh::v1::ListModelsRequest(), &response);
    if (!status.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          status.error_message());
    }
    std::vector<std::string> names;
    for (const moh::v1::ModelInfo& info : response.models()) {
      names.push_back(info.name());
    }
    return names;
  }

  std::shared_ptr<BenchCall> NewCall(PlannedRequest planned,
                                     BenchDoneFn done) override {
    auto context = std::make_shared<grpc::ClientContext>();
    ConfigureContext({config_.timeout, config_.token}, context.get());
    moh::v1::Inference::Stub* const stub = stub_.get();
    std::function<void()> start;
    if (config_.rpc == BenchRpc::kGenerate) {
      auto* call =
          new GenerateCall(GenerateParts(context, std::move(planned.generate),
                                         planned.ratio_index, std::move(done)));
      start = [call, stub] { call->Start(stub); };
    } else {
      auto* call =
          new ClassifyCall(ClassifyParts(context, std::move(planned.classify),
                                         planned.ratio_index, std::move(done)));
      start = [call, stub] { call->Start(stub); };
    }
    return std::make_shared<GrpcBenchCall>(std::move(context),
                                           std::move(start));
  }

 private:
  const BenchConfig& config_;
  std::unique_ptr<moh::v1::Inference::Stub> stub_;
};

}  // namespace

std::unique_ptr<BenchTransport> NewGrpcBenchTransport(
    const BenchConfig& config, std::shared_ptr<grpc::Channel> channel) {
  return std::make_unique<GrpcBenchTransport>(config, std::move(channel));
}

}  // namespace moh::client
