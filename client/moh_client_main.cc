// moh-client: command-line client of moh-server (SPEC §3).
//
//   moh-client [--server=HOST:PORT] [--timeout=SECONDS] COMMAND [ARGS] [FLAGS]
//
// Commands: models, generate, classify, generate-image, health over gRPC;
// chat over the OpenAI-compatible HTTP API (--http=HOST:PORT). See Usage()
// below. Flags may come before or after the command and its arguments; "--"
// ends the flags.
// Exit status: 0 OK, 1 RPC error / not SERVING / local I/O error, 2 usage
// error, 130 interrupted (Ctrl-C).
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/chat_command.h"
#include "client/commands.h"
#include "client/connection.h"
#include "client/interrupt_watcher.h"
#include "client/openai_http_client.h"
#include "client/rpc_util.h"

ABSL_FLAG(double, timeout, 0,
          "RPC deadline in seconds; 0 = none (health: 5 s)");
ABSL_FLAG(std::string, model, "", "Model name; empty = the server's default");
ABSL_FLAG(float, ratio, 0, "Activation ratio in (0, 1]; 0 = model default");
ABSL_FLAG(float, min_ratio, 0,
          "Adaptive mode: lowest ratio the server may use under load");
ABSL_FLAG(std::optional<int32_t>, max_new_tokens, std::nullopt,
          "Tokens to generate; unset = model default");
ABSL_FLAG(std::optional<float>, temperature, std::nullopt,
          "Sampling temperature; 0 = greedy; unset = the model's default "
          "(greedy unless its generation_config.json samples)");
ABSL_FLAG(int32_t, top_k, 0, "Top-k sampling; 0 = off");
ABSL_FLAG(std::optional<float>, top_p, std::nullopt,
          "Nucleus sampling in (0, 1]; unset or 1 = off");
ABSL_FLAG(std::optional<uint64_t>, seed, std::nullopt,
          "Sampling seed; unset = random");
ABSL_FLAG(std::vector<std::string>, stop, {}, "Comma-separated stop strings");
ABSL_FLAG(std::optional<float>, repetition_penalty, std::nullopt,
          "Repetition penalty > 0; unset or 1 = off");
ABSL_FLAG(float, min_p, 0, "Min-p sampling in [0, 1]; 0 = off");
ABSL_FLAG(float, presence_penalty, 0,
          "Penalty in [-2, 2] on tokens already generated; 0 = off");
ABSL_FLAG(float, frequency_penalty, 0,
          "Penalty in [-2, 2] per occurrence in the output; 0 = off");
ABSL_FLAG(std::vector<std::string>, logit_bias, {},
          "Comma-separated TOKEN_ID:BIAS pairs; each bias (in [-100, 100]) is "
          "added to its token's logit before sampling");
ABSL_FLAG(std::optional<int32_t>, logprobs, std::nullopt,
          "generate: print each token's log-probability and this many "
          "alternatives (0-20) to stderr");
ABSL_FLAG(std::optional<int32_t>, prompt_logprobs, std::nullopt,
          "generate: the same for the prompt's tokens");
ABSL_FLAG(int32_t, n, 1,
          "generate: samples sharing one prefill (1-16), printed whole");
ABSL_FLAG(int32_t, priority, 0,
          "generate: scheduling priority (-1000 to 1000; higher first)");
ABSL_FLAG(std::vector<std::string>, token_ids, {},
          "Comma-separated prompt token ids, instead of PROMPT");
ABSL_FLAG(bool, routing, false, "Print the per-layer head-load table");
ABSL_FLAG(int32_t, top_n, 0, "Classes to return; 0 = server default");
ABSL_FLAG(std::string, text, "", "Text to score the --labels against");
ABSL_FLAG(std::vector<std::string>, labels, {},
          "Comma-separated candidate labels for --text");
ABSL_FLAG(std::string, class, "",
          "generate-image: the class, by index (digits) or label");
ABSL_FLAG(std::string, out, "", "generate-image: the PNG file to write");
ABSL_FLAG(int32_t, steps, 0, "generate-image: sampler steps; 0 = default");
ABSL_FLAG(std::optional<float>, guidance, std::nullopt,
          "generate-image: guidance scale >= 1; unset = the model's default");
ABSL_FLAG(bool, progress, false, "generate-image: print each step to stderr");
ABSL_FLAG(std::string, service, "",
          "Health service name; empty = the whole server");
