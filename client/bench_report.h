// The two renderings of a moh-bench run: a human-readable report and JSON.
//
// JSON schema (schema_version 1). Latencies are milliseconds; a latency
// object is {"count", "p50", "p90", "p99", "mean", "max"}, the statistics
// null when count is 0. Latencies and tokens count completed requests only.
// {
//   "schema_version": 1,
//   "config": {
//     "server": "HOST:PORT", "api": "grpc" | "openai",
//     "rpc": "generate" | "classify",
//     "model": requested name ("" = default), "served_model": name or "",
//     "mode": "closed" | "open", "concurrency": int | null,
//     "rate": requests/s | null, "max_in_flight": int,
//     "requests": int | null, "duration_s": number | null,
//     "warmup_requests": int, "timeout_s": number, "seed": int,
//     "ratios": [number], "ratio_order": "round_robin" | "random",
//     "min_ratio": number,
//     generate:  "prompt_tokens": int | null (null: --prompt text),
//                "max_new_tokens": int | null, "temperature": number | null
//     classify:  "input": "image" | "pixels" | "text"
//   },
//   "interrupted": bool,         // Stopped by SIGINT/SIGTERM.
//   "elapsed_s": number,         // First measured send to last completion.
//   "requests": int,             // Sent = completed + errors.
//   "completed": int, "errors": int,
//   "dropped": int,              // Open loop: arrivals over max_in_flight.
//   "errors_by_code": {"UNAVAILABLE": int, ...},  // gRPC code names (openai:
//                                 // the error JSON's "code", else of the
//                                 // HTTP status or the transport failure)
//   "warmup": {"requests": int, "errors": int},
//   "generated_tokens": int,     // Streamed token ids (openai: usage's
//                                // completion_tokens; 0 for classify).
//   "throughput": {"requests_per_s": number,   // completed / elapsed_s
//                  "tokens_per_s": number | null},  // null for classify
//   "latency_ms": {"e2e": latency,
//                  "ttft": latency | null,    // null for classify
//                  "itl": latency | null},    // per token (openai: per
//                                             // chunk); null for classify
//   "ratios": [{"requested": number (0 = model default),
//               "requests": int, "completed": int, "errors": int,
//               "mean_effective_activation_ratio": number | null,
//               "mean_activation_ratio": number | null,  // ratio it ran at
//               "e2e_ms": latency}]          // In --ratios order.
// }
#ifndef MOH_CLIENT_BENCH_REPORT_H_
#define MOH_CLIENT_BENCH_REPORT_H_

#include <string>

#include "client/bench_config.h"
#include "client/bench_stats.h"

namespace moh::client {

// `served_model`: the model the server resolved (may be empty).
std::string RenderBenchText(const BenchConfig& config,
                            const std::string& served_model,
                            const BenchResults& results);

// One JSON object in the schema above, ending with '\n'.
std::string RenderBenchJson(const BenchConfig& config,
                            const std::string& served_model,
                            const BenchResults& results);

}  // namespace moh::client

#endif  // MOH_CLIENT_BENCH_REPORT_H_
