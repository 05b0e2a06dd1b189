#include "service/metrics/request_log.h"

#include <atomic>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/abbreviate.h"
#include "base/log.h"

namespace moh {
namespace {

std::atomic<bool> access_log{false};

}  // namespace

absl::Status UnexpectedException(absl::string_view what_request,
                                 absl::string_view request_id,
                                 absl::string_view what) {
  MOH_LOG(Error) << what_request << " request " << request_id
                 << ": unexpected exception: " << Abbreviate(what, 512);
  return absl::InternalError(
      absl::StrCat("internal error (request id ", request_id,
                   "); the server logged it and serves other requests"));
}

std::string RequestId(std::optional<absl::string_view> from_client) {
  constexpr size_t kMaxLength = 128;
  if (from_client && !from_client->empty() &&
      from_client->size() <= kMaxLength) {
    bool printable = true;
    for (char c : *from_client) printable &= c > ' ' && c < 127;
    if (printable) return std::string(*from_client);
  }
  return RandomHex(16);
}

std::string RandomHex(int digits) {
  thread_local std::mt19937_64 random(std::random_device{}());
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex(digits, '0');
  uint64_t bits = 0;
  for (int i = 0; i < digits; ++i) {
    if (i % 16 == 0) bits = random();
    hex[i] = kHex[bits & 15];
    bits >>= 4;
  }
  return hex;
}

void SetAccessLog(bool on) { access_log = on; }

void RecordRequest(ModelMetrics* metrics, Metrics* server, Rpc rpc,
                   absl::string_view model, absl::StatusCode code,
                   absl::Time start, absl::string_view request_id) {
  const absl::Duration duration = absl::Now() - start;
  if (metrics != nullptr) {
    metrics->RequestFinished(rpc, code, duration);
  } else if (server != nullptr) {
    server->RequestWithoutModel(rpc, code);
  }
  const LogLevel level = access_log ? LogLevel::kInfo : LogLevel::kDebug;
  if (!LogEnabled(level)) return;
  LogMessage(level).stream()
      << RpcName(rpc) << " model=" << Abbreviate(model)
      << " code=" << absl::StatusCodeToString(code) << " duration=" << duration
      << " request_id=" << request_id;
}

}  // namespace moh
