// The defaults and allowed ranges of moh-server's configuration: the one place
// they are written. `ResolveServerConfig` (service/config/server_config.cc)
// applies them to an operator's ServerConfig; the components that the config
// feeds (Batcher<Task>::Options, LanguageExecutor::Options) take their defaults
// and minimums from here, so that a component built without a config (a test, a
// benchmark) behaves as an unconfigured server.
//
// The ranges are what an operator may write in the config file. A component
// may accept more (Batcher takes any max_batch_size up to INT32_MAX): its own
// checks guard against programming errors, the config's against typos that
// would allocate absurd amounts of memory.
//
// Plain constants: no protobuf, no Abseil, usable from any layer of service/.
// Units are those of the config field the constant is named after.
// proto/moh/v1/server_config.proto documents the same defaults for operators.
#pragma once

#include <algorithm>
#include <cstdint>

namespace moh {

// One numeric config field: the value an unset field (0) takes, and the range
// the value must then be in, [min, max] (or (min, max] when min_exclusive).
template <typename T>
struct ConfigLimits {
  T default_value;
  T min;
  T max;
  bool min_exclusive = false;

  constexpr bool Contains(T value) const {
    return (min_exclusive ? value > min : value >= min) && value <= max;
  }
};

namespace config_limits {

// ---------------------------------------------------------------- ServerConfig

// port: the gRPC listen port.
inline constexpr ConfigLimits<int32_t> kPort{50051, 1, 65535};
// health_port: the plaintext health-only port, or kHealthPortOff (default).
inline constexpr ConfigLimits<int32_t> kHealthPort{0, 1, 65535};
inline constexpr int32_t kHealthPortOff = 0;
// metrics_port: the Prometheus exporter's port, or kMetricsPortOff.
inline constexpr ConfigLimits<int32_t> kMetricsPort{9464, 1, 65535};
inline constexpr int32_t kMetricsPortOff = -1;
// http_port: the OpenAI-compatible HTTP API's port, or kHttpPortOff.
inline constexpr ConfigLimits<int32_t> kHttpPort{8000, 1, 65535};
inline constexpr int32_t kHttpPortOff = -1;
// http_max_connections: HTTP connections served at once.
inline constexpr ConfigLimits<int32_t> kHttpMaxConnections{256, 1, 4096};
// http_max_connections_per_client: HTTP connections one client address may
// hold (at most http_max_connections).
inline constexpr ConfigLimits<int32_t> kHttpMaxConnectionsPerClient{64, 1,
                                                                    4096};
// http_body_memory_mb: HTTP request bodies being received at once, MiB (at
// least max_message_mb).
inline constexpr ConfigLimits<int32_t> kHttpBodyMemoryMb{1024, 1, 1 << 20};
// http_header_timeout_seconds, http_body_timeout_seconds: deadlines for a
// request's headers and body, not reset by bytes.
inline constexpr ConfigLimits<double> kHttpHeaderTimeoutSeconds{30.0, 1.0,
                                                                3600.0};
inline constexpr ConfigLimits<double> kHttpBodyTimeoutSeconds{60.0, 1.0,
                                                              3600.0};
// http_threads: libmicrohttpd's polling threads.
inline constexpr ConfigLimits<int32_t> kHttpThreads{2, 1, 64};
// host: the listen address.
inline constexpr char kDefaultHost[] = "0.0.0.0";
// drain_timeout_seconds: how long in-flight requests may run after SIGTERM.
inline constexpr ConfigLimits<double> kDrainTimeoutSeconds{30.0, 0.001,
                                                           86400.0};
// gpu_memory_fraction: the share of each GPU's memory the process may hold.
inline constexpr ConfigLimits<double> kGpuMemoryFraction{
    1.0, 0.0, 1.0, /*min_exclusive=*/true};
// threads: LibTorch intra-op threads; 0 (the default) leaves the choice to
// model/core/runtime.h. At most kMaxThreads: OpenMP starts them all at once
// (4096 kept a 2-core machine from listening for over a minute).
inline constexpr int32_t kMinThreads = 0;
inline constexpr int32_t kMaxThreads = 1024;

// max_message_mb: the largest request message, MiB.
inline constexpr ConfigLimits<int32_t> kMaxMessageMb{64, 1, 1024};
// max_concurrent_streams: concurrent calls per client connection.
inline constexpr ConfigLimits<int32_t> kMaxConcurrentStreams{256, 1, 100000};
// grpc_memory_mb: gRPC's resource quota (its buffers), MiB.
inline constexpr ConfigLimits<int32_t> kGrpcMemoryMb{2048, 64, 1 << 20};
// request_threads: threads preparing requests (tokenizing, decoding images)
// off gRPC's own threads (service/serving/request_workers.h).
inline constexpr ConfigLimits<int32_t> kRequestThreads{4, 1, 256};
// request_queue: requests that may wait for one of them before
// RESOURCE_EXHAUSTED.
inline constexpr ConfigLimits<int32_t> kRequestQueue{1024, 1, 1 << 20};
// image_decode_memory_mb: memory of the images being decoded at once, MiB.
inline constexpr ConfigLimits<int32_t> kImageDecodeMemoryMb{512, 1, 1 << 20};

// ----------------------------------------------------------------- ModelConfig

// device and dtype: "auto" picks CUDA when there is one, and its dtype.
inline constexpr char kDefaultDevice[] = "auto";
inline constexpr char kDefaultDtype[] = "auto";

// ------------------------------------------------- BatchingConfig (Classify)

// batching.max_batch_size: requests (task sizes) per batch.
inline constexpr ConfigLimits<int32_t> kMaxBatchSize{32, 1, 4096};
// batching.max_queue_delay_ms: how long a batch that is not full may wait, in
// milliseconds; must be positive.
inline constexpr ConfigLimits<double> kMaxQueueDelayMs{5.0, 0.0, 10000.0,
                                                       /*min_exclusive=*/true};
// batching.max_queued_requests: waiting requests before RESOURCE_EXHAUSTED.
inline constexpr ConfigLimits<int32_t> kBatchingMaxQueuedRequests{256, 1,
                                                                  1 << 20};

// ----------------------------------------------- GenerationConfig (Generate)

// generation.max_running: sequences decoded together (KV-cache slots).
inline constexpr ConfigLimits<int32_t> kMaxRunning{16, 1, 4096};
// generation.max_queued_requests: waiting requests before RESOURCE_EXHAUSTED.
inline constexpr ConfigLimits<int32_t> kGenerationMaxQueuedRequests{256, 1,
                                                                    1 << 20};
// generation.prefill_token_budget: prompt tokens prefilled per step.
inline constexpr ConfigLimits<int32_t> kPrefillTokenBudget{512, 1, 1 << 20};
// generation.default_max_new_tokens: max_new_tokens of a request that leaves
// it unset.
inline constexpr ConfigLimits<int32_t> kDefaultMaxNewTokens{64, 1, 1 << 20};
// generation.attention_workspace_mb: the attention workspace of one step, MiB.
inline constexpr ConfigLimits<int32_t> kAttentionWorkspaceMb{256, 1, 1 << 16};
// generation.idle_gather_us: an idle model's wait for more arrivals, in
// microseconds (0: none).
inline constexpr ConfigLimits<int32_t> kIdleGatherUs{300, 0, 100000};
// generation.cuda_graphs: decode-step shapes recorded as CUDA graphs (0: none).
inline constexpr ConfigLimits<int32_t> kCudaGraphs{64, 0, 4096};
// generation.kv_block_size: token positions per KV-cache block.
inline constexpr ConfigLimits<int32_t> kKvBlockSize{16, 1, 4096};
// generation.kv_blocks: KV-cache blocks; 0 (the default) = max_running x
// max_seq_len / kv_block_size (rounded up), resolved with the model
// (LanguageExecutor::Create checks the lower bound).
inline constexpr int32_t kKvBlocksAuto = 0;
inline constexpr int32_t kMaxKvBlocks = 1 << 24;

// generation.max_seq_len: tokens per sequence, prompt + output. The config
// accepts any value >= 0; 0 (the default) means the model's
// max_position_embeddings capped at kMaxSeqLenDefaultCap. The resolved value
// must be in [kMinSeqLen, max_position_embeddings], which only the model can
// tell (LanguageExecutor::Create checks it).
inline constexpr int32_t kMaxSeqLenUnset = 0;
inline constexpr int32_t kMaxSeqLenDefaultCap = 4096;
inline constexpr int32_t kMinSeqLen = 2;

// The max_seq_len a sequence gets: `configured`, or when it is unset the
// model's maximum capped at kMaxSeqLenDefaultCap.
constexpr int32_t ResolveMaxSeqLen(int32_t configured, int32_t model_max) {
  return configured == kMaxSeqLenUnset
             ? std::min(model_max, kMaxSeqLenDefaultCap)
             : configured;
}

// Blocks of `block_size` positions that `positions` take.
constexpr int64_t KvBlocksFor(int64_t positions, int32_t block_size) {
  return (positions + block_size - 1) / block_size;
}

// The positions per KV-cache block a model gets: `configured`, capped at its
// max_seq_len (a longer block would only hold unused positions).
constexpr int32_t ResolveKvBlockSize(int32_t configured, int32_t max_seq_len) {
  return std::clamp(configured, kKvBlockSize.min,
                    std::max(max_seq_len, kKvBlockSize.min));
}

// The KV-cache blocks a model gets: `configured`, or when it is automatic
// enough for `max_running` sequences of `max_seq_len`.
constexpr int64_t ResolveKvBlocks(int32_t configured, int32_t max_running,
                                  int32_t max_seq_len, int32_t block_size) {
  return configured != kKvBlocksAuto
             ? configured
             : max_running * KvBlocksFor(max_seq_len, block_size);
}

// ------------------------------------------------------------- AdaptiveConfig

// adaptive.queue_depth: requests that allow it run at their min_ratio when
// more than this many wait; 0 (the default) switches adaptive activation off.
inline constexpr int32_t kAdaptiveQueueDepthOff = 0;
inline constexpr int32_t kMinAdaptiveQueueDepth = 0;

}  // namespace config_limits
}  // namespace moh
