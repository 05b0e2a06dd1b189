#include "service/continuous_batch_scheduler.h"

#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <exception>
#include <optional>
#include <thread>
#include <unordered_set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "model/status_macros.h"
#include "model/tokenizer.h"
#include "service/draining.h"

namespace moh {
namespace {

constexpr int32_t kDefaultMaxSeqLenCap = 4096;
constexpr int32_t kMaxRunningLimit = 4096;

// A job accepted by Submit, not yet holding a slot.
struct QueuedJob {
  uint64_t id = 0;
  GenerationJob job;
  std::shared_ptr<GenerationObserver> observer;
  absl::Time submit_time;
};

// A queued job that leaves without ever being computed.
struct RejectedJob {
  QueuedJob job;
  absl::Status status;  // OK: cancelled (OnFinished kCancelled)
};

enum class SlotState {
  kIdle,        // no sequence
  kPrefilling,  // prompt not fully in the KV cache
  kGenerating,  // prompt cached; one decode token per step
  kDone,        // finished this step; released at the end of it
};

// A sequence holding a KV-cache slot. Owned by the loop thread.
struct Sequence {
  Sequence(QueuedJob queued, float ratio, const Tokenizer* tokenizer,
           const std::vector<int32_t>& eos_ids, size_t num_head_counters)
      : id(queued.id),
        job(std::move(queued.job)),
        observer(std::move(queued.observer)),
        submit_time(queued.submit_time),
        applied_ratio(ratio),
        output(job.sampling, job.prompt_ids, tokenizer, eos_ids),
        head_tokens(num_head_counters, 0) {}

  int32_t prompt_len() const { return job.prompt_ids.size(); }
  // KV positions reserved at admission: the most this sequence can fill.
  int64_t reserved() const {
    return prompt_len() + job.sampling.max_new_tokens;
  }

  uint64_t id;
  GenerationJob job;
  std::shared_ptr<GenerationObserver> observer;
  absl::Time submit_time;
  float applied_ratio;
  SequenceOutput output;             // sampling, stop strings, text
  int32_t cached = 0;                // positions filled in the KV cache
  int64_t processed = 0;             // tokens run through the model
  std::vector<int64_t> head_tokens;  // [L * H]
  absl::Time last_token_time;
  bool finished = false;  // finish_reason is set
  FinishReason finish_reason = FinishReason::kLength;
};

struct Slot {
  SlotState state = SlotState::kIdle;
  std::unique_ptr<Sequence> seq;
};

// One row of a step's batch.
struct BatchRow {
  int slot;
  int32_t num_tokens;
  bool prefill;
};

}  // namespace

class ContinuousBatchScheduler::Impl {
 public:
  Impl(const Options& options, const LanguageModel& lm, ModelMetrics* metrics)
      : options_(options),
        lm_(lm),
        model_(*lm.model),
        metrics_(metrics),
        default_ratio_(model_.config().moh.DefaultRatio()),
        num_head_counters_(static_cast<size_t>(model_.config().num_layers) *
                           model_.config().num_heads),
        cache_(model_.CreateKvCache(options.max_running, options.max_seq_len)),
        slots_(options.max_running) {}

