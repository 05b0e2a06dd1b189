// In-process text generation and label scoring on a LlamaModel.
//
// Generator runs a static batch of requests to completion: one prefill of all
// prompts, then decode steps over the rows still running; rows finish
// independently (EOS, stop string, max_new_tokens). Each row has its own
// sampler (seeded → reproducible whatever else is in the batch), its own
// activation ratio, and streams UTF-8-safe text through an optional callback.
// This is the reference loop for tools, tests and benchmarks; the server drives
// LlamaModel::Forward through its own continuous-batching scheduler.
// Thread-compatible: one Generate() call at a time per Generator.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "model/core/activation.h"
#include "model/core/best_logits.h"
#include "model/core/llama_model.h"
#include "model/generation/grammar.h"
#include "model/generation/sampler.h"
#include "model/tokenizer/tokenizer.h"

namespace moh {

enum class FinishReason { kLength, kStop, kEos, kCancelled };
const char* FinishReasonName(FinishReason reason);

struct GenerationRequest {
  std::vector<int32_t> prompt_ids;
  SamplingParams sampling;
  float ratio = 0.0f;  // activation ratio in (0, 1]; 0 = the model's default
  // Structured output (grammar.h), compiled for the Generator's tokenizer.
  std::shared_ptr<const CompiledGrammar> grammar;
};

// New output of one row since its previous chunk.
struct GenerationChunk {
  std::string text;
  std::vector<int32_t> token_ids;
  // With SamplingParams::logprobs: one entry per token id.
  std::vector<LogprobEntry> logprobs;
  // With SamplingParams::prompt_logprobs, on a sequence's first chunk: one
  // entry per prompt token after the first.
  std::vector<LogprobEntry> prompt_logprobs;
  // With SamplingParams::prompt_logprobs, on a sequence's first chunk: the
  // prompt's ids (its first one has no entry above).
  std::vector<int32_t> prompt_token_ids;
  // The sample of the request it belongs to (GenerateCall n), from 0.
  int32_t index = 0;
};

struct GenerationResult {
  std::vector<int32_t> token_ids;  // generated ids (an EOS id included)
  std::string text;                // decoded, stop string excluded
  FinishReason finish_reason = FinishReason::kLength;
  int32_t prompt_tokens = 0;
  at::Tensor head_token_counts;        // int64 [L, H] over prompt and output
  double effective_ratio = 1.0;        // used (token, head) pairs / all pairs
  std::vector<LogprobEntry> logprobs;  // with SamplingParams::logprobs
};

// One sequence's output as its tokens are sampled: the sampler (own seeded
// RNG), EOS, stop strings, max_new_tokens and UTF-8-safe incremental text.
// Generator and the server's scheduler drive one per sequence. Not thread-safe.
class SequenceOutput {
 public:
  // `tokenizer` may be null (no text, no stop strings). `grammar`, when set
  // (compiled for this tokenizer and EOS ids), masks every draw to the tokens
  // it allows, EOS only where its output is complete (min_tokens then does
  // not hold EOS back: the grammar decides where the output may end); the
  // sequence ends (kEos, or kStop under ignore_eos) once it is complete.
  SequenceOutput(const SamplingParams& sampling,
                 std::vector<int32_t> prompt_ids, const Tokenizer* tokenizer,
                 std::vector<int32_t> eos_ids,
                 std::shared_ptr<const CompiledGrammar> grammar = nullptr);

  // Samples the next token from `logits` ([vocab]) and returns what it adds to
  // the stream: its id, and the text that is now safe to emit (a stop string
  // and anything after it never is). Sets finish_reason() on the last token.
  absl::StatusOr<GenerationChunk> Next(const at::Tensor& logits);

  // How a step may reduce this row's logits where they lie (the model's
  // device: BestLogits and RowStats, best_logits.h) instead of returning
  // the whole row, when its draw reads the logits as the model made them
  // (no logit bias, penalty, grammar, or end token held back by min_tokens):
  // from logits [0, limit), the `best` best and, when `stats`, RowStats under
  // `row`. Greedy: the best (and log-probabilities' alternatives); top-k:
  // top_k + 1; top-p alone: 256; temperature alone: a draw on the device at
  // the Sampler's next uniform (peeked now). Log-probabilities add the log
  // partition. nullopt: the draw needs the whole row.
  struct Reduction {
    // How the best logits and the stats decide the draw.
    enum class Draw { kArgmax, kTopK, kNucleus, kOnDevice };
    Draw draw = Draw::kArgmax;
    int64_t limit = 0;
    int64_t best = 0;
    bool stats = false;
    RowReduction row;
  };
  std::optional<Reduction> PlanReduction(int64_t vocab);
  // Next() from what the step reduced as `plan` (PlanReduction's) asked: the
  // row's best logits (`values` on the host, at least `best` of them, in
  // BestLogits' order) and their `ids`, and RowStats' `stats` (kRowStats;
  // empty without). nullopt, having drawn nothing, when they do not decide
  // the draw after all (a top-p nucleus past them, or a sum too close to a
  // decision's edge to tell): pass the whole row to Next() then.
  absl::StatusOr<std::optional<GenerationChunk>> NextFromReduced(
      const Reduction& plan, absl::Span<const float> values,
      absl::Span<const int64_t> ids, absl::Span<const double> stats);

  // Set once the sequence has ended.
  const std::optional<FinishReason>& finish_reason() const { return finish_; }
  const std::vector<int32_t>& history() const {
    return history_;
  }  // prompt + output
  int32_t generated() const { return generated_; }

