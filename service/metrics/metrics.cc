#include "service/metrics/metrics.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <iostream>
#include <utility>

#include "base/enum_names.h"
#include "service/metrics/process_collector.h"

namespace moh {
namespace {

using prometheus::Counter;
using prometheus::Family;
using prometheus::Gauge;
using prometheus::Histogram;

constexpr int kNumRpcs = 9;
constexpr int kNumBatchKinds = 4;
constexpr int kNumCodes = 17;  // absl::StatusCode (== grpc::StatusCode) 0..16.
constexpr int kUnknownCode = 2;

int CodeIndex(absl::StatusCode code) {
  const int i = static_cast<int>(code);
  return i >= 0 && i < kNumCodes ? i : kUnknownCode;
}

int RpcIndex(Rpc rpc) {
  const int i = static_cast<int>(rpc);
  return i >= 0 && i < kNumRpcs ? i : -1;
}

int BatchKindIndex(BatchKind kind) {
  const int i = static_cast<int>(kind);
  return i >= 0 && i < kNumBatchKinds ? i : -1;
}

// Request and queue latency: 1 ms .. 60 s, roughly 1-2.5-5 per decade.
Histogram::BucketBoundaries DurationBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
          0.5,   1,      2.5,   5,    10,    20,   30,  60};
}

// Queue waits are often sub-millisecond; start at 100 us.
Histogram::BucketBoundaries QueueBuckets() {
  Histogram::BucketBoundaries b = {0.0001, 0.00025, 0.0005};
  for (double v : DurationBuckets()) b.push_back(v);
  return b;
}

// Time to first token: finer between 10 ms and 1 s, up to 60 s.
Histogram::BucketBoundaries TtftBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2,
          0.3,   0.5,    0.75,  1,    2.5,  5,    7.5,  10,   20,  40,   60};
}

// Inter-token latency: one decode step, 1 ms .. 5 s, finest below 100 ms.
Histogram::BucketBoundaries ItlBuckets() {
  return {0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025,
          0.03,  0.04,   0.05,  0.075,  0.1,  0.15,  0.2,  0.3,
          0.4,   0.5,    0.75,  1,      2.5,  5};
}

// Rows per model step: powers of two 1 .. 256.
Histogram::BucketBoundaries BatchSizeBuckets() {
  Histogram::BucketBoundaries b;
  for (int v = 1; v <= 256; v *= 2) b.push_back(v);
  return b;
}

// Effective activation ratio: 0.05 .. 1.0 in steps of 0.05, computed as k/20
// so that bounds such as 0.5 and 0.75 are exact. Separates every k/16, k/12,
// k/8 ratio into its own bucket.
Histogram::BucketBoundaries ActivationRatioBuckets() {
  Histogram::BucketBoundaries b;
  for (int k = 1; k <= 20; ++k) b.push_back(k / 20.0);
  return b;
}

// BuildCounter()/BuildGauge()/BuildHistogram() with name and help, registered.
template <typename Builder>
auto& Register(Builder builder, const char* name, const char* help,
               prometheus::Registry& r) {
  return builder.Name(name).Help(help).Register(r);
}

}  // namespace

const char* RpcName(Rpc rpc) {
  static constexpr const char* kNames[] = {
      "Generate",        "Classify", "GenerateImage", "Completions",
      "ChatCompletions", "Tokenize", "Detokenize",    "TokenizerInfo",
      "Messages"};
  return EnumName(rpc, kNames);
}

const char* BatchKindName(BatchKind kind) {
  static constexpr const char* kNames[] = {"prefill", "decode", "classify",
                                           "image_step"};
  return EnumName(kind, kNames);
}

