#include "service/config/server_config.h"

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/utf8.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "service/config/config_limits.h"

namespace moh {
namespace {

// Collects the text-format parser's first complaint.
class ParseErrors : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, int column, const std::string& message) override {
    if (first_.empty()) {
      first_ = absl::StrCat("line ", line + 1, ", column ", column + 1, ": ",
                            message);
    }
  }
  const std::string& first() const { return first_; }

 private:
  std::string first_;
};

// Sets *value to the field's default when unset (0), then checks its range.
template <typename T>
absl::Status Default(const std::string& field, T* value,
                     const ConfigLimits<T>& limits) {
  if (*value == T{0}) *value = limits.default_value;
  if (!limits.Contains(*value)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be in ", limits.min_exclusive ? "(" : "[",
                     limits.min, ", ", limits.max, "], got ", *value));
  }
  return absl::OkStatus();
}

// Applies the default of `limits` through the proto's setter when the field is
// unset.
#define MOH_DEFAULT(msg, field, path, limits)                            \
  do {                                                                   \
    auto value = (msg)->field();                                         \
    MOH_RETURN_IF_ERROR(Default<decltype(value)>(path, &value, limits)); \
    (msg)->set_##field(value);                                           \
  } while (0)

// Checks a field whose 0 means "off" or "the default" and stays 0.
absl::Status AtLeast(const std::string& field, int32_t value, int32_t min,
                     const char* zero_means) {
  if (value >= min) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, " must be >= ", min, " (0 = ", zero_means, "), got ", value));
}

absl::Status ResolveModel(const std::string& path, v1::ModelConfig* m) {
  if (m->model_dir().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ".model_dir must be set"));
  }
  if (m->name().empty()) {
    std::filesystem::path dir(m->model_dir());
    std::string base = dir.filename().string();
    if (base.empty()) base = dir.parent_path().filename().string();
    m->set_name(base);
  }
  if (m->device().empty()) m->set_device(config_limits::kDefaultDevice);
  if (m->dtype().empty()) m->set_dtype(config_limits::kDefaultDtype);
  v1::BatchingConfig* b = m->mutable_batching();
  MOH_DEFAULT(b, max_batch_size, path + ".batching.max_batch_size",
              config_limits::kMaxBatchSize);
  MOH_DEFAULT(b, max_queue_delay_ms, path + ".batching.max_queue_delay_ms",
              config_limits::kMaxQueueDelayMs);
  MOH_DEFAULT(b, max_queued_requests, path + ".batching.max_queued_requests",
              config_limits::kBatchingMaxQueuedRequests);
  v1::GenerationConfig* g = m->mutable_generation();
  MOH_DEFAULT(g, max_running, path + ".generation.max_running",
              config_limits::kMaxRunning);
  MOH_RETURN_IF_ERROR(AtLeast(path + ".generation.max_seq_len",
                              g->max_seq_len(), config_limits::kMaxSeqLenUnset,
                              "model maximum"));
  MOH_DEFAULT(g, max_queued_requests, path + ".generation.max_queued_requests",
              config_limits::kGenerationMaxQueuedRequests);
  MOH_DEFAULT(g, prefill_token_budget,
              path + ".generation.prefill_token_budget",
              config_limits::kPrefillTokenBudget);
  MOH_DEFAULT(g, default_max_new_tokens,
              path + ".generation.default_max_new_tokens",
              config_limits::kDefaultMaxNewTokens);
  MOH_DEFAULT(g, attention_workspace_mb,
              path + ".generation.attention_workspace_mb",
              config_limits::kAttentionWorkspaceMb);
  MOH_DEFAULT(g, kv_block_size, path + ".generation.kv_block_size",
              config_limits::kKvBlockSize);
  MOH_RETURN_IF_ERROR(AtLeast(path + ".generation.kv_blocks", g->kv_blocks(),
                              config_limits::kKvBlocksAuto, "automatic"));
  if (g->kv_blocks() > config_limits::kMaxKvBlocks) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ".generation.kv_blocks must be in [0, ",
                     config_limits::kMaxKvBlocks, "], got ", g->kv_blocks()));
  }
  if (!g->has_prefix_caching()) g->set_prefix_caching(true);
  if (!g->has_idle_gather_us()) {
    g->set_idle_gather_us(config_limits::kIdleGatherUs.default_value);
  } else if (!config_limits::kIdleGatherUs.Contains(g->idle_gather_us())) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ".generation.idle_gather_us must be in [",
        config_limits::kIdleGatherUs.min, ", ",
        config_limits::kIdleGatherUs.max, "], got ", g->idle_gather_us()));
  }
  if (!g->has_cuda_graphs()) {
    g->set_cuda_graphs(config_limits::kCudaGraphs.default_value);
  } else if (!config_limits::kCudaGraphs.Contains(g->cuda_graphs())) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ".generation.cuda_graphs must be in [",
        config_limits::kCudaGraphs.min, ", ", config_limits::kCudaGraphs.max,
        "], got ", g->cuda_graphs()));
  }
  // Every CUDA path on unless switched off.
  v1::CudaPaths* paths = g->mutable_cuda_paths();
  if (!paths->has_paged_decode()) paths->set_paged_decode(true);
  if (!paths->has_fused_ops()) paths->set_fused_ops(true);
  if (!paths->has_varlen_prefill()) paths->set_varlen_prefill(true);
  if (!paths->has_skinny_linear()) paths->set_skinny_linear(true);
  if (g->kv_cache_dtype().empty()) {
    g->set_kv_cache_dtype(config_limits::kDefaultDtype);
  }
  MOH_RETURN_IF_ERROR(AtLeast(path + ".adaptive.queue_depth",
                              m->adaptive().queue_depth(),
                              config_limits::kMinAdaptiveQueueDepth, "off"));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::ServerConfig> ReadServerConfigFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream text;
  text << in.rdbuf();
  v1::ServerConfig config;
  google::protobuf::TextFormat::Parser parser;
  ParseErrors errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(text.str(), &config)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", errors.first()));
  }
  return config;
}

