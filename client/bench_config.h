// BenchConfig: everything one moh-bench run is asked to do, validated, plus
// RequestSource, which turns it into the stream of requests to send.
#ifndef MOH_CLIENT_BENCH_CONFIG_H_
#define MOH_CLIENT_BENCH_CONFIG_H_

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "moh/v1/inference.pb.h"

namespace moh::client {

enum class BenchRpc { kGenerate, kClassify };
// gRPC (the Inference service) or the OpenAI-compatible HTTP API (generate
// only: POST /v1/completions, streamed).
enum class BenchApi { kGrpc, kOpenAi };

// Hard caps on one run, whatever the flags say.
inline constexpr int64_t kMaxBenchRequests = 1000000;
inline constexpr double kMaxBenchSeconds = 3600;
inline constexpr int kMaxBenchInFlight = 10000;

struct BenchConfig {
  std::string server;  // HOST:PORT of the api's port
  std::string token;   // bearer token; empty: none
  BenchApi api = BenchApi::kGrpc;
  BenchRpc rpc = BenchRpc::kGenerate;
  std::string model;  // Empty: the server's default model.

  // Load shape: closed loop at `concurrency` workers, or, with `rate` set, an
  // open loop of Poisson arrivals at `rate` requests/s that drops an arrival
  // (counted) while `max_in_flight` requests are outstanding.
  std::optional<int> concurrency;  // Closed loop; unset with no rate: 1.
  std::optional<double> rate;      // Open loop, requests/s.
  int max_in_flight = 256;
  // Bounds on the measured phase; at least one must be set, an unset one is
  // the hard cap. Requests counts arrivals (sent + dropped).
  std::optional<int64_t> requests;
  std::optional<absl::Duration> duration;
  // Sent before the measured phase, at the closed-loop concurrency (1 for an
  // open loop); not counted.
  int64_t warmup_requests = 0;
  // Deadline of each request, from its start.
  absl::Duration timeout = absl::Seconds(60);
  uint64_t seed = 1;

  // Requested activation ratios; each request takes one, round-robin or
  // (ratio_random) drawn with the seed. {0} = the model's default.
  std::vector<float> ratios = {0};
  bool ratio_random = false;
  float min_ratio = 0;

  // Generate.
  std::string prompt;     // Used when prompt_tokens == 0.
  int prompt_tokens = 0;  // > 0: synthetic token_ids prompts in [1, 255].
  std::optional<int32_t> max_new_tokens;
  std::optional<float> temperature;

  // Classify: exactly one of image_path, pixels_shape, text (+ labels).
  std::string image_path;
  std::vector<int64_t> pixels_shape;  // [C, H, W]; random pixels in [0, 1].
  std::string text;
  std::vector<std::string> labels;
  int top_n = 0;

  bool quiet = false;
  bool IsOpenLoop() const { return rate.has_value(); }
  int64_t RequestLimit() const { return requests.value_or(kMaxBenchRequests); }
  absl::Duration DurationLimit() const {
    return duration.value_or(absl::Seconds(kMaxBenchSeconds));
  }
};

// "" when `config` is usable, else what is wrong with it, naming the flag.
std::string ValidateBenchConfig(const BenchConfig& config);

// One request to send: its index into BenchConfig::ratios and the message
// (only the one for the config's rpc is set).
struct PlannedRequest {
  int ratio_index = 0;
  moh::v1::GenerateRequest generate;
  moh::v1::ClassifyRequest classify;
};

// Builds the requests of a run deterministically from the config's seed.
// Synthetic inputs (prompt_tokens, pixels_shape) come from a small pool of
// variants generated once. Not thread-safe.
class RequestSource {
 public:
  // Reads the image file, if any; on failure sets `error` and the source
  // must not be used.
  RequestSource(const BenchConfig& config, std::string* error);

  PlannedRequest Next();
  // Starts the sequence again (ratio order and inputs), as if new.
  void Restart();

 private:
  const BenchConfig& config_;
  std::vector<moh::v1::GenerateRequest> generate_pool_;
  std::vector<moh::v1::ClassifyRequest> classify_pool_;
  std::mt19937_64 rng_;
  uint64_t sequence_ = 0;
};

}  // namespace moh::client

#endif  // MOH_CLIENT_BENCH_CONFIG_H_
