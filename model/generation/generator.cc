#include "model/generation/generator.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "base/enum_names.h"
#include "base/status_macros.h"

namespace moh {
namespace {

// Per-row state of one generation.
struct Row {
  Row(const GenerationRequest& r, const MohConfig& moh,
      const Tokenizer* tokenizer, const std::vector<int32_t>& eos_ids)
      : request(r),
        top_k(Activation::AtRatio(moh, r.ratio).top_k()),
        output(r.sampling, r.prompt_ids, tokenizer, eos_ids, r.grammar) {}
  const GenerationRequest& request;
  const LayerTopK top_k;
  SequenceOutput output;
  GenerationResult result;
};

}  // namespace

const char* FinishReasonName(FinishReason reason) {
  static constexpr const char* kNames[] = {"LENGTH", "STOP", "EOS",
                                           "CANCELLED"};
  return EnumName(reason, kNames);
}

SequenceOutput::SequenceOutput(const SamplingParams& sampling,
                               std::vector<int32_t> prompt_ids,
                               const Tokenizer* tokenizer,
                               std::vector<int32_t> eos_ids,
                               std::shared_ptr<const CompiledGrammar> grammar)
    : max_new_tokens_(sampling.max_new_tokens),
      min_tokens_(sampling.min_tokens),
      logprobs_(sampling.logprobs.value_or(-1)),
      stop_token_ids_(sampling.stop_token_ids),
      vocab_limit_(tokenizer != nullptr ? tokenizer->vocab_size() : 0),
      eos_ids_(sampling.ignore_eos ? std::vector<int32_t>()
                                   : std::move(eos_ids)),
      sampler_(sampling),
      stop_matcher_(sampling.stop),
      history_(std::move(prompt_ids)) {
  if (tokenizer != nullptr) {
    decoder_.emplace(*tokenizer, /*skip_special_tokens=*/true);
  }
  if (grammar != nullptr) matcher_.emplace(std::move(grammar));
}

absl::StatusOr<GenerationChunk> SequenceOutput::Next(const at::Tensor& logits) {
  // Rows beyond the tokenizer (released checkpoints often pad the embedding)
  // are never sampled: every id streamed can be decoded.
  const bool padded = vocab_limit_ > 0 && logits.size(-1) > vocab_limit_;
  const at::Tensor streamable =
      padded ? logits.narrow(-1, 0, vocab_limit_) : logits;
  at::Tensor scores = streamable;
  if (generated_ < min_tokens_ && !matcher_) {
    // Too early to end: the ending tokens cannot be drawn.
    scores = scores.clone();
    for (const std::vector<int32_t>* ids : {&eos_ids_, &stop_token_ids_}) {
      for (int32_t id : *ids) {
        if (id < scores.size(-1)) {
          scores.select(-1, id).fill_(-std::numeric_limits<float>::infinity());
        }
      }
    }
  }
  std::optional<absl::Span<const uint32_t>> allowed;
  if (matcher_) allowed = matcher_->AllowedTokens();
  const int32_t token = sampler_.Sample(scores, history_, generated_, allowed);
  return Emit(token, streamable);
}

bool SequenceOutput::DrawsFromRawLogits() const {
  const SamplingParams& p = sampler_.params();
  return p.logit_bias.empty() && p.repetition_penalty == 1.0f &&
         p.presence_penalty == 0.0f && p.frequency_penalty == 0.0f &&
         !matcher_ && generated_ >= min_tokens_;
}

namespace {
// The Sampler's top-p path reads its row's best 256 logits (sampler.cc).
constexpr int64_t kNucleusBest = 256;
}  // namespace

std::optional<SequenceOutput::Reduction> SequenceOutput::PlanReduction(
    int64_t vocab) {
  if (!DrawsFromRawLogits()) return std::nullopt;
  const SamplingParams& p = sampler_.params();
  Reduction plan;
  plan.limit =
      vocab_limit_ > 0 ? std::min<int64_t>(vocab, vocab_limit_) : vocab;
  // The Sampler cuts to top_k only below the vocabulary's size.
  const bool top_k = p.top_k > 0 && p.top_k < plan.limit;
  using Draw = Reduction::Draw;
  if (p.temperature == 0.0f) {
    plan.best = 1;
  } else if (top_k) {
    plan.draw = Draw::kTopK;
    plan.best = p.top_k + 1;
  } else {
    plan.stats = true;
    plan.row.temperature = p.temperature;
    plan.row.min_p_offset = sampler_.MinPOffset();
    if (p.top_p < 1.0f) {
      plan.draw = Draw::kNucleus;
      plan.best = std::min(kNucleusBest, plan.limit);
    } else {
      plan.draw = Draw::kOnDevice;
      plan.best = 1;
      plan.row.uniform = sampler_.PeekUniform();
    }
  }
  if (logprobs_ >= 0) {
    plan.stats = true;
    plan.best =
        std::max<int64_t>(plan.best, std::min<int64_t>(logprobs_, plan.limit));
  }
  return plan;
}

absl::StatusOr<std::optional<GenerationChunk>> SequenceOutput::NextFromReduced(
    const Reduction& plan, absl::Span<const float> best,
    absl::Span<const int64_t> ids, absl::Span<const double> stats) {
  const size_t count = best.size();
  TORCH_CHECK(count >= static_cast<size_t>(plan.best) && ids.size() >= count &&
                  (!plan.stats || stats.size() == kRowStats),
              "NextFromReduced: ", plan.best,
              " best values, their ids and the stats needed, got ", count,
              " values, ", ids.size(), " ids and ", stats.size(), " stats");
  // The index in `best` of the token, or -1 for the device's draw.
  int64_t pick = 0;
  switch (plan.draw) {
    case Reduction::Draw::kArgmax:
      break;
    case Reduction::Draw::kTopK:
      // The Sampler over the best top_k + 1 alone, in the order it prefers,
      // draws what it would over the row: its top_k cut keeps the same ids
      // in the same order, and min_p, top_p and the weights read only those
      // and the best. (The one past the cut only keeps top_k below the
      // count.)
      pick = sampler_.Sample(best.first(sampler_.params().top_k + 1),
                             absl::Span<const int32_t>());
      break;
    case Reduction::Draw::kNucleus: {
      const std::optional<int32_t> drawn = sampler_.DrawNucleusFromBest(
          best.first(std::min<size_t>(count, kNucleusBest)), stats[kWeightSum]);
      if (!drawn) return std::nullopt;
      pick = *drawn;
      break;
    }
    case Reduction::Draw::kOnDevice:
      if (std::isinf(best.front())) break;  // the Sampler's best id, no draw
      if (!sampler_.TakeRowDraw(best.front(), stats)) return std::nullopt;
      pick = -1;
      break;
  }
  const auto token = static_cast<int32_t>(
      pick >= 0 ? ids[pick] : static_cast<int64_t>(stats[kDrawId]));
  std::optional<LogprobEntry> logprobs;
  if (logprobs_ >= 0) {
    logprobs = LogprobsFromBest(
        best, ids, stats[kLogPartition], token,
        pick >= 0 ? best[pick] : static_cast<float>(stats[kDrawLogit]),
        pick >= 0 ? static_cast<int32_t>(pick + 1)
                  : static_cast<int32_t>(stats[kDrawRank]),
        logprobs_);
  }
  return Emit(token, at::Tensor(), std::move(logprobs));
}

absl::StatusOr<GenerationChunk> SequenceOutput::Emit(
    int32_t token, const at::Tensor& streamable,
    std::optional<LogprobEntry> logprobs) {
  if (matcher_) MOH_RETURN_IF_ERROR(matcher_->Accept(token));
  GenerationChunk chunk;
  if (logprobs_ >= 0) {
    // The model's distribution over the tokens it may stream.
    chunk.logprobs.push_back(
        logprobs ? std::move(*logprobs)
                 : ComputeLogprobs(streamable, token, logprobs_));
  }
  history_.push_back(token);
  ++generated_;
  chunk.token_ids.push_back(token);
  const bool stop_token =
      std::find(stop_token_ids_.begin(), stop_token_ids_.end(), token) !=
      stop_token_ids_.end();
  if (stop_token) finish_ = FinishReason::kStop;
  const bool eos = stop_token || std::find(eos_ids_.begin(), eos_ids_.end(),
                                           token) != eos_ids_.end();
  if (decoder_ && !eos) {
    MOH_ASSIGN_OR_RETURN(std::string text, decoder_->Push(token));
    StopStringMatcher::Result matched = stop_matcher_.Push(text);
    chunk.text = std::move(matched.emit);
    if (matched.stopped) finish_ = FinishReason::kStop;
  }
  if (!finish_ && eos) finish_ = FinishReason::kEos;
  if (!finish_ && matcher_ && matcher_->terminated()) {
    finish_ = FinishReason::kStop;  // complete, its EOS ignored (ignore_eos)
  }
  if (!finish_ && generated_ >= max_new_tokens_)
    finish_ = FinishReason::kLength;
  if (finish_ && decoder_ && *finish_ != FinishReason::kStop) {
    // Text held back by the decoder or the stop matcher is released (or
    // completes a stop string) at the end.
    StopStringMatcher::Result tail = stop_matcher_.Push(decoder_->Flush());
    chunk.text += tail.emit;
    if (tail.stopped) {
      finish_ = FinishReason::kStop;
    } else {
      chunk.text += stop_matcher_.Flush();
    }
  }
  return chunk;
}

double EffectiveRatio(const at::Tensor& head_token_counts, int64_t tokens) {
  const int64_t pairs =
      tokens * head_token_counts.size(-1) * head_token_counts.size(-2);
  if (pairs == 0) return 0.0;
  return static_cast<double>(head_token_counts.sum().item<int64_t>()) / pairs;
}

bool ReduceLogitsWhereTheyLie(const LlamaModel& model) {
  const char* value = std::getenv("MOH_REDUCE_LOGITS");
  const std::string_view set = value != nullptr ? value : "";
  if (set == "0") return false;
  return !model.options().device().is_cpu() || set == "1";
}

StepDraws::StepDraws(std::vector<SequenceOutput*> outputs, int64_t vocab,
                     bool reduce, DecoderBatch& batch)
    : outputs_(std::move(outputs)),
      plans_(outputs_.size()),
      whole_row_(outputs_.size(), -1) {
  const size_t rows = outputs_.size();
  int64_t limit = 0;  // the leading logits read: one for every row
  bool stats = false;
  for (size_t b = 0; reduce && b < rows; ++b) {
    if (outputs_[b] == nullptr) continue;
    std::optional<SequenceOutput::Reduction> plan =
        outputs_[b]->PlanReduction(vocab);
    if (!plan || (limit != 0 && plan->limit != limit)) continue;
    limit = plan->limit;
    stats |= plan->stats;
    plans_[b] = std::move(plan);
  }
  if (limit != 0) {
    batch.top_logits_limit = limit;
    batch.whole_logits.resize(rows);
    if (stats) batch.row_reductions.resize(rows);
    for (size_t b = 0; b < rows; ++b) {
      // Rows that draw nothing (mid-prompt) read no logits.
      batch.whole_logits[b] = !plans_[b] && outputs_[b] != nullptr;
      if (!plans_[b]) continue;
      batch.top_logits = std::max(batch.top_logits, plans_[b]->best);
      if (plans_[b]->stats) batch.row_reductions[b] = plans_[b]->row;
    }
  }
  int64_t next = 0;
  for (size_t b = 0; b < rows; ++b) {
    if (batch.top_logits == 0 || batch.whole_logits[b]) whole_row_[b] = next++;
  }
}

namespace {
// Row b of a step's [B, n] results on the host, read where it lies (a
// tensor a row, as select() makes, cost about 1 µs a row: a third of a
// 64-row step's sampling).
template <typename T>
absl::Span<const T> RowOf(const at::Tensor& t, size_t b) {
  TORCH_CHECK(t.dim() == 2 && t.is_cpu() && t.is_contiguous() &&
                  static_cast<size_t>(t.size(0)) > b,
              "StepDraws: the step's reduced results must be contiguous "
              "[B, n] on the host, got ",
              t.sizes(), " on ", t.device(), " for row ", b);
  return absl::MakeConstSpan(t.data_ptr<T>() + b * t.size(1), t.size(1));
}
}  // namespace

absl::StatusOr<GenerationChunk> StepDraws::Next(size_t b,
                                                const DecoderOutput& out,
                                                const at::Tensor& row_logits,
                                                From* from) {
  SequenceOutput& output = *outputs_[b];
  if (!plans_[b]) {
    *from = From::kWhole;
    return output.Next(row_logits);
  }
  const SequenceOutput::Reduction& plan = *plans_[b];
  MOH_ASSIGN_OR_RETURN(
      std::optional<GenerationChunk> reduced,
      output.NextFromReduced(plan, RowOf<float>(out.top_values, b),
                             RowOf<int64_t>(out.top_ids, b),
                             plan.stats ? RowOf<double>(out.row_stats, b)
                                        : absl::Span<const double>()));
  if (reduced) {
    *from = From::kReduced;
    return *std::move(reduced);
  }
  // Not decided by what was reduced: the row whole, where it lies.
  *from = From::kReducedThenWhole;
  return output.Next(out.resident_logits[b].to(at::kCPU, at::kFloat));
}

Generator::Generator(const LlamaModel& model, const Tokenizer* tokenizer,
                     std::vector<int32_t> eos_ids)
    : model_(model),
      tokenizer_(tokenizer),
      eos_ids_(std::move(eos_ids)),
      reduce_logits_(ReduceLogitsWhereTheyLie(model)) {}

absl::Status Generator::Validate(const GenerationRequest& request,
                                 size_t index) const {
  const int32_t max_len = model_.config().max_position_embeddings;
  const int32_t vocab = model_.config().vocab_size;
  const std::string where = absl::StrCat("requests[", index, "].");
  const int64_t prompt = request.prompt_ids.size();
  if (prompt < 1 || prompt >= max_len) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "prompt_ids must have 1 to ", max_len - 1,
                     " tokens, got ", prompt));
  }
  for (int32_t id : request.prompt_ids) {
    if (id < 0 || id >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "prompt_ids must be in [0, ", vocab, "), got ", id));
    }
  }
  MOH_RETURN_IF_ERROR(
      ValidateSamplingParams(request.sampling, max_len - prompt));
  if (!request.sampling.stop.empty() && tokenizer_ == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "sampling.stop needs a model with a tokenizer"));
  }
  return ValidateRatio(request.ratio, (where + "ratio").c_str());
}

