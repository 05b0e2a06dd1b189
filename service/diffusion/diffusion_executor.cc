#include "service/diffusion/diffusion_executor.h"

#include <pthread.h>

#include <atomic>
#include <deque>
#include <exception>
#include <functional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/core/activation.h"
#include "model/core/device_context.h"
#include "model/core/runtime.h"
#include "model/generation/dit_sampler.h"
#include "service/diffusion/image_encoder.h"
#include "service/engine/engine_loop.h"

namespace moh {
namespace {

// One GenerateImage request: inside the loop (owned by the loop thread),
// then, once sampled, on its way to the client (decoded, encoded,
// delivered; on the decode thread with a VAE).
struct ImageRequestState {
  ImageJob job;
  Activation activation;  // resolved at Submit; lowered at admission
  std::shared_ptr<ImageObserver> observer;
  std::unique_ptr<ImageSample> sample;
  absl::Time submitted, started, sampled;
  bool counted = false;  // sampled: in DiffusionSteps::undelivered_
};

// Runs `deliver` on finished images on its own thread, first come first
// served, so that a VAE decode (about a second for XL at 256 px on CPU)
// does not stall the other requests' steps. At most `max_backlog` wait;
// TryPost refuses beyond, and the caller decodes itself: a slow decoder
// then slows the loop instead of growing memory. The destructor delivers
// what waits, then joins.
class DecodeWorker {
 public:
  DecodeWorker(const std::string& name, int32_t max_backlog,
               std::function<void(ImageRequestState)> deliver)
      : max_backlog_(max_backlog), deliver_(std::move(deliver)) {
    thread_ = std::thread([this] { Loop(); });
    // Linux limits thread names to 15 characters.
    pthread_setname_np(thread_.native_handle(),
                       ("moh-vae-" + name).substr(0, 15).c_str());
  }

  ~DecodeWorker() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    thread_.join();
  }

  // Queues `image` (moved from) unless the backlog is full.
  bool TryPost(ImageRequestState& image) {
    absl::MutexLock lock(&mu_);
    if (static_cast<int32_t>(queue_.size()) >= max_backlog_) return false;
    queue_.push_back(std::move(image));
    return true;
  }

 private:
  void Loop() {
    for (;;) {
      ImageRequestState image;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](DecodeWorker* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) {
              return w->stopping_ || !w->queue_.empty();
            },
            this));
        if (queue_.empty()) return;  // stopping, nothing left
        image = std::move(queue_.front());
        queue_.pop_front();
      }
      deliver_(std::move(image));
    }
  }

  const int32_t max_backlog_;
  const std::function<void(ImageRequestState)> deliver_;
  absl::Mutex mu_;
  std::deque<ImageRequestState> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

class DiffusionSteps : public StepExecutor<ImageRequestState> {
 public:
  // With a VAE, images are decoded on a DecodeWorker (at most `max_running`
  // waiting); pixel-space images are mapped on the loop thread (cheap).
  DiffusionSteps(const std::string& name, int32_t max_running,
                 const DitModel& model, const VaeDecoder* vae,
                 ModelMetrics* metrics)
      : model_(model), vae_(vae), metrics_(metrics) {
    if (vae_ != nullptr) {
      decoder_ = std::make_unique<DecodeWorker>(
          name, max_running,
          [this](ImageRequestState image) { Deliver(std::move(image)); });
    }
  }

  // Every image sampled so far has reached its observer.
  bool AllDelivered() const { return undelivered_.load() == 0; }

  absl::Status DeviceLost() override {
    return moh::DeviceLost(model_.options().device());
  }

  void Admit(ImageRequestState& r, const AdmittedRequest& admitted) override {
    if (admitted.lowered) {
      r.activation = r.activation.Lowered(model_.config().moh);
      r.sample->set_top_k(r.activation.top_k());
    }
    r.started = absl::Now();
  }

  absl::Status Run(const std::vector<PlannedRow>& rows,
                   const std::vector<ImageRequestState*>& requests,
                   std::vector<RowOutcome>* outcomes) override {
    undone_ = true;
    try {
      std::vector<ImageSample*> samples;
      for (ImageRequestState* r : requests) samples.push_back(r->sample.get());
      MOH_RETURN_IF_ERROR(SampleStep(model_, samples));
      undone_ = false;
      if (metrics_ != nullptr) metrics_->DiffusionSteps(samples.size());
      const absl::Time now = absl::Now();
      for (size_t i = 0; i < requests.size(); ++i) {
        ImageRequestState& r = *requests[i];
        r.observer->OnProgress(r.sample->steps_done(), r.sample->steps());
        if (!r.sample->done()) continue;
        // Counted before the planner lets it go, so that the executor is
        // never idle while an image is still on its way.
        r.sampled = now;
        r.counted = true;
        ++undelivered_;
        (*outcomes)[i].finished = true;
      }
      return absl::OkStatus();
    } catch (const std::exception& e) {
      return StatusFromException(e);
    }
  }