ABSL_FLAG(std::string, system, "", "chat: the system message; empty = none");

namespace moh::client {
namespace {

struct Command {
  const char* name;
  const char* synopsis;
  std::vector<const char*> flags;  // Accepted besides the global ones.
  // The address flag: "server" (gRPC) or "http" (the OpenAI-compatible API).
  const char* address = "server";
};

// Accepted by every command, besides its address flag.
const std::vector<const char*> kGlobalFlags = {"timeout", "tls_ca", "tls_cert",
                                               "tls_key", "token_file"};

const std::vector<Command>& Commands() {
  static const auto* const commands = new std::vector<Command>{
      {"models", "models                   list the hosted models", {}},
      {"generate",
       "generate PROMPT          stream a completion of PROMPT to stdout",
       {"model",
        "ratio",
        "min_ratio",
        "max_new_tokens",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "seed",
        "stop",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "prompt_logprobs",
        "n",
        "priority",
        "token_ids",
        "routing"}},
      {"classify",
       "classify IMAGE_FILE      classify a PNG or JPEG image\n"
       "  classify --text=TEXT --labels=a,b,c\n"
       "                           score labels for TEXT with a language model",
       {"model", "ratio", "min_ratio", "top_n", "text", "labels", "routing"}},
      {"generate-image",
       "generate-image --class=C --out=FILE.png\n"
       "                           generate an image of class C (index or "
       "label)",
       {"model", "ratio", "min_ratio", "class", "out", "seed", "steps",
        "guidance", "progress", "routing"}},
      {"health",
       "health                   grpc.health.v1 Check; exit 0 only if SERVING",
       {"service"}},
      {"chat",
       "chat                     chat with a language model over the HTTP "
       "API:\n"
       "                           a line of stdin per turn, replies "
       "streamed to stdout",
       {"model", "ratio", "min_ratio", "max_new_tokens", "temperature", "top_k",
        "top_p", "min_p", "seed", "stop", "repetition_penalty",
        "presence_penalty", "frequency_penalty", "logit_bias", "priority",
        "system"},
       "http"},
  };
  return *commands;
}

void PrintFlag(std::FILE* out, const char* name) {
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  const std::string def = flag->DefaultValue();
  absl::FPrintF(out, "    --%-20s %s%s\n", name, flag->Help(),
                def.empty() ? "" : absl::StrFormat(" (default %s)", def));
}

// The synopsis of every command; with `flags`, their flags too.
void Usage(std::FILE* out, bool flags) {
  absl::FPrintF(out,
                "usage: moh-client [--server=HOST:PORT | --http=HOST:PORT] "
                "[--timeout=SECONDS] [TLS, token] COMMAND [ARGS] [FLAGS]\n\n"
                "commands:\n");
  for (const Command& command : Commands()) {
    absl::FPrintF(out, "  %s\n", command.synopsis);
    if (flags) {
      for (const char* name : command.flags) PrintFlag(out, name);
    }
  }
  if (!flags) {
    absl::FPrintF(out, "run 'moh-client --help' for the flags\n");
    return;
  }
  absl::FPrintF(out, "global flags:\n");
  for (const char* name : {"server", "http"}) PrintFlag(out, name);
  for (const char* name : kGlobalFlags) PrintFlag(out, name);
  absl::FPrintF(out,
                "exit status: 0 ok, 1 RPC error or not SERVING, 2 usage "
                "error, 130 interrupted\n");
}

int UsageError(const std::string& message) {
  absl::FPrintF(stderr, "moh-client: %s\n\n", message);
  Usage(stderr, /*flags=*/false);
  return kExitUsage;
}

struct CommandLine {
  std::vector<std::string> positional;
  std::set<std::string> flags_given;
  bool help = false;
};

// Parses --name=value, --name value (non-bool), --name / --noname (bool);
// single-dash forms too. On error returns false with `error` set.
bool ParseCommandLine(int argc, char** argv, CommandLine* line,
                      std::string* error) {
  bool flags_done = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (flags_done || arg.size() < 2 || arg[0] != '-') {
      line->positional.push_back(arg);
      continue;
    }
    if (arg == "--") {
      flags_done = true;
      continue;
    }
    arg = arg.substr(arg[1] == '-' ? 2 : 1);
    if (arg == "help" || arg == "h") {
      line->help = true;
      continue;
    }
    const size_t eq = arg.find('=');
    std::string name = arg.substr(0, eq);
    std::optional<std::string> value;
    if (eq != std::string::npos) value = arg.substr(eq + 1);
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && !value && absl::StartsWith(name, "no")) {
      flag = absl::FindCommandLineFlag(name.substr(2));
      if (flag != nullptr && flag->IsOfType<bool>()) {
        name = name.substr(2);
        value = "false";
      } else {
        flag = nullptr;
      }
    }
    if (flag == nullptr) {
      *error = absl::StrFormat("unknown flag --%s", name);
      return false;
    }
    if (!value) {
      if (flag->IsOfType<bool>()) {
        value = "true";
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        *error = absl::StrFormat("missing value for --%s", name);
        return false;
      }
    }
    std::string parse_error;
    if (!flag->ParseFrom(*value, &parse_error)) {
      *error = absl::StrFormat("--%s=%s: %s", name, *value, parse_error);
      return false;
    }
    line->flags_given.insert(name);
  }
  return true;
}