  ~Impl() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      accepting_ = false;
    }
    if (thread_.joinable()) thread_.join();
  }

  void Start() {
    thread_ = std::thread([this] { Loop(); });
    const std::string name = ("moh-sched-" + options_.model_name).substr(0, 15);
    pthread_setname_np(thread_.native_handle(), name.c_str());
  }

  absl::StatusOr<uint64_t> Submit(
      GenerationJob job, std::shared_ptr<GenerationObserver> observer) {
    if (observer == nullptr) {
      return absl::InvalidArgumentError("observer must not be null");
    }
    MOH_RETURN_IF_ERROR(Validate(job));
    uint64_t id;
    {
      absl::MutexLock lock(&mu_);
      if (!accepting_) return DrainingError();
      if (static_cast<int64_t>(queue_.size()) >= options_.max_queued_requests) {
        return absl::ResourceExhaustedError(
            absl::StrCat("too many requests waiting (max_queued_requests = ",
                         options_.max_queued_requests, "); retry later"));
      }
      id = next_id_++;
      queue_.push_back(
          QueuedJob{id, std::move(job), std::move(observer), absl::Now()});
      live_.insert(id);
      // Set under the lock, as the loop does: set after it, this count could
      // land after the loop's newer one and leave the gauge stale while idle.
      if (metrics_ != nullptr) metrics_->SetWaiting(queue_.size());
    }
    return id;
  }

  void Cancel(uint64_t id) {
    absl::MutexLock lock(&mu_);
    if (live_.count(id) != 0) cancelled_.insert(id);
  }

  void StopAccepting() {
    absl::MutexLock lock(&mu_);
    accepting_ = false;
  }

  int64_t num_running() const { return num_running_.load(); }
  int64_t num_waiting() const {
    absl::MutexLock lock(&mu_);
    return queue_.size();
  }
  int32_t max_seq_len() const { return options_.max_seq_len; }

 private:
  absl::Status Validate(const GenerationJob& job) const;
  void Loop();
  // Waits for work, then drops cancelled and expired jobs and admits queued
  // ones into free slots. Returns false when the scheduler is stopping.
  bool Admit();
  // The rows of the next step: every decode, then prompt chunks.
  std::vector<BatchRow> PlanStep() const;
  DecoderBatch BuildBatch(const std::vector<BatchRow>& rows) const;
  // One model forward over the planned rows; samples and streams.
  void Step();
  // Samples the next token of `seq` from its logits and streams it.
  absl::Status SampleAndEmit(Sequence& seq, const at::Tensor& logits);
  // Frees slot `index` and returns its sequence (no longer live).
  std::unique_ptr<Sequence> Release(int index);
  void Finish(int index, FinishReason reason);
  void Fail(int index, const absl::Status& status);
  GenerationSummary Summarize(const Sequence& seq) const;
  void PublishGauges();

  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !queue_.empty();
  }
  bool AnyRunning() const {
    return std::any_of(slots_.begin(), slots_.end(), [](const Slot& s) {
      return s.state != SlotState::kIdle;
    });
  }
  float ReferenceRatio(float ratio) const {
    return ratio > 0.0f ? ratio : static_cast<float>(default_ratio_);
  }

  const Options options_;
  const LanguageModel& lm_;
  const LlamaModel& model_;
  ModelMetrics* const metrics_;
  const double default_ratio_;
  const size_t num_head_counters_;

  // Loop thread only.
  KvCache cache_;
  std::vector<Slot> slots_;

  std::atomic<int64_t> num_running_{0};
  mutable absl::Mutex mu_;
  std::deque<QueuedJob> queue_ ABSL_GUARDED_BY(mu_);
  std::unordered_set<uint64_t> live_ ABSL_GUARDED_BY(mu_);  // queued/running
  std::unordered_set<uint64_t> cancelled_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool accepting_ ABSL_GUARDED_BY(mu_) = true;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

absl::Status ContinuousBatchScheduler::Impl::Validate(
    const GenerationJob& job) const {
  const int32_t max_len = options_.max_seq_len;
  const int32_t vocab = model_.config().vocab_size;
  const int64_t prompt = job.prompt_ids.size();
  if (prompt < 1 || prompt >= max_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt (or token_ids) must have 1 to ", max_len - 1,
                     " tokens, got ", prompt));
  }
  for (int32_t id : job.prompt_ids) {
    if (id < 0 || id >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("token_ids must be in [0, ", vocab, "), got ", id));
    }
  }
  if (job.sampling.max_new_tokens > max_len - prompt) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling.max_new_tokens must be in [1, ", max_len - prompt,
        "]: prompt (", prompt, " tokens) + sampling.max_new_tokens (",
        job.sampling.max_new_tokens, ") must be <= max_seq_len ", max_len));
  }
  MOH_RETURN_IF_ERROR(ValidateSamplingParams(job.sampling, max_len - prompt));
  if (!job.sampling.stop.empty() && lm_.tokenizer == nullptr) {
    return absl::InvalidArgumentError(
        "sampling.stop needs a model with a tokenizer");
  }
  MOH_RETURN_IF_ERROR(
      ValidateActivation(job.ratio, job.min_ratio, default_ratio_));
  return absl::OkStatus();
}

void ContinuousBatchScheduler::Impl::Loop() {
  while (Admit()) {
    Step();
    PublishGauges();
  }
  const absl::Status shutdown = absl::UnavailableError("server shutting down");
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].state != SlotState::kIdle) Fail(i, shutdown);
  }
  PublishGauges();
}