namespace {

// The four ports: defaults, ranges, all different.
absl::Status ResolvePorts(v1::ServerConfig* config) {
  MOH_DEFAULT(config, port, std::string("port"), config_limits::kPort);
  const ConfigLimits<int32_t>& metrics_port = config_limits::kMetricsPort;
  if (config->metrics_port() == 0) {
    config->set_metrics_port(metrics_port.default_value);
  }
  if (config->metrics_port() != config_limits::kMetricsPortOff &&
      !metrics_port.Contains(config->metrics_port())) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_port must be in [", metrics_port.min, ", ",
                     metrics_port.max, "] or ", config_limits::kMetricsPortOff,
                     " (off), got ", config->metrics_port()));
  }
  if (config->metrics_port() == config->port()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics_port must differ from port (", config->port(), ")"));
  }
  const ConfigLimits<int32_t>& health_port = config_limits::kHealthPort;
  if (config->health_port() != config_limits::kHealthPortOff &&
      (!health_port.Contains(config->health_port()) ||
       config->health_port() == config->port() ||
       config->health_port() == config->metrics_port())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "health_port must be in [", health_port.min, ", ", health_port.max,
        "] and differ from port and metrics_port, or 0 (off), got ",
        config->health_port()));
  }
  const ConfigLimits<int32_t>& http_port = config_limits::kHttpPort;
  if (config->http_port() == 0) config->set_http_port(http_port.default_value);
  if (config->http_port() != config_limits::kHttpPortOff &&
      (!http_port.Contains(config->http_port()) ||
       config->http_port() == config->port() ||
       config->http_port() == config->metrics_port() ||
       config->http_port() == config->health_port())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "http_port must be in [", http_port.min, ", ", http_port.max,
        "] and differ from port, metrics_port and health_port, or ",
        config_limits::kHttpPortOff, " (off), got ", config->http_port()));
  }
  return absl::OkStatus();
}

// The HTTP door's connection limits and deadlines.
absl::Status ResolveHttpLimits(v1::ServerConfig* config) {
  MOH_DEFAULT(config, http_max_connections, std::string("http_max_connections"),
              config_limits::kHttpMaxConnections);
  MOH_DEFAULT(config, http_max_connections_per_client,
              std::string("http_max_connections_per_client"),
              config_limits::kHttpMaxConnectionsPerClient);
  // The default follows a smaller http_max_connections down.
  if (config->http_max_connections_per_client() >
      config->http_max_connections()) {
    config->set_http_max_connections_per_client(config->http_max_connections());
  }
  MOH_DEFAULT(config, http_header_timeout_seconds,
              std::string("http_header_timeout_seconds"),
              config_limits::kHttpHeaderTimeoutSeconds);
  MOH_DEFAULT(config, http_body_timeout_seconds,
              std::string("http_body_timeout_seconds"),
              config_limits::kHttpBodyTimeoutSeconds);
  MOH_DEFAULT(config, http_threads, std::string("http_threads"),
              config_limits::kHttpThreads);
  return absl::OkStatus();
}