struct Metrics::Families {
  explicit Families(prometheus::Registry& r)
      : requests(Register(prometheus::BuildCounter(), "moh_requests_total",
                          "Finished RPCs by model, rpc and gRPC status code.",
                          r)),
        request_duration(Register(
            prometheus::BuildHistogram(), "moh_request_duration_seconds",
            "RPC latency from arrival to the final response.", r)),
        queue_duration(
            Register(prometheus::BuildHistogram(), "moh_queue_duration_seconds",
                     "Time from submission to start of compute.", r)),
        ttft(Register(prometheus::BuildHistogram(),
                      "moh_time_to_first_token_seconds",
                      "Time from arrival to the first generated token.", r)),
        itl(Register(
            prometheus::BuildHistogram(), "moh_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a stream.", r)),
        prompt_tokens(Register(prometheus::BuildCounter(),
                               "moh_prompt_tokens_total",
                               "Prompt tokens processed (prefill).", r)),
        generated_tokens(Register(prometheus::BuildCounter(),
                                  "moh_generated_tokens_total",
                                  "Tokens generated (decode).", r)),
        images(Register(prometheus::BuildCounter(),
                        "moh_images_generated_total",
                        "Images generated (GenerateImage).", r)),
        image_seconds(
            Register(prometheus::BuildHistogram(), "moh_image_seconds",
                     "Time from submission to the finished image (PNG).", r)),
        diffusion_steps(Register(prometheus::BuildCounter(),
                                 "moh_diffusion_steps_total",
                                 "Sampler steps computed, per request.", r)),
        batch_size(Register(prometheus::BuildHistogram(), "moh_batch_size",
                            "Rows in one model step, by kind.", r)),
        running(Register(prometheus::BuildGauge(), "moh_requests_running",
                         "Requests currently being computed.", r)),
        waiting(Register(prometheus::BuildGauge(), "moh_requests_waiting",
                         "Requests queued, not yet started.", r)),
        kv_cache_usage(Register(prometheus::BuildGauge(),
                                "moh_kv_cache_usage_ratio",
                                "Fraction of the KV cache in use (0..1).", r)),
        kv_cache_config(Register(
            prometheus::BuildGauge(), "moh_kv_cache_config_info",
            "The paged KV cache: positions per block and blocks (always 1).",
            r)),
        kv_blocks_in_use(
            Register(prometheus::BuildGauge(), "moh_kv_blocks_in_use",
                     "KV-cache blocks held by running requests.", r)),
        kv_blocks_cached(Register(
            prometheus::BuildGauge(), "moh_kv_blocks_cached",
            "Free KV-cache blocks that keep a prompt prefix for reuse.", r)),
        prefix_queries(Register(
            prometheus::BuildCounter(), "moh_prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache.", r)),
        prefix_hits(Register(prometheus::BuildCounter(),
                             "moh_prefix_cache_hits_total",
                             "Prompt tokens found in the prefix cache (their "
                             "keys and values were not computed again).",
                             r)),
        activation_ratio(
            Register(prometheus::BuildHistogram(), "moh_activation_ratio",
                     "Effective fraction of attention heads activated per "
                     "token, one observation per finished request.",
                     r)),
        head_tokens(Register(prometheus::BuildCounter(),
                             "moh_head_tokens_total",
                             "Tokens routed to each attention head.", r)),
        ratio_lowered(Register(
            prometheus::BuildCounter(), "moh_activation_ratio_lowered_total",
            "Times adaptive mode lowered the activation ratio.", r)),
        steps_retried(Register(
            prometheus::BuildCounter(), "moh_steps_retried_total",
            "Steps (and Classify batches) that ran out of memory and ran "
            "again smaller.",
            r)),
        load_seconds(Register(prometheus::BuildGauge(),
                              "moh_model_load_seconds",
                              "Seconds it took to load the model.", r)),
        cuda_graph_replays(Register(
            prometheus::BuildCounter(), "moh_cuda_graph_replays_total",
            "Language-model steps replayed as a recorded CUDA graph (0 on "
            "CPU).",
            r)),
        sampled_tokens(Register(
            prometheus::BuildCounter(), "moh_sampled_tokens_total",
            "Generated tokens by what they were drawn from: logits reduced "
            "where they lie (reduced), the whole row (whole), or reduced "
            "without deciding, then whole (reduced_then_whole).",
            r)) {}

  Family<Counter>& requests;
  Family<Histogram>& request_duration;
  Family<Histogram>& queue_duration;
  Family<Histogram>& ttft;
  Family<Histogram>& itl;
  Family<Counter>& prompt_tokens;
  Family<Counter>& generated_tokens;
  Family<Counter>& images;
  Family<Histogram>& image_seconds;
  Family<Counter>& diffusion_steps;
  Family<Histogram>& batch_size;
  Family<Gauge>& running;
  Family<Gauge>& waiting;
  Family<Gauge>& kv_cache_usage;
  Family<Gauge>& kv_cache_config;
  Family<Gauge>& kv_blocks_in_use;
  Family<Gauge>& kv_blocks_cached;
  Family<Counter>& prefix_queries;
  Family<Counter>& prefix_hits;
  Family<Histogram>& activation_ratio;
  Family<Counter>& head_tokens;
  Family<Counter>& ratio_lowered;
  Family<Counter>& steps_retried;
  Family<Gauge>& load_seconds;
  Family<Counter>& cuda_graph_replays;
  Family<Counter>& sampled_tokens;
};

