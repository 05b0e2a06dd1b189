// moh-generate: in-process generation with a MoH language model directory.
// Streams the continuation to stdout, then prints finish reason, usage, the
// effective activation ratio and (with --routing) the per-layer head load.
//
//   moh-generate --model_dir=DIR --prompt="Once upon a time" --ratio=0.5
#include <chrono>
#include <cstdio>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/log.h"
#include "model/core/runtime.h"
#include "model/generation/generator.h"
#include "model/generation/language_model.h"

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
ABSL_FLAG(int32_t, threads, 0,
          "LibTorch intra-op threads; 0 = the default (see model/runtime.h)");
ABSL_FLAG(bool, routing, false, "Print tokens served per (layer, head)");
ABSL_FLAG(int32_t, batch, 1,
          "Generate this many copies of the request in one batch (throughput "
          "measurement; only the first is printed)");
ABSL_FLAG(int32_t, repeat, 1, "Run the whole generation this many times");
ABSL_FLAG(int32_t, prompt_tokens, 0,
          "Benchmark prompt of exactly this many token ids (--prompt's ids "
          "repeated); 0 = --prompt as it is");
ABSL_FLAG(int32_t, warmup, 0, "Untimed generations before the timed ones");
ABSL_FLAG(bool, print_token_ids, false,
          "Print the prompt's and the first sequence's generated token ids");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Generates text with a MoH language model, in process.");
  absl::ParseCommandLine(argc, argv);
  const std::string dir = absl::GetFlag(FLAGS_model_dir);
  if (dir.empty()) {
    std::cerr << "moh-generate: --model_dir is required\n";
    return 2;
  }
  moh::ConfigureCpuAllocator();
  moh::ConfigureCpuThreads(absl::GetFlag(FLAGS_threads));
  const auto load_start = std::chrono::steady_clock::now();
  auto lm = moh::LanguageModel::Load(
      dir, moh::DeviceOptions{absl::GetFlag(FLAGS_device),
                              absl::GetFlag(FLAGS_dtype)});
  if (!lm.ok()) {
    std::cerr << "moh-generate: " << lm.status().message() << "\n";
    return 1;
  }
  if (lm->tokenizer == nullptr) {
    std::cerr << "moh-generate: " << dir << " has no tokenizer.json\n";
    return 1;
  }
  const double load_s = std::chrono::duration<double>(
                            std::chrono::steady_clock::now() - load_start)
                            .count();
  const absl::Status kv_set = lm->model->set_kv_cache_dtype(
      absl::GetFlag(FLAGS_kv_cache_dtype), "--kv_cache_dtype");
  if (!kv_set.ok()) {
    std::cerr << "moh-generate: " << kv_set.message() << "\n";
    return 2;
  }
  const moh::LlamaConfig& config = lm->model->config();
  MOH_LOG(Info) << absl::StrFormat(
      "loaded %s in %.2fs: %d layers, %d heads, router %s, default ratio "
      "%.3f",
      dir, load_s, config.num_layers, config.num_heads,
      moh::RouterKindName(config.moh.router), config.moh.DefaultRatio());

  moh::GenerationRequest request;
  request.prompt_ids = lm->tokenizer->Encode(absl::GetFlag(FLAGS_prompt), true);
  if (const size_t n = std::max(0, absl::GetFlag(FLAGS_prompt_tokens));
      n > 0 && !request.prompt_ids.empty()) {
    const auto text = request.prompt_ids;  // BOS first: repeat what follows
    const size_t from = text.size() > 1 ? 1 : 0;
    for (size_t i = text.size(); i < n; ++i)
      request.prompt_ids.push_back(
          text[from + (i - from) % (text.size() - from)]);
    request.prompt_ids.resize(n);
  }
  request.sampling.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  request.sampling.temperature = absl::GetFlag(FLAGS_temperature);
  request.sampling.top_k = absl::GetFlag(FLAGS_top_k);
  request.sampling.top_p = absl::GetFlag(FLAGS_top_p);
  request.sampling.repetition_penalty = absl::GetFlag(FLAGS_repetition_penalty);
  request.sampling.stop = absl::GetFlag(FLAGS_stop);
  if (absl::GetFlag(FLAGS_seed) >= 0)
    request.sampling.seed = absl::GetFlag(FLAGS_seed);

  std::vector<float> ratios;
  for (const std::string& text : absl::GetFlag(FLAGS_ratios)) {
    float ratio = 0;
    if (!absl::SimpleAtof(text, &ratio) || !(ratio >= 0 && ratio <= 1)) {
      std::cerr << "moh-generate: --ratios: \"" << text
                << "\" is not a ratio in [0, 1]\n";
      return 2;
    }
    ratios.push_back(ratio);
  }
  if (ratios.empty()) ratios.push_back(absl::GetFlag(FLAGS_ratio));

  moh::Generator generator(*lm->model, lm->tokenizer.get(), lm->eos_ids);
  const int32_t batch = std::max(1, absl::GetFlag(FLAGS_batch));
  const int32_t repeat = std::max(1, absl::GetFlag(FLAGS_repeat));
  std::cout << absl::GetFlag(FLAGS_prompt) << std::flush;
  absl::StatusOr<std::vector<moh::GenerationResult>> results;
  double seconds = 0;
  for (size_t k = 0; k < ratios.size(); ++k) {
    request.ratio = ratios[k];
    const std::vector<moh::GenerationRequest> requests(batch, request);
    for (int32_t i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) {
      if (!generator.Generate(requests, nullptr).ok()) break;
    }
    int64_t total_tokens = 0;
    // Prefill: from a repeat's start to its first chunk (the prompts' forward
    // pass and the first token); decode: the rest, one token per row a step.
    double prefill_s = 0;
    const auto start = std::chrono::steady_clock::now();
    for (int32_t i = 0; i < repeat; ++i) {
      const auto repeat_start = std::chrono::steady_clock::now();
      bool first = true;
      const bool print = k == 0 && i == 0;
      auto batch_results = generator.Generate(
          requests, [&](size_t row, const moh::GenerationChunk& chunk) {
            if (first) {
              first = false;
              prefill_s += std::chrono::duration<double>(
                               std::chrono::steady_clock::now() - repeat_start)
                               .count();
            }
            if (print && row == 0) std::cout << chunk.text << std::flush;
          });
      if (!batch_results.ok()) {
        std::cerr << "\nmoh-generate: " << batch_results.status().message()
                  << "\n";
        return 1;
      }
      for (const moh::GenerationResult& r : *batch_results) {
        total_tokens += r.token_ids.size();
      }
      if (k == 0 && i == 0) results = std::move(batch_results);
    }
    const double ratio_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();
    if (k == 0) {
      seconds = ratio_s;
      std::cout << "\n";
    }
    if (batch > 1 || repeat > 1 || absl::GetFlag(FLAGS_prompt_tokens) > 0 ||
        ratios.size() > 1) {
      const int64_t prompt =
          int64_t{batch} * repeat * request.prompt_ids.size();
      const int64_t decoded = total_tokens - int64_t{batch} * repeat;
      const double decode_s = ratio_s - prefill_s;
      std::fprintf(
          stderr,
          "batch=%d repeat=%d ratio=%.4f generated_tokens=%lld "
          "time=%.3fs tokens_per_s=%.2f prefill_tokens=%lld "
          "prefill_time=%.3fs prefill_tokens_per_s=%.2f "
          "decode_tokens=%lld decode_time=%.3fs "
          "decode_tokens_per_s=%.2f\n",
          batch, repeat, request.ratio, static_cast<long long>(total_tokens),
          ratio_s, total_tokens / std::max(ratio_s, 1e-9),
          static_cast<long long>(prompt), prefill_s,
          prompt / std::max(prefill_s, 1e-9), static_cast<long long>(decoded),
          decode_s, decoded / std::max(decode_s, 1e-9));
    }
  }
  const moh::GenerationResult& r = (*results)[0];
  if (absl::GetFlag(FLAGS_print_token_ids)) {
    std::fprintf(stderr, "prompt_ids=%s\ntoken_ids=%s\n",
                 absl::StrJoin(request.prompt_ids, ",").c_str(),
                 absl::StrJoin(r.token_ids, ",").c_str());
  }
  std::fprintf(stderr,
               "finish_reason=%s prompt_tokens=%d completion_tokens=%zu "
               "effective_ratio=%.4f time=%.3fs (%.1f tokens/s)\n",
               moh::FinishReasonName(r.finish_reason), r.prompt_tokens,
               r.token_ids.size(), r.effective_ratio, seconds / repeat,
               r.token_ids.size() * repeat / std::max(seconds, 1e-9));
  if (absl::GetFlag(FLAGS_routing)) {
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
  return 0;
}
