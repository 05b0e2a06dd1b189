// moh-generate: in-process generation with a MoH language model directory.
// Streams the continuation to stdout, then prints finish reason, usage, the
// effective activation ratio and (with --routing) the per-layer head load.
//
//   moh-generate --model_dir=DIR --prompt="Once upon a time" --ratio=0.5
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <optional>
#include <set>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "model/core/fused_layer_ops.h"
#include "model/core/runtime.h"
#include "model/generation/generator.h"
#include "model/generation/language_model.h"
#include "torch/csrc/autograd/profiler_kineto.h"

ABSL_FLAG(std::string, model_dir, "",
          "Model directory (config.json, weights, tokenizer.json)");
ABSL_FLAG(std::string, prompt, "Once upon a time", "Prompt text");
ABSL_FLAG(float, ratio, 0.0f,
          "Activation ratio in (0, 1]; 0 = the model's default");
ABSL_FLAG(std::vector<std::string>, ratios, {},
          "Comma-separated ratios measured one after the other with one load "
          "of the model (a throughput line each, tagged ratio=R; the first is "
          "printed); overrides --ratio");
ABSL_FLAG(int32_t, max_new_tokens, 32, "Tokens to generate");
ABSL_FLAG(float, temperature, 0.0f, "Sampling temperature; 0 = greedy");
ABSL_FLAG(int32_t, top_k, 0, "Top-k sampling; 0 = off");
ABSL_FLAG(float, top_p, 1.0f, "Nucleus sampling in (0, 1]; 1 = off");
ABSL_FLAG(int64_t, seed, -1, "Sampling seed; -1 = random");
ABSL_FLAG(float, repetition_penalty, 1.0f, "Repetition penalty; 1 = off");
ABSL_FLAG(std::vector<std::string>, stop, {}, "Comma-separated stop strings");
ABSL_FLAG(std::string, device, "auto", "auto, cpu, cuda or cuda:N");
ABSL_FLAG(std::string, dtype, "auto", "auto, float32, bfloat16 or float16");
ABSL_FLAG(std::string, kv_cache_dtype, "auto",
          "KV cache element type: auto (the model's dtype), float32, bfloat16 "
          "or float16");
ABSL_FLAG(std::string, weights, "",
          "Linear weights' precision under float32 activations on the CPU: "
          "empty (as --dtype), bfloat16 or int8, converted as they load (see "
          "LlamaModel::FromTensors)");
ABSL_FLAG(
    int32_t, threads, 0,
    "LibTorch intra-op threads; 0 = the default (see model/core/runtime.h)");
ABSL_FLAG(int64_t, cuda_graphs, moh::kDefaultCudaGraphs,
          "On CUDA: decode-step shapes recorded as CUDA graphs (see "
          "LlamaModel::set_cuda_graphs); 0 = every step eagerly");
ABSL_FLAG(bool, cuda_paged_decode, true,
          "On CUDA: decode attention over the paged cache in place (see "
          "LlamaModel::set_cuda_paged_decode); false = the gathered copy");
ABSL_FLAG(bool, cuda_fused_ops, true,
          "On CUDA: a layer's norms, RoPE, KV store, SwiGLU and query-norm "
          "gates as one kernel each (see LlamaModel::set_cuda_fused_ops); "
          "false = chains of ATen ops");
ABSL_FLAG(bool, cuda_varlen_prefill, true,
          "On CUDA: prompt chunks through FlashAttention over packed keys (see "
          "LlamaModel::set_cuda_varlen_prefill); false = padded rows and a "
          "mask");
ABSL_FLAG(bool, cuda_skinny_linear, true,
          "On CUDA: a decode step's products with few outputs as one kernel "
          "each without split-K, SwiGLU inside the down projection (see "
          "LlamaModel::set_cuda_skinny_linear); false = cuBLAS");
ABSL_FLAG(bool, cuda_programmatic_launch, false,
          "On CUDA (Hopper and later): this project's kernels launch to "
          "overlap the kernel before them (programmatic dependent launch; "
          "see model/kernels/cuda_launch.h)");
