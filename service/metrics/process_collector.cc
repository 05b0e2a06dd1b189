#include "service/metrics/process_collector.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>

#include "prometheus/client_metric.h"
#include "prometheus/metric_type.h"

namespace moh {
namespace {

struct Stat {
  double utime = 0, stime = 0, starttime = 0, vsize_bytes = 0, rss_pages = 0;
};

prometheus::MetricFamily Single(const MetricDescription& description,
                                prometheus::MetricType type, double value) {
  prometheus::MetricFamily f;
  f.name = description.name;
  f.help = description.help;
  f.type = type;
  prometheus::ClientMetric m;
  if (type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f.metric.push_back(std::move(m));
  return f;
}

// /proc/self/stat, see proc(5). The command name (field 2) may contain
// spaces and parentheses, so fields are counted after its last ')'.
bool ReadStat(Stat* stat) {
  std::ifstream in("/proc/self/stat");
  std::string line;
  if (!std::getline(in, line)) return false;
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream fields(line.substr(close + 1));
  std::vector<std::string> f;  // f[0] is field 3 (state).
  for (std::string s; fields >> s;) f.push_back(s);
  if (f.size() < 22) return false;
  auto at = [&](int field) {
    return std::strtod(f[field - 3].c_str(), nullptr);
  };
  stat->utime = at(14);
  stat->stime = at(15);
  stat->starttime = at(22);
  stat->vsize_bytes = at(23);
  stat->rss_pages = at(24);
  return true;
}

double ReadBootTime() {
  std::ifstream in("/proc/stat");
  for (std::string key; in >> key;) {
    if (key == "btime") {
      double btime = 0;
      in >> btime;
      return btime;
    }
    in.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  return 0;
}

// Entries of /proc/self/fd, not counting the one used to list them.
int CountOpenFds() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  const std::string self = std::to_string(dirfd(dir));
  int n = 0;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.' || self == e->d_name) continue;
    ++n;
  }
  closedir(dir);
  return n;
}

}  // namespace

ProcessCollector::ProcessCollector(const Descriptions& descriptions)
    : descriptions_(descriptions),
      clk_tck_(static_cast<double>(sysconf(_SC_CLK_TCK))),
      page_size_(static_cast<double>(sysconf(_SC_PAGESIZE))) {
  Stat stat;
  const double btime = ReadBootTime();
  if (ReadStat(&stat) && btime > 0 && clk_tck_ > 0) {
    start_time_seconds_ = btime + stat.starttime / clk_tck_;
  }
}

void ProcessCollector::SetGpuMemoryReader(GpuMemoryReader reader) {
  absl::MutexLock lock(&mu_);
  gpu_reader_ = std::move(reader);
}

std::vector<prometheus::MetricFamily> ProcessCollector::Collect() const {
  const Descriptions& d = descriptions_;
  std::vector<prometheus::MetricFamily> out;
  Stat stat;
  if (ReadStat(&stat)) {
    if (clk_tck_ > 0) {
      out.push_back(Single(d.cpu_seconds, prometheus::MetricType::Counter,
                           (stat.utime + stat.stime) / clk_tck_));
    }
    out.push_back(Single(d.resident_memory, prometheus::MetricType::Gauge,
                         stat.rss_pages * page_size_));
    out.push_back(Single(d.virtual_memory, prometheus::MetricType::Gauge,
                         stat.vsize_bytes));
  }
  if (start_time_seconds_ > 0) {
    out.push_back(Single(d.start_time, prometheus::MetricType::Gauge,
                         start_time_seconds_));
  }
  const int fds = CountOpenFds();
  if (fds >= 0) {
    out.push_back(Single(d.open_fds, prometheus::MetricType::Gauge, fds));
  }
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) {
    out.push_back(Single(d.max_fds, prometheus::MetricType::Gauge,
                         static_cast<double>(lim.rlim_cur)));
  }
  GpuMemoryReader reader;
  {
    absl::MutexLock lock(&mu_);
    reader = gpu_reader_;
  }
  const std::map<std::string, GpuMemoryReading> gpus =
      reader ? reader() : std::map<std::string, GpuMemoryReading>{};
  if (gpus.empty()) return out;
  // One gauge per device of each figure.
  auto per_device = [&](const MetricDescription& description,
                        double GpuMemoryReading::*figure) {
    prometheus::MetricFamily family;
    family.name = description.name;
    family.help = description.help;
    family.type = prometheus::MetricType::Gauge;
    for (const auto& [device, reading] : gpus) {
      prometheus::ClientMetric m;
      m.label.push_back({"device", device});
      m.gauge.value = reading.*figure;
      family.metric.push_back(std::move(m));
    }
    out.push_back(std::move(family));
  };
  per_device(d.gpu_memory, &GpuMemoryReading::in_use);
  per_device(d.gpu_memory_limit, &GpuMemoryReading::limit);
  return out;
}

}  // namespace moh
