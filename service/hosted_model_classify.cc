// HostedModel's Classify path: input checks, the dynamic batch, and the model
// calls for image classification and LM label scoring.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "model/generator.h"
#include "model/status_macros.h"
#include "service/hosted_model.h"
#include "service/image_decoder.h"

namespace moh {
namespace {

constexpr size_t kMaxLabels = 64;
constexpr size_t kMaxTextBytes = 1 << 20;
constexpr int32_t kDefaultImageTopN = 5;

std::vector<int64_t> Flatten(const at::Tensor& counts) {
  at::Tensor c = counts.to(at::kLong).contiguous().cpu();
  return std::vector<int64_t>(c.data_ptr<int64_t>(),
                              c.data_ptr<int64_t>() + c.numel());
}

}  // namespace

float HostedModel::AdaptRatio(float ratio, float min_ratio,
                              int64_t waiting) const {
  const int32_t depth = config_.adaptive().queue_depth();
  if (depth <= 0 || min_ratio <= 0.0f || waiting <= depth) return ratio;
  const MohConfig& moh = lm_ ? lm_->model->config().moh : vit_->config().moh;
  const double current = ratio > 0 ? ratio : moh.DefaultRatio();
  if (min_ratio >= current) return ratio;
  model_metrics_->RatioLowered();
  return min_ratio;
}

absl::StatusOr<HostedModel::ClassifyTask> HostedModel::PrepareClassify(
    ClassifyCall& call) const {
  ClassifyTask task;
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
  if (vit_) {
    const VitConfig& c = vit_->config();
    if (call.text) {
      return absl::InvalidArgumentError(
          absl::StrCat("text: model '", name(),
                       "' is an image classifier; send image or pixels"));
    }
    if (!call.labels.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("labels: model '", name(),
                       "' has fixed classes; labels are for language models"));
    }
    MOH_RETURN_IF_ERROR(
        ValidateActivation(call.ratio, call.min_ratio, c.moh.DefaultRatio()));
    const int64_t classes = c.labels.size();
    if (call.top_n > classes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "top_n must be in [0, ", classes, "], got ", call.top_n));
    }
    task.top_n = call.top_n > 0 ? call.top_n
                                : std::min<int32_t>(kDefaultImageTopN, classes);
    at::Tensor pixels;
    if (call.image) {
      MOH_ASSIGN_OR_RETURN(
          pixels, DecodeImage(*call.image, c.num_channels, c.image_size));
    } else {
      const auto& [shape, data] = *call.pixels;
      const std::vector<int64_t> expected = {c.num_channels, c.image_size,
                                             c.image_size};
      if (shape != expected) {
        return absl::InvalidArgumentError(absl::StrCat(
            "pixels.shape must be [", c.num_channels, ", ", c.image_size, ", ",
            c.image_size, "] (channels, height, width)"));
      }
      const int64_t n = c.num_channels * c.image_size * c.image_size;
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
    task.pixels = vit_->NormalizePixels(pixels.unsqueeze(0)).squeeze(0);
    return task;
  }
  // Language model: label scoring.
  const LlamaConfig& c = lm_->model->config();
  if (!call.text) {
    return absl::InvalidArgumentError(
        absl::StrCat(call.image ? "image" : "pixels", ": model '", name(),
                     "' is a language model; send text and labels"));
  }
  if (call.labels.empty() || call.labels.size() > kMaxLabels) {
    return absl::InvalidArgumentError(absl::StrCat(
        "labels: a language model scores candidate labels; send 1 to ",
        kMaxLabels, " labels, got ", call.labels.size()));
  }
  if (call.text->empty() || call.text->size() > kMaxTextBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("text must have 1 to ", kMaxTextBytes, " bytes, got ",
                     call.text->size()));
  }
  if (!lm_->tokenizer) {
    return absl::InvalidArgumentError(
        absl::StrCat("text: model '", name(), "' has no tokenizer.json"));
  }
  MOH_RETURN_IF_ERROR(
      ValidateActivation(call.ratio, call.min_ratio, c.moh.DefaultRatio()));
  if (call.top_n > static_cast<int32_t>(call.labels.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_n must be in [0, ", call.labels.size(),
                     "] (the number of labels), got ", call.top_n));
  }
  task.top_n = call.top_n > 0 ? call.top_n : call.labels.size();
  task.context_ids = lm_->tokenizer->Encode(*call.text, true);
  const int64_t max_len = c.max_position_embeddings;
  for (size_t i = 0; i < call.labels.size(); ++i) {
    std::vector<int32_t> ids = lm_->tokenizer->Encode(call.labels[i], false);
    if (ids.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("labels[", i, "] must not be empty"));
    }
    if (static_cast<int64_t>(task.context_ids.size() + ids.size()) > max_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("text + labels[", i, "] must fit in ", max_len,
                       " tokens, got ", task.context_ids.size() + ids.size()));
    }
    task.label_ids.push_back(std::move(ids));
  }
  task.labels = std::move(call.labels);
  return task;
}