  // SampleStep advances every sample or none.
  bool StepUndone() const override { return undone_; }

  void End(ImageRequestState& r, EndKind kind,
           const absl::Status& status) override {
    switch (kind) {
      case EndKind::kFinished: {
        if (decoder_ == nullptr || !decoder_->TryPost(r)) {
          Deliver(std::move(r));
        }
        return;
      }
      case EndKind::kCancelled:
        Uncount(r);
        r.observer->OnError(absl::CancelledError("the client cancelled"));
        return;
      case EndKind::kFailed:
        Uncount(r);
        r.observer->OnError(status);
        return;
    }
  }

 private:
  void Uncount(const ImageRequestState& r) {
    if (r.counted) --undelivered_;
  }

  // Decodes and encodes `image` and hands it to its observer; a request
  // whose image cannot be made fails alone. Loop or decode thread.
  void Deliver(ImageRequestState image) {
    ImageResult result;
    absl::Status status;
    try {
      status = Finish(image, &result);
    } catch (const std::exception& e) {
      status = StatusFromException(e);
    }
    if (status.ok()) {
      if (metrics_ != nullptr) {
        metrics_->ActivationRatio(result.effective_ratio);
        metrics_->HeadTokens(result.head_tokens);
        metrics_->ImageGenerated(absl::Now() - image.submitted);
      }
      image.observer->OnFinished(result);
    } else {
      image.observer->OnError(status);
    }
    --undelivered_;
  }

  absl::Status Finish(const ImageRequestState& image, ImageResult* result) {
    const ImageSample& sample = *image.sample;
    MOH_ASSIGN_OR_RETURN(
        at::Tensor pixels,
        SampleImage(sample, vae_, model_.config().latent_scale));
    result->class_id = image.job.class_id;
    result->seed = image.job.seed;
    result->guidance = sample.request().guidance;
    MOH_ASSIGN_OR_RETURN(result->png, EncodePng(pixels));
    result->height = pixels.size(1);
    result->width = pixels.size(2);
    result->steps = sample.steps();
    result->applied_ratio =
        static_cast<float>(image.activation.nominal_ratio());
    const at::Tensor counts = sample.head_token_counts().contiguous();
    result->head_tokens.assign(counts.data_ptr<int64_t>(),
                               counts.data_ptr<int64_t>() + counts.numel());
    const int64_t rows = int64_t{sample.steps()} * sample.rows();
    result->routed_tokens = rows * model_.config().tokens();
    result->effective_ratio = sample.effective_ratio();
    result->queued = image.started - image.submitted;
    result->sampling = image.sampled - image.started;
    result->decoding = absl::Now() - image.sampled;
    return absl::OkStatus();
  }

  const DitModel& model_;
  const VaeDecoder* const vae_;
  ModelMetrics* const metrics_;
  std::atomic<int64_t> undelivered_{0};
  bool undone_ = false;  // the last step failed before any sample advanced
  std::unique_ptr<DecodeWorker> decoder_;  // last: joined first
};

}  // namespace

class DiffusionExecutor::Impl {
 public:
  Impl(const Options& options, const DitModel& model, const VaeDecoder* vae,
       ModelMetrics* metrics)
      : model_(model),
        steps_(options.model_name, options.max_running, model, vae, metrics),
        loop_(LoopOptions(options), &steps_, metrics) {}

  absl::StatusOr<uint64_t> Submit(const ImageJob& job,
                                  std::shared_ptr<ImageObserver> observer) {
    if (observer == nullptr) {
      return absl::InvalidArgumentError("observer must not be null");
    }
    const DitConfig& c = model_.config();
    // The model's ranges (diffusion.h, dit_sampler.h), with what an unset
    // field means.
    const int32_t steps = job.steps == 0 ? c.default_steps : job.steps;
    if (steps < kMinSamplingSteps || steps > kTrainingSteps) {
      return absl::InvalidArgumentError(
          absl::StrCat("steps must be in [", kMinSamplingSteps, ", ",
                       kTrainingSteps, "] (0: the model's default, ",
                       c.default_steps, "), got ", job.steps));
    }
    const float guidance =
        job.guidance.value_or(static_cast<float>(c.default_guidance));
    if (!(guidance >= kMinGuidance && guidance <= kMaxGuidance)) {
      return absl::InvalidArgumentError(
          absl::StrCat("guidance_scale must be in [", kMinGuidance, ", ",
                       kMaxGuidance, "] (absent: the model's default, ",
                       c.default_guidance, "), got ", guidance));
    }
    if (job.class_id < 0 || job.class_id >= c.num_classes) {
      return absl::InvalidArgumentError(
          absl::StrCat("class_index must be in [0, ", c.num_classes, "), got ",
                       job.class_id));
    }
    MOH_ASSIGN_OR_RETURN(Activation activation,
                         Activation::Resolve(c.moh, job.ratio, job.min_ratio));
    ImageRequest request;
    request.class_id = job.class_id;
    request.seed = job.seed;
    request.guidance = guidance;
    request.top_k = activation.top_k();
    MOH_ASSIGN_OR_RETURN(const Diffusion* diffusion, Schedule(steps));
    MOH_ASSIGN_OR_RETURN(std::unique_ptr<ImageSample> sample,
                         ImageSample::Start(model_, diffusion, request));
    PlannedWork work;
    work.prompt_len = 0;
    work.max_outputs = steps;
    work.deadline = job.deadline;
    work.can_lower = activation.CanLower();
    work.rows_per_step = sample->rows();
    auto state = std::make_unique<ImageRequestState>();
    state->job = job;
    state->job.steps = steps;
    state->job.guidance = guidance;
    state->activation = std::move(activation);
    state->observer = std::move(observer);
    state->sample = std::move(sample);
    state->submitted = absl::Now();
    return loop_.Submit(work, std::move(state));
  }