absl::StatusOr<std::vector<GenerationResult>> Generator::Generate(
    const std::vector<GenerationRequest>& requests,
    const ChunkCallback& on_chunk) const {
  if (requests.empty()) return std::vector<GenerationResult>();
  int64_t max_len = 0, width = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    MOH_RETURN_IF_ERROR(Validate(requests[i], i));
    const int64_t prompt = requests[i].prompt_ids.size();
    width = std::max(width, prompt);
    max_len = std::max<int64_t>(max_len,
                                prompt + requests[i].sampling.max_new_tokens);
  }
  const int64_t n = requests.size();
  KvCache cache = model_.CreateKvCache(n, max_len);
  std::vector<Row> rows;
  rows.reserve(n);
  for (const GenerationRequest& r : requests) {
    rows.emplace_back(r, model_.config().moh, tokenizer_, eos_ids_);
  }

  // Prefill every prompt in one padded batch.
  DecoderBatch batch;
  batch.token_ids = at::zeros({n, width}, at::kLong);
  auto ids = batch.token_ids.accessor<int64_t, 2>();
  for (int64_t b = 0; b < n; ++b) {
    const auto& prompt = requests[b].prompt_ids;
    for (size_t t = 0; t < prompt.size(); ++t) ids[b][t] = prompt[t];
    batch.num_tokens.push_back(prompt.size());
    batch.slots.push_back(b);
    batch.start_positions.push_back(0);
    batch.top_k.push_back(rows[b].top_k);
    rows[b].result.prompt_tokens = prompt.size();
  }
  std::vector<int64_t> active(n);
  for (int64_t b = 0; b < n; ++b) active[b] = b;

  while (!active.empty()) {
    std::vector<SequenceOutput*> outputs;
    for (int64_t b : active) outputs.push_back(&rows[b].output);
    StepDraws draws(std::move(outputs), model_.config().vocab_size,
                    reduce_logits_, batch);
    MOH_ASSIGN_OR_RETURN(DecoderOutput out, model_.Forward(batch, cache));
    {
      // The host's phases, named for the profiler (as LlamaModel::Forward's).
      RECORD_USER_SCOPE("moh::sample");
      at::Tensor logits = out.logits.cpu();
      // [rows, L, H]: each row's counts added where they lie (no tensor op
      // per row).
      const at::Tensor counts =
          out.head_token_counts.to(at::kCPU, at::kLong).contiguous();
      const int64_t pairs =
          counts.numel() / std::max<int64_t>(counts.size(0), 1);
      std::vector<int64_t> still_active;
      for (size_t i = 0; i < active.size(); ++i) {
        Row& row = rows[active[i]];
        GenerationResult& result = row.result;
        if (!result.head_token_counts.defined()) {
          result.head_token_counts =
              at::zeros(counts.sizes().slice(1), at::kLong);
        }
        const int64_t* add = counts.data_ptr<int64_t>() + i * pairs;
        int64_t* total = result.head_token_counts.data_ptr<int64_t>();
        for (int64_t k = 0; k < pairs; ++k) total[k] += add[k];
        const int64_t whole = draws.whole_row(i);
        StepDraws::From from;
        MOH_ASSIGN_OR_RETURN(
            GenerationChunk chunk,
            draws.Next(i, out, whole >= 0 ? logits[whole] : at::Tensor(),
                       &from));
        result.token_ids.insert(result.token_ids.end(), chunk.token_ids.begin(),
                                chunk.token_ids.end());
        result.text += chunk.text;
        result.logprobs.insert(result.logprobs.end(), chunk.logprobs.begin(),
                               chunk.logprobs.end());
        if (row.output.finish_reason()) {
          result.finish_reason = *row.output.finish_reason();
        }
        if (on_chunk) on_chunk(active[i], chunk);
        if (!row.output.finish_reason()) still_active.push_back(active[i]);
      }
      active = std::move(still_active);
    }
    if (active.empty()) break;
    // Next decode step: one new token per running row.
    RECORD_USER_SCOPE("moh::build_batch");
    const int64_t a = active.size();
    batch = DecoderBatch();
    batch.token_ids = at::empty({a, 1}, at::kLong);
    int64_t* next_ids = batch.token_ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < a; ++i) {
      const Row& row = rows[active[i]];
      next_ids[i] = row.output.history().back();
      batch.num_tokens.push_back(1);
      batch.slots.push_back(active[i]);
      batch.start_positions.push_back(row.output.history().size() - 1);
      batch.top_k.push_back(row.top_k);
    }
  }

  std::vector<GenerationResult> results;
  results.reserve(n);
  for (Row& row : rows) {
    // Every prompt token and every generated token but the last was processed.
    const int64_t processed =
        row.result.prompt_tokens + row.result.token_ids.size() - 1;
    row.result.effective_ratio =
        EffectiveRatio(row.result.head_token_counts, processed);
    results.push_back(std::move(row.result));
  }
  return results;
}