ABSL_FLAG(bool, routing, false, "Print tokens served per (layer, head)");
ABSL_FLAG(int32_t, batch, 1,
          "Generate this many copies of the request in one batch (throughput "
          "measurement; only the first is printed)");
ABSL_FLAG(int32_t, repeat, 1, "Run the whole generation this many times");
ABSL_FLAG(int32_t, prompt_tokens, 0,
          "Benchmark prompt of exactly this many token ids (--prompt's ids "
          "repeated); 0 = --prompt as it is");
ABSL_FLAG(int32_t, warmup, 0, "Untimed generations before the timed ones");
ABSL_FLAG(std::string, profile_dir, "",
          "Trace each ratio's first timed generation with LibTorch's profiler "
          "(host operators and, on CUDA, every kernel, graph-replayed ones "
          "too): its prefill (to the first token) to "
          "DIR/prefill-ratio-R.json and its decode to "
          "DIR/decode-ratio-R.json, Chrome traces (bench/trace_summary.py, "
          "Perfetto); the profiled figures include the profiler's overhead");
ABSL_FLAG(bool, print_token_ids, false,
          "Print the prompt's and the first sequence's generated token ids");

namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The error path: prints `message` and returns `code` (2: a bad flag, 1: a
// failure).
int Fail(int code, absl::string_view message) {
  std::cerr << "moh-generate: " << message << "\n";
  return code;
}

// --prompt, tokenized; with --prompt_tokens, its ids after BOS repeated to
// exactly that many.
std::vector<int32_t> PromptIds(const moh::Tokenizer& tokenizer) {
  std::vector<int32_t> ids =
      tokenizer.Encode(absl::GetFlag(FLAGS_prompt), true);
  const size_t n = std::max(0, absl::GetFlag(FLAGS_prompt_tokens));
  if (n == 0 || ids.empty()) return ids;
  const auto text = ids;  // BOS first: repeat what follows
  const size_t from = text.size() > 1 ? 1 : 0;
  for (size_t i = text.size(); i < n; ++i) {
    ids.push_back(text[from + (i - from) % (text.size() - from)]);
  }
  ids.resize(n);
  return ids;
}

moh::GenerationRequest RequestFromFlags(const moh::Tokenizer& tokenizer) {
  moh::GenerationRequest request;
  request.prompt_ids = PromptIds(tokenizer);
  request.sampling.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  request.sampling.temperature = absl::GetFlag(FLAGS_temperature);
  request.sampling.top_k = absl::GetFlag(FLAGS_top_k);
  request.sampling.top_p = absl::GetFlag(FLAGS_top_p);
  request.sampling.repetition_penalty = absl::GetFlag(FLAGS_repetition_penalty);
  request.sampling.stop = absl::GetFlag(FLAGS_stop);
  if (absl::GetFlag(FLAGS_seed) >= 0) {
    request.sampling.seed = absl::GetFlag(FLAGS_seed);
  }
  return request;
}

// --ratios, else --ratio.
absl::StatusOr<std::vector<float>> RatiosFromFlags() {
  std::vector<float> ratios;
  for (const std::string& text : absl::GetFlag(FLAGS_ratios)) {
    float ratio = 0;
    if (!absl::SimpleAtof(text, &ratio) || !(ratio >= 0 && ratio <= 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--ratios: \"", text, "\" is not a ratio in [0, 1]"));
    }
    ratios.push_back(ratio);
  }
  if (ratios.empty()) ratios.push_back(absl::GetFlag(FLAGS_ratio));
  return ratios;
}

// The model of --model_dir with its KV cache type set, and how long loading
// took.
absl::StatusOr<moh::LanguageModel> LoadModel(double* load_s) {
  const std::string dir = absl::GetFlag(FLAGS_model_dir);
  const Clock::time_point start = Clock::now();
  MOH_ASSIGN_OR_RETURN(
      moh::LanguageModel lm,
      moh::LanguageModel::Load(
          dir, moh::DeviceOptions{absl::GetFlag(FLAGS_device),
                                  absl::GetFlag(FLAGS_dtype),
                                  absl::GetFlag(FLAGS_weights)}));
  if (lm.tokenizer == nullptr) {
    return absl::NotFoundError(absl::StrCat(dir, " has no tokenizer.json"));
  }
  *load_s = SecondsSince(start);
  return lm;
}