// Hosts, threads, drain, and the memory bounds of requests in flight.
absl::Status ResolveProcessLimits(v1::ServerConfig* config) {
  if (config->host().empty()) config->set_host(config_limits::kDefaultHost);
  if (config->metrics_host().empty()) config->set_metrics_host(config->host());
  MOH_DEFAULT(config, drain_timeout_seconds,
              std::string("drain_timeout_seconds"),
              config_limits::kDrainTimeoutSeconds);
  if (config->threads() < config_limits::kMinThreads ||
      config->threads() > config_limits::kMaxThreads) {
    return absl::InvalidArgumentError(
        absl::StrCat("threads must be in [", config_limits::kMinThreads, ", ",
                     config_limits::kMaxThreads, "] (0 = the default), got ",
                     config->threads()));
  }
  MOH_DEFAULT(config, gpu_memory_fraction, std::string("gpu_memory_fraction"),
              config_limits::kGpuMemoryFraction);
  MOH_DEFAULT(config, max_message_mb, std::string("max_message_mb"),
              config_limits::kMaxMessageMb);
  MOH_DEFAULT(config, http_body_memory_mb, std::string("http_body_memory_mb"),
              config_limits::kHttpBodyMemoryMb);
  if (config->http_body_memory_mb() < config->max_message_mb()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "http_body_memory_mb must be at least max_message_mb (",
        config->max_message_mb(), "), got ", config->http_body_memory_mb()));
  }
  MOH_DEFAULT(config, max_concurrent_streams,
              std::string("max_concurrent_streams"),
              config_limits::kMaxConcurrentStreams);
  MOH_DEFAULT(config, grpc_memory_mb, std::string("grpc_memory_mb"),
              config_limits::kGrpcMemoryMb);
  MOH_DEFAULT(config, request_threads, std::string("request_threads"),
              config_limits::kRequestThreads);
  MOH_DEFAULT(config, request_queue, std::string("request_queue"),
              config_limits::kRequestQueue);
  MOH_DEFAULT(config, image_decode_memory_mb,
              std::string("image_decode_memory_mb"),
              config_limits::kImageDecodeMemoryMb);
  return absl::OkStatus();
}

// A model's aliases: named, their ratios in range.
absl::Status CheckAliases(const std::string& path, const v1::ModelConfig& m) {
  for (int k = 0; k < m.aliases_size(); ++k) {
    const v1::ModelAlias& alias = m.aliases(k);
    const std::string at = absl::StrCat(path, ".aliases[", k, "]");
    if (alias.name().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(at, ".name must be set"));
    }
    const float ratio = alias.activation_ratio();
    if (!(ratio > 0.0f && ratio <= 1.0f)) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, ".activation_ratio must be in (0, 1], got ", ratio));
    }
    const float min_ratio = alias.min_activation_ratio();
    if (!(min_ratio >= 0.0f && min_ratio <= ratio)) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, ".min_activation_ratio must be in [0, ", ratio,
                       "] (its activation_ratio), got ", min_ratio));
    }
  }
  return absl::OkStatus();
}

// Each model's fields, and names unique among models and aliases.
absl::Status ResolveModels(v1::ServerConfig* config) {
  if (config->models().empty()) {
    return absl::InvalidArgumentError("models: at least one model is needed");
  }
  std::set<std::string> names;
  // A name travels in every answer, metric label and log line: valid UTF-8
  // (a client's protobuf library refuses anything else) on one line, and
  // unique.
  const auto unique = [&](const std::string& field, const std::string& name) {
    if (!IsValidUtf8(name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " must be valid UTF-8, got \"", LossyUtf8(name), "\""));
    }
    for (const char c : name) {
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7F) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, " must not hold control characters, got \"",
                         absl::CEscape(name), "\""));
      }
    }
    if (names.insert(name).second) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        field, " \"", name, "\" is used by another model or alias"));
  };
  for (int i = 0; i < config->models_size(); ++i) {
    const std::string path = absl::StrCat("models[", i, "]");
    MOH_RETURN_IF_ERROR(ResolveModel(path, config->mutable_models(i)));
    const v1::ModelConfig& m = config->models(i);
    MOH_RETURN_IF_ERROR(unique(path + ".name", m.name()));
    MOH_RETURN_IF_ERROR(CheckAliases(path, m));
    for (int k = 0; k < m.aliases_size(); ++k) {
      MOH_RETURN_IF_ERROR(unique(absl::StrCat(path, ".aliases[", k, "].name"),
                                 m.aliases(k).name()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ResolveServerConfig(v1::ServerConfig* config) {
  MOH_RETURN_IF_ERROR(ResolvePorts(config));
  MOH_RETURN_IF_ERROR(ResolveHttpLimits(config));
  MOH_RETURN_IF_ERROR(ResolveProcessLimits(config));
  return ResolveModels(config);
}

v1::ServerConfig DemoServerConfig(const std::string& demo_dir) {
  v1::ServerConfig config;
  v1::ModelConfig* lm = config.add_models();
  lm->set_name("demo-lm");
  lm->set_model_dir(demo_dir + "/demo-lm");
  // Its trained default is 0.75: half the routed heads and all of them, for
  // tools that choose a model by name only.
  for (float ratio : {0.5f, 1.0f}) {
    v1::ModelAlias* alias = lm->add_aliases();
    alias->set_name(absl::StrCat("demo-lm@", ratio == 1.0f ? "1.0" : "0.5"));
    alias->set_activation_ratio(ratio);
  }
  v1::ModelConfig* vit = config.add_models();
  vit->set_name("demo-vit");
  vit->set_model_dir(demo_dir + "/demo-vit");
  v1::ModelConfig* dit = config.add_models();
  dit->set_name("demo-dit");
  dit->set_model_dir(demo_dir + "/demo-dit");
  return config;
}

}  // namespace moh
