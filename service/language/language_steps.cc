#include "service/language/language_steps.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <array>
#include <exception>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/env.h"
#include "base/status_macros.h"
#include "model/core/device_context.h"
#include "model/core/runtime.h"
#include "model/tokenizer/tokenizer.h"

namespace moh {
namespace {

// The metrics' name for how a row drew.
SampledFrom Sampled(StepDraws::From from) {
  switch (from) {
    case StepDraws::From::kReduced:
      return SampledFrom::kReduced;
    case StepDraws::From::kWhole:
      return SampledFrom::kWhole;
    case StepDraws::From::kReducedThenWhole:
      break;
  }
  return SampledFrom::kReducedThenWhole;
}

// Tests only: faults a GPU can have and the CPU never does, injected into
// every language model's steps. With $MOH_TEST_DEVICE_LOST_AFTER_STEPS=N each
// step after the first N fails as one on a lost device would; with
// $MOH_TEST_OUT_OF_MEMORY_AT_STEP=N step N (from 0) runs out of memory, as
// one whose activations the device cannot hold would, and with
// $MOH_TEST_OUT_OF_MEMORY_OVER_TOKENS=N every step of more than N tokens
// does, as on a device with room for N tokens' activations. With
// $MOH_TEST_DEVICE_FAULT_AT_STEP=N a CUDA model's step N first launches a
// kernel that fails a device-side assertion (LaunchDeviceFault): a real
// sticky error, the CUDA side of a lost device; the CPU runs it as any
// other step. -1: none.
struct InjectedFaults {
  int64_t lost_after_steps = EnvInt("MOH_TEST_DEVICE_LOST_AFTER_STEPS", -1);
  int64_t device_fault_at_step = EnvInt("MOH_TEST_DEVICE_FAULT_AT_STEP", -1);
  int64_t out_of_memory_at_step = EnvInt("MOH_TEST_OUT_OF_MEMORY_AT_STEP", -1);
  int64_t out_of_memory_over_tokens =
      EnvInt("MOH_TEST_OUT_OF_MEMORY_OVER_TOKENS", -1);
};

// The language family's steps: one LlamaModel::Forward over the planned rows,
// then sampling and streaming for each row that emits.
class LanguageSteps : public StepExecutor<Sequence> {
 public:
  LanguageSteps(const LanguageModel& lm, int32_t kv_blocks,
                int32_t kv_block_size, ModelMetrics* metrics,
                CallbackThread* callbacks)
      : lm_(lm),
        callbacks_(callbacks),
        model_(*lm.model),
        metrics_(metrics),
        num_head_counters_(static_cast<size_t>(model_.config().num_layers) *
                           model_.config().num_heads),
        cache_(model_.CreateKvCache(kv_blocks, kv_block_size)),
        graph_replays_(model_.graph_replays()),
        reduce_logits_(ReduceLogitsWhereTheyLie(model_)) {}

  void Admit(Sequence& seq, const AdmittedRequest& admitted) override {
    if (admitted.lowered) {
      seq.activation = seq.activation.Lowered(model_.config().moh);
    }
    seq.output.emplace(seq.job.sampling, seq.job.prompt_ids,
                       lm_.tokenizer.get(), lm_.eos_ids, seq.job.grammar);
    seq.head_tokens.assign(num_head_counters_, 0);
  }

  absl::Status Run(const std::vector<PlannedRow>& rows,
                   const std::vector<Sequence*>& seqs,
                   std::vector<RowOutcome>* outcomes) override {
    const int64_t step = steps_++;
    undone_ = true;
    if (faults_.lost_after_steps >= 0 && step >= faults_.lost_after_steps) {
      injected_loss_ = true;
      return absl::InternalError("injected device fault");
    }
    try {
      TORCH_CHECK_WITH(OutOfMemoryError, step != faults_.out_of_memory_at_step,
                       "injected: $MOH_TEST_OUT_OF_MEMORY_AT_STEP=", step);
      const int64_t tokens = PlannedTokens(rows);
      TORCH_CHECK_WITH(OutOfMemoryError,
                       faults_.out_of_memory_over_tokens < 0 ||
                           tokens <= faults_.out_of_memory_over_tokens,
                       "injected: a step of ", tokens,
                       " tokens over $MOH_TEST_OUT_OF_MEMORY_OVER_TOKENS");
      if (step == faults_.device_fault_at_step) {
        LaunchDeviceFault(model_.options().device());
      }
      return RunUnchecked(rows, seqs, outcomes);
    } catch (const std::exception& e) {
      return StatusFromException(e);
    }
  }

