#include "service/vision/vision_servable.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/env.h"
#include "base/status_macros.h"
#include "model/core/transnext_model.h"
#include "model/core/vit_model.h"
#include "model/generation/generator.h"
#include "service/vision/image_decoder.h"

namespace moh {
namespace {

constexpr int32_t kDefaultImageTopN = 5;

}  // namespace

absl::StatusOr<std::unique_ptr<VisionServable>> VisionServable::Load(
    const v1::ModelConfig& config, ModelFamily family,
    const DeviceOptions& device, Metrics* metrics,
    ImageDecodeBudget* image_decode_budget) {
  std::unique_ptr<ImageClassifier> model;
  if (family == ModelFamily::kTransNext) {
    MOH_ASSIGN_OR_RETURN(model,
                         TransNextModel::Load(config.model_dir(), device));
  } else {
    MOH_ASSIGN_OR_RETURN(model, VitModel::Load(config.model_dir(), device));
  }
  const bool head_metrics = !config.has_head_metrics() || config.head_metrics();
  ModelMetrics* model_metrics =
      metrics->ForModel(config.name(), LayerHeads(model->moh()), head_metrics);
  std::unique_ptr<VisionServable> servable(new VisionServable(
      config.name(), family == ModelFamily::kTransNext ? "transnext" : "vit",
      std::move(model), model_metrics, image_decode_budget));
  VisionServable* self = servable.get();
  MOH_ASSIGN_OR_RETURN(
      servable->classifier_,
      BatchedClassifier::Create(config, self->model_->moh(), model_metrics,
                                [self](std::vector<ClassifyTask>& batch) {
                                  return self->RunBatch(batch);
                                }));
  return servable;
}

VisionServable::VisionServable(const std::string& name,
                               const std::string& family,
                               std::unique_ptr<ImageClassifier> model,
                               ModelMetrics* metrics,
                               ImageDecodeBudget* image_decode_budget)
    : Servable(name, family),
      model_(std::move(model)),
      preprocessing_(model_->preprocessing()),
      layer_tokens_(model_->LayerTokens()),
      routable_pairs_(RoutablePairs(model_->moh(), layer_tokens_)),
      metrics_(metrics),
      image_decode_budget_(image_decode_budget),
      out_of_memory_over_batch_(
          EnvInt("MOH_TEST_OUT_OF_MEMORY_OVER_BATCH", -1)) {}

absl::Status VisionServable::Warmup() const {
  const ImagePreprocessing& p = preprocessing_;
  at::Tensor pixels =
      at::zeros({1, p.num_channels, p.image_size, p.image_size});
  return model_->Forward(pixels, {0.0f}).status();
}

void VisionServable::Describe(v1::ModelInfo* info) const {
  info->set_max_seq_len(
      *std::max_element(layer_tokens_.begin(), layer_tokens_.end()));
  for (const std::string& label : model_->labels()) info->add_labels(label);
  info->set_weights(WeightFormatName(model_->linear_weights()));
  DescribeMoh(model_->moh(), info);
}

absl::Status VisionServable::Classify(ClassifyCall call, ClassifyDone done) {
  MOH_ASSIGN_OR_RETURN(ClassifyTask task, Prepare(call));
  return classifier_->Submit(std::move(task), std::move(call), std::move(done));
}

absl::StatusOr<ClassifyTask> VisionServable::Prepare(ClassifyCall& call) const {
  MOH_RETURN_IF_ERROR(CheckClassifyCall(call));
  if (call.text) {
    return NotServedError("text", name(), family(), Task::kClassifyText,
                          "send image or pixels");
  }
  if (!call.labels.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("labels: model '", name(),
                     "' has fixed classes; labels are for language models"));
  }
  const ImagePreprocessing& p = preprocessing_;
  ClassifyTask task;
  MOH_ASSIGN_OR_RETURN(
      task.activation,
      Activation::Resolve(model_->moh(), call.ratio, call.min_ratio));
  const int64_t classes = model_->labels().size();
  if (call.top_n > classes) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_n must be in [0, ", classes, "], got ", call.top_n));
  }
  task.top_n = call.top_n > 0 ? call.top_n
                              : std::min<int32_t>(kDefaultImageTopN, classes);
  at::Tensor pixels;
  if (call.image) {
    ImageResize resize;
    resize.channels = p.num_channels;
    resize.size = p.image_size;
    resize.shorter_side = p.resize_size;
    resize.bicubic = p.bicubic;
    MOH_ASSIGN_OR_RETURN(
        pixels, DecodeImage(*call.image, resize, image_decode_budget_));
  } else {
    const auto& [shape, data] = *call.pixels;
    const std::vector<int64_t> expected = {p.num_channels, p.image_size,
                                           p.image_size};
    if (shape != expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pixels.shape must be [", p.num_channels, ", ", p.image_size, ", ",
          p.image_size, "] (channels, height, width)"));
    }
    const int64_t n = int64_t{p.num_channels} * p.image_size * p.image_size;
    if (static_cast<int64_t>(data.size()) != n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pixels.data must have ", n,
          " values (the product of pixels.shape), got ", data.size()));
    }
    for (float v : data) {
      if (!(v >= 0.0f && v <= 1.0f)) {
        return absl::InvalidArgumentError(
            absl::StrCat("pixels.data values must be in [0, 1], got ", v));
      }
    }
    pixels = at::tensor(data).view(expected);
  }
  task.pixels = model_->NormalizePixels(pixels.unsqueeze(0)).squeeze(0);
  return task;
}