// --profile_dir: LibTorch's profiler (kineto) over the phases of one
// generation, each saved as a Chrome trace DIR/PHASE-ratio-R.json. Open()
// starts a phase's window, Close() ends it and saves it; the first error
// is kept (status()) and stops further windows.
class PhaseTrace {
 public:
  PhaseTrace(std::string dir, float ratio, bool cuda)
      : dir_(std::move(dir)),
        ratio_(ratio),
        config_(torch::profiler::impl::ProfilerState::KINETO),
        activities_{torch::profiler::impl::ActivityType::CPU} {
    if (cuda) activities_.insert(torch::profiler::impl::ActivityType::CUDA);
    // Made once here, so that no phase's trace holds a file system call.
    std::error_code error;
    std::filesystem::create_directories(dir_, error);
    if (error) {
      status_ = absl::FailedPreconditionError(absl::StrCat(
          "--profile_dir: cannot make ", dir_, ": ", error.message()));
    }
  }

  void Open(absl::string_view phase) {
    if (!status_.ok() || open_) return;
    status_ = Guard("start", [&] {
      torch::autograd::profiler::prepareProfiler(config_, activities_);
      torch::autograd::profiler::enableProfiler(config_, activities_);
    });
    if (!status_.ok()) return;
    open_ = true;
    path_ = absl::StrFormat("%s/%s-ratio-%.2f.json", dir_, phase, ratio_);
  }

  void Close() {
    if (!open_) return;
    open_ = false;
    status_ = Guard("save", [&] {
      torch::autograd::profiler::disableProfiler()->save(path_);
    });
    // (Kineto logs a file it cannot write, and returns.)
    if (status_.ok() && !std::filesystem::exists(path_)) {
      status_ = absl::FailedPreconditionError(
          absl::StrCat("--profile_dir: the trace was not written to ", path_));
    }
    if (status_.ok()) paths_.push_back(path_);
  }

  const absl::Status& status() const { return status_; }
  const std::vector<std::string>& paths() const { return paths_; }

 private:
  // Runs `step`, turning LibTorch's exception into a status that names it.
  template <typename F>
  absl::Status Guard(absl::string_view what, F step) {
    try {
      step();
      return absl::OkStatus();
    } catch (const std::exception& e) {
      // LibTorch's message, without the stack trace it appends.
      const absl::string_view message = e.what();
      return absl::FailedPreconditionError(
          absl::StrCat("--profile_dir: LibTorch's profiler could not ", what,
                       " (", message.substr(0, message.find('\n')), ")"));
    }
  }

  std::string dir_;
  float ratio_;
  torch::profiler::impl::ProfilerConfig config_;
  std::set<torch::profiler::impl::ActivityType> activities_;
  bool open_ = false;
  std::string path_;
  std::vector<std::string> paths_;
  absl::Status status_;
};

// One ratio's timed generations.
struct Measured {
  int64_t total_tokens = 0;
  double seconds = 0;
  // From each repeat's start to its first chunk (the prompts' forward pass
  // and the first token); decode is the rest, one token per row a step.
  double prefill_s = 0;
  std::vector<moh::GenerationResult> first;  // the first repeat's results
};

