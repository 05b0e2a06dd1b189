// The vision families: image classification (Classify with image or pixels)
// on a MoH ViT (timm layout, family "vit") or a MoH-ViT TransNeXt as released
// (family "transnext"), in dynamic batches.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "model/core/image_classifier.h"
#include "model/core/model_config.h"
#include "moh/v1/server_config.pb.h"
#include "service/engine/batched_classifier.h"
#include "service/engine/image_decode_budget.h"
#include "service/metrics/metrics.h"
#include "service/servable/servable.h"

namespace moh {

class VisionServable : public Servable {
 public:
  // Loads the classifier of `config.model_dir()` (`family`: kVit or
  // kTransNext) on `device`. Its image decodes reserve their memory in
  // `image_decode_budget` (not owned; may be shared with other models;
  // outlives the servable).
  static absl::StatusOr<std::unique_ptr<VisionServable>> Load(
      const v1::ModelConfig& config, ModelFamily family,
      const DeviceOptions& device, Metrics* metrics,
      ImageDecodeBudget* image_decode_budget);

  void Describe(v1::ModelInfo* info) const override;
  bool Serves(Task task) const override { return task == Task::kClassifyImage; }
  const MohConfig& moh() const override { return model_->moh(); }
  ModelMetrics* metrics() const override { return metrics_; }
  absl::Status Classify(ClassifyCall call, ClassifyDone done) override;
  void StopAccepting() override {}
  bool Idle() const override { return classifier_->Idle(); }

  // One forward of a blank image.
  absl::Status Warmup() const;

 private:
  VisionServable(const std::string& name, const std::string& family,
                 std::unique_ptr<ImageClassifier> model, ModelMetrics* metrics,
                 ImageDecodeBudget* image_decode_budget);
  absl::StatusOr<ClassifyTask> Prepare(ClassifyCall& call) const;
  // BatchedClassifier::RunBatchFn.
  absl::Status RunBatch(std::vector<ClassifyTask>& batch);

  const std::unique_ptr<ImageClassifier> model_;
  const ImagePreprocessing preprocessing_;
  const std::vector<int64_t> layer_tokens_;
  const int64_t routable_pairs_;  // tokens x heads over the layers
  ModelMetrics* const metrics_;
  ImageDecodeBudget* const image_decode_budget_;
  // Tests only: batches of more images than $MOH_TEST_OUT_OF_MEMORY_OVER_BATCH
  // run out of memory, as batches whose activations a device cannot hold
  // would. -1: none.
  const int64_t out_of_memory_over_batch_;
  std::unique_ptr<BatchedClassifier> classifier_;  // last: stopped first
};

}  // namespace moh