  EngineLoop<ImageRequestState>& loop() { return loop_; }
  const EngineLoop<ImageRequestState>& loop() const { return loop_; }
  // The loop first: an image leaving it is counted before the loop is idle.
  bool Idle() const { return loop_.idle() && steps_.AllDelivered(); }

 private:
  static EngineLoopOptions LoopOptions(const Options& options) {
    EngineLoopOptions loop;
    loop.name = options.model_name;
    loop.rpc = Rpc::kGenerateImage;
    loop.step_kind = BatchKind::kImageStep;
    loop.planner.max_running = options.max_running;
    loop.planner.max_step_rows = options.max_running;  // model rows
    loop.planner.max_seq_len = kTrainingSteps;         // outputs are steps
    loop.planner.max_queued_requests = options.max_queued_requests;
    loop.planner.prefill_token_budget = 1;  // no prompts
    loop.planner.adaptive_queue_depth = options.adaptive_queue_depth;
    loop.on_device_lost = options.on_device_lost;
    return loop;
  }

  // The schedule respaced to `steps`, made once per step count.
  absl::StatusOr<const Diffusion*> Schedule(int32_t steps) {
    absl::MutexLock lock(&mu_);
    auto it = schedules_.find(steps);
    if (it == schedules_.end()) {
      MOH_ASSIGN_OR_RETURN(Diffusion d, Diffusion::Respaced(steps));
      it = schedules_.emplace(steps, std::make_unique<Diffusion>(std::move(d)))
               .first;
    }
    return it->second.get();
  }

  const DitModel& model_;
  absl::Mutex mu_;
  std::map<int32_t, std::unique_ptr<Diffusion>> schedules_ ABSL_GUARDED_BY(mu_);
  DiffusionSteps steps_;
  EngineLoop<ImageRequestState> loop_;  // last: stopped first
};

absl::StatusOr<std::unique_ptr<DiffusionExecutor>> DiffusionExecutor::Create(
    const Options& options, const DitModel& model, const VaeDecoder* vae,
    ModelMetrics* metrics) {
  namespace limits = config_limits;
  const struct {
    const char* name;
    int64_t value, min, max;
  } checks[] = {
      {"max_running", options.max_running, limits::kMaxRunning.min,
       limits::kMaxRunning.max},
      {"max_queued_requests", options.max_queued_requests,
       limits::kGenerationMaxQueuedRequests.min, INT32_MAX},
      {"adaptive_queue_depth", options.adaptive_queue_depth,
       limits::kMinAdaptiveQueueDepth, INT32_MAX},
  };
  for (const auto& c : checks) {
    if (c.value < c.min || c.value > c.max) {
      return absl::InvalidArgumentError(absl::StrCat(
          c.name, " must be in [", c.min, ", ", c.max, "], got ", c.value));
    }
  }
  return std::unique_ptr<DiffusionExecutor>(new DiffusionExecutor(
      std::make_unique<Impl>(options, model, vae, metrics)));
}

DiffusionExecutor::DiffusionExecutor(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}
DiffusionExecutor::~DiffusionExecutor() = default;

absl::StatusOr<uint64_t> DiffusionExecutor::Submit(
    const ImageJob& job, std::shared_ptr<ImageObserver> observer) {
  return impl_->Submit(job, std::move(observer));
}
void DiffusionExecutor::Cancel(uint64_t id) { impl_->loop().Cancel(id); }
void DiffusionExecutor::StopAccepting() { impl_->loop().StopAccepting(); }
bool DiffusionExecutor::Idle() const { return impl_->Idle(); }
int64_t DiffusionExecutor::num_running() const {
  return impl_->loop().num_running();
}
int64_t DiffusionExecutor::num_waiting() const {
  return impl_->loop().num_waiting();
}

}  // namespace moh