bool ContinuousBatchScheduler::Impl::Admit() {
  std::vector<RejectedJob> rejected;
  std::vector<std::pair<QueuedJob, bool>> admitted;  // (job, ratio lowered)
  std::vector<int> cancelled_slots;
  bool stopping;
  const bool any_running = AnyRunning();
  {
    absl::MutexLock lock(&mu_);
    if (!any_running) mu_.Await(absl::Condition(this, &Impl::HasWork));
    stopping = stopping_;
    const absl::Time now = absl::Now();
    for (auto it = queue_.begin(); it != queue_.end();) {
      absl::Status status;
      if (stopping) {
        status = absl::UnavailableError("server shutting down");
      } else if (cancelled_.count(it->id) != 0) {
        status = absl::OkStatus();
      } else if (it->job.deadline <= now) {
        status = absl::DeadlineExceededError(
            "deadline exceeded while waiting in the queue");
      } else {
        ++it;
        continue;
      }
      live_.erase(it->id);
      cancelled_.erase(it->id);
      rejected.push_back(RejectedJob{std::move(*it), status});
      it = queue_.erase(it);
    }
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (slots_[i].seq != nullptr && cancelled_.count(slots_[i].seq->id)) {
        cancelled_slots.push_back(i);
      }
    }
    int64_t free_slots = std::count_if(
        slots_.begin(), slots_.end(),
        [](const Slot& s) { return s.state == SlotState::kIdle; });
    while (!stopping && free_slots > 0 && !queue_.empty()) {
      const int64_t queued = queue_.size();  // this job included
      QueuedJob job = std::move(queue_.front());
      queue_.pop_front();
      const bool lowered = options_.adaptive_queue_depth > 0 &&
                           queued > options_.adaptive_queue_depth &&
                           job.job.min_ratio > 0.0f &&
                           job.job.min_ratio < ReferenceRatio(job.job.ratio);
      admitted.emplace_back(std::move(job), lowered);
      --free_slots;
      ++num_running_;
    }
    if (metrics_ != nullptr) metrics_->SetWaiting(queue_.size());
  }

  for (RejectedJob& r : rejected) {
    if (r.status.ok()) {
      const float ratio = r.job.job.ratio;
      Sequence seq(std::move(r.job), ratio, nullptr, {}, num_head_counters_);
      seq.finish_reason = FinishReason::kCancelled;
      seq.observer->OnFinished(Summarize(seq));
    } else {
      r.job.observer->OnError(r.status);
    }
  }
  if (stopping) return false;

  for (int index : cancelled_slots) Finish(index, FinishReason::kCancelled);
  const absl::Time now = absl::Now();
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].seq != nullptr && slots_[i].seq->job.deadline <= now) {
      Fail(i,
           absl::DeadlineExceededError("deadline exceeded during generation"));
    }
  }

  size_t next_slot = 0;
  for (auto& [job, lowered] : admitted) {
    while (slots_[next_slot].state != SlotState::kIdle) ++next_slot;
    const float ratio = lowered ? job.job.min_ratio : job.job.ratio;
    if (metrics_ != nullptr) {
      metrics_->QueueTime(Rpc::kGenerate, now - job.submit_time);
      if (lowered) metrics_->RatioLowered();
    }
    Slot& slot = slots_[next_slot];
    slot.seq =
        std::make_unique<Sequence>(std::move(job), ratio, lm_.tokenizer.get(),
                                   lm_.eos_ids, num_head_counters_);
    slot.state = SlotState::kPrefilling;
  }
  return true;
}

std::vector<BatchRow> ContinuousBatchScheduler::Impl::PlanStep() const {
  // Decode rows first, then prompt chunks in admission order under the budget.
  std::vector<BatchRow> rows;
  std::vector<int> prefilling;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].state == SlotState::kGenerating) {
      rows.push_back(BatchRow{static_cast<int>(i), 1, false});
    } else if (slots_[i].state == SlotState::kPrefilling) {
      prefilling.push_back(i);
    }
  }
  std::sort(prefilling.begin(), prefilling.end(), [this](int a, int b) {
    return slots_[a].seq->id < slots_[b].seq->id;
  });
  int32_t budget = options_.prefill_token_budget;
  for (int index : prefilling) {
    if (budget == 0) break;
    const Sequence& seq = *slots_[index].seq;
    const int32_t n = std::min(seq.prompt_len() - seq.cached, budget);
    budget -= n;
    rows.push_back(BatchRow{index, n, true});
  }
  return rows;
}

