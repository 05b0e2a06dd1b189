#include "service/language/language_executor.h"

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "base/field_error.h"
#include "base/status_macros.h"
#include "model/core/activation.h"
#include "model/tokenizer/tokenizer.h"
#include "service/engine/callback_thread.h"
#include "service/engine/engine_loop.h"

namespace moh {
namespace {

// A job's observer, called on the executor's callback thread: each call is
// queued there (with a copy of its argument) and runs after the step.
class DeliveredObserver : public GenerationObserver {
 public:
  DeliveredObserver(std::shared_ptr<GenerationObserver> target,
                    CallbackThread* thread)
      : target_(std::move(target)), thread_(thread) {}
  void OnChunk(const GenerationChunk& chunk) override {
    thread_->Post([target = target_, chunk] { target->OnChunk(chunk); });
  }
  void OnFinished(const GenerationSummary& summary) override {
    thread_->Post([target = target_, summary] { target->OnFinished(summary); });
  }
  void OnError(const absl::Status& status) override {
    thread_->Post([target = target_, status] { target->OnError(status); });
  }

 private:
  const std::shared_ptr<GenerationObserver> target_;
  CallbackThread* const thread_;
};

// The samples of one job with n > 1 share its observer: each reports
// through a SampleObserver, which numbers its output, and forwards one error
// (cancelling the other samples) or every sample's end (the last one marked).
// Loop thread only.
struct SampleGroup {
  std::shared_ptr<GenerationObserver> observer;
  int32_t live;                  // samples that have not ended
  bool failed = false;           // OnError was forwarded
  std::function<void()> cancel;  // cancels every sample
};

class SampleObserver : public GenerationObserver {
 public:
  SampleObserver(std::shared_ptr<SampleGroup> group, int32_t index)
      : group_(std::move(group)), index_(index) {}
  void OnChunk(const GenerationChunk& chunk) override {
    if (group_->failed) return;
    GenerationChunk numbered = chunk;
    numbered.index = index_;
    group_->observer->OnChunk(numbered);
  }
  void OnFinished(const GenerationSummary& summary) override {
    const bool last = --group_->live == 0;
    if (group_->failed) return;
    GenerationSummary numbered = summary;
    numbered.index = index_;
    numbered.last = last;
    group_->observer->OnFinished(numbered);
  }
  void OnError(const absl::Status& status) override {
    --group_->live;
    if (group_->failed) return;
    group_->failed = true;
    group_->observer->OnError(status);
    group_->cancel();
  }

 private:
  const std::shared_ptr<SampleGroup> group_;
  const int32_t index_;
};

// One Generate sample inside the loop. Owned by the loop thread.
struct Sequence {
  GenerationJob job;
  Activation activation;  // resolved at Submit; lowered at admission
  std::shared_ptr<GenerationObserver> observer;
  absl::Time submit_time;
  std::optional<SequenceOutput> output;  // sampling, stop strings, text
  int64_t processed = 0;                 // tokens run through the model
  std::vector<int64_t> head_tokens;      // [L * H]
  absl::Time last_token_time;
  // With job.sampling.prompt_logprobs: entries computed so far, delivered
  // with the first chunk.
  std::vector<LogprobEntry> prompt_logprobs;
};

// The language family's steps: one LlamaModel::Forward over the planned rows,
// then sampling and streaming for each row that emits.
class LanguageSteps : public StepExecutor<Sequence> {
 public:
  LanguageSteps(const LanguageExecutor::Options& options,
                const LanguageModel& lm, ModelMetrics* metrics,
                CallbackThread* callbacks)
      : lm_(lm),
        callbacks_(callbacks),
        model_(*lm.model),
        metrics_(metrics),
        num_head_counters_(static_cast<size_t>(model_.config().num_layers) *
                           model_.config().num_heads),
        cache_(model_.CreateKvCache(options.kv_blocks, options.kv_block_size)) {
  }

  void Admit(Sequence& seq, const AdmittedRequest& admitted) override {
    if (admitted.lowered) {
      seq.activation = seq.activation.Lowered(model_.config().moh);
    }
    seq.output.emplace(seq.job.sampling, seq.job.prompt_ids,
                       lm_.tokenizer.get(), lm_.eos_ids);
    seq.head_tokens.assign(num_head_counters_, 0);
  }

