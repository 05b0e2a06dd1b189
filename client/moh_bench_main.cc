// moh-bench: load generator for moh-server (SPEC §3).
//
//   moh-bench --server=HOST:PORT [--rpc=generate|classify]
//   moh-bench --api=openai --http=HOST:PORT  (generate over the HTTP API)
//             [--concurrency=N | --rate=R] --requests=N and/or --duration=S
//             [--ratios=0.5,1] [generate or classify options] [--json[=FILE]]
//
// Closed loop at --concurrency workers (default 1) or an open loop of Poisson
// arrivals at --rate requests/s (see bench_runner.h), bounded by --requests
// and/or --duration (hard caps: 1e6 requests, 3600 s). Prints a report of
// throughput, latencies (end-to-end; for generate also time to first token
// and inter-token), errors by gRPC code and the activation ratios seen per
// requested ratio to stdout; --json=FILE writes every number as JSON (schema:
// bench_report.h); with a bare --json the JSON goes to stdout and the report
// to stderr. A progress line goes to stderr when it is a terminal, unless
// --quiet.
//
// Exit status: 0 the run happened (request errors are reported, not fatal);
// 1 the server is unreachable at the start (one ListModels call, or GET
// /v1/models), the --model
// is not served, or a local I/O error; 2 usage error (absl's own flag parse
// errors exit 1); 128 + signal when SIGINT/SIGTERM cut the run short (the
// report of what finished is still printed). A second signal exits at once.
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "client/bench_config.h"
#include "client/bench_report.h"
#include "client/bench_runner.h"
#include "client/bench_transport.h"
#include "client/connection.h"
#include "client/rpc_util.h"
#include "moh/v1/inference.grpc.pb.h"

ABSL_FLAG(std::string, api, "grpc",
          "The server's door to load: grpc (--server) or openai (the "
          "OpenAI-compatible HTTP API at --http, POST /v1/completions "
          "streamed; generate only)");
ABSL_FLAG(std::string, rpc, "generate", "RPC to load: generate or classify");
ABSL_FLAG(std::string, model, "", "Model name; empty = the server's default");
ABSL_FLAG(std::optional<int>, concurrency, std::nullopt,
          "Closed loop: requests kept in flight (default 1)");
ABSL_FLAG(std::optional<double>, rate, std::nullopt,
          "Open loop: Poisson arrivals per second (instead of --concurrency)");
ABSL_FLAG(int, max_in_flight, 256,
          "Open loop: arrivals beyond this many outstanding requests are "
          "dropped and counted");
ABSL_FLAG(std::optional<int64_t>, requests, std::nullopt,
          "Measured requests (open loop: arrivals, dropped included); at most "
          "1e6");
ABSL_FLAG(std::optional<double>, duration, std::nullopt,
          "Seconds to send for (then in-flight requests finish); at most 3600");
ABSL_FLAG(int64_t, warmup_requests, 0,
          "Unmeasured requests first, closed loop at --concurrency (1 for "
          "--rate)");
ABSL_FLAG(double, timeout, 60, "Deadline of each request in seconds");
ABSL_FLAG(uint64_t, seed, 1,
          "Seed of arrivals, random ratio order and synthetic inputs");
ABSL_FLAG(std::vector<std::string>, ratios, {},
          "Comma-separated activation ratios in [0, 1] to mix (0 = model "
          "default); default: the model's default only");
ABSL_FLAG(std::string, ratio_order, "round_robin",
          "How each request picks its ratio: round_robin or random");
ABSL_FLAG(float, min_ratio, 0,
          "Adaptive mode: lowest ratio the server may use under load");
ABSL_FLAG(std::optional<std::string>, prompt, std::nullopt,
          "Generate: prompt text (default \"Once upon a time\")");
ABSL_FLAG(int, prompt_tokens, 0,
          "Generate: synthetic prompts of this many token ids in [1, 255] "
          "instead of --prompt");
ABSL_FLAG(std::optional<int32_t>, max_new_tokens, std::nullopt,
          "Generate: tokens to generate; unset = model default");
ABSL_FLAG(std::optional<float>, temperature, std::nullopt,
          "Generate: sampling temperature; unset = the model's default "
          "(greedy, unless its generation_config.json samples)");
ABSL_FLAG(std::string, image, "", "Classify: PNG or JPEG file");
ABSL_FLAG(std::vector<std::string>, pixels_shape, {},
          "Classify: C,H,W of random pixels in [0, 1]");
ABSL_FLAG(std::string, text, "", "Classify: text to score --labels against");
ABSL_FLAG(std::vector<std::string>, labels, {},
          "Classify: comma-separated candidate labels for --text");
ABSL_FLAG(int, top_n, 0, "Classify: classes to return; 0 = server default");
ABSL_FLAG(std::string, json, "",
          "Write the results as JSON to this file; a bare --json (or '-'): "
          "stdout, the text report then going to stderr");
ABSL_FLAG(bool, quiet, false, "No progress line on stderr");