bool ReadFile(const std::string& path, std::string* contents) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream buffer;
  buffer << in.rdbuf();
  *contents = buffer.str();
  return !in.bad();
}

moh::v1::Activation ActivationFromFlags() {
  moh::v1::Activation activation;
  activation.set_ratio(absl::GetFlag(FLAGS_ratio));
  activation.set_min_ratio(absl::GetFlag(FLAGS_min_ratio));
  return activation;
}

// --logit_bias's pairs into `bias`; an error message, or "". The server
// checks the ranges.
std::string LogitBiasFromFlags(std::vector<std::pair<int32_t, float>>* bias) {
  for (const std::string& pair : absl::GetFlag(FLAGS_logit_bias)) {
    const std::vector<std::string> parts = absl::StrSplit(pair, ':');
    int32_t id = 0;
    float value = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &id) ||
        !absl::SimpleAtof(parts[1], &value)) {
      return absl::StrFormat("--logit_bias: '%s' is not TOKEN_ID:BIAS", pair);
    }
    bias->emplace_back(id, value);
  }
  return "";
}

// The request fields of `chat` (OpenAI's names); unset flags are left out,
// so the server's defaults apply. `bias`: --logit_bias's pairs.
nlohmann::json ChatFieldsFromFlags(
    const std::vector<std::pair<int32_t, float>>& bias) {
  nlohmann::json fields = nlohmann::json::object();
  if (const std::string model = absl::GetFlag(FLAGS_model); !model.empty()) {
    fields["model"] = model;
  }
  if (auto v = absl::GetFlag(FLAGS_max_new_tokens)) fields["max_tokens"] = *v;
  if (auto v = absl::GetFlag(FLAGS_temperature))
    fields["temperature"] = Decimal(*v);
  if (const int32_t k = absl::GetFlag(FLAGS_top_k); k != 0) {
    fields["top_k"] = k;
  }
  if (auto v = absl::GetFlag(FLAGS_top_p)) fields["top_p"] = Decimal(*v);
  if (auto v = absl::GetFlag(FLAGS_seed)) fields["seed"] = *v;
  if (const auto stop = absl::GetFlag(FLAGS_stop); !stop.empty()) {
    fields["stop"] = stop;
  }
  if (auto v = absl::GetFlag(FLAGS_repetition_penalty)) {
    fields["repetition_penalty"] = Decimal(*v);
  }
  for (const auto& [name, value] :
       {std::pair<const char*, float>{"min_p", absl::GetFlag(FLAGS_min_p)},
        {"presence_penalty", absl::GetFlag(FLAGS_presence_penalty)},
        {"frequency_penalty", absl::GetFlag(FLAGS_frequency_penalty)}}) {
    if (value != 0) fields[name] = Decimal(value);
  }
  if (const int32_t p = absl::GetFlag(FLAGS_priority); p != 0) {
    fields["priority"] = p;
  }
  for (const auto& [id, value] : bias) {
    fields["logit_bias"][std::to_string(id)] = Decimal(value);
  }
  if (const float r = absl::GetFlag(FLAGS_ratio); r != 0) {
    fields["activation_ratio"] = Decimal(r);
  }
  if (const float r = absl::GetFlag(FLAGS_min_ratio); r != 0) {
    fields["min_activation_ratio"] = Decimal(r);
  }
  return fields;
}

