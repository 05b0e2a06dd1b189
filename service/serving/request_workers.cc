#include "service/serving/request_workers.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace moh {

absl::StatusOr<std::unique_ptr<RequestWorkers>> RequestWorkers::Create(
    const Options& options) {
  std::unique_ptr<RequestWorkers> workers(
      new RequestWorkers(options.max_queued));
  Batcher<Work>::Options batching;
  batching.name = "request-workers";
  batching.max_batch_size = 1;
  batching.max_queue_delay = absl::ZeroDuration();
  batching.max_queued_requests = options.max_queued;
  batching.num_batch_threads = options.threads;
  MOH_ASSIGN_OR_RETURN(
      workers->batcher_,
      Batcher<Work>::Create(batching, [](std::vector<Work> batch) {
        for (Work& work : batch) work.run();
      }));
  return workers;
}

RequestWorkers::~RequestWorkers() {
  if (batcher_) batcher_->Stop();
}

absl::Status RequestWorkers::Run(std::function<void()> work) {
  absl::Status status = batcher_->Schedule(Work{std::move(work)});
  if (absl::IsResourceExhausted(status)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the server is busy: ", max_queued_,
        " requests already wait for a request worker (request_queue); "
        "retry later"));
  }
  return status;
}

}  // namespace moh
