// The threads that prepare requests: finding the model, converting the
// request, tokenizing prompts and labels, decoding images and validating
// fields against the model, up to handing the request to its executor or
// batcher. gRPC's callback threads only post this work here, so that a flood
// of heavy requests (megabyte prompts, 16-megapixel images) cannot starve
// them: health checks and ListModels keep answering, and the queue in front
// of the workers is bounded. A Batcher (batcher.h) of single-task batches.
// Thread-safe.
#pragma once

#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "service/config/config_limits.h"
#include "service/engine/batcher.h"

namespace moh {

class RequestWorkers {
 public:
  struct Options {
    // Worker threads. Range config_limits::kRequestThreads.
    int threads = config_limits::kRequestThreads.default_value;
    // Requests that may wait for a worker. Range config_limits::kRequestQueue.
    int max_queued = config_limits::kRequestQueue.default_value;
  };

  // INVALID_ARGUMENT when an option is out of range (the server's config
  // checks its fields first).
  static absl::StatusOr<std::unique_ptr<RequestWorkers>> Create(
      const Options& options);
  // Runs what is queued, then joins the workers.
  ~RequestWorkers();

  // Runs `work` on a worker, in arrival order. Never blocks. When it returns
  // an error, `work` will not run: RESOURCE_EXHAUSTED when `max_queued`
  // requests wait already (naming request_queue), UNAVAILABLE once the
  // workers are stopping.
  absl::Status Run(std::function<void()> work);

 private:
  struct Work {
    std::function<void()> run;
    size_t size() const { return 1; }
  };
  explicit RequestWorkers(int max_queued) : max_queued_(max_queued) {}

  const int max_queued_;
  std::unique_ptr<Batcher<Work>> batcher_;
};

}  // namespace moh
