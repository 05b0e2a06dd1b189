#include "client/bench_report.h"

#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "client/text_table.h"

namespace moh::client {
namespace {

bool IsGenerate(const BenchConfig& c) { return c.rpc == BenchRpc::kGenerate; }

const char* ApiName(const BenchConfig& c) {
  return c.api == BenchApi::kGrpc ? "grpc" : "openai";
}

double TokensPerSecond(const BenchResults& r) {
  return r.elapsed_s > 0 ? static_cast<double>(r.generated_tokens) / r.elapsed_s
                         : 0;
}

double RequestsPerSecond(const BenchResults& r) {
  return r.elapsed_s > 0 ? static_cast<double>(r.completed) / r.elapsed_s : 0;
}

const char* ClassifyInput(const BenchConfig& c) {
  if (!c.image_path.empty()) return "image";
  return c.text.empty() ? "pixels" : "text";
}

std::string RatioName(float ratio) {
  return ratio == 0 ? "default" : absl::StrFormat("%g", ratio);
}

// ---- JSON ----

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (const unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          absl::StrAppendFormat(&out, "\\u%04x", c);
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

// 7 significant digits: float inputs print as typed, and latencies (ms) to
// about a microsecond.
std::string JsonNumber(double v) { return absl::StrFormat("%.7g", v); }

template <typename T>
std::string JsonOptional(const std::optional<T>& v) {
  if (!v) return "null";
  return JsonNumber(static_cast<double>(*v));
}

// Fields in order; values are already JSON.
std::string JsonObject(
    const std::vector<std::pair<std::string, std::string>>& fields) {
  std::vector<std::string> parts;
  for (const auto& [name, value] : fields) {
    parts.push_back(absl::StrCat(JsonString(name), ": ", value));
  }
  return absl::StrCat("{", absl::StrJoin(parts, ", "), "}");
}

std::string JsonLatency(const LatencySummary& s) {
  const auto ms = [&s](double seconds) {
    return s.count == 0 ? std::string("null") : JsonNumber(seconds * 1e3);
  };
  return JsonObject({{"count", absl::StrCat(s.count)},
                     {"p50", ms(s.p50)},
                     {"p90", ms(s.p90)},
                     {"p99", ms(s.p99)},
                     {"mean", ms(s.mean)},
                     {"max", ms(s.max)}});
}

std::string JsonConfig(const BenchConfig& c, const std::string& served_model) {
  std::vector<std::string> ratios;
  for (float r : c.ratios) ratios.push_back(JsonNumber(r));
  std::optional<double> duration_s;
  if (c.duration) duration_s = absl::ToDoubleSeconds(*c.duration);
  std::vector<std::pair<std::string, std::string>> fields = {
      {"server", JsonString(c.server)},
      {"api", JsonString(ApiName(c))},
      {"rpc", JsonString(IsGenerate(c) ? "generate" : "classify")},
      {"model", JsonString(c.model)},
      {"served_model", JsonString(served_model)},
      {"mode", JsonString(c.IsOpenLoop() ? "open" : "closed")},
      {"concurrency",
       c.IsOpenLoop() ? "null" : absl::StrCat(c.concurrency.value_or(1))},
      {"rate", JsonOptional(c.rate)},
      {"max_in_flight", absl::StrCat(c.max_in_flight)},
      {"requests", JsonOptional(c.requests)},
      {"duration_s", JsonOptional(duration_s)},
      {"warmup_requests", absl::StrCat(c.warmup_requests)},
      {"timeout_s", JsonNumber(absl::ToDoubleSeconds(c.timeout))},
      {"seed", absl::StrCat(c.seed)},
      {"ratios", absl::StrCat("[", absl::StrJoin(ratios, ", "), "]")},
      {"ratio_order", JsonString(c.ratio_random ? "random" : "round_robin")},
      {"min_ratio", JsonNumber(c.min_ratio)},
  };
  if (IsGenerate(c)) {
    fields.push_back({"prompt_tokens", c.prompt_tokens > 0
                                           ? absl::StrCat(c.prompt_tokens)
                                           : "null"});
    fields.push_back({"max_new_tokens", JsonOptional(c.max_new_tokens)});
    fields.push_back({"temperature", JsonOptional(c.temperature)});
  } else {
    fields.push_back({"input", JsonString(ClassifyInput(c))});
  }
  return JsonObject(fields);
}

// ---- Text ----

std::string Ms(double seconds) {
  return absl::StrFormat("%.2f", seconds * 1e3);
}

void AddLatencyRow(const char* name, const LatencySummary& s,
                   TextTable* table) {
  if (s.count == 0) {
    table->AddRow({name, "0", "-", "-", "-", "-", "-"});
    return;
  }
  table->AddRow({name, absl::StrCat(s.count), Ms(s.p50), Ms(s.p90), Ms(s.p99),
                 Ms(s.mean), Ms(s.max)});
}

std::string OptionalRatio(const std::optional<double>& v) {
  return v ? absl::StrFormat("%.4f", *v) : "-";
}

}  // namespace

std::string RenderBenchText(const BenchConfig& c,
                            const std::string& served_model,
                            const BenchResults& r) {
  std::string out = absl::StrFormat(
      "moh-bench: %s on %s (%s), model %s, %s\n",
      IsGenerate(c) ? "generate" : "classify", c.server,
      c.api == BenchApi::kGrpc ? "gRPC" : "OpenAI HTTP API",
      served_model.empty() ? (c.model.empty() ? "(default)" : c.model)
                           : served_model,
      c.IsOpenLoop()
          ? absl::StrFormat("open loop at %g req/s (max %d in flight)", *c.rate,
                            c.max_in_flight)
          : absl::StrFormat("closed loop at concurrency %d",
                            c.concurrency.value_or(1)));
  absl::StrAppendFormat(
      &out, "requests %d: completed %d, errors %d, dropped %d in %.3f s%s\n",
      r.requests, r.completed, r.errors, r.dropped, r.elapsed_s,
      r.interrupted ? " (interrupted)" : "");
  if (r.warmup_requests > 0) {
    absl::StrAppendFormat(&out, "warmup: %d requests, %d errors\n",
                          r.warmup_requests, r.warmup_errors);
  }
  absl::StrAppendFormat(&out, "throughput: %.2f requests/s",
                        RequestsPerSecond(r));
  if (IsGenerate(c)) {
    absl::StrAppendFormat(&out, ", %.1f tokens/s (%d tokens)",
                          TokensPerSecond(r), r.generated_tokens);
  }
  out += "\n\n";

  TextTable latency(
      {"latency ms", "count", "p50", "p90", "p99", "mean", "max"});
  for (int col = 1; col < 7; ++col) latency.AlignRight(col);
  AddLatencyRow("end-to-end", r.e2e, &latency);
  if (IsGenerate(c)) {
    AddLatencyRow("TTFT", r.ttft, &latency);
    AddLatencyRow("inter-token", r.itl, &latency);
  }
  out += latency.Render() + "\n";

  TextTable ratios({"ratio", "requests", "completed", "errors", "effective",
                    "ran at", "e2e p50 ms", "e2e mean ms"});
  for (int col = 1; col < 8; ++col) ratios.AlignRight(col);
  for (const RatioResults& ratio : r.ratios) {
    ratios.AddRow({RatioName(ratio.requested), absl::StrCat(ratio.requests),
                   absl::StrCat(ratio.completed), absl::StrCat(ratio.errors),
                   OptionalRatio(ratio.mean_effective_activation_ratio),
                   OptionalRatio(ratio.mean_activation_ratio),
                   ratio.e2e.count ? Ms(ratio.e2e.p50) : "-",
                   ratio.e2e.count ? Ms(ratio.e2e.mean) : "-"});
  }
  out += ratios.Render();

  if (!r.errors_by_code.empty()) {
    TextTable errors({"error", "count"});
    errors.AlignRight(1);
    for (const auto& [code, count] : r.errors_by_code) {
      errors.AddRow({code, absl::StrCat(count)});
    }
    out += "\n" + errors.Render();
  }
  return out;
}

std::string RenderBenchJson(const BenchConfig& c,
                            const std::string& served_model,
                            const BenchResults& r) {
  std::vector<std::pair<std::string, std::string>> errors;
  for (const auto& [code, count] : r.errors_by_code) {
    errors.push_back({code, absl::StrCat(count)});
  }
  std::vector<std::string> ratios;
  for (const RatioResults& ratio : r.ratios) {
    ratios.push_back(JsonObject(
        {{"requested", JsonNumber(ratio.requested)},
         {"requests", absl::StrCat(ratio.requests)},
         {"completed", absl::StrCat(ratio.completed)},
         {"errors", absl::StrCat(ratio.errors)},
         {"mean_effective_activation_ratio",
          JsonOptional(ratio.mean_effective_activation_ratio)},
         {"mean_activation_ratio", JsonOptional(ratio.mean_activation_ratio)},
         {"e2e_ms", JsonLatency(ratio.e2e)}}));
  }
  const bool generate = IsGenerate(c);
  return JsonObject({
             {"schema_version", "1"},
             {"config", JsonConfig(c, served_model)},
             {"interrupted", r.interrupted ? "true" : "false"},
             {"elapsed_s", JsonNumber(r.elapsed_s)},
             {"requests", absl::StrCat(r.requests)},
             {"completed", absl::StrCat(r.completed)},
             {"errors", absl::StrCat(r.errors)},
             {"dropped", absl::StrCat(r.dropped)},
             {"errors_by_code", JsonObject(errors)},
             {"warmup",
              JsonObject({{"requests", absl::StrCat(r.warmup_requests)},
                          {"errors", absl::StrCat(r.warmup_errors)}})},
             {"generated_tokens", absl::StrCat(r.generated_tokens)},
             {"throughput",
              JsonObject(
                  {{"requests_per_s", JsonNumber(RequestsPerSecond(r))},
                   {"tokens_per_s",
                    generate ? JsonNumber(TokensPerSecond(r)) : "null"}})},
             {"latency_ms",
              JsonObject({{"e2e", JsonLatency(r.e2e)},
                          {"ttft", generate ? JsonLatency(r.ttft) : "null"},
                          {"itl", generate ? JsonLatency(r.itl) : "null"}})},
             {"ratios", absl::StrCat("[", absl::StrJoin(ratios, ", "), "]")},
         }) +
         "\n";
}

}  // namespace moh::client