namespace moh::client {
namespace {

constexpr char kDefaultPrompt[] = "Once upon a time";

// The run to stop on a signal, and the first signal received.
absl::Mutex g_runner_mu(absl::kConstInit);
BenchRunner* g_runner ABSL_GUARDED_BY(g_runner_mu) = nullptr;
std::atomic<int> g_signal{0};

// SIGINT/SIGTERM: the first stops the run (or exits if none is running), the
// second exits at once. Call before any other thread exists, so that every
// thread inherits the blocked mask and only the watcher receives them.
void InstallSignalWatcher() {
  static sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([] {
    bool stopping = false;
    for (;;) {
      int sig = 0;
      if (sigwait(&set, &sig) != 0) continue;
      absl::MutexLock lock(&g_runner_mu);
      if (stopping || g_runner == nullptr) _exit(128 + sig);
      stopping = true;
      g_signal.store(sig);
      absl::FPrintF(stderr, "\nmoh-bench: stopping (signal %d)\n", sig);
      g_runner->Stop();
    }
  }).detach();
}

int UsageError(const std::string& message) {
  absl::FPrintF(stderr, "moh-bench: %s\nrun 'moh-bench --help' for the flags\n",
                message);
  return kExitUsage;
}

// Flags into `config`; returns "" or a usage error.
std::string ConfigFromFlags(BenchConfig* config) {
  absl::StatusOr<Connection> connection = ConnectionFromFlags();
  if (!connection.ok()) return std::string(connection.status().message());
  const std::string api = absl::GetFlag(FLAGS_api);
  if (api == "grpc") {
    config->api = BenchApi::kGrpc;
  } else if (api == "openai") {
    config->api = BenchApi::kOpenAi;
  } else {
    return absl::StrFormat("--api=%s: expected grpc or openai", api);
  }
  const bool openai = config->api == BenchApi::kOpenAi;
  // The other door's address, set (this abseil cannot tell "given" itself).
  const absl::CommandLineFlag* other =
      absl::FindCommandLineFlag(openai ? "server" : "http");
  if (other->CurrentValue() != other->DefaultValue()) {
    return openai ? "--api=openai takes the address as --http, not --server"
                  : "--http applies to --api=openai; gRPC's address is "
                    "--server";
  }
  config->server = openai ? connection->http : connection->server;
  config->token = connection->token;
  const std::string rpc = absl::GetFlag(FLAGS_rpc);
  if (rpc == "generate") {
    config->rpc = BenchRpc::kGenerate;
  } else if (rpc == "classify") {
    config->rpc = BenchRpc::kClassify;
  } else {
    return absl::StrFormat("--rpc=%s: expected generate or classify", rpc);
  }
  config->model = absl::GetFlag(FLAGS_model);
  config->concurrency = absl::GetFlag(FLAGS_concurrency);
  config->rate = absl::GetFlag(FLAGS_rate);
  config->max_in_flight = absl::GetFlag(FLAGS_max_in_flight);
  config->requests = absl::GetFlag(FLAGS_requests);
  if (auto d = absl::GetFlag(FLAGS_duration)) {
    if (!std::isfinite(*d) || *d <= 0 || *d > kMaxBenchSeconds) {
      return absl::StrFormat("--duration must be in (0, %g] seconds",
                             kMaxBenchSeconds);
    }
    config->duration = absl::Seconds(*d);
  }
  config->warmup_requests = absl::GetFlag(FLAGS_warmup_requests);
  const double timeout = absl::GetFlag(FLAGS_timeout);
  if (!std::isfinite(timeout)) return "--timeout must be finite";
  config->timeout = absl::Seconds(timeout);
  config->seed = absl::GetFlag(FLAGS_seed);
  const std::vector<std::string> ratios = absl::GetFlag(FLAGS_ratios);
  if (!ratios.empty()) {
    config->ratios.clear();
    for (const std::string& r : ratios) {
      float value = 0;
      if (!absl::SimpleAtof(r, &value)) {
        return absl::StrFormat("--ratios: '%s' is not a number", r);
      }
      config->ratios.push_back(value);
    }
  }
  const std::string order = absl::GetFlag(FLAGS_ratio_order);
  if (order != "round_robin" && order != "random") {
    return absl::StrFormat("--ratio_order=%s: expected round_robin or random",
                           order);
  }
  config->ratio_random = order == "random";
  config->min_ratio = absl::GetFlag(FLAGS_min_ratio);

  config->prompt_tokens = absl::GetFlag(FLAGS_prompt_tokens);
  if (auto prompt = absl::GetFlag(FLAGS_prompt)) {
    config->prompt = *prompt;
    if (prompt->empty()) return "--prompt must not be empty";
  } else if (config->rpc == BenchRpc::kGenerate && config->prompt_tokens == 0) {
    config->prompt = kDefaultPrompt;
  }
  config->max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  config->temperature = absl::GetFlag(FLAGS_temperature);

  config->image_path = absl::GetFlag(FLAGS_image);
  for (const std::string& d : absl::GetFlag(FLAGS_pixels_shape)) {
    int64_t value = 0;
    if (!absl::SimpleAtoi(d, &value)) {
      return absl::StrFormat("--pixels_shape: '%s' is not an integer", d);
    }
    config->pixels_shape.push_back(value);
  }
  config->text = absl::GetFlag(FLAGS_text);
  config->labels = absl::GetFlag(FLAGS_labels);
  config->top_n = absl::GetFlag(FLAGS_top_n);
  config->quiet = absl::GetFlag(FLAGS_quiet);
  return ValidateBenchConfig(*config);
}

// One ListModels call (GET /v1/models). Returns the served model's name (""
// when the server picks among several) or, on failure, sets `error`.
std::string CheckServer(BenchTransport& transport, const BenchConfig& config,
                        std::string* error) {
  absl::StatusOr<std::vector<std::string>> names = transport.ModelNames();
  if (!names.ok()) {
    *error = absl::StrFormat(
        "cannot reach %s: %s: %s", config.server,
        StatusCodeName(static_cast<grpc::StatusCode>(names.status().code())),
        names.status().message());
    return "";
  }
  if (config.model.empty()) return names->size() == 1 ? (*names)[0] : "";
  for (const std::string& name : *names) {
    if (name == config.model) return name;
  }
  *error = absl::StrFormat(
      "model '%s' is not served by %s (it serves: %s)", config.model,
      config.server, names->empty() ? "none" : absl::StrJoin(*names, ", "));
  return "";
}

bool WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << contents;
  out.close();
  return !out.fail();
}

// A bare --json means --json=- (stdout); absl needs the value spelled out.
std::vector<char*> ExpandBareJson(int argc, char** argv) {
  static char json_stdout[] = "--json=-";
  std::vector<char*> args(argv, argv + argc);
  for (char*& arg : args) {
    if (std::strcmp(arg, "--json") == 0 || std::strcmp(arg, "-json") == 0) {
      arg = json_stdout;
    }
    if (std::strcmp(arg, "--") == 0) break;
  }
  return args;
}

int Main(int argc, char** argv) {
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view path) {
    return absl::StrContains(path, "moh_bench_main");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "load generator for moh-server.\n"
      "usage: moh-bench [--server=HOST:PORT | --api=openai --http=HOST:PORT] "
      "[--rpc=generate|classify] [--concurrency=N | --rate=R] --requests=N "
      "and/or --duration=SECONDS [flags]");
  std::vector<char*> args = ExpandBareJson(argc, argv);
  const std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  if (positional.size() > 1) {
    return UsageError(
        absl::StrFormat("unexpected argument '%s'", positional[1]));
  }
  BenchConfig config;
  const std::string usage_error = ConfigFromFlags(&config);
  if (!usage_error.empty()) return UsageError(usage_error);

