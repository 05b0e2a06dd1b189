#include "service/diffusion/diffusion_servable.h"

#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/abbreviate.h"
#include "base/status_macros.h"
#include "model/generation/dit_sampler.h"

namespace moh {

absl::StatusOr<std::unique_ptr<DiffusionServable>> DiffusionServable::Load(
    const v1::ModelConfig& config, const DeviceOptions& device,
    Metrics* metrics) {
  MOH_ASSIGN_OR_RETURN(std::unique_ptr<DitModel> model,
                       DitModel::Load(config.model_dir(), device));
  MOH_ASSIGN_OR_RETURN(std::unique_ptr<VaeDecoder> vae,
                       LoadDitVae(config.model_dir(), *model));
  const bool head_metrics = !config.has_head_metrics() || config.head_metrics();
  ModelMetrics* model_metrics = metrics->ForModel(
      config.name(), LayerHeads(model->config().moh), head_metrics);
  std::unique_ptr<DiffusionServable> servable(new DiffusionServable(
      config.name(), std::move(model), std::move(vae), model_metrics));
  DiffusionExecutor::Options options;
  options.model_name = config.name();
  options.max_running = config.generation().max_running();
  options.max_queued_requests = config.generation().max_queued_requests();
  options.adaptive_queue_depth = config.adaptive().queue_depth();
  DiffusionServable* self = servable.get();
  options.on_device_lost = [self](const absl::Status& status) {
    self->MarkDeviceLost(status);
  };
  MOH_ASSIGN_OR_RETURN(
      servable->executor_,
      DiffusionExecutor::Create(options, *servable->model_,
                                servable->vae_.get(), model_metrics));
  return servable;
}

DiffusionServable::DiffusionServable(const std::string& name,
                                     std::unique_ptr<DitModel> model,
                                     std::unique_ptr<VaeDecoder> vae,
                                     ModelMetrics* metrics)
    : Servable(name, "dit"),
      model_(std::move(model)),
      vae_(std::move(vae)),
      metrics_(metrics) {}

DiffusionServable::~DiffusionServable() = default;

absl::Status DiffusionServable::Warmup() const {
  const DitConfig& c = model_->config();
  MOH_RETURN_IF_ERROR(
      model_
          ->Forward(at::zeros({1, c.in_channels, c.input_size, c.input_size}),
                    at::zeros({1}), at::zeros({1}, at::kLong),
                    {Activation::AtRatio(c.moh, 0).top_k()})
          .status());
  if (vae_ == nullptr) return absl::OkStatus();
  return vae_->Decode(at::zeros({1, c.in_channels, c.input_size, c.input_size}))
      .status();
}

void DiffusionServable::Describe(v1::ModelInfo* info) const {
  info->set_max_seq_len(model_->config().tokens());
  info->set_weights(WeightFormatName(model_->linear_weights()));
  for (const std::string& label : model_->config().labels) {
    info->add_labels(label);
  }
  DescribeMoh(model_->config().moh, info);
}

absl::StatusOr<uint64_t> DiffusionServable::GenerateImage(
    GenerateImageCall call, std::shared_ptr<ImageObserver> observer) {
  const DitConfig& c = model_->config();
  ImageJob job;
  if (call.class_label.has_value()) {
    const auto it =
        std::find(c.labels.begin(), c.labels.end(), *call.class_label);
    if (it == c.labels.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "class_label must be one of the model's ", c.labels.size(),
          " labels (ListModels), got \"", Abbreviate(*call.class_label), "\""));
    }
    job.class_id = it - c.labels.begin();
  } else if (call.class_index.has_value()) {
    job.class_id = *call.class_index;
  } else {
    return absl::InvalidArgumentError(
        "class_index or class_label: exactly one must be set");
  }
  if (call.seed.has_value()) {
    job.seed = *call.seed;
  } else {
    std::random_device device;
    job.seed = (uint64_t{device()} << 32) | device();
  }
  job.steps = call.steps;
  job.guidance = call.guidance;
  job.ratio = call.ratio;
  job.min_ratio = call.min_ratio;
  job.deadline = call.deadline;
  return executor_->Submit(job, std::move(observer));
}

void DiffusionServable::CancelGenerateImage(uint64_t id) {
  executor_->Cancel(id);
}

void DiffusionServable::StopAccepting() { executor_->StopAccepting(); }

bool DiffusionServable::Idle() const { return executor_->Idle(); }

}  // namespace moh