  absl::Status Run(const std::vector<PlannedRow>& rows,
                   const std::vector<Sequence*>& seqs,
                   std::vector<RowOutcome>* outcomes) override {
    try {
      return RunUnchecked(rows, seqs, outcomes);
    } catch (const std::exception& e) {
      return absl::InternalError(e.what());
    }
  }

  void StepDone() override { callbacks_->Flush(); }

  void End(Sequence& seq, EndKind kind, const absl::Status& status) override {
    if (kind == EndKind::kFailed) {
      seq.observer->OnError(status);
      return;
    }
    GenerationSummary summary = Summarize(seq);
    if (kind == EndKind::kCancelled) {
      summary.finish_reason = FinishReason::kCancelled;
    }
    if (metrics_ != nullptr && seq.processed > 0) {
      metrics_->ActivationRatio(summary.effective_ratio);
      metrics_->HeadTokens(summary.head_tokens);
    }
    seq.observer->OnFinished(summary);
  }

 private:
  // Rows whose prompt log-probabilities are asked for need the logits of
  // every position: they run in a forward of their own, so that the others'
  // (and their padding) never cost [rows, width, vocab] logits.
  absl::Status RunUnchecked(const std::vector<PlannedRow>& rows,
                            const std::vector<Sequence*>& seqs,
                            std::vector<RowOutcome>* outcomes) {
    std::vector<size_t> last_logits, all_logits;
    for (size_t b = 0; b < rows.size(); ++b) {
      const bool all =
          rows[b].prefill && seqs[b]->job.sampling.prompt_logprobs.has_value();
      (all ? all_logits : last_logits).push_back(b);
    }
    if (!last_logits.empty()) {
      MOH_RETURN_IF_ERROR(RunRows(rows, seqs, last_logits, false, outcomes));
    }
    if (!all_logits.empty()) {
      MOH_RETURN_IF_ERROR(RunRows(rows, seqs, all_logits, true, outcomes));
    }
    return absl::OkStatus();
  }

  // One forward over rows[i] for i in `which`.
  absl::Status RunRows(const std::vector<PlannedRow>& all_rows,
                       const std::vector<Sequence*>& all_seqs,
                       const std::vector<size_t>& which, bool all_logits,
                       std::vector<RowOutcome>* outcomes) {
    std::vector<PlannedRow> rows;
    std::vector<Sequence*> seqs;
    for (size_t i : which) {
      rows.push_back(all_rows[i]);
      seqs.push_back(all_seqs[i]);
    }
    DecoderBatch batch = BuildBatch(rows, seqs);
    batch.all_logits = all_logits;
    MOH_ASSIGN_OR_RETURN(DecoderOutput out, model_.Forward(batch, cache_));
    const at::Tensor logits = out.logits.to(at::kCPU, at::kFloat);
    const at::Tensor counts =
        out.head_token_counts.to(at::kCPU, at::kLong).contiguous();
    const int64_t* count_data = counts.data_ptr<int64_t>();
    for (size_t b = 0; b < rows.size(); ++b) {
      Sequence& seq = *seqs[b];
      RowOutcome& outcome = (*outcomes)[which[b]];
      const int64_t* row_counts = count_data + b * num_head_counters_;
      for (size_t k = 0; k < num_head_counters_; ++k) {
        seq.head_tokens[k] += row_counts[k];
      }
      seq.processed += rows[b].num_tokens;
      if (rows[b].prefill && metrics_ != nullptr) {
        metrics_->PromptTokens(rows[b].num_tokens);
      }
      if (all_logits) AddPromptLogprobs(rows[b], logits[b], seq);
      if (!rows[b].emits) continue;  // mid-prompt chunk
      // A row that cannot sample or decode fails alone; its batch goes on.
      outcome.error = SampleAndEmit(
          seq, all_logits ? logits[b][rows[b].num_tokens - 1] : logits[b]);
      if (outcome.error.ok()) outcome.token = seq.output->history().back();
      outcome.finished = seq.output->finish_reason().has_value();
    }
    return absl::OkStatus();
  }

