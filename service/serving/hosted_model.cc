#include "service/serving/hosted_model.h"

#include <exception>

#include "absl/strings/str_cat.h"
#include "base/abbreviate.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "base/utf8.h"
#include "model/core/runtime.h"
#include "model/kernels/cpu_isa.h"
#include "service/diffusion/diffusion_servable.h"
#include "service/engine/draining.h"
#include "service/language/language_servable.h"
#include "service/vision/vision_servable.h"

namespace moh {
namespace {

// The servable its family's loader returned, warmed up.
template <typename FamilyServable>
absl::StatusOr<std::unique_ptr<Servable>> WarmedUp(
    absl::StatusOr<std::unique_ptr<FamilyServable>> loaded) {
  MOH_ASSIGN_OR_RETURN(std::unique_ptr<FamilyServable> servable,
                       std::move(loaded));
  MOH_RETURN_IF_ERROR(servable->Warmup());
  return std::unique_ptr<Servable>(std::move(servable));
}

absl::StatusOr<std::unique_ptr<Servable>> LoadServable(
    const v1::ModelConfig& config, ModelFamily family,
    const DeviceOptions& device, Metrics* metrics,
    ImageDecodeBudget* image_decode_budget) {
  switch (family) {
    case ModelFamily::kLlama:
      return WarmedUp(LanguageServable::Load(config, device, metrics));
    case ModelFamily::kDit:
      return WarmedUp(DiffusionServable::Load(config, device, metrics));
    case ModelFamily::kVit:
    case ModelFamily::kTransNext:
      return WarmedUp(VisionServable::Load(config, family, device, metrics,
                                           image_decode_budget));
  }
  return absl::InvalidArgumentError("unknown model family");
}

}  // namespace

HostedModel::HostedModel(v1::ModelConfig config, Metrics* metrics,
                         ImageDecodeBudget* image_decode_budget)
    : config_(std::move(config)),
      metrics_(metrics),
      image_decode_budget_(image_decode_budget) {}

HostedModel::~HostedModel() = default;

void HostedModel::Load() {
  const absl::Time start = absl::Now();
  MOH_LOG(Info) << "model " << name() << ": loading " << config_.model_dir();
  absl::Status status;
  try {
    status = LoadUnchecked();
  } catch (const std::exception& e) {
    // LibTorch errors, failed allocations: a FAILED model, never a dead
    // server. LibTorch's message without its backtrace, cut short.
    status = absl::InternalError(absl::StrCat(
        "loading failed: ", Abbreviate(StatusFromException(e).message(), 512)));
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  absl::MutexLock lock(&mu_);
  if (!status.ok()) {
    state_ = State::kFailed;
    failure_reason_ = std::string(status.message());
    MOH_LOG(Error) << "model " << name() << ": FAILED: " << failure_reason_;
    return;
  }
  servable_->metrics()->SetLoadSeconds(seconds);
  state_ = State::kReady;
  MOH_LOG(Info) << "model " << name() << ": READY in " << seconds << " s on "
                << device_ << " (" << dtype_ << ")";
}

absl::Status HostedModel::LoadUnchecked() {
  MOH_ASSIGN_OR_RETURN(ModelConfig model_config,
                       LoadModelConfig(config_.model_dir()));
  const DeviceOptions device{config_.device(), config_.dtype(),
                             config_.weights()};
  MOH_ASSIGN_OR_RETURN(at::TensorOptions options, ResolveTensorOptions(device));
  device_ = options.device().str();
  const at::ScalarType dtype = at::typeMetaToScalarType(options.dtype());
  dtype_ = DtypeName(dtype);
  if (options.device().is_cpu() && dtype == at::kBFloat16 &&
      !ActiveExtension(CpuExtension::kAvx512Bf16)) {
    // Measured on a 2-core AVX2 EPYC (the tiny Llama 3 layout): a 256-token
    // prefill 25x and a decode step 4x slower than float32 activations over
    // bfloat16 weights.
    MOH_LOG(Warning)
        << "model " << name() << ": bfloat16 activations on a CPU without "
        << "AVX512_BF16 run LibTorch's generic bfloat16 kernels, many times "
        << "slower than float32; dtype: \"float32\" with weights: "
        << "\"bfloat16\" holds the weights at the same size and runs this "
        << "project's kernels";
  }
  MOH_ASSIGN_OR_RETURN(
      servable_, LoadServable(config_, model_config.family, device, metrics_,
                              image_decode_budget_));
  return absl::OkStatus();
}

HostedModel::State HostedModel::state() const {
  absl::MutexLock lock(&mu_);
  return StateLocked();
}

HostedModel::State HostedModel::StateLocked() const {
  // A READY model whose device was lost since can serve nothing more.
  if (state_ == State::kReady && !servable_->device_lost().ok()) {
    return State::kFailed;
  }
  return state_;
}

absl::StatusOr<Servable*> HostedModel::Ready() const {
  absl::MutexLock lock(&mu_);
  switch (state_) {
    case State::kReady:
      if (absl::Status lost = servable_->device_lost(); !lost.ok()) {
        return lost;
      }
      if (!accepting_) return DrainingError();
      return servable_.get();
    case State::kLoading:
      return absl::UnavailableError(
          absl::StrCat("model '", name(), "' is still loading"));
    case State::kFailed:
      return absl::FailedPreconditionError(absl::StrCat(
          "model '", name(), "' failed to load: ", failure_reason_));
  }
  return absl::InternalError("unknown model state");
}

bool HostedModel::Serves(Task task) const {
  return state() == State::kReady && servable_->Serves(task);
}

v1::ModelInfo HostedModel::Info() const {
  v1::ModelInfo info;
  info.set_name(name());
  State state;
  {
    absl::MutexLock lock(&mu_);
    state = StateLocked();
    // Valid UTF-8, or no client could parse the whole ListModels answer: a
    // checkpoint's error may quote its bytes (a pickle's global name).
    info.set_failure_reason(
        LossyUtf8(state == state_ ? failure_reason_
                                  : servable_->device_lost().message()));
  }
  info.set_state(state == State::kReady     ? v1::ModelInfo::READY
                 : state == State::kLoading ? v1::ModelInfo::LOADING
                                            : v1::ModelInfo::FAILED);
  if (state != State::kReady) return info;
  info.set_family(servable_->family());
  servable_->Describe(&info);
  info.set_device(device_);
  info.set_dtype(dtype_);
  // A servable names weights it converted (bfloat16, int8); others are held
  // as loaded, in the model's dtype.
  if (info.weights().empty()) info.set_weights(dtype_);
  return info;
}

void HostedModel::StopAccepting() {
  {
    absl::MutexLock lock(&mu_);
    accepting_ = false;
  }
  if (state() == State::kReady) servable_->StopAccepting();
}

bool HostedModel::Idle() const {
  return state() != State::kReady || servable_->Idle();
}

}  // namespace moh
