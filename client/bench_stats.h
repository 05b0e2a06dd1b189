// What moh-bench measures: the result of each request (RequestResult), the
// thread-safe BenchRecorder that accumulates them, and the BenchResults it
// produces at the end. Times are in seconds.
#ifndef MOH_CLIENT_BENCH_STATS_H_
#define MOH_CLIENT_BENCH_STATS_H_

#include <grpcpp/support/status.h>

#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace moh::client {

// One finished request.
struct RequestResult {
  grpc::StatusCode code = grpc::StatusCode::OK;
  int ratio_index = 0;
  double e2e_s = 0;              // Send to final status.
  std::optional<double> ttft_s;  // Send to the first message with tokens.
  int64_t tokens = 0;            // Streamed token ids.
  // Inter-token latency: for each message with tokens after the first, the
  // gap since the previous such message divided by its token count, once per
  // token. Over the OpenAI API, whose chunks do not say how many
  // tokens they hold: the gap, once per chunk with text.
  std::vector<double> itl_s;
  std::optional<float> effective_activation_ratio;
  std::optional<float> activation_ratio;  // The ratio the request ran at.
};

// count == 0: every other field is 0. Percentiles interpolate linearly
// between the closest ranks.
struct LatencySummary {
  int64_t count = 0;
  double p50 = 0, p90 = 0, p99 = 0, mean = 0, max = 0;
};

// Samples with exact count, mean and max; percentiles over a uniform sample
// of at most `capacity` values (exact below it). Not thread-safe.
class SampleSet {
 public:
  explicit SampleSet(size_t capacity = size_t{1} << 20);
  void Add(double value);
  LatencySummary Summarize() const;

 private:
  size_t capacity_;
  std::vector<double> reservoir_;
  int64_t count_ = 0;
  double sum_ = 0;
  double max_ = 0;
  std::mt19937_64 rng_{0x5eed};
};

struct RatioResults {
  float requested = 0;  // 0: the model's default.
  int64_t requests = 0, completed = 0, errors = 0;
  // Means over the completed requests that reported them; unset if none did.
  std::optional<double> mean_effective_activation_ratio;
  std::optional<double> mean_activation_ratio;
  LatencySummary e2e;
};

struct BenchResults {
  double elapsed_s = 0;  // First measured send to the last completion.
  int64_t requests = 0;  // Sent: completed + errors.
  int64_t completed = 0, errors = 0;
  int64_t dropped = 0;  // Open loop: arrivals over --max_in_flight.
  int64_t warmup_requests = 0, warmup_errors = 0;
  bool interrupted = false;
  std::map<std::string, int64_t> errors_by_code;  // By gRPC code name.
  int64_t generated_tokens = 0;
  // Over completed requests only.
  LatencySummary e2e, ttft, itl;
  std::vector<RatioResults> ratios;  // In --ratios order.
};

// Counts in the measured phase so far, for the progress line.
struct BenchProgress {
  int64_t completed = 0, errors = 0, dropped = 0;
};

// Accumulates the measured phase. Record and RecordDrop may be called from
// any thread.
class BenchRecorder {
 public:
  explicit BenchRecorder(const std::vector<float>& ratios);

  void Record(const RequestResult& result);
  void RecordDrop();
  BenchProgress Progress() const;
  // Everything but elapsed_s, warmup_* and interrupted, which the caller
  // knows.
  BenchResults Results() const;

 private:
  struct PerRatio {
    int64_t requests = 0, completed = 0, errors = 0;
    double effective_sum = 0, activation_sum = 0;
    int64_t effective_count = 0, activation_count = 0;
    SampleSet e2e;
  };
  mutable absl::Mutex mu_;
  std::vector<float> ratio_values_;
  std::vector<PerRatio> per_ratio_ ABSL_GUARDED_BY(mu_);
  BenchProgress progress_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> errors_by_code_ ABSL_GUARDED_BY(mu_);
  int64_t generated_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  SampleSet e2e_ ABSL_GUARDED_BY(mu_);
  SampleSet ttft_ ABSL_GUARDED_BY(mu_);
  SampleSet itl_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moh::client

#endif  // MOH_CLIENT_BENCH_STATS_H_
