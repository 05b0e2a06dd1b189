// Standard process_* metrics (CPU seconds, resident and virtual memory, start
// time, open and maximum file descriptors) read from /proc at scrape time,
// plus moh_gpu_memory_bytes{device} from an optional reader. A Collectable of
// its own, served beside the registry (Metrics::Collectables()).
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace moh {

class ProcessCollector : public prometheus::Collectable {
 public:
  // Reads bytes in use per device label (e.g. "cuda:0"); an empty map
  // exports nothing.
  using GpuMemoryReader = std::function<std::map<std::string, double>()>;

  ProcessCollector();

  void SetGpuMemoryReader(GpuMemoryReader reader);

  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const double clk_tck_;
  const double page_size_;
  double start_time_seconds_ = 0;
  mutable absl::Mutex mu_;
  GpuMemoryReader gpu_reader_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moh