// --warmup untimed generations of `batch` copies of `request`, then --repeat
// timed ones; with `print`, streams row 0 of the first to stdout. With
// `trace`, the first timed generation is traced in two phases: "prefill"
// (from its start to its first chunk: the prompts' forward pass and the
// first token) and "decode" (the rest).
absl::StatusOr<Measured> Measure(const moh::Generator& generator,
                                 const moh::GenerationRequest& request,
                                 int32_t batch, int32_t repeat, bool print,
                                 PhaseTrace* trace) {
  const std::vector<moh::GenerationRequest> requests(batch, request);
  for (int32_t i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) {
    if (!generator.Generate(requests, nullptr).ok()) break;
  }
  Measured measured;
  const Clock::time_point start = Clock::now();
  for (int32_t i = 0; i < repeat; ++i) {
    const bool traced = trace != nullptr && i == 0;
    if (traced) trace->Open("prefill");
    const Clock::time_point repeat_start = Clock::now();
    bool first = true;
    MOH_ASSIGN_OR_RETURN(
        std::vector<moh::GenerationResult> results,
        generator.Generate(requests,
                           [&](size_t row, const moh::GenerationChunk& chunk) {
                             if (first) {
                               first = false;
                               measured.prefill_s += SecondsSince(repeat_start);
                               if (traced) {
                                 trace->Close();
                                 trace->Open("decode");
                               }
                             }
                             if (print && i == 0 && row == 0)
                               std::cout << chunk.text << std::flush;
                           }));
    for (const moh::GenerationResult& r : results) {
      measured.total_tokens += r.token_ids.size();
    }
    if (i == 0) {
      measured.first = std::move(results);
      if (traced) {
        trace->Close();
        MOH_RETURN_IF_ERROR(trace->status());
      }
    }
  }
  measured.seconds = SecondsSince(start);
  return measured;
}

// The process's resident memory now, in MiB (/proc/self/statm; 0 where it
// cannot be read): the weights' footprint after the load, which `weights:
// "bfloat16"` halves and "int8" quarters (time's maximum RSS also counts
// the checkpoint's mapped pages, file-backed and reclaimable, as they were
// read).
double ResidentMiB() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  long long size = 0, resident = 0;
  const int read = std::fscanf(f, "%lld %lld", &size, &resident);
  std::fclose(f);
  return read == 2 ? resident * (sysconf(_SC_PAGESIZE) / 1048576.0) : 0;
}

void PrintThroughput(const Measured& m, int32_t batch, int32_t repeat,
                     float ratio, size_t prompt_len) {
  const int64_t prompt = int64_t{batch} * repeat * prompt_len;
  const int64_t decoded = m.total_tokens - int64_t{batch} * repeat;
  const double decode_s = m.seconds - m.prefill_s;
  std::fprintf(stderr,
               "batch=%d repeat=%d ratio=%.4f generated_tokens=%lld "
               "time=%.3fs tokens_per_s=%.2f prefill_tokens=%lld "
               "prefill_time=%.3fs prefill_tokens_per_s=%.2f "
               "decode_tokens=%lld decode_time=%.3fs "
               "decode_tokens_per_s=%.2f rss_mib=%.1f\n",
               batch, repeat, ratio, static_cast<long long>(m.total_tokens),
               m.seconds, m.total_tokens / std::max(m.seconds, 1e-9),
               static_cast<long long>(prompt), m.prefill_s,
               prompt / std::max(m.prefill_s, 1e-9),
               static_cast<long long>(decoded), decode_s,
               decoded / std::max(decode_s, 1e-9), ResidentMiB());
}