absl::StatusOr<LabelScores> ScoreLabels(
    const LlamaModel& model, const std::vector<int32_t>& context_ids,
    const std::vector<std::vector<int32_t>>& label_ids, float ratio) {
  MOH_RETURN_IF_ERROR(ValidateRatio(ratio, "ratio"));
  return ScoreLabels(model, context_ids, label_ids,
                     Activation::AtRatio(model.config().moh, ratio));
}

absl::StatusOr<LabelScores> ScoreLabels(
    const LlamaModel& model, const std::vector<int32_t>& context_ids,
    const std::vector<std::vector<int32_t>>& label_ids,
    const Activation& activation, int64_t max_positions) {
  if (context_ids.empty()) {
    return absl::InvalidArgumentError("text must encode to at least one token");
  }
  if (label_ids.empty()) {
    return absl::InvalidArgumentError("labels must not be empty");
  }
  const int64_t limit = max_positions > 0
                            ? max_positions
                            : int64_t{model.config().max_position_embeddings};
  const int64_t n = label_ids.size();
  int64_t width = 0;
  int64_t longest = 0;
  for (size_t i = 0; i < label_ids.size(); ++i) {
    if (label_ids[i].empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("labels[", i, "] must encode to at least one token"));
    }
    width = std::max<int64_t>(width, context_ids.size() + label_ids[i].size());
    longest = std::max<int64_t>(longest, label_ids[i].size());
  }
  if (width > limit) {
    return absl::InvalidArgumentError(absl::StrCat(
        "text + label must fit in ", limit, " tokens, got ", width));
  }
  // Rows go through Forward in groups: a group's cache holds at most `limit`
  // positions (one sequence's worth), and its logits, kept only where a label
  // token is predicted (the last longest label + 1 positions of each row),
  // stay under kMaxLabelLogitsBytes.
  const int64_t tail = longest + 1;
  const int64_t row_logits_bytes =
      tail * int64_t{model.config().vocab_size} * 4;
  if (row_logits_bytes > kMaxLabelLogitsBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("labels: a label of ", longest, " tokens needs ",
                     row_logits_bytes >> 20, " MiB of logits; at most ",
                     kMaxLabelLogitsBytes >> 20, " MiB (send shorter labels)"));
  }
  const int64_t group = std::max<int64_t>(
      1, std::min({n, limit / width, kMaxLabelLogitsBytes / row_logits_bytes}));
  LabelScores scores;
  const int64_t context = context_ids.size();
  for (int64_t begin = 0; begin < n; begin += group) {
    const int64_t rows = std::min(group, n - begin);
    DecoderBatch batch;
    batch.token_ids = at::zeros({rows, width}, at::kLong);
    batch.logits_tail = static_cast<int32_t>(tail);
    auto ids = batch.token_ids.accessor<int64_t, 2>();
    for (int64_t b = 0; b < rows; ++b) {
      int64_t t = 0;
      for (int32_t id : context_ids) ids[b][t++] = id;
      for (int32_t id : label_ids[begin + b]) ids[b][t++] = id;
      batch.num_tokens.push_back(t);
      batch.slots.push_back(b);
      batch.start_positions.push_back(0);
      batch.top_k.push_back(activation.top_k());
    }
    KvCache cache = model.CreateKvCache(rows, width);
    MOH_ASSIGN_OR_RETURN(DecoderOutput out, model.Forward(batch, cache));
    // [rows, tail, V]: row b's position p sits at p - (row length - tail).
    at::Tensor log_probs = at::log_softmax(out.logits, -1).cpu();
    at::Tensor counts = out.head_token_counts.sum(0);
    scores.head_token_counts = scores.head_token_counts.defined()
                                   ? scores.head_token_counts + counts
                                   : counts;
    for (int64_t b = 0; b < rows; ++b) {
      const std::vector<int32_t>& label = label_ids[begin + b];
      const int64_t m = label.size();
      const int64_t first = tail - 1 - m;  // where position context - 1 sits
      double total = 0;
      for (int64_t j = 0; j < m; ++j) {
        // The token at position context + j is predicted at position
        // context + j - 1.
        total += log_probs[b][first + j][label[j]].item<float>();
      }
      scores.log_likelihoods.push_back(total);
      scores.tokens += context + m;
    }
  }
  return scores;
}

}  // namespace moh