struct ModelMetrics::Impl {
  std::string model;
  Family<Gauge>* kv_cache_config = nullptr;
  Family<Counter>* requests_family = nullptr;
  // requests[rpc][code], created on first use under mu.
  absl::Mutex mu;
  std::array<std::array<std::atomic<Counter*>, kNumCodes>, kNumRpcs> requests{};
  std::array<Histogram*, kNumRpcs> request_duration{};
  std::array<Histogram*, kNumRpcs> queue_duration{};
  Histogram* ttft = nullptr;
  Histogram* itl = nullptr;
  Counter* prompt_tokens = nullptr;
  Counter* generated_tokens = nullptr;
  Counter* images = nullptr;
  Histogram* image_seconds = nullptr;
  Counter* diffusion_steps = nullptr;
  std::array<Histogram*, kNumBatchKinds> batch_size{};
  Gauge* running = nullptr;
  Gauge* waiting = nullptr;
  Gauge* kv_cache_usage = nullptr;
  Gauge* kv_blocks_in_use = nullptr;
  Gauge* kv_blocks_cached = nullptr;
  Counter* prefix_queries = nullptr;
  Counter* prefix_hits = nullptr;
  Histogram* activation_ratio = nullptr;
  std::vector<Counter*> head_tokens;  // [layer * num_heads + head]; fixed.
  std::atomic<bool> head_size_mismatch_logged{false};
  Counter* ratio_lowered = nullptr;
  Counter* steps_retried = nullptr;
  Gauge* load_seconds = nullptr;
  Counter* cuda_graph_replays = nullptr;
  std::array<Counter*, 3> sampled_tokens{};  // by SampledFrom

  Counter* RequestCounter(int rpc, int code) {
    Counter* c = requests[rpc][code].load(std::memory_order_acquire);
    if (c != nullptr) return c;
    absl::MutexLock lock(&mu);
    c = requests[rpc][code].load(std::memory_order_relaxed);
    if (c == nullptr) {
      c = &requests_family->Add(
          {{"model", model},
           {"rpc", RpcName(static_cast<Rpc>(rpc))},
           {"code",
            absl::StatusCodeToString(static_cast<absl::StatusCode>(code))}});
      requests[rpc][code].store(c, std::memory_order_release);
    }
    return c;
  }
};

void ModelMetrics::RequestFinished(Rpc rpc, absl::StatusCode code,
                                   absl::Duration duration) {
  const int r = RpcIndex(rpc);
  if (r < 0) return;
  impl_->RequestCounter(r, CodeIndex(code))->Increment();
  impl_->request_duration[r]->Observe(absl::ToDoubleSeconds(duration));
}

void ModelMetrics::QueueTime(Rpc rpc, absl::Duration wait) {
  const int r = RpcIndex(rpc);
  if (r < 0) return;
  impl_->queue_duration[r]->Observe(absl::ToDoubleSeconds(wait));
}

void ModelMetrics::TimeToFirstToken(absl::Duration ttft) {
  impl_->ttft->Observe(absl::ToDoubleSeconds(ttft));
}

void ModelMetrics::InterTokenLatency(absl::Duration itl) {
  impl_->itl->Observe(absl::ToDoubleSeconds(itl));
}

void ModelMetrics::PromptTokens(int64_t n) {
  if (n > 0) impl_->prompt_tokens->Increment(static_cast<double>(n));
}

void ModelMetrics::GeneratedTokens(int64_t n) {
  if (n > 0) impl_->generated_tokens->Increment(static_cast<double>(n));
}

void ModelMetrics::CudaGraphReplays(int64_t n) {
  if (n > 0) impl_->cuda_graph_replays->Increment(static_cast<double>(n));
}

void ModelMetrics::SampledTokens(SampledFrom from, int64_t n) {
  if (n > 0) {
    impl_->sampled_tokens[static_cast<int>(from)]->Increment(
        static_cast<double>(n));
  }
}

void ModelMetrics::ImageGenerated(absl::Duration total) {
  impl_->images->Increment();
  impl_->image_seconds->Observe(absl::ToDoubleSeconds(total));
}