  bool StepUndone() const override { return undone_; }

  void StepDone() override { callbacks_->Flush(); }

  absl::Status DeviceLost() override {
    if (injected_loss_) {
      return absl::UnavailableError(
          "device lost (injected: $MOH_TEST_DEVICE_LOST_AFTER_STEPS)");
    }
    return moh::DeviceLost(model_.options().device());
  }

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
  // One forward's rows (rows[i] of the step for i in `which`), and what it
  // computed, on the host but for what the draws read where it lies.
  struct Computed {
    std::vector<size_t> which;
    std::vector<PlannedRow> rows;
    std::vector<Sequence*> seqs;
    bool all_logits = false;
    std::optional<StepDraws> draws;
    DecoderOutput out;
    at::Tensor logits;  // float
    at::Tensor counts;  // int64, contiguous
  };

  // Rows whose prompt log-probabilities are asked for need the logits of
  // every position: they run in a forward of their own, so that the others'
  // (and their padding) never cost [rows, width, vocab] logits. Every
  // forward runs before any row takes its token: until then, the step has
  // changed nothing but keys and values that a retry writes again the same
  // (StepUndone).
  absl::Status RunUnchecked(const std::vector<PlannedRow>& rows,
                            const std::vector<Sequence*>& seqs,
                            std::vector<RowOutcome>* outcomes) {
    std::vector<size_t> last_logits, all_logits;
    for (size_t b = 0; b < rows.size(); ++b) {
      const bool all =
          rows[b].prefill && seqs[b]->job.sampling.prompt_logprobs.has_value();
      (all ? all_logits : last_logits).push_back(b);
    }
    std::vector<Computed> computed;
    for (bool all : {false, true}) {
      std::vector<size_t>& which = all ? all_logits : last_logits;
      if (which.empty()) continue;
      computed.emplace_back();
      MOH_RETURN_IF_ERROR(
          Compute(rows, seqs, std::move(which), all, computed.back()));
    }
    undone_ = false;
    RECORD_USER_SCOPE("moh::sample");
    const int64_t replays = model_.graph_replays();
    if (metrics_ != nullptr)
      metrics_->CudaGraphReplays(replays - graph_replays_);
    graph_replays_ = replays;
    for (Computed& c : computed) Apply(c, outcomes);
    return absl::OkStatus();
  }

  // The forward of `c`'s rows, and the downloads of its results.
  absl::Status Compute(const std::vector<PlannedRow>& all_rows,
                       const std::vector<Sequence*>& all_seqs,
                       std::vector<size_t> which, bool all_logits,
                       Computed& c) {
    c.which = std::move(which);
    c.all_logits = all_logits;
    for (size_t i : c.which) {
      c.rows.push_back(all_rows[i]);
      c.seqs.push_back(all_seqs[i]);
    }
    // The host's phases are named for the profiler (as LlamaModel's).
    DecoderBatch batch;
    {
      RECORD_USER_SCOPE("moh::build_batch");
      batch = BuildBatch(c.rows, c.seqs);
      batch.all_logits = all_logits;
      // How each row's token is chosen: from what its logits are reduced to
      // where they lie, or from its whole row, which the step returns.
      std::vector<SequenceOutput*> outputs(c.rows.size());
      for (size_t b = 0; b < c.rows.size(); ++b) {
        if (c.rows[b].emits) outputs[b] = &*c.seqs[b]->output;
      }
      c.draws.emplace(std::move(outputs), model_.config().vocab_size,
                      reduce_logits_ && !all_logits, batch);
    }
    MOH_ASSIGN_OR_RETURN(c.out, model_.Forward(batch, cache_));
    RECORD_USER_SCOPE("moh::sample");
    c.logits = c.out.logits.to(at::kCPU, at::kFloat);
    c.counts = c.out.head_token_counts.to(at::kCPU, at::kLong).contiguous();
    return absl::OkStatus();
  }

