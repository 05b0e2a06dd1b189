#include "client/bench_config.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/str_format.h"

namespace moh::client {
namespace {

// Distinct synthetic inputs per run; enough to defeat trivial caching without
// spending client CPU on every request.
constexpr int kSyntheticVariants = 16;
constexpr int64_t kMaxPixels = int64_t{1} << 24;
constexpr int kMaxPromptTokens = 1 << 20;
constexpr size_t kMaxRatios = 64;

std::string ValidateGenerate(const BenchConfig& c) {
  if (!c.image_path.empty() || !c.pixels_shape.empty() || !c.text.empty() ||
      !c.labels.empty() || c.top_n != 0) {
    return "--image, --pixels_shape, --text, --labels and --top_n apply to "
           "--rpc=classify only";
  }
  if (c.prompt_tokens < 0 || c.prompt_tokens > kMaxPromptTokens) {
    return absl::StrFormat("--prompt_tokens must be in [0, %d]",
                           kMaxPromptTokens);
  }
  if (c.prompt_tokens > 0 && !c.prompt.empty()) {
    return "give either --prompt or --prompt_tokens, not both";
  }
  if (c.prompt_tokens == 0 && c.prompt.empty()) {
    return "--prompt must not be empty";
  }
  return "";
}

std::string ValidateClassify(const BenchConfig& c) {
  if (!c.prompt.empty() || c.prompt_tokens != 0 || c.max_new_tokens ||
      c.temperature) {
    return "--prompt, --prompt_tokens, --max_new_tokens and --temperature "
           "apply to --rpc=generate only";
  }
  const int inputs =
      !c.image_path.empty() + !c.pixels_shape.empty() + !c.text.empty();
  if (inputs != 1) {
    return "--rpc=classify needs exactly one of --image, --pixels_shape or "
           "--text";
  }
  if (!c.text.empty() && c.labels.empty()) return "--text needs --labels";
  if (c.text.empty() && !c.labels.empty()) return "--labels needs --text";
  if (!c.pixels_shape.empty()) {
    if (c.pixels_shape.size() != 3) return "--pixels_shape must be C,H,W";
    int64_t n = 1;
    for (int64_t d : c.pixels_shape) {
      if (d < 1 || d > kMaxPixels) return "--pixels_shape: bad dimension";
      n *= d;
      if (n > kMaxPixels) return "--pixels_shape: too many pixels";
    }
  }
  if (c.top_n < 0) return "--top_n must be >= 0";
  return "";
}

}  // namespace

std::string ValidateBenchConfig(const BenchConfig& c) {
  if (c.server.empty()) return "--server must not be empty";
  if (c.concurrency && c.rate) {
    return "give either --concurrency (closed loop) or --rate (open loop), "
           "not both";
  }
  if (c.concurrency &&
      (*c.concurrency < 1 || *c.concurrency > kMaxBenchInFlight)) {
    return absl::StrFormat("--concurrency must be in [1, %d]",
                           kMaxBenchInFlight);
  }
  if (c.rate && !(*c.rate > 0 && *c.rate <= 1e6)) {
    return "--rate must be in (0, 1e6] requests/s";
  }
  if (c.max_in_flight < 1 || c.max_in_flight > kMaxBenchInFlight) {
    return absl::StrFormat("--max_in_flight must be in [1, %d]",
                           kMaxBenchInFlight);
  }
  if (!c.requests && !c.duration) {
    return "give --requests and/or --duration to bound the run";
  }
  if (c.requests && (*c.requests < 1 || *c.requests > kMaxBenchRequests)) {
    return absl::StrFormat("--requests must be in [1, %d]", kMaxBenchRequests);
  }
  if (c.duration && !(*c.duration > absl::ZeroDuration() &&
                      *c.duration <= absl::Seconds(kMaxBenchSeconds))) {
    return absl::StrFormat("--duration must be in (0, %g] seconds",
                           kMaxBenchSeconds);
  }
  if (c.warmup_requests < 0 || c.warmup_requests > kMaxBenchRequests) {
    return absl::StrFormat("--warmup_requests must be in [0, %d]",
                           kMaxBenchRequests);
  }
  if (!(c.timeout > absl::ZeroDuration() &&
        c.timeout <= absl::Seconds(kMaxBenchSeconds))) {
    return absl::StrFormat("--timeout must be in (0, %g] seconds",
                           kMaxBenchSeconds);
  }
  if (c.ratios.empty() || c.ratios.size() > kMaxRatios) {
    return absl::StrFormat("--ratios needs 1 to %d values", kMaxRatios);
  }
  for (float r : c.ratios) {
    if (!(r >= 0 && r <= 1)) {
      return "--ratios: each ratio must be in [0, 1] (0 = model default)";
    }
  }
  if (!(c.min_ratio >= 0 && c.min_ratio <= 1)) {
    return "--min_ratio must be in [0, 1]";
  }
  if (c.api == BenchApi::kOpenAi && c.rpc != BenchRpc::kGenerate) {
    return "--api=openai loads --rpc=generate only (POST /v1/completions)";
  }
  return c.rpc == BenchRpc::kGenerate ? ValidateGenerate(c)
                                      : ValidateClassify(c);
}

RequestSource::RequestSource(const BenchConfig& config, std::string* error)
    : config_(config), rng_(config.seed) {
  std::mt19937_64 input_rng(config.seed ^ 0x9e3779b97f4a7c15ULL);
  if (config.rpc == BenchRpc::kGenerate) {
    moh::v1::GenerateRequest base;
    base.set_model(config.model);
    if (config.max_new_tokens) {
      base.mutable_sampling()->set_max_new_tokens(*config.max_new_tokens);
    }
    if (config.temperature) {
      base.mutable_sampling()->set_temperature(*config.temperature);
    }
    if (config.prompt_tokens == 0) {
      base.set_prompt(config.prompt);
      generate_pool_.push_back(base);
      return;
    }
    std::uniform_int_distribution<int32_t> token(1, 255);
    for (int v = 0; v < kSyntheticVariants; ++v) {
      moh::v1::GenerateRequest request = base;
      for (int i = 0; i < config.prompt_tokens; ++i) {
        request.add_token_ids(token(input_rng));
      }
      generate_pool_.push_back(std::move(request));
    }
    return;
  }
  moh::v1::ClassifyRequest base;
  base.set_model(config.model);
  base.set_top_n(config.top_n);
  if (!config.image_path.empty()) {
    std::ifstream in(config.image_path, std::ios::binary);
    std::ostringstream contents;
    contents << in.rdbuf();
    if (!in || contents.str().empty()) {
      *error = absl::StrFormat("cannot read --image=%s", config.image_path);
      return;
    }
    base.set_image(contents.str());
    classify_pool_.push_back(base);
  } else if (!config.text.empty()) {
    base.set_text(config.text);
    for (const std::string& label : config.labels) base.add_labels(label);
    classify_pool_.push_back(base);
  } else {
    int64_t n = 1;
    for (int64_t d : config.pixels_shape) n *= d;
    std::uniform_real_distribution<float> pixel(0.0f, 1.0f);
    for (int v = 0; v < kSyntheticVariants; ++v) {
      moh::v1::ClassifyRequest request = base;
      moh::v1::Tensor* pixels = request.mutable_pixels();
      for (int64_t d : config.pixels_shape) pixels->add_shape(d);
      pixels->mutable_data()->Reserve(static_cast<int>(n));
      for (int64_t i = 0; i < n; ++i) pixels->add_data(pixel(input_rng));
      classify_pool_.push_back(std::move(request));
    }
  }
}

void RequestSource::Restart() {
  rng_.seed(config_.seed);
  sequence_ = 0;
}

PlannedRequest RequestSource::Next() {
  PlannedRequest planned;
  const uint64_t n = config_.ratios.size();
  planned.ratio_index = static_cast<int>(
      config_.ratio_random
          ? std::uniform_int_distribution<uint64_t>(0, n - 1)(rng_)
          : sequence_ % n);
  moh::v1::Activation activation;
  activation.set_ratio(config_.ratios[planned.ratio_index]);
  activation.set_min_ratio(config_.min_ratio);
  if (config_.rpc == BenchRpc::kGenerate) {
    planned.generate = generate_pool_[sequence_ % generate_pool_.size()];
    *planned.generate.mutable_activation() = activation;
  } else {
    planned.classify = classify_pool_[sequence_ % classify_pool_.size()];
    *planned.classify.mutable_activation() = activation;
  }
  ++sequence_;
  return planned;
}

}  // namespace moh::client
