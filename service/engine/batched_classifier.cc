#include "service/engine/batched_classifier.h"

#include <utility>

#include "base/log.h"
#include "base/status_macros.h"
#include "service/engine/adaptive_activation.h"

namespace moh {

std::vector<int64_t> HeadTokenVector(const at::Tensor& counts) {
  at::Tensor c = counts.to(at::kLong).contiguous().cpu();
  return std::vector<int64_t>(c.data_ptr<int64_t>(),
                              c.data_ptr<int64_t>() + c.numel());
}

BatchedClassifier::BatchedClassifier(const v1::ModelConfig& config,
                                     const MohConfig& moh,
                                     ModelMetrics* metrics,
                                     RunBatchFn run_batch)
    : name_(config.name()),
      moh_(moh),
      adaptive_queue_depth_(config.adaptive().queue_depth()),
      metrics_(metrics),
      run_batch_(std::move(run_batch)) {}

absl::StatusOr<std::unique_ptr<BatchedClassifier>> BatchedClassifier::Create(
    const v1::ModelConfig& config, const MohConfig& moh, ModelMetrics* metrics,
    RunBatchFn run_batch) {
  std::unique_ptr<BatchedClassifier> classifier(
      new BatchedClassifier(config, moh, metrics, std::move(run_batch)));
  Batcher<ClassifyTask>::Options batching;
  batching.name = config.name() + "/classify";
  batching.max_batch_size = config.batching().max_batch_size();
  batching.max_queue_delay =
      absl::Milliseconds(config.batching().max_queue_delay_ms());
  batching.max_queued_requests = config.batching().max_queued_requests();
  BatchedClassifier* self = classifier.get();
  MOH_ASSIGN_OR_RETURN(classifier->batcher_,
                       Batcher<ClassifyTask>::Create(
                           batching, [self](std::vector<ClassifyTask> batch) {
                             self->ProcessBatch(std::move(batch));
                           }));
  return classifier;
}

BatchedClassifier::~BatchedClassifier() {
  // Its threads call back into this object.
  if (batcher_) batcher_->Stop();
}

absl::Status BatchedClassifier::Submit(ClassifyTask task, ClassifyCall call,
                                       ClassifyDone done) {
  task.deadline = call.deadline;
  task.cancelled = std::move(call.cancelled);
  task.done = std::move(done);
  if (LowerActivation(adaptive_queue_depth_, batcher_->NumQueued(),
                      task.activation.CanLower())) {
    task.activation = task.activation.Lowered(moh_);
    metrics_->RatioLowered();
  }
  task.enqueued = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    ++in_flight_;
  }
  absl::Status status = batcher_->Schedule(std::move(task));
  if (!status.ok()) {
    absl::MutexLock lock(&mu_);
    --in_flight_;
  }
  return status;
}

void BatchedClassifier::Finish(ClassifyTask& task,
                               absl::StatusOr<ClassifyResult> result) {
  if (result.ok()) {
    metrics_->ActivationRatio(result->effective_ratio);
    metrics_->HeadTokens(result->head_tokens);
  }
  task.done(std::move(result));
  absl::MutexLock lock(&mu_);
  --in_flight_;
}

bool BatchedClassifier::Idle() const {
  absl::MutexLock lock(&mu_);
  return in_flight_ == 0;
}

bool BatchedClassifier::FinishIfGone(ClassifyTask& task) {
  if (absl::Now() >= task.deadline) {
    // A request whose deadline has passed is never computed.
    Finish(task, absl::DeadlineExceededError(
                     "deadline passed while the request waited"));
    return true;
  }
  if (task.cancelled && task.cancelled()) {
    Finish(task, absl::CancelledError("cancelled by the client"));
    return true;
  }
  return false;
}

void BatchedClassifier::ProcessBatch(std::vector<ClassifyTask> batch) {
  const absl::Time now = absl::Now();
  std::vector<ClassifyTask> live;
  for (ClassifyTask& task : batch) {
    metrics_->QueueTime(Rpc::kClassify, now - task.enqueued);
    if (!FinishIfGone(task)) live.push_back(std::move(task));
  }
  if (live.empty()) return;
  metrics_->BatchSize(BatchKind::kClassify, live.size());
  RunLive(live);
}

void BatchedClassifier::RunLive(std::vector<ClassifyTask>& live) {
  const absl::Status status = run_batch_(live);
  if (status.ok()) return;
  if (live.size() == 1) {
    Finish(live[0], status);
    return;
  }
  MOH_LOG(Warning) << "model " << name_ << ": a Classify batch of "
                   << live.size() << " failed: " << status.message()
                   << "; its halves run again";
  metrics_->StepsRetried();
  const size_t half = live.size() / 2;
  for (auto [begin, end] :
       {std::make_pair(size_t{0}, half), std::make_pair(half, live.size())}) {
    std::vector<ClassifyTask> part;
    for (size_t i = begin; i < end; ++i) {
      if (!FinishIfGone(live[i])) part.push_back(std::move(live[i]));
    }
    if (!part.empty()) RunLive(part);
  }
}

}  // namespace moh
