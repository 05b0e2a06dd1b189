#include "service/hosted_model.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "model/runtime.h"
#include "model/status_macros.h"
#include "service/draining.h"
#include "service/log.h"

namespace moh {
namespace {

constexpr size_t kMaxPromptBytes = 1 << 20;

v1::LayerHeads LayerInfo(const MohLayerConfig& layer) {
  v1::LayerHeads info;
  info.set_num_heads(layer.num_heads);
  info.set_shared_heads(layer.shared_heads);
  info.set_routed_heads(layer.routed_heads());
  info.set_default_top_k(layer.top_k);
  return info;
}

}  // namespace

const char* HostedModelStateName(HostedModel::State state) {
  switch (state) {
    case HostedModel::State::kLoading:
      return "LOADING";
    case HostedModel::State::kReady:
      return "READY";
    case HostedModel::State::kFailed:
      return "FAILED";
  }
  return "UNKNOWN";
}

HostedModel::HostedModel(v1::ModelConfig config, Metrics* metrics)
    : config_(std::move(config)), metrics_(metrics) {}

HostedModel::~HostedModel() {
  // Stop the batcher first: its threads use the model.
  if (classify_batcher_) classify_batcher_->Stop();
  scheduler_.reset();
}

void HostedModel::Load() {
  const absl::Time start = absl::Now();
  MOH_LOG(Info) << "model " << name() << ": loading " << config_.model_dir();
  absl::Status status = LoadUnchecked();
  if (status.ok()) status = Warmup();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  absl::MutexLock lock(&mu_);
  if (!status.ok()) {
    state_ = State::kFailed;
    failure_reason_ = std::string(status.message());
    MOH_LOG(Error) << "model " << name() << ": FAILED: " << failure_reason_;
    return;
  }
  model_metrics_->SetLoadSeconds(seconds);
  state_ = State::kReady;
  MOH_LOG(Info) << "model " << name() << ": READY in " << seconds << " s on "
                << device_ << " (" << dtype_ << ")";
}

absl::Status HostedModel::LoadUnchecked() {
  MOH_ASSIGN_OR_RETURN(ModelConfig model_config,
                       LoadModelConfig(config_.model_dir()));
  const DeviceOptions device{config_.device(), config_.dtype()};
  MOH_ASSIGN_OR_RETURN(at::TensorOptions options, ResolveTensorOptions(device));
  device_ = options.device().str();
  dtype_ = DtypeName(at::typeMetaToScalarType(options.dtype()));
  const bool head_metrics =
      !config_.has_head_metrics() || config_.head_metrics();
  if (model_config.family == ModelFamily::kLlama) {
    MOH_ASSIGN_OR_RETURN(LanguageModel lm,
                         LanguageModel::Load(config_.model_dir(), device));
    lm_.emplace(std::move(lm));
    const LlamaConfig& c = lm_->model->config();
    model_metrics_ =
        metrics_->ForModel(name(), c.num_layers, c.num_heads, head_metrics);
    ContinuousBatchScheduler::Options options;
    options.model_name = name();
    const v1::GenerationConfig& g = config_.generation();
    options.max_running = g.max_running();
    options.max_seq_len = g.max_seq_len();
    options.max_queued_requests = g.max_queued_requests();
    options.prefill_token_budget = g.prefill_token_budget();
    options.adaptive_queue_depth = config_.adaptive().queue_depth();
    lm_->model->set_attention_workspace_bytes(
        int64_t{g.attention_workspace_mb()} << 20);
    MOH_RETURN_IF_ERROR(
        lm_->model->CheckMemoryFits(options.max_running, options.max_seq_len));
    MOH_ASSIGN_OR_RETURN(scheduler_, ContinuousBatchScheduler::Create(
                                         options, *lm_, model_metrics_));
  } else {
    MOH_ASSIGN_OR_RETURN(vit_, VitModel::Load(config_.model_dir(), device));
    const VitConfig& c = vit_->config();
    model_metrics_ =
        metrics_->ForModel(name(), c.num_layers, c.num_heads, head_metrics);
  }
  typename Batcher<ClassifyTask>::Options batching;
  batching.name = name() + "/classify";
  batching.max_batch_size = config_.batching().max_batch_size();
  batching.max_queue_delay =
      absl::Milliseconds(config_.batching().max_queue_delay_ms());
  batching.max_queued_requests = config_.batching().max_queued_requests();
  MOH_ASSIGN_OR_RETURN(classify_batcher_,
                       Batcher<ClassifyTask>::Create(
                           batching, [this](std::vector<ClassifyTask> batch) {
                             ProcessClassifyBatch(std::move(batch));
                           }));
  return absl::OkStatus();
}

absl::Status HostedModel::Warmup() {
  if (vit_) {
    const VitConfig& c = vit_->config();
    at::Tensor pixels =
        at::zeros({1, c.num_channels, c.image_size, c.image_size});
    return vit_->Forward(pixels, {0.0f}).status();
  }
  KvCache cache = lm_->model->CreateKvCache(1, 8);
  DecoderBatch batch;
  batch.token_ids = at::zeros({1, 4}, at::kLong);
  batch.num_tokens = {4};
  batch.slots = {0};
  batch.start_positions = {0};
  batch.ratios = {0.0f};
  return lm_->model->Forward(batch, cache).status();
}

HostedModel::State HostedModel::state() const {
  absl::MutexLock lock(&mu_);
  return state_;
}

ModelMetrics* HostedModel::metrics() const {
  return state() == State::kReady ? model_metrics_ : nullptr;
}

bool HostedModel::is_language_model() const { return lm_.has_value(); }

int32_t HostedModel::num_layers() const {
  if (state() != State::kReady) return 0;
  return lm_ ? lm_->model->config().num_layers : vit_->config().num_layers;
}

absl::Status HostedModel::CheckReady() const {
  absl::MutexLock lock(&mu_);
  switch (state_) {
    case State::kReady:
      return accepting_ ? absl::OkStatus() : DrainingError();
    case State::kLoading:
      return absl::UnavailableError(
          absl::StrCat("model '", name(), "' is still loading"));
    case State::kFailed:
      return absl::FailedPreconditionError(absl::StrCat(
          "model '", name(), "' failed to load: ", failure_reason_));
  }
  return absl::InternalError("unknown model state");
}

v1::ModelInfo HostedModel::Info() const {
  v1::ModelInfo info;
  info.set_name(name());
  State state;
  {
    absl::MutexLock lock(&mu_);
    state = state_;
    info.set_failure_reason(failure_reason_);
  }
  info.set_state(state == State::kReady     ? v1::ModelInfo::READY
                 : state == State::kLoading ? v1::ModelInfo::LOADING
                                            : v1::ModelInfo::FAILED);
  if (state != State::kReady) return info;
  const MohConfig* moh = nullptr;
  if (lm_) {
    const LlamaConfig& c = lm_->model->config();
    info.set_family("llama");
    info.set_max_seq_len(scheduler_->max_seq_len());
    moh = &c.moh;
  } else {
    const VitConfig& c = vit_->config();
    info.set_family("vit");
    info.set_max_seq_len(1 + c.num_patches());
    for (const std::string& label : c.labels) info.add_labels(label);
    moh = &c.moh;
  }
  info.set_router(RouterKindName(moh->router));
  for (const MohLayerConfig& layer : moh->layers) {
    *info.add_layers() = LayerInfo(layer);
  }
  info.set_default_ratio(moh->DefaultRatio());
  info.set_min_ratio(moh->MinRatio());
  info.set_device(device_);
  info.set_dtype(dtype_);
  return info;
}

absl::StatusOr<uint64_t> HostedModel::Generate(
    GenerateCall call, std::shared_ptr<GenerationObserver> observer) {
  MOH_RETURN_IF_ERROR(CheckReady());
  if (!lm_) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: '", name(),
                     "' is an image classifier; Generate needs a "
                     "language model"));
  }
  if (call.prompt.has_value() == call.token_ids.has_value()) {
    return absl::InvalidArgumentError(
        "prompt or token_ids: exactly one must be set");
  }
  GenerationJob job;
  if (call.prompt) {
    if (call.prompt->empty()) {
      return absl::InvalidArgumentError("prompt must not be empty");
    }
    if (call.prompt->size() > kMaxPromptBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt must be at most ", kMaxPromptBytes,
                       " bytes, got ", call.prompt->size()));
    }
    if (!lm_->tokenizer) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt: model '", name(),
                       "' has no tokenizer.json; send token_ids instead"));
    }
    job.prompt_ids = lm_->tokenizer->Encode(*call.prompt, true);
  } else {
    job.prompt_ids = std::move(*call.token_ids);
  }
  job.sampling = std::move(call.sampling);
  job.sampling.max_new_tokens = call.max_new_tokens.value_or(
      config_.generation().default_max_new_tokens());
  job.ratio = call.ratio;
  job.min_ratio = call.min_ratio;
  job.deadline = call.deadline;
  return scheduler_->Submit(std::move(job), std::move(observer));
}

void HostedModel::CancelGenerate(uint64_t id) {
  if (scheduler_) scheduler_->Cancel(id);
}

void HostedModel::StopAccepting() {
  {
    absl::MutexLock lock(&mu_);
    accepting_ = false;
  }
  if (scheduler_) scheduler_->StopAccepting();
}

bool HostedModel::Idle() const {
  {
    absl::MutexLock lock(&mu_);
    if (classify_in_flight_ > 0) return false;
  }
  return !scheduler_ ||
         (scheduler_->num_running() == 0 && scheduler_->num_waiting() == 0);
}

}  // namespace moh