void ModelMetrics::DiffusionSteps(int64_t n) {
  if (n > 0) impl_->diffusion_steps->Increment(static_cast<double>(n));
}

void ModelMetrics::BatchSize(BatchKind kind, int64_t rows) {
  const int k = BatchKindIndex(kind);
  if (k < 0) return;
  impl_->batch_size[k]->Observe(static_cast<double>(rows));
}

void ModelMetrics::SetRunning(int64_t n) {
  impl_->running->Set(static_cast<double>(n));
}

void ModelMetrics::SetWaiting(int64_t n) {
  impl_->waiting->Set(static_cast<double>(n));
}

void ModelMetrics::SetKvCacheUsage(double ratio) {
  impl_->kv_cache_usage->Set(ratio);
}

void ModelMetrics::SetKvCacheConfig(int32_t block_size, int64_t num_blocks) {
  impl_->kv_cache_config
      ->Add({{"model", impl_->model},
             {"block_size", std::to_string(block_size)},
             {"num_gpu_blocks", std::to_string(num_blocks)}})
      .Set(1);
}

void ModelMetrics::SetKvBlocks(int64_t in_use, int64_t cached) {
  impl_->kv_blocks_in_use->Set(static_cast<double>(in_use));
  impl_->kv_blocks_cached->Set(static_cast<double>(cached));
}

void ModelMetrics::PrefixCache(int64_t queried, int64_t hit) {
  if (queried > 0)
    impl_->prefix_queries->Increment(static_cast<double>(queried));
  if (hit > 0) impl_->prefix_hits->Increment(static_cast<double>(hit));
}

void ModelMetrics::ActivationRatio(double effective_ratio) {
  if (std::isnan(effective_ratio)) return;
  impl_->activation_ratio->Observe(effective_ratio);
}

void ModelMetrics::HeadTokens(const std::vector<int64_t>& counts) {
  const std::vector<Counter*>& heads = impl_->head_tokens;
  if (heads.empty()) return;
  if (counts.size() != heads.size()) {
    if (!impl_->head_size_mismatch_logged.exchange(true)) {
      std::cerr << "moh metrics: HeadTokens for model '" << impl_->model
                << "' got " << counts.size() << " counts, expected "
                << heads.size() << "; ignored (logged once)\n";
    }
    return;
  }
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] > 0 && heads[i] != nullptr) {
      heads[i]->Increment(static_cast<double>(counts[i]));
    }
  }
}

void ModelMetrics::RatioLowered() { impl_->ratio_lowered->Increment(); }

void ModelMetrics::StepsRetried() { impl_->steps_retried->Increment(); }

void ModelMetrics::SetLoadSeconds(double seconds) {
  impl_->load_seconds->Set(seconds);
}

// The process collector's families: their names are written here, with every
// other exported name.
const ProcessCollector::Descriptions kProcessDescriptions = {
    {"process_cpu_seconds_total",
     "Total user and system CPU time spent in seconds."},
    {"process_resident_memory_bytes", "Resident memory size in bytes."},
    {"process_virtual_memory_bytes", "Virtual memory size in bytes."},
    {"process_start_time_seconds",
     "Start time of the process since unix epoch in seconds."},
    {"process_open_fds", "Number of open file descriptors."},
    {"process_max_fds", "Maximum number of open file descriptors."},
    {"moh_gpu_memory_bytes", "GPU memory in use in bytes, by device."},
    {"moh_gpu_memory_limit_bytes",
     "GPU memory this process may hold in bytes (its gpu_memory_fraction of "
     "the device), by device."},
};

Metrics::Metrics(std::shared_ptr<prometheus::Registry> registry)
    : registry_(std::move(registry)),
      process_collector_(
          std::make_shared<ProcessCollector>(kProcessDescriptions)),
      families_(std::make_unique<Families>(*registry_)) {}

Metrics::~Metrics() = default;

ModelMetrics* Metrics::ForModel(const std::string& name, int num_layers,
                                int num_heads, bool head_metrics) {
  return ForModel(name,
                  std::vector<int32_t>(std::max(num_layers, 0), num_heads),
                  head_metrics);
}

