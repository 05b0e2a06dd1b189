#include "client/bench_runner.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/time.h"

namespace moh::client {
namespace {

using Clock = std::chrono::steady_clock;

// Longest the sending thread sleeps, so that the progress line stays fresh.
constexpr Clock::duration kProgressPeriod = std::chrono::milliseconds(500);

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

}  // namespace

BenchRunner::BenchRunner(const BenchConfig& config, BenchTransport* transport,
                         RequestSource* source)
    : config_(config),
      transport_(transport),
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
  std::vector<std::shared_ptr<BenchCall>> in_flight;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    changed_.SignalAll();
    for (const auto& entry : calls_) in_flight.push_back(entry.second);
  }
  // Outside the lock: a cancelled call may complete on this thread.
  for (const auto& call : in_flight) call->Cancel();
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
  uint64_t id = 0;
  {
    absl::MutexLock lock(&mu_);
    id = next_call_id_++;
  }
  std::shared_ptr<BenchCall> call = transport_->NewCall(
      std::move(planned), [this, id, recorder](const RequestResult& result) {
        OnCallDone(id, recorder, result);
      });
  {
    absl::MutexLock lock(&mu_);
    ++in_flight_;
    calls_.emplace(id, call);
  }
  call->Start();
  // A Stop that raced this send missed the call.
  bool stopped = false;
  {
    absl::MutexLock lock(&mu_);
    stopped = stop_;
  }
  if (stopped) call->Cancel();
}

void BenchRunner::OnCallDone(uint64_t call_id, BenchRecorder* recorder,
                             const RequestResult& result) {
  recorder->Record(result);
  absl::MutexLock lock(&mu_);
  auto it = calls_.find(call_id);
  if (it != calls_.end()) {
    finished_.push_back(std::move(it->second));
    calls_.erase(it);
  }
  --in_flight_;
  last_done_ = Clock::now();
  changed_.SignalAll();
}

void BenchRunner::ReleaseFinished() {
  std::vector<std::shared_ptr<BenchCall>> finished;
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
