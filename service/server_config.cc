#include "service/server_config.h"

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "model/status_macros.h"

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

// Sets *value to `fallback` when unset (0), then checks [lo, hi].
template <typename T>
absl::Status Default(const std::string& field, T* value, T fallback, T lo,
                     T hi) {
  if (*value == T{0}) *value = fallback;
  if (!(*value >= lo && *value <= hi)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be in [", lo, ", ", hi, "], got ", *value));
  }
  return absl::OkStatus();
}

// Applies `fallback` through the proto's setter when the field is unset.
#define MOH_DEFAULT(msg, field, path, fallback, lo, hi)            \
  do {                                                             \
    auto value = (msg)->field();                                   \
    MOH_RETURN_IF_ERROR(                                           \
        Default<decltype(value)>(path, &value, fallback, lo, hi)); \
    (msg)->set_##field(value);                                     \
  } while (0)

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
  if (m->device().empty()) m->set_device("auto");
  if (m->dtype().empty()) m->set_dtype("auto");
  v1::BatchingConfig* b = m->mutable_batching();
  MOH_DEFAULT(b, max_batch_size, path + ".batching.max_batch_size", 32, 1,
              4096);
  if (b->max_queue_delay_ms() == 0) b->set_max_queue_delay_ms(5);
  if (!(b->max_queue_delay_ms() > 0 && b->max_queue_delay_ms() <= 10000)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path,
                     ".batching.max_queue_delay_ms must be in (0, "
                     "10000], got ",
                     b->max_queue_delay_ms()));
  }
  MOH_DEFAULT(b, max_queued_requests, path + ".batching.max_queued_requests",
              256, 1, 1 << 20);
  v1::GenerationConfig* g = m->mutable_generation();
  MOH_DEFAULT(g, max_running, path + ".generation.max_running", 16, 1, 4096);
  if (g->max_seq_len() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ".generation.max_seq_len must be >= 0 (0 = model maximum), got ",
        g->max_seq_len()));
  }
  MOH_DEFAULT(g, max_queued_requests, path + ".generation.max_queued_requests",
              256, 1, 1 << 20);
  MOH_DEFAULT(g, prefill_token_budget,
              path + ".generation.prefill_token_budget", 512, 1, 1 << 20);
  MOH_DEFAULT(g, default_max_new_tokens,
              path + ".generation.default_max_new_tokens", 64, 1, 1 << 20);
  MOH_DEFAULT(g, attention_workspace_mb,
              path + ".generation.attention_workspace_mb", 256, 1, 1 << 16);
  if (m->adaptive().queue_depth() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ".adaptive.queue_depth must be >= 0 (0 = off), got ",
                     m->adaptive().queue_depth()));
  }
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

absl::Status ResolveServerConfig(v1::ServerConfig* config) {
  MOH_DEFAULT(config, port, std::string("port"), 50051, 1, 65535);
  if (config->metrics_port() == 0) config->set_metrics_port(9464);
  if (config->metrics_port() != -1 &&
      (config->metrics_port() < 1 || config->metrics_port() > 65535)) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_port must be in [1, 65535] or -1 (off), got ",
                     config->metrics_port()));
  }
  if (config->metrics_port() == config->port()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics_port must differ from port (", config->port(), ")"));
  }
  if (config->host().empty()) config->set_host("0.0.0.0");
  MOH_DEFAULT(config, drain_timeout_seconds,
              std::string("drain_timeout_seconds"), 30.0, 0.001, 86400.0);
  if (config->threads() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "threads must be >= 0 (0 = the default), got ", config->threads()));
  }
  if (config->models().empty()) {
    return absl::InvalidArgumentError("models: at least one model is needed");
  }
  std::set<std::string> names;
  for (int i = 0; i < config->models_size(); ++i) {
    const std::string path = absl::StrCat("models[", i, "]");
    MOH_RETURN_IF_ERROR(ResolveModel(path, config->mutable_models(i)));
    if (!names.insert(config->models(i).name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ".name \"", config->models(i).name(),
                       "\" is used by another model"));
    }
  }
  return absl::OkStatus();
}

v1::ServerConfig DemoServerConfig(const std::string& demo_dir) {
  v1::ServerConfig config;
  v1::ModelConfig* lm = config.add_models();
  lm->set_name("demo-lm");
  lm->set_model_dir(demo_dir + "/demo-lm");
  v1::ModelConfig* vit = config.add_models();
  vit->set_name("demo-vit");
  vit->set_model_dir(demo_dir + "/demo-vit");
  return config;
}

}  // namespace moh