 private:
  const int32_t max_new_tokens_;
  const int32_t min_tokens_;
  const int32_t logprobs_;  // SamplingParams::logprobs; -1 unset
  // Tokens that end the sequence: EOS (kEos, unless ignore_eos), and the
  // request's stop tokens (kStop).
  const std::vector<int32_t> stop_token_ids_;
  // Ids the tokenizer can decode: [0, vocab_limit_); 0 = no tokenizer.
  const int32_t vocab_limit_;
  const std::vector<int32_t> eos_ids_;
  // A draw from the logits as the model made them: no bias, penalty, grammar
  // or end token held back (what PlanReduction asks first).
  bool DrawsFromRawLogits() const;
  // The rest of Next() once `token` is chosen; its log-probabilities are
  // `logprobs` if given, else read from `streamable` (the logits of the ids
  // it may stream).
  absl::StatusOr<GenerationChunk> Emit(
      int32_t token, const at::Tensor& streamable,
      std::optional<LogprobEntry> logprobs = std::nullopt);

  Sampler sampler_;
  StopStringMatcher stop_matcher_;
  std::optional<IncrementalDecoder> decoder_;
  std::optional<GrammarMatcher> matcher_;
  std::vector<int32_t> history_;
  int32_t generated_ = 0;
  std::optional<FinishReason> finish_;
};

// Whether `model`'s steps reduce their rows' logits where they lie
// (StepDraws): on a GPU; on the CPU, where the logits are already on the
// host and reducing only adds passes over them, when the environment sets
// MOH_REDUCE_LOGITS=1 (tests). MOH_REDUCE_LOGITS=0 draws every row from its
// whole logits on a GPU too (a fallback, and the GPU test's reference). Read
// when called.
bool ReduceLogitsWhereTheyLie(const LlamaModel& model);

// How each row of one step draws its token: from what its logits reduce to
// where they lie (SequenceOutput::PlanReduction: a GPU step then downloads
// at most 256 values and ids and a few sums a row, not [V] logits), or from
// its whole row. Generator and the server's steps make one a step.
class StepDraws {
 public:
  enum class From { kReduced, kWhole, kReducedThenWhole };

  // outputs[b]: row b's sequence, or null where row b draws nothing this
  // step (a prompt chunk short of its end). With `reduce`, plans the rows
  // whose reduced logits decide their draw and sets `batch` to reduce so and
  // to return whole only the other drawing rows (DecoderBatch::top_logits,
  // whole_logits, row_reductions); `batch` stays as it is when no row
  // qualifies.
  StepDraws(std::vector<SequenceOutput*> outputs, int64_t vocab, bool reduce,
            DecoderBatch& batch);

  // Row b's index in the step's DecoderOutput::logits, or -1: its logits
  // were reduced where they lie.
  int64_t whole_row(size_t b) const { return whole_row_[b]; }

  // Row b's next chunk (row b draws) from the step's `out`; `row_logits` is
  // its whole row ([V] on the host) where whole_row(b) >= 0, else unused.
  // *from: how the token was drawn.
  absl::StatusOr<GenerationChunk> Next(size_t b, const DecoderOutput& out,
                                       const at::Tensor& row_logits,
                                       From* from);

 private:
  std::vector<SequenceOutput*> outputs_;
  std::vector<std::optional<SequenceOutput::Reduction>> plans_;
  std::vector<int64_t> whole_row_;
};

class Generator {
 public:
  using ChunkCallback =
      std::function<void(size_t row, const GenerationChunk& chunk)>;

  // `tokenizer` may be null: no text is produced and stop strings are refused.
  // `eos_ids`: tokens that end a sequence. Its steps draw as the server's
  // (StepDraws), reducing the logits where they lie when
  // ReduceLogitsWhereTheyLie(model) says so here.
  Generator(const LlamaModel& model, const Tokenizer* tokenizer,
            std::vector<int32_t> eos_ids);

  // INVALID_ARGUMENT naming the request field and allowed range for bad input
  // (empty prompt, prompt + max_new_tokens beyond the model's maximum sequence
  // length, sampling parameters, ratio outside (0, 1]).
  absl::StatusOr<std::vector<GenerationResult>> Generate(
      const std::vector<GenerationRequest>& requests,
      const ChunkCallback& on_chunk = nullptr) const;

 private:
  absl::Status Validate(const GenerationRequest& request, size_t index) const;

  const LlamaModel& model_;
  const Tokenizer* tokenizer_;
  std::vector<int32_t> eos_ids_;
  // ReduceLogitsWhereTheyLie, read at construction.
  const bool reduce_logits_;
};

// Label scoring keeps the logits of one Forward under this size.
inline constexpr int64_t kMaxLabelLogitsBytes = int64_t{256} << 20;

// Log-likelihood of each candidate label given `context_ids`:
// sum over label tokens of log p(label token | context, previous label tokens),
// at activation ratio `ratio` (0 = default). Labels are scored in groups of
// rows whose KV cache holds at most `max_positions` positions (0: the model's
// max_position_embeddings), so a request never needs more than one
// sequence's cache; context + label must fit in it (INVALID_ARGUMENT).
struct LabelScores {
  std::vector<double> log_likelihoods;  // one per label
  at::Tensor head_token_counts;         // int64 [L, H] over every row
  int64_t tokens = 0;                   // tokens processed over every row
};
absl::StatusOr<LabelScores> ScoreLabels(
    const LlamaModel& model, const std::vector<int32_t>& context_ids,
    const std::vector<std::vector<int32_t>>& label_ids, float ratio);
absl::StatusOr<LabelScores> ScoreLabels(
    const LlamaModel& model, const std::vector<int32_t>& context_ids,
    const std::vector<std::vector<int32_t>>& label_ids,
    const Activation& activation, int64_t max_positions = 0);

// Fraction of (token, head) pairs used, from counts [..., L, H] over `tokens`.
double EffectiveRatio(const at::Tensor& head_token_counts, int64_t tokens);

}  // namespace moh
