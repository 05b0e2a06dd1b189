// The Classify machinery every classifying family shares: a dynamic batch
// (batcher.h) of prepared tasks, adaptive activation at submission, the
// deadline checked before any compute, the metrics of each result, and the
// in-flight count a drain waits for. The family prepares tasks (decoding,
// tokenizing, checks naming the fields) and runs batches.
// Thread-safe.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "model/core/activation.h"
#include "moh/v1/server_config.pb.h"
#include "service/engine/batcher.h"
#include "service/metrics/metrics.h"
#include "service/servable/servable.h"

namespace moh {

// One Classify request, ready to compute.
struct ClassifyTask {
  at::Tensor pixels;                 // [C, S, S] normalized (image models)
  std::vector<int32_t> context_ids;  // LM label scoring
  std::vector<std::vector<int32_t>> label_ids;  // LM label scoring
  std::vector<std::string> labels;
  int32_t top_n = 0;
  Activation activation;  // resolved against the model; lowered under load
  absl::Time deadline;
  std::function<bool()> cancelled;  // ClassifyCall::cancelled
  absl::Time enqueued;
  ClassifyDone done;
  size_t size() const { return 1; }
};

// Head counts [L, H] (any device, any integer type) as a flat host vector.
std::vector<int64_t> HeadTokenVector(const at::Tensor& counts);

class BatchedClassifier {
 public:
  // Computes a batch of live tasks and calls Finish() once for each: OK. Or,
  // having finished none, returns out of memory (RESOURCE_EXHAUSTED): the
  // classifier then runs the batch's halves (their tasks still live), and
  // fails a single task with it.
  using RunBatchFn =
      std::function<absl::Status(std::vector<ClassifyTask>& batch)>;

  // `config`: the model's (batching, adaptive); `metrics` outlives it.
  static absl::StatusOr<std::unique_ptr<BatchedClassifier>> Create(
      const v1::ModelConfig& config, const MohConfig& moh,
      ModelMetrics* metrics, RunBatchFn run_batch);
  ~BatchedClassifier();

  // Queues `task` (prepared from `call`, its activation resolved) with the
  // call's deadline and cancellation check; `done` gets its result. Adaptive
  // activation may lower it. RESOURCE_EXHAUSTED when the queue is full.
  absl::Status Submit(ClassifyTask task, ClassifyCall call, ClassifyDone done);
  // Delivers a task's result and records its metrics.
  void Finish(ClassifyTask& task, absl::StatusOr<ClassifyResult> result);
  // Finishes `task` with DEADLINE_EXCEEDED or CANCELLED and returns true when
  // its deadline has passed or its client has gone: it must not be computed.
  // Batches check every task before the batch; families that compute task by
  // task check each before it.
  bool FinishIfGone(ClassifyTask& task);
  bool Idle() const;

 private:
  BatchedClassifier(const v1::ModelConfig& config, const MohConfig& moh,
                    ModelMetrics* metrics, RunBatchFn run_batch);
  void ProcessBatch(std::vector<ClassifyTask> batch);
  // Runs `live` (every task live), in halves while it runs out of memory.
  void RunLive(std::vector<ClassifyTask>& live);

  const std::string name_;  // the model's: logs
  const MohConfig& moh_;
  const int32_t adaptive_queue_depth_;
  ModelMetrics* const metrics_;
  const RunBatchFn run_batch_;
  std::unique_ptr<Batcher<ClassifyTask>> batcher_;
  mutable absl::Mutex mu_;
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace moh
