// Token sampling for generation: per-request sampling settings, their
// validation, a per-sequence Sampler and a streaming stop-string matcher.
//
// Sampling order (vLLM's): logit bias -> repetition, presence and frequency
// penalties -> greedy argmax if temperature == 0 -> divide by temperature ->
// min-p -> top-k -> top-p -> softmax -> one draw by inverse CDF from the
// sequence's own RNG.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace moh {

// Limits on SamplingParams::stop enforced by ValidateSamplingParams.
inline constexpr int kMaxStopStrings = 16;
inline constexpr int kMaxStopStringBytes = 256;
// Limit on SamplingParams::stop_token_ids.
inline constexpr int kMaxStopTokenIds = 64;
// Limit on SamplingParams::logprobs and prompt_logprobs (vLLM's default).
inline constexpr int kMaxLogprobs = 20;
// Range of the presence and frequency penalties (OpenAI's).
inline constexpr float kMaxOutputPenalty = 2.0f;
// Limits on SamplingParams::logit_bias: entries, and each bias's magnitude
// (OpenAI's range).
inline constexpr int kMaxLogitBias = 1024;
inline constexpr float kMaxLogitBiasValue = 100.0f;

// Per-request sampling settings; the defaults are what an omitted field means.
struct SamplingParams {
  // Upper bound on generated tokens; >= 1 and <= the server's limit.
  int32_t max_new_tokens = 64;
  // Softmax temperature, >= 0 and finite. 0 means greedy (argmax); top_k,
  // top_p and the seed are then irrelevant.
  float temperature = 0.0f;
  // Keep only the k highest logits; 0 (or k >= vocab) means off.
  int32_t top_k = 0;
  // Nucleus sampling: keep the smallest set of most probable tokens whose
  // probability (renormalised after top-k) sums to >= top_p, at least one
  // token. In (0, 1]; 1 means off.
  float top_p = 1.0f;
  // RNG seed. Unset: a fresh one per sampler, from std::random_device mixed
  // with a counter (see Sampler::seed()).
  std::optional<uint64_t> seed;
  // CTRL/HF repetition penalty, > 0 and finite; 1 means off. For each token
  // already in the prompt or output: logit > 0 ? logit / p : logit * p.
  float repetition_penalty = 1.0f;
  // OpenAI's penalties on tokens already generated (not the prompt), in
  // [-2, 2]; 0 means off. Each logit drops by presence_penalty if its token
  // occurs in the output and by frequency_penalty per occurrence.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  // Keep only tokens whose probability is at least min_p times the most
  // probable one's (after temperature), in [0, 1]; 0 means off.
  float min_p = 0.0f;
  // Generation stops when the output contains one of these; the output is
  // truncated before it. At most kMaxStopStrings, each 1..kMaxStopStringBytes
  // bytes.
  std::vector<std::string> stop;
  // Generation stops after one of these tokens (finish reason stop; the
  // token is counted, not decoded). At most kMaxStopTokenIds; ids within the
  // vocabulary (checked by the scheduler, which knows it).
  std::vector<int32_t> stop_token_ids;
  // The model's end-of-sequence tokens do not end generation.
  bool ignore_eos = false;
  // Tokens generated before an end-of-sequence or stop token may be: those
  // tokens are masked until then. In [0, max_new_tokens].
  int32_t min_tokens = 0;
  // Added to the logits of these token ids before anything else (OpenAI's
  // logit_bias): at most kMaxLogitBias entries, each id >= 0 and within the
  // vocabulary (checked by the scheduler, which knows it), each bias in
  // [-kMaxLogitBiasValue, kMaxLogitBiasValue]; an id listed twice adds both.
  std::vector<std::pair<int32_t, float>> logit_bias;
  // Log-probabilities returned with each generated token: unset none, else
  // the sampled token's and those of the `logprobs` most likely tokens, in
  // [0, kMaxLogprobs]. They are the model's own distribution (log-softmax of
  // the raw logits, before penalties, temperature and truncation), as vLLM
  // returns by default.
  std::optional<int32_t> logprobs;
  // The same for every prompt token after the first (computed, so the prompt
  // is not read from the prefix cache).
  std::optional<int32_t> prompt_logprobs;
};

