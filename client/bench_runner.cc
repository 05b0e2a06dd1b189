#include "client/bench_runner.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "client/rpc_util.h"

namespace moh::client {
namespace {

using Clock = std::chrono::steady_clock;
using DoneFn = std::function<void(const RequestResult&)>;

// Longest the sending thread sleeps, so that the progress line stays fresh.
constexpr Clock::duration kProgressPeriod = std::chrono::milliseconds(500);

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
  CallRecord(int ratio_index, DoneFn done_fn) : done(std::move(done_fn)) {
    result.ratio_index = ratio_index;
  }

  // Stamps the outcome and hands the result over. Called on a record moved
  // out of a call that has deleted itself (`done` may start the next call).
  void Finish(const grpc::Status& status) {
    result.code = status.error_code();
    result.e2e_s = Seconds(Clock::now() - start);
    done(result);
  }

  DoneFn done;
  RequestResult result;
  Clock::time_point start;
};

// One streaming Generate; deletes itself when done, after calling `done`.
class GenerateCall : public grpc::ClientReadReactor<moh::v1::GenerateResponse> {
 public:
  GenerateCall(std::shared_ptr<grpc::ClientContext> context,
               moh::v1::GenerateRequest request, int ratio_index, DoneFn done)
      : context_(std::move(context)),
        request_(std::move(request)),
        record_(ratio_index, std::move(done)) {}

  void Start(moh::v1::Inference::Stub* stub) {
    record_.start = Clock::now();
    stub->async()->Generate(context_.get(), &request_, this);
    StartRead(&response_);
    StartCall();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows.
    const Clock::time_point now = Clock::now();
    const int tokens = response_.token_ids_size();
    RequestResult& result = record_.result;
    if (tokens > 0) {
      if (!result.ttft_s) {
        result.ttft_s = Seconds(now - record_.start);
      } else {
        const double gap = Seconds(now - last_tokens_) / tokens;
        result.itl_s.insert(result.itl_s.end(), tokens, gap);
      }
      last_tokens_ = now;
      result.tokens += tokens;
    }
    TakeRatios(response_.effective_activation_ratio(),
               response_.activation_ratio(), &result);
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override {
    CallRecord record = std::move(record_);
    delete this;
    record.Finish(status);
  }

 private:
  std::shared_ptr<grpc::ClientContext> context_;
  moh::v1::GenerateRequest request_;
  moh::v1::GenerateResponse response_;
  CallRecord record_;
  Clock::time_point last_tokens_;
};

// One unary Classify; deletes itself when done, after calling `done`.
class ClassifyCall {
 public:
  ClassifyCall(std::shared_ptr<grpc::ClientContext> context,
               moh::v1::ClassifyRequest request, int ratio_index, DoneFn done)
      : context_(std::move(context)),
        request_(std::move(request)),
        record_(ratio_index, std::move(done)) {}

  void Start(moh::v1::Inference::Stub* stub) {
    record_.start = Clock::now();
    stub->async()->Classify(context_.get(), &request_, &response_,
                            [this](grpc::Status status) { OnDone(status); });
  }

 private:
  void OnDone(const grpc::Status& status) {
    if (status.ok()) {
      TakeRatios(response_.effective_activation_ratio(),
                 response_.activation_ratio(), &record_.result);
    }
    CallRecord record = std::move(record_);
    delete this;
    record.Finish(status);
  }

  std::shared_ptr<grpc::ClientContext> context_;
  moh::v1::ClassifyRequest request_;
  moh::v1::ClassifyResponse response_;
  CallRecord record_;
};

}  // namespace

BenchRunner::BenchRunner(const BenchConfig& config,
                         moh::v1::Inference::Stub* stub, RequestSource* source)
    : config_(config),
      stub_(stub),
      source_(source),
      show_progress_(!config.quiet && isatty(STDERR_FILENO)) {}

BenchResults BenchRunner::Run() {
  const int concurrency = config_.concurrency.value_or(1);
  const Clock::duration cap = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(kMaxBenchSeconds));
  BenchRecorder warmup(config_.ratios);
  if (config_.warmup_requests > 0) {
    RunPhase(
        {"warmup", /*open_loop=*/false, config_.IsOpenLoop() ? 1 : concurrency,
         config_.warmup_requests, cap},
        &warmup);
  }
  // The measured phase's ratio order does not depend on the warmup.
  source_->Restart();
  BenchRecorder measured(config_.ratios);
  const Clock::time_point start = Clock::now();
  Clock::time_point end = start;
  bool stopped = false;
  {
    absl::MutexLock lock(&mu_);
    stopped = stop_;
  }
  if (!stopped) {
    end = RunPhase(
        {"measure", config_.IsOpenLoop(), concurrency, config_.RequestLimit(),
         absl::ToChronoNanoseconds(config_.DurationLimit())},
        &measured);
  }
  BenchResults results = measured.Results();
  const BenchProgress warm = warmup.Progress();
  results.warmup_requests = warm.completed + warm.errors;
  results.warmup_errors = warm.errors;
  absl::MutexLock lock(&mu_);
  if (results.requests > 0) end = std::max(end, last_done_);
  results.elapsed_s = Seconds(end - start);
  results.interrupted = stop_;
  return results;
}

void BenchRunner::Stop() {
  std::vector<std::shared_ptr<grpc::ClientContext>> in_flight;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    changed_.SignalAll();
    for (const auto& entry : contexts_) in_flight.push_back(entry.second);
  }
  // Outside the lock: a cancelled call may complete on this thread.
  for (const auto& context : in_flight) context->TryCancel();
}