  DecoderBatch BuildBatch(const std::vector<PlannedRow>& rows,
                          const std::vector<Sequence*>& seqs) const {
    int64_t width = 0;
    for (const PlannedRow& row : rows) {
      width = std::max<int64_t>(width, row.num_tokens);
    }
    DecoderBatch batch;
    batch.token_ids = at::zeros({static_cast<int64_t>(rows.size()), width},
                                at::kLong);  // right-padded
    auto ids = batch.token_ids.accessor<int64_t, 2>();
    for (size_t b = 0; b < rows.size(); ++b) {
      const std::vector<int32_t>& history = seqs[b]->output->history();
      for (int32_t t = 0; t < rows[b].num_tokens; ++t) {
        ids[b][t] = history[rows[b].start + t];
      }
      batch.num_tokens.push_back(rows[b].num_tokens);
      batch.block_tables.push_back(rows[b].blocks);
      batch.start_positions.push_back(rows[b].start);
      batch.top_k.push_back(seqs[b]->activation.top_k());
    }
    return batch;
  }

  // The entries of the prompt tokens `row` (a prompt chunk) predicts: its
  // position i's logits ([T, V]) are those of prompt token start + i + 1.
  void AddPromptLogprobs(const PlannedRow& row, const at::Tensor& logits,
                         Sequence& seq) const {
    const std::vector<int32_t>& prompt = seq.job.prompt_ids;
    for (int32_t i = 0; i < row.num_tokens; ++i) {
      const size_t next = static_cast<size_t>(row.start) + i + 1;
      if (next >= prompt.size()) break;
      seq.prompt_logprobs.push_back(ComputeLogprobs(
          logits[i], prompt[next], *seq.job.sampling.prompt_logprobs));
    }
  }

  // Samples the next token of `seq` from its logits and streams it.
  absl::Status SampleAndEmit(Sequence& seq, const at::Tensor& logits) {
    const bool first = seq.output->generated() == 0;
    MOH_ASSIGN_OR_RETURN(GenerationChunk chunk, seq.output->Next(logits));
    if (first) chunk.prompt_logprobs = std::move(seq.prompt_logprobs);
    const absl::Time now = absl::Now();
    if (metrics_ != nullptr) {
      if (first) {
        metrics_->TimeToFirstToken(now - seq.submit_time);
      } else {
        metrics_->InterTokenLatency(now - seq.last_token_time);
      }
      metrics_->GeneratedTokens(1);
    }
    seq.last_token_time = now;
    // Every sampled id is streamed at once, even when its text is held back.
    seq.observer->OnChunk(chunk);
    return absl::OkStatus();
  }

  GenerationSummary Summarize(const Sequence& seq) const {
    GenerationSummary summary;
    if (seq.output.has_value() && seq.output->finish_reason()) {
      summary.finish_reason = *seq.output->finish_reason();
    }
    summary.prompt_tokens = seq.job.prompt_ids.size();
    summary.completion_tokens =
        seq.output.has_value() ? seq.output->generated() : 0;
    summary.applied_ratio = static_cast<float>(seq.activation.nominal_ratio());
    summary.routed_tokens = seq.processed;
    summary.head_tokens = seq.head_tokens;
    summary.head_tokens.resize(num_head_counters_, 0);
    std::vector<int64_t> counts = summary.head_tokens;
    summary.effective_ratio = EffectiveRatio(
        at::from_blob(counts.data(),
                      {model_.config().num_layers, model_.config().num_heads},
                      at::kLong),
        seq.processed);
    return summary;
  }

  const LanguageModel& lm_;
  CallbackThread* const callbacks_;
  const LlamaModel& model_;
  ModelMetrics* const metrics_;
  const size_t num_head_counters_;
  KvCache cache_;
};

}  // namespace

class LanguageExecutor::Impl {
 public:
  Impl(const Options& options, const LanguageModel& lm, ModelMetrics* metrics)
      : options_(options),
        lm_(lm),
        callbacks_("moh-out-" + options.model_name),
        steps_(options, lm, metrics, &callbacks_),
        loop_(LoopOptions(options), &steps_, metrics) {}

