#include "model/generation/sampler.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/field_error.h"
#include "model/core/best_logits.h"

namespace moh {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

absl::Status OutOfRange(absl::string_view field, absl::string_view range,
                        const absl::AlphaNum& got) {
  return FieldError(absl::StrCat("sampling.", field),
                    absl::StrCat("must be ", range, ", got ", got.Piece()));
}

// Uniform double in [0, 1) from the top 53 bits; unlike
// std::uniform_real_distribution it is the same on every standard library.
double Uniform01(std::mt19937_64& rng) {
  return static_cast<double>(rng() >> 11) * 0x1.0p-53;
}

// Length of the incomplete UTF-8 sequence at the end of `text` (0 if none).
size_t IncompleteUtf8Tail(std::string_view text) {
  const size_t n = text.size();
  for (size_t back = 1; back <= std::min<size_t>(3, n); ++back) {
    const auto c = static_cast<unsigned char>(text[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte
    size_t len = 1;
    if ((c & 0xE0) == 0xC0) {
      len = 2;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
    }
    return len > back ? back : 0;
  }
  return 0;
}

// A fresh seed for a request without one: SplitMix64 over a process-wide
// counter that starts from std::random_device once. Opening the random
// device for every request was 0.65% of a busy server's time (perf).
uint64_t RandomSeed() {
  static std::atomic<uint64_t> state{(uint64_t{std::random_device{}()} << 32) ^
                                     std::random_device{}()};
  uint64_t z = state.fetch_add(0x9e3779b97f4a7c15, std::memory_order_relaxed) +
               0x9e3779b97f4a7c15;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9;
  z = (z ^ (z >> 27)) * 0x94d049bb133111eb;
  return z ^ (z >> 31);
}

// log softmax of a logit `x` of a row whose largest is `max_logit` and log
// partition `log_z` (used when `max_logit` is finite).
float LogProbability(float x, float max_logit, double log_z) {
  if (std::isinf(max_logit)) {
    // +inf holds all the probability; if every logit is -inf, nothing has
    // any.
    return max_logit > 0 && x == max_logit ? 0.0f : kNegInf;
  }
  return static_cast<float>(x - log_z);
}

}  // namespace

absl::Status ValidateSamplingParams(const SamplingParams& params,
                                    int32_t max_new_tokens_limit) {
  if (params.max_new_tokens < 1 ||
      params.max_new_tokens > max_new_tokens_limit) {
    return OutOfRange("max_new_tokens",
                      absl::StrCat("in [1, ", max_new_tokens_limit, "]"),
                      params.max_new_tokens);
  }
  if (!(params.temperature >= 0.0f) || std::isinf(params.temperature)) {
    return OutOfRange("temperature", "finite and >= 0", params.temperature);
  }
  if (params.top_k < 0) {
    return OutOfRange("top_k", ">= 0 (0 = off)", params.top_k);
  }
  if (!(params.top_p > 0.0f && params.top_p <= 1.0f)) {
    return OutOfRange("top_p", "in (0, 1]", params.top_p);
  }
  if (!(params.repetition_penalty > 0.0f) ||
      std::isinf(params.repetition_penalty)) {
    return OutOfRange("repetition_penalty", "finite and > 0 (1 = off)",
                      params.repetition_penalty);
  }
  for (const auto& [name, value] :
       {std::pair<const char*, float>{"presence_penalty",
                                      params.presence_penalty},
        {"frequency_penalty", params.frequency_penalty}}) {
    if (!(std::fabs(value) <= kMaxOutputPenalty)) {
      return OutOfRange(name,
                        absl::StrCat("in [", -kMaxOutputPenalty, ", ",
                                     kMaxOutputPenalty, "] (0 = off)"),
                        value);
    }
  }
  if (!(params.min_p >= 0.0f && params.min_p <= 1.0f)) {
    return OutOfRange("min_p", "in [0, 1] (0 = off)", params.min_p);
  }
  for (const auto& [name, value] :
       {std::pair<const char*, std::optional<int32_t>>{"logprobs",
                                                       params.logprobs},
        {"prompt_logprobs", params.prompt_logprobs}}) {
    if (value && (*value < 0 || *value > kMaxLogprobs)) {
      return OutOfRange(
          name, absl::StrCat("in [0, ", kMaxLogprobs, "] (absent = none)"),
          *value);
    }
  }
  if (params.stop.size() > static_cast<size_t>(kMaxStopStrings)) {
    return OutOfRange("stop",
                      absl::StrCat("at most ", kMaxStopStrings, " strings"),
                      absl::StrCat(params.stop.size(), " strings"));
  }
  for (size_t i = 0; i < params.stop.size(); ++i) {
    const size_t size = params.stop[i].size();
    if (size == 0 || size > static_cast<size_t>(kMaxStopStringBytes)) {
      return OutOfRange(absl::StrCat("stop[", i, "]"),
                        absl::StrCat("1 to ", kMaxStopStringBytes, " bytes"),
                        absl::StrCat(size, " bytes"));
    }
  }
  if (params.stop_token_ids.size() > static_cast<size_t>(kMaxStopTokenIds)) {
    return OutOfRange("stop_token_ids",
                      absl::StrCat("at most ", kMaxStopTokenIds, " ids"),
                      absl::StrCat(params.stop_token_ids.size(), " ids"));
  }
  for (int32_t id : params.stop_token_ids) {
    if (id < 0) return OutOfRange("stop_token_ids", "ids >= 0", id);
  }
  if (params.logit_bias.size() > static_cast<size_t>(kMaxLogitBias)) {
    return OutOfRange("logit_bias",
                      absl::StrCat("at most ", kMaxLogitBias, " entries"),
                      absl::StrCat(params.logit_bias.size(), " entries"));
  }
  for (const auto& [id, bias] : params.logit_bias) {
    if (id < 0) return OutOfRange("logit_bias", "token ids >= 0", id);
    if (!(std::fabs(bias) <= kMaxLogitBiasValue)) {
      return OutOfRange("logit_bias",
                        absl::StrCat("biases in [", -kMaxLogitBiasValue, ", ",
                                     kMaxLogitBiasValue, "]"),
                        bias);
    }
  }
  if (params.min_tokens < 0 || params.min_tokens > params.max_new_tokens) {
    return OutOfRange(
        "min_tokens",
        absl::StrCat("in [0, max_new_tokens = ", params.max_new_tokens, "]"),
        params.min_tokens);
  }
  return absl::OkStatus();
}

Sampler::Sampler(const SamplingParams& params)
    : params_(params),
      seed_(params.seed.has_value() ? *params.seed : RandomSeed()),
      rng_(seed_) {}

void Sampler::LoadLogits(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 1 && logits.numel() > 0 &&
                  logits.numel() <= std::numeric_limits<int32_t>::max(),
              "Sampler: logits must be a non-empty 1-D tensor, got shape ",
              logits.sizes());
  TORCH_CHECK(at::isFloatingType(logits.scalar_type()),
              "Sampler: logits must be floating point, got ",
              logits.scalar_type());
  logits_.resize(logits.numel());
  // One copy handles device, dtype and strides.
  at::from_blob(logits_.data(), {logits.numel()}, at::kFloat).copy_(logits);
}

void Sampler::ApplyLogitBias() {
  const auto vocab = static_cast<int32_t>(logits_.size());
  for (const auto& [id, bias] : params_.logit_bias) {
    if (id >= 0 && id < vocab) logits_[id] += bias;
  }
}

void Sampler::ApplyRepetitionPenalty(absl::Span<const int32_t> history) {
  const float penalty = params_.repetition_penalty;
  if (penalty == 1.0f || history.empty()) return;
  const auto vocab = static_cast<int32_t>(logits_.size());
  penalized_.resize(logits_.size(), 0);
  for (int32_t id : history) {
    if (id < 0 || id >= vocab || penalized_[id]) continue;
    penalized_[id] = 1;
    float& x = logits_[id];
    x = x > 0.0f ? x / penalty : x * penalty;
  }
  for (int32_t id : history) {
    if (id >= 0 && id < vocab) penalized_[id] = 0;
  }
}

void Sampler::ApplyOutputPenalties(absl::Span<const int32_t> output) {
  const float presence = params_.presence_penalty;
  const float frequency = params_.frequency_penalty;
  if ((presence == 0.0f && frequency == 0.0f) || output.empty()) return;
  const auto vocab = static_cast<int32_t>(logits_.size());
  penalized_.resize(logits_.size(), 0);
  for (int32_t id : output) {
    if (id < 0 || id >= vocab) continue;
    logits_[id] -= frequency;
    if (!penalized_[id]) logits_[id] -= presence;
    penalized_[id] = 1;
  }
  for (int32_t id : output) {
    if (id >= 0 && id < vocab) penalized_[id] = 0;
  }
}

bool Sampler::Better(const Candidate& a, const Candidate& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

void Sampler::SelectAll() {
  top_.clear();
  for (size_t id = 0; id < logits_.size(); ++id) {
    top_.push_back({logits_[id], 0.0f, static_cast<int32_t>(id)});
  }
}

void Sampler::SelectTop(size_t n) {
  if (n >= logits_.size()) {
    SelectAll();
    std::sort(top_.begin(), top_.end(), Better);
    return;
  }
  // One pass with a heap of the n best so far; its front is the worst of
  // them. Ids come in increasing order, so an equal logit never gets in.
  top_.clear();
  for (size_t id = 0; id < n; ++id) {
    top_.push_back({logits_[id], 0.0f, static_cast<int32_t>(id)});
  }
  std::make_heap(top_.begin(), top_.end(), Better);
  for (size_t id = n; id < logits_.size(); ++id) {
    if (logits_[id] <= top_.front().logit) continue;
    std::pop_heap(top_.begin(), top_.end(), Better);
    top_.back() = {logits_[id], 0.0f, static_cast<int32_t>(id)};
    std::push_heap(top_.begin(), top_.end(), Better);
  }
  std::sort_heap(top_.begin(), top_.end(), Better);
}

double Sampler::PeekUniform() {
  if (!next_uniform_) next_uniform_ = Uniform01(rng_);
  return *next_uniform_;
}

double Sampler::NextUniform() {
  const double u = PeekUniform();
  next_uniform_.reset();
  return u;
}

float Sampler::MinPOffset() const {
  return params_.min_p > 0.0f ? params_.temperature * std::log(params_.min_p)
                              : kNegInf;
}

int32_t Sampler::Draw(absl::Span<const Candidate> pool, double total) {
  const double u = NextUniform() * total;
  double cumulative = 0.0;
  int32_t last_positive = pool.front().id;
  for (const Candidate& c : pool) {
    if (c.weight <= 0.0f) continue;
    cumulative += c.weight;
    last_positive = c.id;
    if (u < cumulative) return c.id;
  }
  return last_positive;  // only reached through rounding
}

int32_t Sampler::DrawNucleus(size_t from, size_t to, double mass,
                             double threshold) {
  size_t n = from;
  while (n < to && mass < threshold) mass += top_[n++].weight;
  return Draw(absl::MakeConstSpan(top_.data(), n), mass);
}

int32_t Sampler::ApplyTokenMask(absl::Span<const uint32_t> allowed) {
  int32_t first = -1;
  const size_t vocab = logits_.size();
  for (size_t id = 0; id < vocab; ++id) {
    const size_t word = id / 32;
    if (word < allowed.size() && ((allowed[word] >> (id % 32)) & 1u) != 0) {
      if (first < 0) first = static_cast<int32_t>(id);
    } else {
      logits_[id] = kNegInf;
    }
  }
  return std::max(first, 0);
}

int32_t Sampler::Sample(const at::Tensor& logits,
                        absl::Span<const int32_t> history, size_t generated,
                        std::optional<absl::Span<const uint32_t>> allowed) {
  LoadLogits(logits);
  return SampleLoaded(history, generated, allowed);
}

int32_t Sampler::Sample(absl::Span<const float> logits,
                        absl::Span<const int32_t> history, size_t generated,
                        std::optional<absl::Span<const uint32_t>> allowed) {
  TORCH_CHECK(
      !logits.empty() && logits.size() <= std::numeric_limits<int32_t>::max(),
      "Sampler: logits must be non-empty, got ", logits.size());
  logits_.assign(logits.begin(), logits.end());
  return SampleLoaded(history, generated, allowed);
}

int32_t Sampler::SampleLoaded(
    absl::Span<const int32_t> history, size_t generated,
    std::optional<absl::Span<const uint32_t>> allowed) {
  ApplyLogitBias();
  ApplyRepetitionPenalty(history);
  ApplyOutputPenalties(history.last(std::min(generated, history.size())));
  const size_t vocab = logits_.size();
  // NaN becomes -inf; `best` is the lowest id among the maximal logits (the
  // lowest allowed id when every logit is -inf).
  int32_t best = allowed ? ApplyTokenMask(*allowed) : 0;
  float max_logit = kNegInf;
  for (size_t id = 0; id < vocab; ++id) {
    float& x = logits_[id];
    if (x > max_logit) {
      max_logit = x;
      best = static_cast<int32_t>(id);
    } else if (std::isnan(x)) {
      x = kNegInf;
    }
  }
  // Every logit -inf: token 0. A +inf logit holds all the probability and
  // leaves no weights to draw by (inf - inf is NaN): the lowest such id wins.
  if (params_.temperature == 0.0f || std::isinf(max_logit)) return best;

  // exp((x - max) / T) is softmax(x / T) up to normalisation; subtracting
  // first avoids overflow at tiny temperatures.
  const float temperature = params_.temperature;
  if (params_.min_p > 0.0f) {
    // p / p_max >= min_p  <=>  (x - max) / T >= log(min_p).
    const float cutoff = max_logit + MinPOffset();
    for (float& x : logits_) {
      if (x < cutoff) x = kNegInf;
    }
  }
  auto weight = [max_logit, temperature](float logit) {
    return std::exp((logit - max_logit) / temperature);
  };
  auto weigh_top = [&] {
    double sum = 0.0;
    for (Candidate& c : top_) sum += c.weight = weight(c.logit);
    return sum;
  };
  const bool use_top_k =
      params_.top_k > 0 && static_cast<size_t>(params_.top_k) < vocab;
  if (use_top_k) {
    SelectTop(static_cast<size_t>(params_.top_k));
  } else if (params_.top_p == 1.0f) {
    SelectAll();
  }
  if (use_top_k || params_.top_p == 1.0f) {
    const double total = weigh_top();
    if (params_.top_p == 1.0f) return Draw(top_, total);
    return DrawNucleus(0, top_.size(), 0.0, params_.top_p * total);
  }

  // Top-p alone. Fast path: the nucleus of a real model is usually small.
  double total = 0.0;
  for (float logit : logits_) total += weight(logit);
  const double threshold = params_.top_p * total;
  SelectTop(std::min<size_t>(256, vocab));
  if (weigh_top() >= threshold || top_.size() == vocab) {
    return DrawNucleus(0, top_.size(), 0.0, threshold);
  }
  // Otherwise bisect all tokens by mass with nth_element, O(vocab), and sort
  // only the block where the cumulative mass crosses the threshold. The
  // order of the tokens before that block does not matter for the draw.
  SelectAll();
  weigh_top();
  size_t lo = 0;
  size_t hi = vocab;
  double before = 0.0;  // mass of top_[0, lo)
  while (hi - lo > 256) {
    const size_t mid = lo + (hi - lo) / 2;
    std::nth_element(top_.begin() + lo, top_.begin() + mid, top_.begin() + hi,
                     Better);
    double upper = 0.0;
    for (size_t i = lo; i < mid; ++i) upper += top_[i].weight;
    if (before + upper >= threshold) {
      hi = mid;
    } else {
      before += upper;
      lo = mid;
    }
  }
  std::sort(top_.begin() + lo, top_.begin() + hi, Better);
  return DrawNucleus(lo, hi, before, threshold);
}

std::optional<int32_t> Sampler::DrawNucleusFromBest(
    absl::Span<const float> best, double weight_sum) {
  // Sample's top-p path: its best logit's id when it is not finite, else
  // the smallest prefix of its best 256 whose weight reaches top_p times the
  // whole row's (its threshold). The same weights in the same order make
  // the same prefix sums here; only the threshold is known to within
  // kRowSumTolerance, so the prefix is certain when both ends of that
  // interval give the same one.
  const float max_logit = best.front();
  if (std::isinf(max_logit)) return 0;
  const float temperature = params_.temperature;
  const float cutoff = max_logit + MinPOffset();
  top_.clear();
  for (size_t i = 0; i < best.size(); ++i) {
    const float x = best[i] < cutoff ? kNegInf : best[i];
    top_.push_back(
        {x, std::exp((x - max_logit) / temperature), static_cast<int32_t>(i)});
  }
  const double threshold = params_.top_p * weight_sum;
  const double low = threshold * (1.0 - kRowSumTolerance);
  const double high = threshold * (1.0 + kRowSumTolerance);
  double mass = 0.0;
  size_t n = 0;
  while (n < top_.size() && mass < low) mass += top_[n++].weight;
  if (mass < high) return std::nullopt;  // past them, or the edge uncertain
  return Draw(absl::MakeConstSpan(top_.data(), n), mass);
}

bool Sampler::TakeRowDraw(float max_logit, absl::Span<const double> stats) {
  // Sample's draw without top-k and top-p: the first id in id order whose
  // cumulative weight exceeds u times their sum. RowStats' cumulative sums
  // and target lie within kRowSumTolerance of Sample's, so its id is the
  // draw when the target clears both of that id's bounds by that much.
  if (std::isinf(max_logit)) return false;  // Sample takes the best id
  const double target = stats[kDrawTarget];
  const double margin = kRowSumTolerance;
  if (!(stats[kDrawBelow] * (1.0 + margin) < target * (1.0 - margin) &&
        stats[kDrawUpTo] * (1.0 - margin) > target * (1.0 + margin))) {
    return false;
  }
  NextUniform();
  return true;
}

LogprobEntry ComputeLogprobs(const at::Tensor& logits, int32_t token,
                             int32_t top_n) {
  TORCH_CHECK(logits.dim() == 1 && logits.numel() > 0 &&
                  at::isFloatingType(logits.scalar_type()),
              "ComputeLogprobs: logits must be a non-empty 1-D floating "
              "tensor, got ",
              logits.sizes(), " ", logits.scalar_type());
  const int64_t vocab = logits.numel();
  TORCH_CHECK(token >= 0 && token < vocab, "ComputeLogprobs: token ", token,
              " outside [0, ", vocab, ")");
  std::vector<float> x(vocab);
  at::from_blob(x.data(), {vocab}, at::kFloat).copy_(logits);
  float max_logit = kNegInf;
  for (float& v : x) {
    if (std::isnan(v)) v = kNegInf;
    max_logit = std::max(max_logit, v);
  }
  // log softmax = x - (max + log sum exp(x - max)), summed in double.
  double sum = 0.0;
  if (std::isfinite(max_logit)) {
    for (float v : x) sum += std::exp(static_cast<double>(v) - max_logit);
  }
  const double log_z = std::isfinite(max_logit)
                           ? max_logit + std::log(sum)
                           : static_cast<double>(max_logit);
  auto logprob = [&](int64_t id) {
    return LogProbability(x[id], max_logit, log_z);
  };
  auto better = [&](int32_t a, int32_t b) {
    return x[a] > x[b] || (x[a] == x[b] && a < b);
  };
  LogprobEntry entry;
  entry.token = {token, logprob(token)};
  for (int64_t id = 0; id < vocab; ++id) {
    if (better(static_cast<int32_t>(id), token)) ++entry.rank;
  }
  const int64_t n = std::min<int64_t>(std::max(top_n, 0), vocab);
  if (n == 0) return entry;
  std::vector<int32_t> ids(vocab);
  for (int64_t id = 0; id < vocab; ++id) ids[id] = static_cast<int32_t>(id);
  std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), better);
  for (int64_t i = 0; i < n; ++i) {
    entry.top.push_back({ids[i], logprob(ids[i])});
  }
  return entry;
}