BenchRunner::Clock::time_point BenchRunner::RunPhase(const Phase& phase,
                                                     BenchRecorder* recorder) {
  phase_start_ = last_progress_ = Clock::now();
  next_progress_ = phase_start_ + kProgressPeriod;
  last_progress_done_ = 0;
  const Clock::time_point deadline = phase_start_ + phase.duration;
  std::mt19937_64 arrival_rng(config_.seed);
  std::exponential_distribution<double> gap(config_.rate.value_or(1.0));
  const auto next_gap = [&] {
    return std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(gap(arrival_rng)));
  };
  Clock::time_point next_arrival = phase_start_ + next_gap();
  const int limit = phase.open_loop ? config_.max_in_flight : phase.concurrency;

  int64_t arrivals = 0;
  while (arrivals < phase.arrivals) {
    const Clock::time_point now = Clock::now();
    if (now >= deadline) break;
    bool stop = false;
    int in_flight = 0;
    {
      absl::MutexLock lock(&mu_);
      stop = stop_;
      in_flight = in_flight_;
    }
    if (stop) break;
    if (phase.open_loop) {
      if (now < next_arrival) {
        WaitABit(std::min(next_arrival, deadline), /*while_in_flight=*/0, phase,
                 *recorder);
        continue;
      }
      if (in_flight >= limit) {
        recorder->RecordDrop();
      } else {
        Send(recorder);
      }
      next_arrival += next_gap();
    } else {
      if (in_flight >= limit) {
        WaitABit(deadline, limit, phase, *recorder);
        continue;
      }
      Send(recorder);
    }
    ++arrivals;
    if (arrivals % 64 == 0) ReleaseFinished();
    MaybePrintProgress(phase, *recorder, /*final=*/false);
  }
  const Clock::time_point sending_stopped = std::min(Clock::now(), deadline);
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (in_flight_ == 0) break;
    }
    WaitABit(Clock::now() + kProgressPeriod, /*while_in_flight=*/1, phase,
             *recorder);
  }
  ReleaseFinished();
  MaybePrintProgress(phase, *recorder, /*final=*/true);
  return sending_stopped;
}

void BenchRunner::Send(BenchRecorder* recorder) {
  PlannedRequest planned = source_->Next();
  auto context = std::make_shared<grpc::ClientContext>();
  ConfigureContext({config_.timeout, config_.token}, context.get());
  grpc::ClientContext* const key = context.get();
  const std::shared_ptr<grpc::ClientContext> keep = context;
  {
    absl::MutexLock lock(&mu_);
    ++in_flight_;
    contexts_.emplace(key, context);
  }
  DoneFn done = [this, key, recorder](const RequestResult& result) {
    OnCallDone(key, recorder, result);
  };
  if (config_.rpc == BenchRpc::kGenerate) {
    (new GenerateCall(std::move(context), std::move(planned.generate),
                      planned.ratio_index, std::move(done)))
        ->Start(stub_);
  } else {
    (new ClassifyCall(std::move(context), std::move(planned.classify),
                      planned.ratio_index, std::move(done)))
        ->Start(stub_);
  }
  // A Stop that raced this send missed its context.
  bool stopped = false;
  {
    absl::MutexLock lock(&mu_);
    stopped = stop_;
  }
  if (stopped) keep->TryCancel();
}

void BenchRunner::OnCallDone(grpc::ClientContext* context,
                             BenchRecorder* recorder,
                             const RequestResult& result) {
  recorder->Record(result);
  absl::MutexLock lock(&mu_);
  auto it = contexts_.find(context);
  if (it != contexts_.end()) {
    finished_.push_back(std::move(it->second));
    contexts_.erase(it);
  }
  --in_flight_;
  last_done_ = Clock::now();
  changed_.SignalAll();
}

void BenchRunner::ReleaseFinished() {
  std::vector<std::shared_ptr<grpc::ClientContext>> finished;
  absl::MutexLock lock(&mu_);
  finished.swap(finished_);
  // Destroyed after unlocking (declared first).
}

void BenchRunner::WaitABit(Clock::time_point until, int while_in_flight,
                           const Phase& phase, const BenchRecorder& recorder) {
  const Clock::time_point wake = std::min(until, next_progress_);
  const Clock::time_point now = Clock::now();
  if (wake > now) {
    absl::MutexLock lock(&mu_);
    if (!stop_ && in_flight_ >= while_in_flight) {
      changed_.WaitWithTimeout(&mu_, absl::FromChrono(wake - now));
    }
  }
  ReleaseFinished();
  MaybePrintProgress(phase, recorder, /*final=*/false);
}

void BenchRunner::MaybePrintProgress(const Phase& phase,
                                     const BenchRecorder& recorder,
                                     bool final) {
  const Clock::time_point now = Clock::now();
  if (!final && now < next_progress_) return;
  next_progress_ = now + kProgressPeriod;
  if (!show_progress_) return;
  const BenchProgress p = recorder.Progress();
  int in_flight = 0;
  {
    absl::MutexLock lock(&mu_);
    in_flight = in_flight_;
  }
  const int64_t done = p.completed + p.errors;
  const double interval = Seconds(now - last_progress_);
  const double rate =
      interval > 0 ? static_cast<double>(done - last_progress_done_) / interval
                   : 0;
  last_progress_ = now;
  last_progress_done_ = done;
  absl::FPrintF(stderr,
                "\r%s %7.1fs  done %-7d in flight %-5d errors %-6d dropped "
                "%-6d %8.1f req/s %s",
                phase.name, Seconds(now - phase_start_), done, in_flight,
                p.errors, p.dropped, rate, final ? "\n" : "");
  std::fflush(stderr);
}

}  // namespace moh::client