DecoderBatch ContinuousBatchScheduler::Impl::BuildBatch(
    const std::vector<BatchRow>& rows) const {
  int64_t width = 0;
  for (const BatchRow& row : rows) {
    width = std::max<int64_t>(width, row.num_tokens);
  }
  DecoderBatch batch;
  batch.token_ids = at::zeros({static_cast<int64_t>(rows.size()), width},
                              at::kLong);  // right-padded
  auto ids = batch.token_ids.accessor<int64_t, 2>();
  for (size_t b = 0; b < rows.size(); ++b) {
    const Sequence& seq = *slots_[rows[b].slot].seq;
    for (int32_t t = 0; t < rows[b].num_tokens; ++t) {
      ids[b][t] = seq.output.history()[seq.cached + t];
    }
    batch.num_tokens.push_back(rows[b].num_tokens);
    batch.slots.push_back(rows[b].slot);
    batch.start_positions.push_back(seq.cached);
    batch.ratios.push_back(seq.applied_ratio);
  }
  return batch;
}

void ContinuousBatchScheduler::Impl::Step() {
  const std::vector<BatchRow> rows = PlanStep();
  if (rows.empty()) return;
  const int64_t batch_rows = rows.size();
  const int64_t decode_rows = std::count_if(
      rows.begin(), rows.end(), [](const BatchRow& r) { return !r.prefill; });
  const DecoderBatch batch = BuildBatch(rows);
  if (metrics_ != nullptr) {
    if (batch_rows > decode_rows) {
      metrics_->BatchSize(BatchKind::kPrefill, batch_rows - decode_rows);
    }
    if (decode_rows > 0) metrics_->BatchSize(BatchKind::kDecode, decode_rows);
  }

  absl::Status status;
  try {
    absl::StatusOr<DecoderOutput> out = model_.Forward(batch, cache_);
    if (!out.ok()) {
      status = out.status();
    } else {
      const at::Tensor logits = out->logits.to(at::kCPU, at::kFloat);
      const at::Tensor counts =
          out->head_token_counts.to(at::kCPU, at::kLong).contiguous();
      const int64_t* count_data = counts.data_ptr<int64_t>();
      for (int64_t b = 0; b < batch_rows && status.ok(); ++b) {
        Slot& slot = slots_[rows[b].slot];
        Sequence& seq = *slot.seq;
        const int64_t* row_counts = count_data + b * num_head_counters_;
        for (size_t k = 0; k < num_head_counters_; ++k) {
          seq.head_tokens[k] += row_counts[k];
        }
        seq.cached += rows[b].num_tokens;
        seq.processed += rows[b].num_tokens;
        if (rows[b].prefill) {
          if (metrics_ != nullptr) metrics_->PromptTokens(rows[b].num_tokens);
          if (seq.cached < seq.prompt_len()) continue;  // mid-prompt chunk
          slot.state = SlotState::kGenerating;
        }
        status = SampleAndEmit(seq, logits[b]);
        if (status.ok() && seq.finished) slot.state = SlotState::kDone;
      }
    }
  } catch (const std::exception& e) {
    status = absl::InternalError(e.what());
  }
  if (!status.ok()) {
    // Only this batch's sequences fail; the loop and the queue go on.
    std::fprintf(stderr, "moh-scheduler[%s]: model step failed: %s\n",
                 options_.model_name.c_str(),
                 std::string(status.message()).c_str());
    const absl::Status error =
        absl::InternalError(absl::StrCat("model error: ", status.message()));
    for (const BatchRow& row : rows) {
      if (slots_[row.slot].state != SlotState::kIdle) Fail(row.slot, error);
    }
    return;
  }
  for (const BatchRow& row : rows) {
    if (slots_[row.slot].state == SlotState::kDone) {
      Finish(row.slot, slots_[row.slot].seq->finish_reason);
    }
  }
}

absl::Status ContinuousBatchScheduler::Impl::SampleAndEmit(
    Sequence& seq, const at::Tensor& logits) {
  const bool first = seq.output.generated() == 0;
  MOH_ASSIGN_OR_RETURN(GenerationChunk chunk, seq.output.Next(logits));
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
  if (seq.output.finish_reason()) {
    seq.finished = true;
    seq.finish_reason = *seq.output.finish_reason();
  }
  return absl::OkStatus();
}

