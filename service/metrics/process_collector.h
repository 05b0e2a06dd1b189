// ProcessCollector: the standard process_* metrics of this process, read from
// /proc at scrape time, plus moh_gpu_memory_bytes{device} and
// moh_gpu_memory_limit_bytes{device} from an optional reader. A
// prometheus::Collectable: serve it next to the registry.
//
// It exports the names and help texts it is given: they are written, with
// every other name moh-server exports, in service/metrics/metrics.cc.
//
// Thread-safety: Collect and SetGpuMemoryReader may be called from any thread.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace moh {

// The name and help text of one exported family.
struct MetricDescription {
  const char* name;
  const char* help;
};

// One GPU's memory, in bytes: held by tensors, and what this process may hold
// (its share of the device: moh-server's gpu_memory_fraction).
struct GpuMemoryReading {
  double in_use = 0;
  double limit = 0;
};
using GpuMemoryReader =
    std::function<std::map<std::string, GpuMemoryReading>()>;

class ProcessCollector : public prometheus::Collectable {
 public:
  struct Descriptions {
    MetricDescription cpu_seconds;      // counter, seconds
    MetricDescription resident_memory;  // gauge, bytes
    MetricDescription virtual_memory;   // gauge, bytes
    MetricDescription start_time;       // gauge, seconds since the epoch
    MetricDescription open_fds;         // gauge
    MetricDescription max_fds;          // gauge
    MetricDescription gpu_memory;       // gauge{device}, bytes
    MetricDescription gpu_memory_limit;  // gauge{device}, bytes
  };

  explicit ProcessCollector(const Descriptions& descriptions);

  // Reads each GPU's memory by device; exported as `gpu_memory` and
  // `gpu_memory_limit` at scrape time when it returns a non-empty map.
  // Optional.
  void SetGpuMemoryReader(GpuMemoryReader reader) ABSL_LOCKS_EXCLUDED(mu_);

  // A family for each value /proc (and the GPU reader) could give.
  std::vector<prometheus::MetricFamily> Collect() const override
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const Descriptions descriptions_;
  const double clk_tck_;
  const double page_size_;
  double start_time_seconds_ = 0;  // 0 when unknown
  mutable absl::Mutex mu_;
  GpuMemoryReader gpu_reader_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moh