LogprobEntry LogprobsFromBest(absl::Span<const float> values,
                              absl::Span<const int64_t> ids,
                              double log_partition, int32_t token,
                              float token_logit, int32_t rank, int32_t top_n) {
  const float max_logit = values.front();
  LogprobEntry entry;
  entry.token = {token, LogProbability(token_logit, max_logit, log_partition)};
  entry.rank = rank;
  const size_t n = std::min<size_t>(std::max(top_n, 0), values.size());
  for (size_t i = 0; i < n; ++i) {
    entry.top.push_back({static_cast<int32_t>(ids[i]),
                         LogProbability(values[i], max_logit, log_partition)});
  }
  return entry;
}

StopStringMatcher::StopStringMatcher(std::vector<std::string> stops)
    : stops_(std::move(stops)) {
  stops_.erase(std::remove(stops_.begin(), stops_.end(), std::string()),
               stops_.end());
}

StopStringMatcher::Result StopStringMatcher::Push(std::string_view new_text) {
  Result result;
  if (stopped_) {
    result.stopped = true;
    return result;
  }
  held_.append(new_text);
  // A match cannot start before held_: any text that could begin a stop
  // string was held back by the previous Push.
  size_t match = std::string::npos;
  for (const std::string& stop : stops_) {
    match = std::min(match, held_.find(stop));
  }
  if (match != std::string::npos) {
    result.emit = held_.substr(0, match);
    result.stopped = stopped_ = true;
    held_.clear();
    return result;
  }
  // Hold back the longest suffix that is a proper prefix of a stop string.
  size_t hold = 0;
  for (const std::string& stop : stops_) {
    const size_t longest = std::min(stop.size() - 1, held_.size());
    for (size_t len = longest; len > hold; --len) {
      if (std::string_view(held_).substr(held_.size() - len) ==
          std::string_view(stop).substr(0, len)) {
        hold = len;
        break;
      }
    }
  }
  const size_t emit_size = held_.size() - hold -
                           IncompleteUtf8Tail(std::string_view(held_).substr(
                               0, held_.size() - hold));
  result.emit = held_.substr(0, emit_size);
  held_.erase(0, emit_size);
  return result;
}

std::string StopStringMatcher::Flush() {
  std::string rest;
  rest.swap(held_);
  return rest;
}

}  // namespace moh