  absl::StatusOr<uint64_t> Submit(
      GenerationJob job, std::shared_ptr<GenerationObserver> observer) {
    if (observer == nullptr) {
      return absl::InvalidArgumentError("observer must not be null");
    }
    MOH_ASSIGN_OR_RETURN(Activation activation, Validate(job));
    observer =
        std::make_shared<DeliveredObserver>(std::move(observer), &callbacks_);
    PlannedWork work;
    work.prompt_len = job.prompt_ids.size();
    work.max_outputs = job.sampling.max_new_tokens;
    work.deadline = job.deadline;
    work.can_lower = activation.CanLower();
    work.priority = job.priority;
    if (options_.prefix_caching) {
      // The KV of a prompt depends on the heads every layer routed: its
      // blocks are shared under the key of the activation that computed it.
      work.prompt_tokens = job.prompt_ids;
      work.prefix_key = absl::HashOf(activation.top_k());
      work.lowered_prefix_key =
          absl::HashOf(activation.Lowered(lm_.model->config().moh).top_k());
      // Cached positions have no logits.
      work.read_prefix = !job.sampling.prompt_logprobs;
    }
    const absl::Time now = absl::Now();
    if (job.n == 1) {
      return loop_.Submit(work, std::make_unique<Sequence>(Sequence{
                                    std::move(job), std::move(activation),
                                    std::move(observer), now}));
    }
    auto group = std::make_shared<SampleGroup>();
    group->observer = std::move(observer);
    group->live = job.n;
    std::vector<std::unique_ptr<Sequence>> samples;
    for (int32_t i = 0; i < job.n; ++i) {
      GenerationJob sample = job;
      if (sample.sampling.seed) *sample.sampling.seed += i;
      // The prompt's log-probabilities come once, with sample 0.
      if (i > 0) sample.sampling.prompt_logprobs.reset();
      samples.push_back(std::make_unique<Sequence>(
          Sequence{std::move(sample), activation,
                   std::make_shared<SampleObserver>(group, i), now}));
    }
    return loop_.SubmitGroup(work, std::move(samples), [&](uint64_t id) {
      group->cancel = [this, id] { loop_.Cancel(id); };
    });
  }

  EngineLoop<Sequence>& loop() { return loop_; }
  const EngineLoop<Sequence>& loop() const { return loop_; }
  int32_t max_seq_len() const { return options_.max_seq_len; }
  const Options& options() const { return options_; }

 private:
  static EngineLoopOptions LoopOptions(const Options& options) {
    EngineLoopOptions loop;
    loop.name = options.model_name;
    loop.rpc = Rpc::kGenerate;
    loop.planner.max_running = options.max_running;
    loop.planner.max_seq_len = options.max_seq_len;
    loop.planner.max_queued_requests = options.max_queued_requests;
    loop.planner.prefill_token_budget = options.prefill_token_budget;
    loop.planner.adaptive_queue_depth = options.adaptive_queue_depth;
    loop.planner.kv_blocks = options.kv_blocks;
    loop.planner.kv_block_size = options.kv_block_size;
    loop.planner.prefix_caching = options.prefix_caching;
    loop.idle_gather = options.idle_gather;
    return loop;
  }

  // INVALID_ARGUMENT naming the field and its range; else the job's
  // activation, resolved against the model.
  absl::StatusOr<Activation> Validate(const GenerationJob& job) const;

