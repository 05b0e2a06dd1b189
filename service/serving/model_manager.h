// The models a server hosts, by name, and their lifecycle.
//
// Models load in the background (one after another, in config order) so that
// the server answers ListModels and health checks while they load.
// Thread-safe.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "moh/v1/inference.pb.h"
#include "moh/v1/server_config.pb.h"
#include "service/engine/image_decode_budget.h"
#include "service/metrics/metrics.h"
#include "service/serving/hosted_model.h"

namespace moh {

class ModelManager {
 public:
  // `config` must be resolved (ResolveServerConfig). Starts loading at once.
  ModelManager(const v1::ServerConfig& config, Metrics* metrics);
  ~ModelManager();

  // Blocks until every model has finished loading (READY or FAILED), or, after
  // StopLoading(), until the one loading then has.
  void WaitLoaded();
  // Models not yet started stay unloaded (LOADING): a server stopping during
  // start-up waits for one model at most.
  void StopLoading();
  // Every model finished loading and is READY.
  bool AllReady() const;

  // The model named `name` (or whose alias it is), or for an empty name the
  // only model, or else the first (in config order) READY one that serves
  // `task`. NOT_FOUND naming the hosted models otherwise.
  absl::StatusOr<HostedModel*> Find(absl::string_view name, Task task) const;
  // The alias named `name` (ModelConfig.aliases), or null.
  const v1::ModelAlias* FindAlias(absl::string_view name) const;

  // Every model, each followed by its aliases.
  std::vector<v1::ModelInfo> List() const;
  // The server's metrics (outlive the manager).
  Metrics* metrics() const { return metrics_; }

  // Drain: no model accepts new work; work already accepted completes.
  void StopAccepting();
  bool Idle() const;

 private:
  Metrics* const metrics_;
  // Shared by the models' image decodes (image_decode_memory_mb); outlives
  // them.
  ImageDecodeBudget image_decode_budget_;
  std::atomic<bool> stop_loading_{false};
  std::vector<std::unique_ptr<HostedModel>> models_;
  struct Alias {
    v1::ModelAlias config;
    HostedModel* model = nullptr;
  };
  std::vector<Alias> aliases_;  // in config order
  std::thread loader_;
};

}  // namespace moh
