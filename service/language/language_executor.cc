#include "service/language/language_executor.h"

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/field_error.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "model/core/activation.h"
#include "model/core/runtime.h"
#include "service/engine/callback_thread.h"
#include "service/engine/engine_loop.h"
#include "service/engine/ratio_ceiling.h"
#include "service/language/language_steps.h"

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

}  // namespace

class LanguageExecutor::Impl {
 public:
  Impl(const Options& options, const LanguageModel& lm, ModelMetrics* metrics)
      : options_(options),
        lm_(lm),
        callbacks_("moh-out-" + options.model_name),
        steps_(NewLanguageSteps(lm, options.kv_blocks, options.kv_block_size,
                                metrics, &callbacks_)),
        loop_(LoopOptions(options), steps_.get(), metrics) {}

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
    // The ratio ceiling: a request whose own activation reads no routed head
    // can never read one (lowering only lowers), so it stores the shared KV
    // heads only and a block holds narrow_fold() times its positions.
    const bool narrow = lm_.model->CanStoreNarrow(activation.top_k());
    work.kv_fold = KvFold(narrow, lm_.model->narrow_fold());
    if (options_.prefix_caching) {
      // The KV of a prompt depends on the heads every layer routed, and its
      // blocks' layout on the width it is stored at: its blocks are shared
      // under the key of both (a wide request lowered to K = 0 never reads
      // a narrow one's blocks, nor the reverse).
      work.prompt_tokens = job.prompt_ids;
      work.prefix_key = PrefixKey(activation.top_k(), work.kv_fold);
      work.lowered_prefix_key = PrefixKey(
          activation.Lowered(lm_.model->config().moh).top_k(), work.kv_fold);
      // Cached positions have no logits.
      work.read_prefix = !job.sampling.prompt_logprobs;
    }
    const absl::Time now = absl::Now();
    if (job.n == 1) {
      auto seq = std::make_unique<Sequence>(
          Sequence{std::move(job), std::move(activation), narrow,
                   std::move(observer), now});
      return loop_.Submit(work, std::move(seq));
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
          Sequence{std::move(sample), activation, narrow,
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
    loop.on_device_lost = options.on_device_lost;
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
  const std::unique_ptr<StepExecutor<Sequence>> steps_;
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
  for (const auto& [id, bias] : job.sampling.logit_bias) {
    if (id >= config.vocab_size) {
      return FieldError("sampling.logit_bias",
                        absl::StrCat("token ids must be in [0, ",
                                     config.vocab_size, "), got ", id));
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
    // Whatever the allocator threw (LibTorch's CPU allocator: a plain
    // c10::Error), without its backtrace: the operator's answer is fewer
    // kv_blocks.
    return absl::ResourceExhaustedError(
        StatusFromException(e, "cannot allocate the KV cache").message());
  }
  if (metrics != nullptr) {
    metrics->SetKvCacheConfig(resolved.kv_block_size, resolved.kv_blocks);
  }
  // The ratio ceiling (language_steps.h Sequence::narrow): say whether it
  // applies, since it changes how many requests the blocks admit.
  const LlamaModel& lm = *model.model;
  if (lm.narrow_kv_heads() > 0) {
    MOH_LOG(Info) << "model " << options.model_name << ": narrow KV width "
                  << lm.narrow_kv_heads() << " of " << lm.config().num_kv_heads
                  << " KV heads: a request whose ratio routes no head stores "
                  << "those only, " << lm.narrow_fold()
                  << "x its positions per KV block";
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
