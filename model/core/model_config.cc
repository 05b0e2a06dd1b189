#include "model/core/model_config.h"

#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/enum_names.h"
#include "base/status_macros.h"
#include "model/core/config/config_reader.h"
#include "nlohmann/json.hpp"

// The families' parsers are in config/, one file each; here, what is
// common: the MoH layer arithmetic, which family a file is, reading it.
namespace moh {

using config_json::ConfigReader;
using nlohmann::json;

const char* RouterKindName(RouterKind kind) {
  static constexpr const char* kNames[] = {"dense", "learned", "query_norm"};
  return EnumName(kind, kNames);
}

int32_t MohLayerConfig::TopKForRatio(float ratio) const {
  const int32_t routed = routed_heads();
  if (routed == 0) return 0;
  if (!(ratio > 0)) return top_k;
  const int64_t heads = static_cast<int64_t>(
      std::floor(static_cast<double>(ratio) * num_heads + 0.5));
  return static_cast<int32_t>(
      std::clamp<int64_t>(heads - shared_heads, 0, routed));
}

double MohConfig::DefaultRatio() const {
  int64_t used = 0, total = 0;
  for (const MohLayerConfig& l : layers) {
    used += l.shared_heads + l.top_k;
    total += l.num_heads;
  }
  return total == 0 ? 1.0 : static_cast<double>(used) / total;
}

double MohConfig::MinRatio() const {
  int64_t used = 0, total = 0;
  for (const MohLayerConfig& l : layers) {
    used += l.routed_heads() == 0 ? l.num_heads : l.shared_heads;
    total += l.num_heads;
  }
  return total == 0 ? 1.0 : static_cast<double>(used) / total;
}

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text,
                                             const std::string& source) {
  json j = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not valid JSON"));
  }
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": must be a JSON object"));
  }
  ConfigReader r(j, source);
  MOH_ASSIGN_OR_RETURN(std::string model_type, r.String("model_type", ""));
  bool llama_arch = false;
  if (j.contains("architectures") && j["architectures"].is_array()) {
    for (const json& a : j["architectures"]) {
      if (a.is_string() && a.get<std::string>() == "LlamaForCausalLM") {
        llama_arch = true;
      }
    }
  }
  ModelConfig config;
  if (model_type == "moh_vit") {
    config.family = ModelFamily::kVit;
    MOH_ASSIGN_OR_RETURN(config.vit, config_json::ParseVit(r));
  } else if (model_type == "moh_dit") {
    config.family = ModelFamily::kDit;
    MOH_ASSIGN_OR_RETURN(config.dit, config_json::ParseDit(r));
  } else if (model_type == "moh_transnext") {
    config.family = ModelFamily::kTransNext;
    MOH_ASSIGN_OR_RETURN(config.transnext, config_json::ParseTransNext(r));
  } else if (model_type == "llama" || llama_arch) {
    config.family = ModelFamily::kLlama;
    MOH_ASSIGN_OR_RETURN(config.llama, config_json::ParseLlama(r));
  } else {
    return r.Error("model_type",
                   absl::StrCat("must be \"llama\" (or architectures "
                                "[\"LlamaForCausalLM\"]), \"moh_vit\", "
                                "\"moh_transnext\" or \"moh_dit\", got \"",
                                model_type, "\""));
  }
  return config;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir,
                                            ModelFamily family) {
  MOH_ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));
  if (config.family != family) {
    static constexpr const char* kTypes[] = {"llama", "moh_vit",
                                             "moh_transnext", "moh_dit"};
    return absl::InvalidArgumentError(absl::StrCat(
        dir, "/config.json: not a ", EnumName(family, kTypes), " model"));
  }
  return config;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  return ParseModelConfig(buffer.str(), path);
}

}  // namespace moh