ModelMetrics* Metrics::ForModel(const std::string& name,
                                const std::vector<int32_t>& layer_heads,
                                bool head_metrics) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<ModelMetrics>& slot = models_[name];
  if (slot != nullptr) return slot.get();

  Families& f = *families_;
  auto impl = std::make_shared<ModelMetrics::Impl>();
  impl->model = name;
  impl->requests_family = &f.requests;
  const prometheus::Labels model = {{"model", name}};
  auto with = [&](const char* key, const std::string& value) {
    prometheus::Labels l = model;
    l.emplace(key, value);
    return l;
  };
  for (int r = 0; r < kNumRpcs; ++r) {
    const char* rpc = RpcName(static_cast<Rpc>(r));
    impl->request_duration[r] =
        &f.request_duration.Add(with("rpc", rpc), DurationBuckets());
    impl->queue_duration[r] =
        &f.queue_duration.Add(with("rpc", rpc), QueueBuckets());
    impl->RequestCounter(r, static_cast<int>(absl::StatusCode::kOk));
  }
  impl->ttft = &f.ttft.Add(model, TtftBuckets());
  impl->itl = &f.itl.Add(model, ItlBuckets());
  impl->prompt_tokens = &f.prompt_tokens.Add(model);
  impl->generated_tokens = &f.generated_tokens.Add(model);
  impl->cuda_graph_replays = &f.cuda_graph_replays.Add(model);
  for (const SampledFrom from : {SampledFrom::kReduced, SampledFrom::kWhole,
                                 SampledFrom::kReducedThenWhole}) {
    static constexpr const char* kNames[] = {"reduced", "whole",
                                             "reduced_then_whole"};
    impl->sampled_tokens[static_cast<int>(from)] =
        &f.sampled_tokens.Add(with("logits", kNames[static_cast<int>(from)]));
  }
  impl->images = &f.images.Add(model);
  // Time per image: the tiny demo's tens of milliseconds to a large model's
  // minutes on a CPU.
  impl->image_seconds = &f.image_seconds.Add(
      model,
      Histogram::BucketBoundaries{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                                  10, 25, 50, 100, 250, 500, 1000});
  impl->diffusion_steps = &f.diffusion_steps.Add(model);
  for (int k = 0; k < kNumBatchKinds; ++k) {
    impl->batch_size[k] = &f.batch_size.Add(
        with("kind", BatchKindName(static_cast<BatchKind>(k))),
        BatchSizeBuckets());
  }
  impl->running = &f.running.Add(model);
  impl->waiting = &f.waiting.Add(model);
  impl->kv_cache_usage = &f.kv_cache_usage.Add(model);
  impl->kv_cache_config = &f.kv_cache_config;
  impl->kv_blocks_in_use = &f.kv_blocks_in_use.Add(model);
  impl->kv_blocks_cached = &f.kv_blocks_cached.Add(model);
  impl->prefix_queries = &f.prefix_queries.Add(model);
  impl->prefix_hits = &f.prefix_hits.Add(model);
  impl->activation_ratio =
      &f.activation_ratio.Add(model, ActivationRatioBuckets());
  const int32_t max_heads =
      layer_heads.empty()
          ? 0
          : *std::max_element(layer_heads.begin(), layer_heads.end());
  if (head_metrics && max_heads > 0) {
    impl->head_tokens.reserve(layer_heads.size() * max_heads);
    for (size_t l = 0; l < layer_heads.size(); ++l) {
      for (int32_t h = 0; h < max_heads; ++h) {
        impl->head_tokens.push_back(
            h < layer_heads[l]
                ? &f.head_tokens.Add({{"model", name},
                                      {"layer", std::to_string(l)},
                                      {"head", std::to_string(h)}})
                : nullptr);
      }
    }
  }
  impl->ratio_lowered = &f.ratio_lowered.Add(model);
  impl->steps_retried = &f.steps_retried.Add(model);
  impl->load_seconds = &f.load_seconds.Add(model);

  slot.reset(new ModelMetrics());
  slot->impl_ = std::move(impl);
  return slot.get();
}

void Metrics::SetGpuMemoryReader(GpuMemoryReader reader) {
  process_collector_->SetGpuMemoryReader(std::move(reader));
}

void Metrics::RequestWithoutModel(Rpc rpc, absl::StatusCode code) {
  families_->requests
      .Add({{"model", ""},
            {"rpc", RpcName(rpc)},
            {"code", absl::StatusCodeToString(code)}})
      .Increment();
}

std::vector<std::weak_ptr<prometheus::Collectable>> Metrics::Collectables()
    const {
  return {registry_, process_collector_};
}

}  // namespace moh