// One token's log-probability under the model, with the most likely
// alternatives at that position.
struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0.0f;
};
struct LogprobEntry {
  TokenLogprob token;
  int32_t rank = 1;               // 1 + the tokens more likely than it
  std::vector<TokenLogprob> top;  // best first, ties by lower id
};

// The entry of `token` in `logits` ([vocab], any device and floating dtype)
// with its `top_n` best alternatives. NaN logits count as -inf; +inf ones
// share all the probability (log 0 each); when every logit is -inf, every
// log-probability is -inf.
LogprobEntry ComputeLogprobs(const at::Tensor& logits, int32_t token,
                             int32_t top_n);

// ComputeLogprobs' entry from a row's best logits alone (float32 `values`
// and `ids` in BestLogits' order, best_logits.h: min(top_n, vocab) of them
// or more) and its log partition (RowStats' kLogPartition): `token` has
// logit `token_logit` and rank `rank`.
LogprobEntry LogprobsFromBest(absl::Span<const float> values,
                              absl::Span<const int64_t> ids,
                              double log_partition, int32_t token,
                              float token_logit, int32_t rank, int32_t top_n);

// Returns OK, or INVALID_ARGUMENT naming the first bad field and its allowed
// range, e.g. "sampling.top_p must be in (0, 1], got 1.5". NaN is rejected
// everywhere a float is checked.
absl::Status ValidateSamplingParams(const SamplingParams& params,
                                    int32_t max_new_tokens_limit);