  std::string error;
  RequestSource source(config, &error);
  if (!error.empty()) {
    absl::FPrintF(stderr, "moh-bench: %s\n", error);
    return kExitFailure;
  }
  absl::StatusOr<Connection> connection = ConnectionFromFlags();
  if (!connection.ok()) {
    return UsageError(std::string(connection.status().message()));
  }
  std::unique_ptr<BenchTransport> transport;
  if (config.api == BenchApi::kOpenAi) {
    transport = NewOpenAiBenchTransport(config, *connection);
  } else {
    absl::StatusOr<std::shared_ptr<grpc::Channel>> opened =
        OpenChannel(*connection);
    if (!opened.ok()) return UsageError(std::string(opened.status().message()));
    transport = NewGrpcBenchTransport(config, *opened);
  }
  const std::string served_model = CheckServer(*transport, config, &error);
  if (!error.empty()) {
    absl::FPrintF(stderr, "moh-bench: %s\n", error);
    return kExitFailure;
  }

  BenchRunner runner(config, transport.get(), &source);
  {
    absl::MutexLock lock(&g_runner_mu);
    g_runner = &runner;
  }
  const BenchResults results = runner.Run();
  {
    absl::MutexLock lock(&g_runner_mu);
    g_runner = nullptr;
  }

  const std::string json_path = absl::GetFlag(FLAGS_json);
  const bool json_stdout = json_path == "-";
  const std::string text = RenderBenchText(config, served_model, results);
  absl::FPrintF(json_stdout ? stderr : stdout, "%s", text);
  int exit_status = kExitOk;
  if (!json_path.empty()) {
    const std::string json = RenderBenchJson(config, served_model, results);
    if (json_stdout) {
      absl::FPrintF(stdout, "%s", json);
    } else if (!WriteFile(json_path, json)) {
      absl::FPrintF(stderr, "moh-bench: cannot write --json=%s\n", json_path);
      exit_status = kExitFailure;
    }
  }
  std::fflush(stdout);
  if (results.interrupted && exit_status == kExitOk) {
    exit_status = 128 + g_signal.load();
  }
  return exit_status;
}

}  // namespace
}  // namespace moh::client

int main(int argc, char** argv) {
  moh::client::InstallSignalWatcher();
  return moh::client::Main(argc, argv);
}