absl::Status HostedModel::Classify(ClassifyCall call, ClassifyDone done) {
  MOH_RETURN_IF_ERROR(CheckReady());
  MOH_ASSIGN_OR_RETURN(ClassifyTask task, PrepareClassify(call));
  task.ratio =
      AdaptRatio(call.ratio, call.min_ratio, classify_batcher_->NumQueued());
  task.deadline = call.deadline;
  task.enqueued = absl::Now();
  task.done = std::move(done);
  {
    absl::MutexLock lock(&mu_);
    ++classify_in_flight_;
  }
  absl::Status status = classify_batcher_->Schedule(std::move(task));
  if (!status.ok()) {
    absl::MutexLock lock(&mu_);
    --classify_in_flight_;
  }
  return status;
}

void HostedModel::FinishClassify(ClassifyTask& task,
                                 absl::StatusOr<ClassifyResult> result) {
  if (result.ok()) {
    model_metrics_->ActivationRatio(result->effective_ratio);
    model_metrics_->HeadTokens(result->head_tokens);
  }
  task.done(std::move(result));
  absl::MutexLock lock(&mu_);
  --classify_in_flight_;
}

void HostedModel::ProcessClassifyBatch(std::vector<ClassifyTask> batch) {
  const absl::Time now = absl::Now();
  std::vector<ClassifyTask> live;
  for (ClassifyTask& task : batch) {
    model_metrics_->QueueTime(Rpc::kClassify, now - task.enqueued);
    if (now >= task.deadline) {
      // A request whose deadline has passed is never computed.
      FinishClassify(task, absl::DeadlineExceededError(
                               "deadline passed while the request waited"));
    } else {
      live.push_back(std::move(task));
    }
  }
  if (live.empty()) return;
  model_metrics_->BatchSize(BatchKind::kClassify, live.size());
  if (vit_) {
    RunImageBatch(live);
  } else {
    for (ClassifyTask& task : live) RunLabelScoring(task);
  }
}

void HostedModel::RunImageBatch(std::vector<ClassifyTask>& batch) {
  std::vector<at::Tensor> pixels;
  std::vector<float> ratios;
  for (const ClassifyTask& task : batch) {
    pixels.push_back(task.pixels);
    ratios.push_back(task.ratio);
  }
  auto out = vit_->Forward(at::stack(pixels), ratios);
  if (!out.ok()) {
    for (ClassifyTask& task : batch) FinishClassify(task, out.status());
    return;
  }
  const VitConfig& c = vit_->config();
  const int64_t tokens = 1 + c.num_patches();
  at::Tensor probs = at::softmax(out->logits, -1);
  for (size_t b = 0; b < batch.size(); ++b) {
    ClassifyTask& task = batch[b];
    ClassifyResult result;
    auto [scores, indices] = at::topk(probs[b], task.top_n);
    for (int64_t i = 0; i < task.top_n; ++i) {
      const int64_t index = indices[i].item<int64_t>();
      result.classes.push_back({c.labels[index], static_cast<int32_t>(index),
                                scores[i].item<float>(), 0.0});
    }
    at::Tensor counts = out->head_token_counts[b];
    result.effective_ratio = EffectiveRatio(counts, tokens);
    result.applied_ratio = task.ratio;
    result.routed_tokens = tokens;
    result.head_tokens = Flatten(counts);
    FinishClassify(task, std::move(result));
  }
}

void HostedModel::RunLabelScoring(ClassifyTask& task) {
  auto scored =
      ScoreLabels(*lm_->model, task.context_ids, task.label_ids, task.ratio);
  if (!scored.ok()) {
    FinishClassify(task, scored.status());
    return;
  }
  const std::vector<double>& ll = scored->log_likelihoods;
  // Scores: each label's likelihood, normalized over the candidates.
  at::Tensor probs = at::softmax(at::tensor(ll, at::kDouble), 0);
  std::vector<int32_t> order(ll.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return ll[a] > ll[b]; });
  ClassifyResult result;
  for (int32_t i = 0; i < task.top_n; ++i) {
    const int32_t index = order[i];
    result.classes.push_back({task.labels[index], index,
                              static_cast<float>(probs[index].item<double>()),
                              ll[index]});
  }
  result.applied_ratio = task.ratio;
  result.effective_ratio =
      EffectiveRatio(scored->head_token_counts, scored->tokens);
  result.routed_tokens = scored->tokens;
  result.head_tokens = Flatten(scored->head_token_counts);
  FinishClassify(task, std::move(result));
}

}  // namespace moh
