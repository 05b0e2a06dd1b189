#include "client/bench_stats.h"

#include <algorithm>
#include <cmath>

#include "client/rpc_util.h"

namespace moh::client {
namespace {

// Linear interpolation between closest ranks of sorted `v` (non-empty).
double Percentile(const std::vector<double>& v, double p) {
  const double rank = p * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (rank - static_cast<double>(lo));
}

}  // namespace

SampleSet::SampleSet(size_t capacity)
    : capacity_(std::max<size_t>(1, capacity)) {}

void SampleSet::Add(double value) {
  ++count_;
  sum_ += value;
  max_ = count_ == 1 ? value : std::max(max_, value);
  if (reservoir_.size() < capacity_) {
    reservoir_.push_back(value);
    return;
  }
  // Algorithm R: keep each of the count_ values with equal probability.
  const uint64_t slot = std::uniform_int_distribution<uint64_t>(
      0, static_cast<uint64_t>(count_) - 1)(rng_);
  if (slot < capacity_) reservoir_[slot] = value;
}

LatencySummary SampleSet::Summarize() const {
  LatencySummary s;
  if (count_ == 0) return s;
  std::vector<double> sorted = reservoir_;
  std::sort(sorted.begin(), sorted.end());
  s.count = count_;
  s.p50 = Percentile(sorted, 0.50);
  s.p90 = Percentile(sorted, 0.90);
  s.p99 = Percentile(sorted, 0.99);
  s.mean = sum_ / static_cast<double>(count_);
  s.max = max_;
  return s;
}

BenchRecorder::BenchRecorder(const std::vector<float>& ratios)
    : ratio_values_(ratios), per_ratio_(ratios.size()) {}

void BenchRecorder::Record(const RequestResult& r) {
  absl::MutexLock lock(&mu_);
  PerRatio& ratio = per_ratio_[r.ratio_index];
  ++ratio.requests;
  if (r.code != grpc::StatusCode::OK) {
    ++ratio.errors;
    ++progress_.errors;
    ++errors_by_code_[StatusCodeName(r.code)];
    return;
  }
  ++ratio.completed;
  ++progress_.completed;
  ratio.e2e.Add(r.e2e_s);
  if (r.effective_activation_ratio) {
    ratio.effective_sum += *r.effective_activation_ratio;
    ++ratio.effective_count;
  }
  if (r.activation_ratio) {
    ratio.activation_sum += *r.activation_ratio;
    ++ratio.activation_count;
  }
  e2e_.Add(r.e2e_s);
  if (r.ttft_s) ttft_.Add(*r.ttft_s);
  for (double gap : r.itl_s) itl_.Add(gap);
  generated_tokens_ += r.tokens;
}

void BenchRecorder::RecordDrop() {
  absl::MutexLock lock(&mu_);
  ++progress_.dropped;
}

BenchProgress BenchRecorder::Progress() const {
  absl::MutexLock lock(&mu_);
  return progress_;
}

BenchResults BenchRecorder::Results() const {
  absl::MutexLock lock(&mu_);
  BenchResults results;
  results.completed = progress_.completed;
  results.errors = progress_.errors;
  results.requests = progress_.completed + progress_.errors;
  results.dropped = progress_.dropped;
  results.errors_by_code = errors_by_code_;
  results.generated_tokens = generated_tokens_;
  results.e2e = e2e_.Summarize();
  results.ttft = ttft_.Summarize();
  results.itl = itl_.Summarize();
  for (size_t i = 0; i < per_ratio_.size(); ++i) {
    const PerRatio& p = per_ratio_[i];
    RatioResults r;
    r.requested = ratio_values_[i];
    r.requests = p.requests;
    r.completed = p.completed;
    r.errors = p.errors;
    if (p.effective_count > 0) {
      r.mean_effective_activation_ratio =
          p.effective_sum / static_cast<double>(p.effective_count);
    }
    if (p.activation_count > 0) {
      r.mean_activation_ratio =
          p.activation_sum / static_cast<double>(p.activation_count);
    }
    r.e2e = p.e2e.Summarize();
    results.ratios.push_back(r);
  }
  return results;
}

}  // namespace moh::client
