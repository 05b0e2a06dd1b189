// BenchRunner: drives one moh-bench run against a server through a
// BenchTransport (gRPC or the OpenAI-compatible HTTP API, bench_transport.h),
// which starts each request without waiting on those in flight.
//
// Closed loop: keeps `concurrency` requests outstanding, sending the next as
// soon as one finishes. Open loop: sends at Poisson arrival times (seeded
// exponential gaps, scheduled from the phase start so a late send does not
// shift the next ones); an arrival while --max_in_flight requests are
// outstanding is dropped and counted. Both stop sending at --requests
// arrivals or --duration, whichever comes first, then wait for the requests in
// flight (each bounded by --timeout). Warmup requests go first, closed loop;
// the measured phase then restarts the request source.
//
// Threading: Run blocks the calling thread, which sends every request and
// prints the progress line; completions are recorded on the transport's
// threads. Stop may be called from any thread.
#ifndef MOH_CLIENT_BENCH_RUNNER_H_
#define MOH_CLIENT_BENCH_RUNNER_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "client/bench_config.h"
#include "client/bench_stats.h"
#include "client/bench_transport.h"

namespace moh::client {

class BenchRunner {
 public:
  // `config` (validated), `transport` and `source` must outlive the runner.
  BenchRunner(const BenchConfig& config, BenchTransport* transport,
              RequestSource* source);
  BenchRunner(const BenchRunner&) = delete;
  BenchRunner& operator=(const BenchRunner&) = delete;

  // Runs the warmup and the measured phase; call once.
  BenchResults Run();

  // Stops sending and cancels the requests in flight; Run then returns the
  // results so far with `interrupted` set.
  void Stop();

 private:
  using Clock = std::chrono::steady_clock;
  struct Phase {
    const char* name;  // For the progress line.
    bool open_loop;
    int concurrency;   // Closed loop.
    int64_t arrivals;  // Bound on arrivals (sent + dropped).
    Clock::duration duration;
  };

  // Sends the phase's requests, then waits for those in flight. Returns the
  // time sending stopped.
  Clock::time_point RunPhase(const Phase& phase, BenchRecorder* recorder);
  void Send(BenchRecorder* recorder);
  void OnCallDone(uint64_t call_id, BenchRecorder* recorder,
                  const RequestResult& result);
  // While at least `while_in_flight` requests are in flight, waits until
  // `until` (at most until the next progress line), or less when a request
  // finishes or Stop is called; prints the progress line when due.
  void WaitABit(Clock::time_point until, int while_in_flight,
                const Phase& phase, const BenchRecorder& recorder)
      ABSL_LOCKS_EXCLUDED(mu_);
  void ReleaseFinished() ABSL_LOCKS_EXCLUDED(mu_);
  void MaybePrintProgress(const Phase& phase, const BenchRecorder& recorder,
                          bool final);

  const BenchConfig& config_;
  BenchTransport* const transport_;
  RequestSource* const source_;
  const bool show_progress_;

  mutable absl::Mutex mu_;
  absl::CondVar changed_;  // in_flight_ dropped or stop_ set.
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  Clock::time_point last_done_ ABSL_GUARDED_BY(mu_);
  uint64_t next_call_id_ ABSL_GUARDED_BY(mu_) = 0;
  // The requests in flight, for Stop.
  std::unordered_map<uint64_t, std::shared_ptr<BenchCall>> calls_
      ABSL_GUARDED_BY(mu_);
  // Finished calls, freed on Run's thread (ReleaseFinished): a gRPC call's
  // context holds the channel, whose last release must not happen on a gRPC
  // callback thread, or the process could exit while that thread still tears
  // the channel down.
  std::vector<std::shared_ptr<BenchCall>> finished_ ABSL_GUARDED_BY(mu_);

  // Progress line state (Run's thread only).
  Clock::time_point phase_start_;
  Clock::time_point next_progress_;
  Clock::time_point last_progress_;
  int64_t last_progress_done_ = 0;
};

}  // namespace moh::client

#endif  // MOH_CLIENT_BENCH_RUNNER_H_
