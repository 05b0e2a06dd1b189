// Every Prometheus metric moh-server exports (SPEC §5), in one place.
//
// Families are built once, when Metrics is constructed; per-model children
// (label `model`, plus those named) are created and cached by AddModel, so the
// hot path only increments pre-resolved counters, gauges and histograms and
// never calls Family::Add. All names use the `moh_` prefix and base units
// (seconds, bytes); process metrics use the standard `process_` names.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "service/metrics/process_collector.h"

namespace moh {

// The RPCs served by one model: the gRPC methods, and the HTTP endpoints
// (openai_http.h: OpenAI's, and Anthropic's Messages). ListModels is the
// server's, not a model's, and has no per-model series.
enum class Rpc {
  kGenerate,
  kClassify,
  kGenerateImage,
  kCompletions,
  kChatCompletions,
  kTokenize,
  kDetokenize,
  kTokenizerInfo,
  kMessages
};
enum class BatchKind { kPrefill, kDecode, kClassify, kImageStep };
// Where a generated token was drawn from: the logits reduced where they lie
// (the model's device: best_logits.h), the whole row downloaded, or reduced
// without deciding the draw and then whole.
enum class SampledFrom { kReduced, kWhole, kReducedThenWhole };

// "Generate", "Classify", "GenerateImage", "Completions" (POST
// /v1/completions), "ChatCompletions" (POST /v1/chat/completions),
// "Tokenize", "Detokenize", "TokenizerInfo" (POST /tokenize, POST
// /detokenize, GET /tokenizer_info).
// "Messages" (POST /v1/messages).
const char* RpcName(Rpc rpc);
// "prefill", "decode", "classify", "image_step" (model rows of a sampler
// step)
const char* BatchKindName(BatchKind kind);

// The metrics of one hosted model. Owned by Metrics; valid as long as it.
class ModelMetrics {
 public:
  // moh_requests_total{model,rpc,code} (code: gRPC code name, e.g. "OK",
  // "INVALID_ARGUMENT") and moh_request_duration_seconds{model,rpc}.
  void RequestFinished(Rpc rpc, absl::StatusCode code, absl::Duration duration);
  // moh_queue_duration_seconds{model,rpc}: submission to start of compute.
  void QueueTime(Rpc rpc, absl::Duration wait);
  // moh_time_to_first_token_seconds{model},
  // moh_inter_token_latency_seconds{model}.
  void TimeToFirstToken(absl::Duration ttft);
  void InterTokenLatency(absl::Duration itl);
  // moh_prompt_tokens_total{model}, moh_generated_tokens_total{model}.
  void PromptTokens(int64_t n);
  void GeneratedTokens(int64_t n);
  // moh_cuda_graph_replays_total{model} += n: language-model steps that ran
  // as a recorded CUDA graph (LlamaModel::graph_replays).
  void CudaGraphReplays(int64_t n);
  // moh_sampled_tokens_total{model,logits} += n, logits "reduced", "whole"
  // or "reduced_then_whole" (SampledFrom).
  void SampledTokens(SampledFrom from, int64_t n);
  // moh_images_generated_total{model}, moh_image_seconds{model} (submission
  // to the finished PNG) of one generated image.
  void ImageGenerated(absl::Duration total);
  // moh_diffusion_steps_total{model}: sampler steps computed (per request).
  void DiffusionSteps(int64_t n);
  // moh_batch_size{model,kind}: rows in one model step.
  void BatchSize(BatchKind kind, int64_t rows);
  // moh_requests_running{model}, moh_requests_waiting{model},
  // moh_kv_cache_usage_ratio{model} (0..1).
  void SetRunning(int64_t n);
  void SetWaiting(int64_t n);
  void SetKvCacheUsage(double ratio);
  // moh_kv_cache_config_info{model,block_size,num_gpu_blocks} 1: the paged
  // cache's shape (vLLM's cache_config_info labels; "gpu" whatever the
  // device), which the inference gateway's endpoint picker reads. Once.
  void SetKvCacheConfig(int32_t block_size, int64_t num_blocks);
  // moh_kv_blocks_in_use{model}: KV-cache blocks held by requests;
  // moh_kv_blocks_cached{model}: free blocks keeping a prompt prefix.
  void SetKvBlocks(int64_t in_use, int64_t cached);
  // moh_prefix_cache_queries_total{model}: prompt tokens looked up in the
  // prefix cache; moh_prefix_cache_hits_total{model}: those found (not
  // computed again).
  void PrefixCache(int64_t queried, int64_t hit);
  // moh_activation_ratio{model}: effective ratio of one finished request.
  void ActivationRatio(double effective_ratio);
  // moh_head_tokens_total{model,layer,head} += counts[layer * num_heads + head]
  // (num_heads: the most heads of any layer)
  // (no-op when head metrics are off). counts.size() must be layers * heads.
  void HeadTokens(const std::vector<int64_t>& counts);
  // moh_activation_ratio_lowered_total{model}: adaptive mode lowered a ratio.
  void RatioLowered();
  // moh_steps_retried_total{model}: a step ran out of memory and its rows
  // run again in smaller steps (EngineLoop), or a Classify batch did and its
  // halves run again (BatchedClassifier).
  void StepsRetried();
  // moh_model_load_seconds{model}.
  void SetLoadSeconds(double seconds);

 private:
  friend class Metrics;
  ModelMetrics() = default;
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

class Metrics {
 public:
  // Registers every moh_ family in `registry`. The process collector
  // (process_cpu_seconds_total, process_resident_memory_bytes,
  // process_virtual_memory_bytes, process_start_time_seconds,
  // process_open_fds, process_max_fds; and moh_gpu_memory_bytes and
  // moh_gpu_memory_limit_bytes when a GPU reader is set) is a separate
  // Collectable owned by Metrics: serve Collectables(), not just the registry.
  explicit Metrics(std::shared_ptr<prometheus::Registry> registry);
  ~Metrics();

  // The metrics of model `name`, created on first call (later calls return the
  // same object). `num_layers` x `num_heads` head counters are created up front
  // when `head_metrics` is true.
  ModelMetrics* ForModel(const std::string& name, int num_layers, int num_heads,
                         bool head_metrics);
  // The same for layers with different numbers of heads (`layer_heads[l]`):
  // HeadTokens then takes [layers * H] counts, H the most heads of any
  // layer, and ignores the entries past a layer's heads.
  ModelMetrics* ForModel(const std::string& name,
                         const std::vector<int32_t>& layer_heads,
                         bool head_metrics);

  // A request that reached no model's metrics (unknown model, model loading,
  // failed or draining): counted in moh_requests_total with model="".
  void RequestWithoutModel(Rpc rpc, absl::StatusCode code);

  // Reads each GPU's memory (e.g. from the CUDA allocator); exported as
  // moh_gpu_memory_bytes{device} and moh_gpu_memory_limit_bytes{device} at
  // scrape time. Optional.
  void SetGpuMemoryReader(GpuMemoryReader reader);

  const std::shared_ptr<prometheus::Registry>& registry() const {
    return registry_;
  }
  // Everything an exposer should serve: the registry and the process (and GPU)
  // collector. Collecting all of them yields every family above.
  std::vector<std::weak_ptr<prometheus::Collectable>> Collectables() const;

 private:
  struct Families;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<ProcessCollector> process_collector_;
  std::unique_ptr<Families> families_;
  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<ModelMetrics>> models_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace moh