// The GenerateImage request of the flags; an error message, or "".
std::string BuildGenerateImageRequest(moh::v1::GenerateImageRequest* request) {
  const std::string c = absl::GetFlag(FLAGS_class);
  if (c.empty()) return "generate-image needs --class (an index or a label)";
  if (absl::GetFlag(FLAGS_out).empty()) return "generate-image needs --out";
  int32_t index = 0;
  if (absl::SimpleAtoi(c, &index)) {
    request->set_class_index(index);
  } else {
    request->set_class_label(c);
  }
  request->set_model(absl::GetFlag(FLAGS_model));
  if (auto v = absl::GetFlag(FLAGS_seed)) request->set_seed(*v);
  request->set_steps(absl::GetFlag(FLAGS_steps));
  if (auto v = absl::GetFlag(FLAGS_guidance)) request->set_guidance_scale(*v);
  request->set_progress(absl::GetFlag(FLAGS_progress));
  request->set_include_routing(absl::GetFlag(FLAGS_routing));
  *request->mutable_activation() = ActivationFromFlags();
  return "";
}

std::string BuildGenerateRequest(const std::vector<std::string>& args,
                                 moh::v1::GenerateRequest* request) {
  const std::vector<std::string> ids = absl::GetFlag(FLAGS_token_ids);
  if (ids.empty() && args.size() != 1) return "generate needs one PROMPT";
  if (!ids.empty() && !args.empty()) {
    return "generate takes either PROMPT or --token_ids, not both";
  }
  if (!args.empty()) request->set_prompt(args[0]);
  for (const std::string& id : ids) {
    int32_t value = 0;
    if (!absl::SimpleAtoi(id, &value)) {
      return absl::StrFormat("--token_ids: '%s' is not an integer", id);
    }
    request->add_token_ids(value);
  }
  request->set_model(absl::GetFlag(FLAGS_model));
  moh::v1::SamplingParams* sampling = request->mutable_sampling();
  if (auto v = absl::GetFlag(FLAGS_max_new_tokens)) {
    sampling->set_max_new_tokens(*v);
  }
  if (auto v = absl::GetFlag(FLAGS_temperature)) sampling->set_temperature(*v);
  sampling->set_top_k(absl::GetFlag(FLAGS_top_k));
  if (auto v = absl::GetFlag(FLAGS_top_p)) sampling->set_top_p(*v);
  if (auto v = absl::GetFlag(FLAGS_seed)) sampling->set_seed(*v);
  for (const std::string& stop : absl::GetFlag(FLAGS_stop)) {
    sampling->add_stop(stop);
  }
  if (auto v = absl::GetFlag(FLAGS_repetition_penalty)) {
    sampling->set_repetition_penalty(*v);
  }
  sampling->set_min_p(absl::GetFlag(FLAGS_min_p));
  sampling->set_presence_penalty(absl::GetFlag(FLAGS_presence_penalty));
  sampling->set_frequency_penalty(absl::GetFlag(FLAGS_frequency_penalty));
  std::vector<std::pair<int32_t, float>> bias;
  if (std::string error = LogitBiasFromFlags(&bias); !error.empty()) {
    return error;
  }
  for (const auto& [id, value] : bias)
    (*sampling->mutable_logit_bias())[id] = value;
  if (auto v = absl::GetFlag(FLAGS_logprobs)) sampling->set_logprobs(*v);
  if (auto v = absl::GetFlag(FLAGS_prompt_logprobs)) {
    sampling->set_prompt_logprobs(*v);
  }
  request->set_n(absl::GetFlag(FLAGS_n));
  request->set_priority(absl::GetFlag(FLAGS_priority));
  *request->mutable_activation() = ActivationFromFlags();
  request->set_include_routing(absl::GetFlag(FLAGS_routing));
  return "";
}

// Builds the ClassifyRequest; returns an error message on bad usage and sets
// `io_error` when the image file cannot be read.
std::string BuildClassifyRequest(const std::vector<std::string>& args,
                                 moh::v1::ClassifyRequest* request,
                                 bool* io_error) {
  const std::string text = absl::GetFlag(FLAGS_text);
  const std::vector<std::string> labels = absl::GetFlag(FLAGS_labels);
  if (text.empty()) {
    if (args.size() != 1) return "classify needs one IMAGE_FILE or --text";
    if (!labels.empty()) return "--labels applies to --text only";
    if (!ReadFile(args[0], request->mutable_image())) {
      *io_error = true;
      return absl::StrFormat("cannot read %s", args[0]);
    }
  } else {
    if (!args.empty()) return "classify takes IMAGE_FILE or --text, not both";
    if (labels.empty()) return "--text needs --labels=a,b,...";
    request->set_text(text);
    for (const std::string& label : labels) request->add_labels(label);
  }
  request->set_model(absl::GetFlag(FLAGS_model));
  request->set_top_n(absl::GetFlag(FLAGS_top_n));
  *request->mutable_activation() = ActivationFromFlags();
  request->set_include_routing(absl::GetFlag(FLAGS_routing));
  return "";
}