  const Options options_;
  const LanguageModel& lm_;
  // Before the loop: destroyed after it, running the observers' calls of
  // its last steps and of its shutdown.
  CallbackThread callbacks_;
  LanguageSteps steps_;
  EngineLoop<Sequence> loop_;  // last: stopped first
};

absl::StatusOr<Activation> LanguageExecutor::Impl::Validate(
    const GenerationJob& job) const {
  const LlamaConfig& config = lm_.model->config();
  const int32_t max_len = options_.max_seq_len;
  const int64_t prompt = job.prompt_ids.size();
  if (prompt < 1 || prompt >= max_len) {
    return FieldError(
        "prompt (or token_ids)",
        absl::StrCat("must have 1 to ", max_len - 1, " tokens, got ", prompt));
  }
  for (int32_t id : job.prompt_ids) {
    if (id < 0 || id >= config.vocab_size) {
      return FieldError(
          "token_ids",
          absl::StrCat("must be in [0, ", config.vocab_size, "), got ", id));
    }
  }
  if (job.sampling.max_new_tokens > max_len - prompt) {
    return FieldError("sampling.max_new_tokens",
                      absl::StrCat("must be in [1, ", max_len - prompt,
                                   "] (with the prompt's ", prompt,
                                   " tokens, at most max_seq_len ", max_len,
                                   "), got ", job.sampling.max_new_tokens));
  }
  MOH_RETURN_IF_ERROR(ValidateSamplingParams(job.sampling, max_len - prompt));
  if (job.n < 1 || job.n > kMaxSamples) {
    return FieldError(
        "n", absl::StrCat("must be in [1, ", kMaxSamples, "], got ", job.n));
  }
  if (job.priority < -kMaxPriority || job.priority > kMaxPriority) {
    return FieldError("priority",
                      absl::StrCat("must be in [", -kMaxPriority, ", ",
                                   kMaxPriority, "], got ", job.priority));
  }
  for (int32_t id : job.sampling.stop_token_ids) {
    if (id >= config.vocab_size) {
      return FieldError(
          "sampling.stop_token_ids",
          absl::StrCat("must be in [0, ", config.vocab_size, "), got ", id));
    }
  }
  if (!job.sampling.stop.empty() && lm_.tokenizer == nullptr) {
    return FieldError("sampling.stop", "needs a model with a tokenizer");
  }
  return Activation::Resolve(config.moh, job.ratio, job.min_ratio);
}

absl::StatusOr<std::unique_ptr<LanguageExecutor>> LanguageExecutor::Create(
    const Options& options, const LanguageModel& model, ModelMetrics* metrics) {
  if (model.model == nullptr) {
    return absl::InvalidArgumentError("the language model is not loaded");
  }
  const int32_t model_max = model.model->config().max_position_embeddings;
  Options resolved = options;
  resolved.max_seq_len =
      config_limits::ResolveMaxSeqLen(options.max_seq_len, model_max);
  namespace limits = config_limits;
  resolved.kv_block_size =
      limits::ResolveKvBlockSize(options.kv_block_size, resolved.max_seq_len);
  const int64_t blocks_per_sequence =
      limits::KvBlocksFor(resolved.max_seq_len, resolved.kv_block_size);
  const int64_t kv_blocks =
      limits::ResolveKvBlocks(options.kv_blocks, options.max_running,
                              resolved.max_seq_len, resolved.kv_block_size);
  resolved.kv_blocks =
      static_cast<int32_t>(std::min<int64_t>(kv_blocks, limits::kMaxKvBlocks));
  const struct {
    const char* name;
    int64_t value, min, max;
  } checks[] = {
      {"max_seq_len", resolved.max_seq_len, limits::kMinSeqLen, model_max},
      {"max_running", options.max_running, limits::kMaxRunning.min,
       limits::kMaxRunning.max},
      {"max_queued_requests", options.max_queued_requests,
       limits::kGenerationMaxQueuedRequests.min, INT32_MAX},
      {"prefill_token_budget", options.prefill_token_budget,
       limits::kPrefillTokenBudget.min, INT32_MAX},
      {"adaptive_queue_depth", options.adaptive_queue_depth,
       limits::kMinAdaptiveQueueDepth, INT32_MAX},
      {"idle_gather_us", absl::ToInt64Microseconds(options.idle_gather),
       limits::kIdleGatherUs.min, limits::kIdleGatherUs.max},
      {"kv_block_size", options.kv_block_size, limits::kKvBlockSize.min,
       limits::kKvBlockSize.max},
      // One sequence of max_seq_len must fit.
      {"kv_blocks", kv_blocks, blocks_per_sequence, limits::kMaxKvBlocks},
  };
  for (const auto& c : checks) {
    if (c.value < c.min || c.value > c.max) {
      return absl::InvalidArgumentError(absl::StrCat(
          c.name, " must be in [", c.min, ", ", c.max, "], got ", c.value));
    }
  }
  std::unique_ptr<Impl> impl;
  try {
    impl = std::make_unique<Impl>(resolved, model, metrics);
  } catch (const std::exception& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate the KV cache: ", e.what()));
  }
  return std::unique_ptr<LanguageExecutor>(
      new LanguageExecutor(std::move(impl)));
}

LanguageExecutor::LanguageExecutor(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}

LanguageExecutor::~LanguageExecutor() = default;

absl::StatusOr<uint64_t> LanguageExecutor::Submit(
    GenerationJob job, std::shared_ptr<GenerationObserver> observer) {
  return impl_->Submit(std::move(job), std::move(observer));
}

void LanguageExecutor::Cancel(uint64_t id) { impl_->loop().Cancel(id); }

void LanguageExecutor::StopAccepting() { impl_->loop().StopAccepting(); }

int64_t LanguageExecutor::num_running() const {
  return impl_->loop().num_running();
}

int64_t LanguageExecutor::num_waiting() const {
  return impl_->loop().num_waiting();
}

bool LanguageExecutor::idle() const { return impl_->loop().idle(); }

int32_t LanguageExecutor::max_seq_len() const { return impl_->max_seq_len(); }

const LanguageExecutor::Options& LanguageExecutor::options() const {
  return impl_->options();
}

}  // namespace moh
