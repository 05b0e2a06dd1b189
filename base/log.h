// The one logger of every moh-serve program and library (Debian's Abseil
// predates absl/log).
// One line per message on stderr: "2026-11-20T22:10:00.123Z I message".
// Thread-safe; lines never interleave.
#pragma once

#include <sstream>

namespace moh {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

void SetLogLevel(LogLevel level);
bool LogEnabled(LogLevel level);

class LogMessage {
 public:
  explicit LogMessage(LogLevel level) : level_(level) {}
  ~LogMessage();
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};

}  // namespace moh

#define MOH_LOG(level)                                 \
  if (!::moh::LogEnabled(::moh::LogLevel::k##level)) { \
  } else                                               \
    ::moh::LogMessage(::moh::LogLevel::k##level).stream()
