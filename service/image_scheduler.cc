#include "service/image_scheduler.h"

#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/core/activation.h"
#include "model/generation/dit_sampler.h"
#include "service/engine_loop.h"
#include "service/image_encoder.h"

namespace moh {
namespace {

constexpr int32_t kMaxSteps = 1000;

// One GenerateImage request inside the loop. Owned by the loop thread.
struct ImageRequestState {
  ImageJob job;
  Activation activation;  // resolved at Submit; lowered at admission
  std::shared_ptr<ImageObserver> observer;
  std::unique_ptr<ImageSample> sample;
  absl::Time submitted, started;
  ImageResult result;  // filled when the image is done
};

class ImageExecutor : public StepExecutor<ImageRequestState> {
 public:
  ImageExecutor(const DitModel& model, const VaeDecoder* vae,
                ModelMetrics* metrics)
      : model_(model), vae_(vae), metrics_(metrics) {}

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
    try {
      std::vector<ImageSample*> samples;
      for (ImageRequestState* r : requests) samples.push_back(r->sample.get());
      MOH_RETURN_IF_ERROR(SampleStep(model_, samples));
      if (metrics_ != nullptr) metrics_->DiffusionSteps(samples.size());
      for (size_t i = 0; i < requests.size(); ++i) {
        ImageRequestState& r = *requests[i];
        r.observer->OnProgress(r.sample->steps_done(), r.sample->steps());
        if (!r.sample->done()) continue;
        // A request whose image cannot be made fails alone.
        (*outcomes)[i].error = Finish(r);
        (*outcomes)[i].finished = true;
      }
      return absl::OkStatus();
    } catch (const std::exception& e) {
      return absl::InternalError(e.what());
    }
  }

  void End(ImageRequestState& r, EndKind kind,
           const absl::Status& status) override {
    switch (kind) {
      case EndKind::kFinished:
        if (metrics_ != nullptr) {
          metrics_->ActivationRatio(r.result.effective_ratio);
          metrics_->HeadTokens(r.result.head_tokens);
          metrics_->ImageGenerated(absl::Now() - r.submitted);
        }
        r.observer->OnFinished(r.result);
        return;
      case EndKind::kCancelled:
        r.observer->OnError(absl::CancelledError("the client cancelled"));
        return;
      case EndKind::kFailed:
        r.observer->OnError(status);
        return;
    }
  }

 private:
  // Decodes and encodes the finished sample into r.result.
  absl::Status Finish(ImageRequestState& r) {
    const absl::Time sampled = absl::Now();
    MOH_ASSIGN_OR_RETURN(
        at::Tensor image,
        SampleImage(*r.sample, vae_, model_.config().latent_scale));
    ImageResult& result = r.result;
    result.class_id = r.job.class_id;
    result.seed = r.job.seed;
    result.guidance = r.job.guidance;
    MOH_ASSIGN_OR_RETURN(result.png, EncodePng(image));
    result.height = image.size(1);
    result.width = image.size(2);
    result.steps = r.sample->steps();
    result.applied_ratio = r.activation.requested_ratio();
    const at::Tensor counts = r.sample->head_token_counts().contiguous();
    result.head_tokens.assign(counts.data_ptr<int64_t>(),
                              counts.data_ptr<int64_t>() + counts.numel());
    const int64_t rows = int64_t{r.sample->steps()} * r.sample->rows();
    result.routed_tokens = rows * model_.config().tokens();
    result.effective_ratio = r.sample->effective_ratio();
    const absl::Time now = absl::Now();
    result.queued = r.started - r.submitted;
    result.sampling = sampled - r.started;
    result.decoding = now - sampled;
    return absl::OkStatus();
  }

  const DitModel& model_;
  const VaeDecoder* const vae_;
  ModelMetrics* const metrics_;
};

}  // namespace

class ImageScheduler::Impl {
 public:
  Impl(const Options& options, const DitModel& model, const VaeDecoder* vae,
       ModelMetrics* metrics)
      : model_(model),
        executor_(model, vae, metrics),
        loop_(LoopOptions(options), &executor_, metrics) {}

  absl::StatusOr<uint64_t> Submit(const ImageJob& job,
                                  std::shared_ptr<ImageObserver> observer) {
    if (observer == nullptr) {
      return absl::InvalidArgumentError("observer must not be null");
    }
    const DitConfig& c = model_.config();
    const int32_t steps = job.steps == 0 ? c.default_steps : job.steps;
    if (steps < 2 || steps > kMaxSteps) {
      return absl::InvalidArgumentError(absl::StrCat(
          "steps must be in [2, ", kMaxSteps, "] (0: the model's default, ",
          c.default_steps, "), got ", job.steps));
    }
    const float guidance = job.guidance == 0.0f
                               ? static_cast<float>(c.default_guidance)
                               : job.guidance;
    if (!(guidance >= 1.0f && guidance <= 100.0f)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "guidance_scale must be in [1, 100] (absent: the model's default, ",
          c.default_guidance, "), got ", job.guidance));
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

 private:
  static EngineLoopOptions LoopOptions(const Options& options) {
    EngineLoopOptions loop;
    loop.name = options.model_name;
    loop.rpc = Rpc::kGenerateImage;
    loop.step_kind = BatchKind::kImageStep;
    loop.planner.max_running = options.max_running;
    loop.planner.max_seq_len = kMaxSteps;  // outputs are steps
    loop.planner.max_queued_requests = options.max_queued_requests;
    loop.planner.prefill_token_budget = 1;  // no prompts
    loop.planner.adaptive_queue_depth = options.adaptive_queue_depth;
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
  ImageExecutor executor_;
  EngineLoop<ImageRequestState> loop_;  // last: stopped first
};

absl::StatusOr<std::unique_ptr<ImageScheduler>> ImageScheduler::Create(
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
  return std::unique_ptr<ImageScheduler>(
      new ImageScheduler(std::make_unique<Impl>(options, model, vae, metrics)));
}

ImageScheduler::ImageScheduler(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}
ImageScheduler::~ImageScheduler() = default;

absl::StatusOr<uint64_t> ImageScheduler::Submit(
    const ImageJob& job, std::shared_ptr<ImageObserver> observer) {
  return impl_->Submit(job, std::move(observer));
}
void ImageScheduler::Cancel(uint64_t id) { impl_->loop().Cancel(id); }
void ImageScheduler::StopAccepting() { impl_->loop().StopAccepting(); }
bool ImageScheduler::Idle() const { return impl_->loop().idle(); }
int64_t ImageScheduler::num_running() const {
  return impl_->loop().num_running();
}
int64_t ImageScheduler::num_waiting() const {
  return impl_->loop().num_waiting();
}

}  // namespace moh