// Chooses the next token of one sequence.
//
// Deterministic for a given seed and the same logits and history, whatever
// else runs in the process or the batch: it owns its RNG (std::mt19937_64)
// and never touches LibTorch's global generator. Ties are broken towards the
// lowest token id (greedy argmax, the top-k cut, the top-p order). NaN logits
// count as -inf; if every logit is -inf, token 0 is returned; if any is +inf
// (also after the repetition penalty), the lowest such id is.
//
// Not thread-safe; use one Sampler per sequence. Expects params that passed
// ValidateSamplingParams.
class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);

  // logits: 1-D floating tensor [vocab] on any device, any strides; it is
  // copied once into a CPU float32 buffer and never modified. history: prompt
  // and generated ids so far, for the repetition penalty (each distinct id
  // is penalised once; ids outside [0, vocab) are ignored); its last
  // `generated` ids are the output so far (the presence and frequency
  // penalties). `allowed`, when given, is a bitmask of the ids that may be
  // drawn (bit id % 32 of word id / 32; ids past it are not allowed): the
  // others count as -inf after the penalties (a grammar's mask,
  // grammar.h). Returns a token id in [0, vocab). Throws c10::Error if logits
  // is not a non-empty 1-D floating tensor, like the LibTorch calls around it.
  int32_t Sample(const at::Tensor& logits, absl::Span<const int32_t> history,
                 size_t generated = 0,
                 std::optional<absl::Span<const uint32_t>> allowed = {});
  // The same from float32 logits on the host, without a tensor (a step's
  // best logits, read in place).
  int32_t Sample(absl::Span<const float> logits,
                 absl::Span<const int32_t> history, size_t generated = 0,
                 std::optional<absl::Span<const uint32_t>> allowed = {});

  // The uniform the next draw uses (a draw by inverse CDF at it times the
  // weights' sum), drawn now from the RNG if no draw has taken it yet: a
  // step that draws on the device takes it ahead (RowReduction::uniform).
  // The RNG's sequence is unchanged: a draw that follows uses it.
  double PeekUniform();

  // The draw from a row's best logits and the sums RowStats (best_logits.h)
  // took of the whole row, where they decide what Sample would draw from
  // the whole row (no penalty or mask), with kRowSumTolerance's certainty;
  // nullopt otherwise, having drawn nothing (Sample on the whole row then
  // draws as it would have).
  // - Top-p alone (top_p < 1, top_k off): `best` are the row's best
  //   min(256, vocab) logits or more (float32, BestLogits' order and
  //   cleaning), `weight_sum` the weights' sum (RowStat kWeightSum); returns
  //   the index in `best` of the token drawn.
  std::optional<int32_t> DrawNucleusFromBest(absl::Span<const float> best,
                                             double weight_sum);
  // - Neither (temperature alone, maybe min_p): whether RowStats' draw at
  //   PeekUniform() (`stats`, kRowStats of them) is the draw; then the draw
  //   takes that uniform and the id is stats[kDrawId]. `max_logit`: the
  //   row's best.
  bool TakeRowDraw(float max_logit, absl::Span<const double> stats);
  // temperature * log(min_p): the min-p cut lies this far below the best
  // logit (-inf without min_p).
  float MinPOffset() const;

  const SamplingParams& params() const { return params_; }
  // The seed in use: params().seed, or the one drawn when it was unset, so
  // that a nondeterministic request can be reported and replayed.
  uint64_t seed() const { return seed_; }

 private:
  struct Candidate {
    float logit;
    float weight;  // unnormalised probability, exp((logit - max) / T)
    int32_t id;
  };

  // Copies logits into logits_.
  void LoadLogits(const at::Tensor& logits);
  // Sample() once logits_ holds the logits.
  int32_t SampleLoaded(absl::Span<const int32_t> history, size_t generated,
                       std::optional<absl::Span<const uint32_t>> allowed);
  void ApplyLogitBias();
  void ApplyRepetitionPenalty(absl::Span<const int32_t> history);
  void ApplyOutputPenalties(absl::Span<const int32_t> output);
  // Sets the logits of ids `allowed` leaves out to -inf; returns the lowest
  // allowed id (0 when none is).
  int32_t ApplyTokenMask(absl::Span<const uint32_t> allowed);
  // Strict order of preference: higher logit, then lower id.
  static bool Better(const Candidate& a, const Candidate& b);
  // Sets top_ to every token, by id. Weights are left unset.
  void SelectAll();
  // Sets top_ to the n best tokens (all if n >= vocab), best first. Weights
  // are left unset.
  void SelectTop(size_t n);
  // PeekUniform()'s value, which it then forgets, or the RNG's next.
  double NextUniform();
  // Inverse-CDF draw from `pool`, in its order; `total` is the sum of its
  // weights.
  int32_t Draw(absl::Span<const Candidate> pool, double total);
  // Draws from the smallest top_[0, n) with n in (from, to] whose weight
  // reaches `threshold` (n = to if none does). top_[from, to) must be sorted
  // best first and `mass` must be the weight of top_[0, from).
  int32_t DrawNucleus(size_t from, size_t to, double mass, double threshold);

  SamplingParams params_;
  uint64_t seed_;
  std::mt19937_64 rng_;
  std::optional<double> next_uniform_;  // PeekUniform's, not yet drawn
  // Scratch buffers reused across calls.
  std::vector<float> logits_;       // by token id
  std::vector<Candidate> top_;      // the tokens a draw chooses from
  std::vector<uint8_t> penalized_;  // by token id, all 0 between calls
};

// Finds stop strings in streamed text.
//
// Feed the decoded text as it grows. Each Push returns the text that is safe
// to emit: text that could still be the start of a stop string is held back,
// and so is an incomplete UTF-8 sequence at the end (so emitted pieces of
// valid UTF-8 are valid UTF-8). When a stop string appears, the output is
// truncated right before the earliest match (HF/TGI behaviour), `stopped` is
// set, and every later Push returns nothing. Empty stop strings are ignored.
// Not thread-safe.
class StopStringMatcher {
 public:
  explicit StopStringMatcher(std::vector<std::string> stops);

  struct Result {
    std::string emit;
    bool stopped = false;
  };
  // new_text: decoded text since the last Push.
  Result Push(std::string_view new_text);
  // At the end of generation: returns whatever was held back (empty once
  // stopped) and clears it.
  std::string Flush();

  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace moh
