#include "service/servable/servable.h"

#include "absl/strings/str_cat.h"
#include "base/enum_names.h"
#include "base/field_error.h"
#include "base/log.h"
#include "model/core/device_context.h"

namespace moh {

Task TaskOf(const ClassifyCall& call) {
  return call.text.has_value() ? Task::kClassifyText : Task::kClassifyImage;
}

const char* TaskName(Task task) {
  static constexpr const char* kNames[] = {"Generate", "Classify of an image",
                                           "Classify of a text",
                                           "GenerateImage"};
  return EnumName(task, kNames);
}

void DescribeMoh(const MohConfig& moh, v1::ModelInfo* info) {
  info->set_router(RouterKindName(moh.router));
  for (const MohLayerConfig& layer : moh.layers) {
    v1::LayerHeads* heads = info->add_layers();
    heads->set_num_heads(layer.num_heads);
    heads->set_shared_heads(layer.shared_heads);
    heads->set_routed_heads(layer.routed_heads());
    heads->set_default_top_k(layer.top_k);
    if (layer.stage >= 0) {
      heads->set_stage(layer.stage);
      heads->set_block(layer.block);
    }
  }
  info->set_default_ratio(moh.DefaultRatio());
  info->set_min_ratio(moh.MinRatio());
}

std::vector<int32_t> LayerHeads(const MohConfig& moh) {
  std::vector<int32_t> heads;
  for (const MohLayerConfig& layer : moh.layers) {
    heads.push_back(layer.num_heads);
  }
  return heads;
}

absl::Status NotServedError(absl::string_view field, absl::string_view model,
                            absl::string_view family, Task task,
                            absl::string_view instead) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": model '", model, "' (", family,
                   ") does not serve ", TaskName(task), "; ", instead));
}

absl::Status CheckClassifyCall(const ClassifyCall& call) {
  const int inputs =
      call.image.has_value() + call.pixels.has_value() + call.text.has_value();
  if (inputs != 1) {
    return absl::InvalidArgumentError(
        "image, pixels or text: exactly one must be set");
  }
  if (call.top_n < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_n must be >= 0 (0 = default), got ", call.top_n));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Servable::Generate(
    GenerateCall, std::shared_ptr<GenerationObserver>) {
  return NotServedError("model", name_, family_, Task::kGenerate,
                        "choose a language model");
}

void Servable::CancelGenerate(uint64_t) {}

absl::Status Servable::device_lost() const {
  absl::MutexLock lock(&lost_mu_);
  return lost_;
}

void Servable::MarkDeviceLost(const absl::Status& status) {
  absl::MutexLock lock(&lost_mu_);
  if (lost_.ok()) lost_ = status;
}

absl::Status Servable::ForwardFailed(const at::Device& device,
                                     absl::Status error) {
  // LibTorch's errors (CatchTorchErrors) only: a refused input is not the
  // device's doing, and the check waits for the device.
  if (error.code() != absl::StatusCode::kInternal) return error;
  const absl::Status lost = DeviceLost(device);
  if (lost.ok()) return error;
  error = absl::UnavailableError(
      absl::StrCat("model '", name(), "': ", lost.message()));
  MOH_LOG(Error) << error.message();
  MarkDeviceLost(error);
  return error;
}

absl::StatusOr<std::string> Servable::ChatPrompt(
    const std::vector<ChatMessage>&, bool) const {
  return NotServedError("model", name_, family_, Task::kGenerate,
                        "choose a language model");
}

std::string Servable::TokenText(int32_t) const { return ""; }

absl::Status NoTokenizerError(absl::string_view model,
                              absl::string_view family) {
  return FieldError("model", absl::StrCat("'", model, "' (", family,
                                          ") has no tokenizer; choose a "
                                          "language model"));
}

absl::StatusOr<TokenizeResult> Servable::Tokenize(const TokenizeCall&) const {
  return NoTokenizerError(name_, family_);
}

absl::StatusOr<std::string> Servable::Detokenize(
    const std::vector<int32_t>&) const {
  return NoTokenizerError(name_, family_);
}

absl::StatusOr<TokenizerInfo> Servable::DescribeTokenizer() const {
  return NoTokenizerError(name_, family_);
}

absl::StatusOr<uint64_t> Servable::GenerateImage(
    GenerateImageCall, std::shared_ptr<ImageObserver>) {
  return NotServedError("model", name_, family_, Task::kGenerateImage,
                        "choose an image generator (MoH-DiT)");
}

void Servable::CancelGenerateImage(uint64_t) {}

absl::Status Servable::Classify(ClassifyCall call, ClassifyDone) {
  return NotServedError("model", name_, family_, TaskOf(call),
                        "choose a classifier");
}

}  // namespace moh
