#include "base/log.h"

#include <atomic>
#include <cstdio>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace moh {
namespace {
std::atomic<int> min_level{static_cast<int>(LogLevel::kInfo)};
}  // namespace

void SetLogLevel(LogLevel level) { min_level = static_cast<int>(level); }

bool LogEnabled(LogLevel level) {
  return static_cast<int>(level) >= min_level.load(std::memory_order_relaxed);
}

LogMessage::~LogMessage() {
  static constexpr char kLetters[] = {'D', 'I', 'W', 'E'};
  const std::string line = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ ",
                                            absl::Now(), absl::UTCTimeZone()) +
                           kLetters[static_cast<int>(level_)] + " " +
                           stream_.str() + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);  // one write per line
}

}  // namespace moh