absl::Status VisionServable::RunBatch(std::vector<ClassifyTask>& batch) {
  std::vector<at::Tensor> pixels;
  std::vector<LayerTopK> top_k;
  for (const ClassifyTask& task : batch) {
    pixels.push_back(task.pixels);
    top_k.push_back(task.activation.top_k());
  }
  absl::StatusOr<ClassifierOutput> out;
  if (out_of_memory_over_batch_ >= 0 &&
      static_cast<int64_t>(batch.size()) > out_of_memory_over_batch_) {
    out = absl::ResourceExhaustedError(
        absl::StrCat("out of memory: injected: batch of ", batch.size(),
                     " over $MOH_TEST_OUT_OF_MEMORY_OVER_BATCH"));
  } else {
    out = model_->ForwardWithTopK(at::stack(pixels), top_k);
  }
  if (!out.ok()) {
    // Out of memory: the classifier runs the batch's halves.
    if (absl::IsResourceExhausted(out.status())) return out.status();
    const absl::Status error = ForwardFailed(model_->device(), out.status());
    for (ClassifyTask& task : batch) classifier_->Finish(task, error);
    return absl::OkStatus();
  }
  const std::vector<std::string>& labels = model_->labels();
  const int64_t tokens =
      *std::max_element(layer_tokens_.begin(), layer_tokens_.end());
  const bool uniform = std::all_of(layer_tokens_.begin(), layer_tokens_.end(),
                                   [&](int64_t n) { return n == tokens; });
  at::Tensor probs = at::softmax(out->logits, -1);
  for (size_t b = 0; b < batch.size(); ++b) {
    ClassifyTask& task = batch[b];
    ClassifyResult result;
    auto [scores, indices] = at::topk(probs[b], task.top_n);
    for (int64_t i = 0; i < task.top_n; ++i) {
      const int64_t index = indices[i].item<int64_t>();
      result.classes.push_back({labels[index], static_cast<int32_t>(index),
                                scores[i].item<float>(), 0.0});
    }
    at::Tensor counts = out->head_token_counts[b];
    result.effective_ratio =
        static_cast<double>(counts.sum().item<int64_t>()) / routable_pairs_;
    result.applied_ratio = static_cast<float>(task.activation.nominal_ratio());
    result.routed_tokens = tokens;
    if (!uniform) result.layer_tokens = layer_tokens_;
    result.head_tokens = HeadTokenVector(counts);
    classifier_->Finish(task, std::move(result));
  }
  return absl::OkStatus();
}

}  // namespace moh