// The first sequence: its finish, usage and speed; its ids and its routing
// when asked.
void PrintFirst(const moh::GenerationResult& r,
                const std::vector<int32_t>& prompt_ids, double seconds,
                int32_t repeat) {
  if (absl::GetFlag(FLAGS_print_token_ids)) {
    std::fprintf(stderr, "prompt_ids=%s\ntoken_ids=%s\n",
                 absl::StrJoin(prompt_ids, ",").c_str(),
                 absl::StrJoin(r.token_ids, ",").c_str());
  }
  std::fprintf(stderr,
               "finish_reason=%s prompt_tokens=%d completion_tokens=%zu "
               "effective_ratio=%.4f time=%.3fs (%.1f tokens/s)\n",
               moh::FinishReasonName(r.finish_reason), r.prompt_tokens,
               r.token_ids.size(), r.effective_ratio, seconds / repeat,
               r.token_ids.size() * repeat / std::max(seconds, 1e-9));
  if (!absl::GetFlag(FLAGS_routing)) return;
  const at::Tensor counts = r.head_token_counts;  // [L, H]
  std::fprintf(stderr,
               "tokens served per head (rows: layers, columns: heads)\n");
  for (int64_t l = 0; l < counts.size(0); ++l) {
    std::fprintf(stderr, "layer %3lld:", static_cast<long long>(l));
    for (int64_t h = 0; h < counts.size(1); ++h) {
      std::fprintf(stderr, " %5lld",
                   static_cast<long long>(counts[l][h].item<int64_t>()));
    }
    std::fprintf(stderr, "\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Generates text with a MoH language model, in process.");
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_model_dir).empty()) {
    return Fail(2, "--model_dir is required");
  }
  const absl::StatusOr<std::vector<float>> ratios = RatiosFromFlags();
  if (!ratios.ok()) return Fail(2, ratios.status().message());
  moh::ConfigureCpuAllocator();
  moh::ConfigureCpuThreads(absl::GetFlag(FLAGS_threads));
  double load_s = 0;
  absl::StatusOr<moh::LanguageModel> lm = LoadModel(&load_s);
  if (!lm.ok()) return Fail(1, lm.status().message());
  const absl::Status kv_set = lm->model->set_kv_cache_dtype(
      absl::GetFlag(FLAGS_kv_cache_dtype), "--kv_cache_dtype");
  if (!kv_set.ok()) return Fail(2, kv_set.message());
  if (absl::GetFlag(FLAGS_cuda_graphs) < 0) {
    return Fail(2, "--cuda_graphs must be >= 0");
  }
  lm->model->set_cuda_graphs(absl::GetFlag(FLAGS_cuda_graphs));
  lm->model->set_cuda_paged_decode(absl::GetFlag(FLAGS_cuda_paged_decode));
  lm->model->set_cuda_fused_ops(absl::GetFlag(FLAGS_cuda_fused_ops));
  lm->model->set_cuda_varlen_prefill(absl::GetFlag(FLAGS_cuda_varlen_prefill));
  lm->model->set_cuda_skinny_linear(absl::GetFlag(FLAGS_cuda_skinny_linear));
  moh::SetCudaProgrammaticLaunch(absl::GetFlag(FLAGS_cuda_programmatic_launch));
  const moh::LlamaConfig& config = lm->model->config();
  MOH_LOG(Info) << absl::StrFormat(
      "loaded %s in %.2fs: %d layers, %d heads, router %s, default ratio "
      "%.3f",
      absl::GetFlag(FLAGS_model_dir), load_s, config.num_layers,
      config.num_heads, moh::RouterKindName(config.moh.router),
      config.moh.DefaultRatio());

  moh::GenerationRequest request = RequestFromFlags(*lm->tokenizer);
  const moh::Generator generator(*lm->model, lm->tokenizer.get(), lm->eos_ids);
  const int32_t batch = std::max(1, absl::GetFlag(FLAGS_batch));
  const int32_t repeat = std::max(1, absl::GetFlag(FLAGS_repeat));
  const bool throughput = batch > 1 || repeat > 1 ||
                          absl::GetFlag(FLAGS_prompt_tokens) > 0 ||
                          ratios->size() > 1;
  std::cout << absl::GetFlag(FLAGS_prompt) << std::flush;
  Measured first;
  const std::string profile_dir = absl::GetFlag(FLAGS_profile_dir);
  for (size_t k = 0; k < ratios->size(); ++k) {
    request.ratio = (*ratios)[k];
    std::optional<PhaseTrace> trace;
    if (!profile_dir.empty()) {
      trace.emplace(profile_dir, request.ratio,
                    lm->model->options().device().is_cuda());
    }
    absl::StatusOr<Measured> measured = Measure(
        generator, request, batch, repeat, k == 0, trace ? &*trace : nullptr);
    if (!measured.ok()) {
      std::cout << "\n";
      return Fail(1, measured.status().message());
    }
    if (k == 0) std::cout << "\n";
    if (throughput) {
      PrintThroughput(*measured, batch, repeat, request.ratio,
                      request.prompt_ids.size());
    }
    if (trace) {
      for (const std::string& path : trace->paths()) {
        std::fprintf(stderr, "profile_trace=%s\n", path.c_str());
      }
    }
    if (k == 0) first = *std::move(measured);
  }
  PrintFirst(first.first[0], request.prompt_ids, first.seconds, repeat);
  if (lm->model->options().device().is_cuda()) {
    std::fprintf(stderr, "cuda_graph_replays=%lld\n",
                 static_cast<long long>(lm->model->graph_replays()));
  }
  return 0;
}
