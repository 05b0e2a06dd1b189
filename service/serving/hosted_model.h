// One model the server hosts: its lifecycle (LOADING → READY | FAILED with the
// reason) around the Servable its family's loader builds (servable.h). The
// RPCs go to the servable, which Ready() hands out while the model is READY
// and accepting. Thread-safe.
//
// hosted_model.cc is the composition root of the model families: the one
// file outside language/, vision/ and diffusion/ that names them
// (LoadServable; tests/layering_test.py holds every other file to it).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "moh/v1/inference.pb.h"
#include "moh/v1/server_config.pb.h"
#include "service/engine/image_decode_budget.h"
#include "service/metrics/metrics.h"
#include "service/servable/servable.h"

namespace moh {

class HostedModel {
 public:
  enum class State { kLoading, kReady, kFailed };

  // `config` has its defaults filled (see server_config.h); `metrics` and
  // `image_decode_budget` (shared by the server's models) outlive the model.
  HostedModel(v1::ModelConfig config, Metrics* metrics,
              ImageDecodeBudget* image_decode_budget);
  ~HostedModel();

  // Loads the model with its family's loader and warms it up. Blocking; call
  // once. Leaves the model READY, or FAILED with the reason. A READY model
  // becomes FAILED if a step leaves its device lost (Servable::device_lost).
  void Load();

  const std::string& name() const { return config_.name(); }
  State state() const;
  v1::ModelInfo Info() const;
  // The servable while READY and accepting; UNAVAILABLE while loading or
  // draining, or once its device was lost (naming it), FAILED_PRECONDITION
  // after a failed load.
  absl::StatusOr<Servable*> Ready() const;
  // READY and its family serves `task`.
  bool Serves(Task task) const;

  // Drain: new work gets UNAVAILABLE; work already accepted completes.
  void StopAccepting();
  // Nothing accepted is still running or waiting.
  bool Idle() const;

 private:
  absl::Status LoadUnchecked();
  State StateLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const v1::ModelConfig config_;
  Metrics* const metrics_;
  ImageDecodeBudget* const image_decode_budget_;

  mutable absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kLoading;
  std::string failure_reason_ ABSL_GUARDED_BY(mu_);
  bool accepting_ ABSL_GUARDED_BY(mu_) = true;

  // Set once by Load() before the state becomes READY; immutable afterwards.
  std::unique_ptr<Servable> servable_;
  std::string device_, dtype_;
};

}  // namespace moh