  // What `c`'s rows come to: counts, tokens drawn and streamed.
  void Apply(Computed& c, std::vector<RowOutcome>* outcomes) {
    const int64_t* count_data = c.counts.data_ptr<int64_t>();
    std::array<int64_t, 3> sampled{};  // tokens by SampledFrom
    for (size_t b = 0; b < c.rows.size(); ++b) {
      const PlannedRow& row = c.rows[b];
      Sequence& seq = *c.seqs[b];
      RowOutcome& outcome = (*outcomes)[c.which[b]];
      const int64_t* row_counts = count_data + b * num_head_counters_;
      for (size_t k = 0; k < num_head_counters_; ++k) {
        seq.head_tokens[k] += row_counts[k];
      }
      seq.processed += row.num_tokens;
      if (row.prefill && metrics_ != nullptr) {
        metrics_->PromptTokens(row.num_tokens);
      }
      const int64_t whole_row = c.draws->whole_row(b);
      if (c.all_logits) AddPromptLogprobs(row, c.logits[whole_row], seq);
      if (!row.emits) continue;  // mid-prompt chunk
      // A row that cannot sample or decode fails alone; its batch goes on.
      at::Tensor whole;
      if (whole_row >= 0) {
        whole = c.all_logits ? c.logits[whole_row][row.num_tokens - 1]
                             : c.logits[whole_row];
      }
      StepDraws::From from;
      absl::StatusOr<GenerationChunk> next =
          c.draws->Next(b, c.out, whole, &from);
      if (next.ok()) ++sampled[static_cast<int>(Sampled(from))];
      outcome.error = Emit(seq, std::move(next));
      if (outcome.error.ok()) outcome.token = seq.output->history().back();
      outcome.finished = seq.output->finish_reason().has_value();
    }
    if (metrics_ != nullptr) {
      for (const SampledFrom from : {SampledFrom::kReduced, SampledFrom::kWhole,
                                     SampledFrom::kReducedThenWhole}) {
        metrics_->SampledTokens(from, sampled[static_cast<int>(from)]);
      }
    }
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
      batch.narrow.push_back(seqs[b]->narrow);
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

  // Streams `next`, the chunk of the token seq.output has just taken (or
  // its error).
  absl::Status Emit(Sequence& seq, absl::StatusOr<GenerationChunk> next) {
    const bool first = seq.output->generated() == 1;  // the first token
    MOH_ASSIGN_OR_RETURN(GenerationChunk chunk, std::move(next));
    if (first && seq.job.sampling.prompt_logprobs) {
      chunk.prompt_logprobs = std::move(seq.prompt_logprobs);
      chunk.prompt_token_ids = seq.job.prompt_ids;
    }
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
  int64_t graph_replays_;  // the model's count after the last step
  // Rows draw from their logits reduced where they lie (StepDraws): on a
  // GPU, and on the CPU when MOH_REDUCE_LOGITS=1 (tests).
  const bool reduce_logits_;
  // The faults tests inject, the steps run, and whether the injected loss
  // happened.
  const InjectedFaults faults_;
  int64_t steps_ = 0;
  bool injected_loss_ = false;
  // Whether the last step, failing, left its rows as they were: it failed
  // before any row took its token.
  bool undone_ = false;
};

}  // namespace

std::unique_ptr<StepExecutor<Sequence>> NewLanguageSteps(
    const LanguageModel& lm, int32_t kv_blocks, int32_t kv_block_size,
    ModelMetrics* metrics, CallbackThread* callbacks) {
  return std::make_unique<LanguageSteps>(lm, kv_blocks, kv_block_size, metrics,
                                         callbacks);
}

}  // namespace moh