int Main(int argc, char** argv) {
  CommandLine line;
  std::string error;
  if (!ParseCommandLine(argc, argv, &line, &error)) return UsageError(error);
  if (line.help || (!line.positional.empty() && line.positional[0] == "help")) {
    Usage(stdout, /*flags=*/true);
    return kExitOk;
  }
  if (line.positional.empty()) return UsageError("missing COMMAND");
  const std::string name = line.positional[0];
  const std::vector<std::string> args(line.positional.begin() + 1,
                                      line.positional.end());
  const Command* command = nullptr;
  for (const Command& c : Commands()) {
    if (name == c.name) command = &c;
  }
  if (command == nullptr) {
    return UsageError(absl::StrFormat("unknown command '%s'", name));
  }
  for (const std::string& flag : line.flags_given) {
    bool accepted = flag == command->address;
    for (const char* f : kGlobalFlags) accepted |= flag == f;
    for (const char* f : command->flags) accepted |= flag == f;
    if (!accepted) {
      return UsageError(
          absl::StrFormat("--%s does not apply to %s", flag, name));
    }
  }

  CallOptions call;
  const double timeout_s = absl::GetFlag(FLAGS_timeout);
  if (timeout_s < 0) return UsageError("--timeout must be >= 0");
  call.timeout = absl::Seconds(timeout_s);
  if (name == "health" && line.flags_given.count("timeout") == 0) {
    call.timeout = absl::Seconds(5);
  }
  absl::StatusOr<Connection> connection = ConnectionFromFlags();
  if (!connection.ok())
    return UsageError(std::string(connection.status().message()));
  if (name == "chat") {
    if (!args.empty()) return UsageError("chat takes no arguments");
    std::vector<std::pair<int32_t, float>> bias;
    if (std::string error = LogitBiasFromFlags(&bias); !error.empty()) {
      return UsageError(error);
    }
    ChatOptions options;
    options.system = absl::GetFlag(FLAGS_system);
    options.fields = ChatFieldsFromFlags(bias);
    options.show_prompt = isatty(STDIN_FILENO);
    return RunChat(OpenAiHttpClient(*connection, call.timeout), options,
                   std::cin);
  }
  call.token = connection->token;
  absl::StatusOr<std::shared_ptr<grpc::Channel>> opened =
      OpenChannel(*connection);
  if (!opened.ok()) return UsageError(std::string(opened.status().message()));
  const std::shared_ptr<grpc::Channel> channel = *opened;

  if (name == "health") {
    if (!args.empty()) return UsageError("health takes no arguments");
    auto stub = grpc::health::v1::Health::NewStub(channel);
    return RunHealthCheck(*stub, absl::GetFlag(FLAGS_service), call);
  }
  auto stub = moh::v1::Inference::NewStub(channel);
  if (name == "models") {
    if (!args.empty()) return UsageError("models takes no arguments");
    return RunListModels(*stub, call);
  }
  if (name == "generate") {
    moh::v1::GenerateRequest request;
    error = BuildGenerateRequest(args, &request);
    if (!error.empty()) return UsageError(error);
    return RunGenerate(*stub, request, call);
  }
  if (name == "generate-image") {
    if (!args.empty()) return UsageError("generate-image takes no arguments");
    moh::v1::GenerateImageRequest request;
    error = BuildGenerateImageRequest(&request);
    if (!error.empty()) return UsageError(error);
    return RunGenerateImage(*stub, request, absl::GetFlag(FLAGS_out), call);
  }
  moh::v1::ClassifyRequest request;
  bool io_error = false;
  error = BuildClassifyRequest(args, &request, &io_error);
  if (io_error) {
    absl::FPrintF(stderr, "moh-client: %s\n", error);
    return kExitFailure;
  }
  if (!error.empty()) return UsageError(error);
  return RunClassify(*stub, request, call);
}

}  // namespace
}  // namespace moh::client

int main(int argc, char** argv) {
  moh::client::InstallInterruptWatcher();
  return moh::client::Main(argc, argv);
}