std::unique_ptr<Sequence> ContinuousBatchScheduler::Impl::Release(int index) {
  Slot& slot = slots_[index];
  std::unique_ptr<Sequence> seq = std::move(slot.seq);
  slot.state = SlotState::kIdle;
  --num_running_;
  {
    absl::MutexLock lock(&mu_);
    live_.erase(seq->id);
    cancelled_.erase(seq->id);
  }
  return seq;
}

void ContinuousBatchScheduler::Impl::Finish(int index, FinishReason reason) {
  std::unique_ptr<Sequence> seq = Release(index);
  seq->finish_reason = reason;
  GenerationSummary summary = Summarize(*seq);
  if (metrics_ != nullptr && seq->processed > 0) {
    metrics_->ActivationRatio(summary.effective_ratio);
    metrics_->HeadTokens(summary.head_tokens);
  }
  seq->observer->OnFinished(summary);
}

void ContinuousBatchScheduler::Impl::Fail(int index,
                                          const absl::Status& status) {
  std::unique_ptr<Sequence> seq = Release(index);
  seq->observer->OnError(status);
}

GenerationSummary ContinuousBatchScheduler::Impl::Summarize(
    const Sequence& seq) const {
  GenerationSummary summary;
  summary.finish_reason = seq.finish_reason;
  summary.prompt_tokens = seq.prompt_len();
  summary.completion_tokens = seq.output.generated();
  summary.applied_ratio = seq.applied_ratio;
  summary.routed_tokens = seq.processed;
  summary.head_tokens = seq.head_tokens;
  const int64_t layers = model_.config().num_layers;
  const int64_t heads = model_.config().num_heads;
  std::vector<int64_t> counts = seq.head_tokens;
  summary.effective_ratio = EffectiveRatio(
      at::from_blob(counts.data(), {layers, heads}, at::kLong), seq.processed);
  return summary;
}

void ContinuousBatchScheduler::Impl::PublishGauges() {
  if (metrics_ == nullptr) return;
  int64_t running = 0, reserved = 0;
  for (const Slot& slot : slots_) {
    if (slot.seq == nullptr) continue;
    ++running;
    reserved += slot.seq->reserved();
  }
  metrics_->SetRunning(running);
  metrics_->SetKvCacheUsage(
      static_cast<double>(reserved) /
      (static_cast<double>(options_.max_running) * options_.max_seq_len));
}

absl::StatusOr<std::unique_ptr<ContinuousBatchScheduler>>
ContinuousBatchScheduler::Create(const Options& options,
                                 const LanguageModel& model,
                                 ModelMetrics* metrics) {
  if (model.model == nullptr) {
    return absl::InvalidArgumentError("the language model is not loaded");
  }
  const int32_t model_max = model.model->config().max_position_embeddings;
  Options resolved = options;
  if (resolved.max_seq_len == 0) {
    resolved.max_seq_len = std::min(model_max, kDefaultMaxSeqLenCap);
  }
  const struct {
    const char* name;
    int64_t value, min, max;
  } checks[] = {
      {"max_seq_len", resolved.max_seq_len, 2, model_max},
      {"max_running", options.max_running, 1, kMaxRunningLimit},
      {"max_queued_requests", options.max_queued_requests, 1, INT32_MAX},
      {"prefill_token_budget", options.prefill_token_budget, 1, INT32_MAX},
      {"adaptive_queue_depth", options.adaptive_queue_depth, 0, INT32_MAX},
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
  impl->Start();
  return std::unique_ptr<ContinuousBatchScheduler>(
      new ContinuousBatchScheduler(std::move(impl)));
}

ContinuousBatchScheduler::ContinuousBatchScheduler(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}

ContinuousBatchScheduler::~ContinuousBatchScheduler() = default;

absl::StatusOr<uint64_t> ContinuousBatchScheduler::Submit(
    GenerationJob job, std::shared_ptr<GenerationObserver> observer) {
  return impl_->Submit(std::move(job), std::move(observer));
}

void ContinuousBatchScheduler::Cancel(uint64_t id) { impl_->Cancel(id); }

void ContinuousBatchScheduler::StopAccepting() { impl_->StopAccepting(); }

int64_t ContinuousBatchScheduler::num_running() const {
  return impl_->num_running();
}

int64_t ContinuousBatchScheduler::num_waiting() const {
  return impl_->num_waiting();
}

int32_t ContinuousBatchScheduler::max_seq_len() const {
  return impl_->max_seq_len();
}

}  // namespace moh
