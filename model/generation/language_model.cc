#include "model/generation/language_model.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"

namespace moh {
namespace {

// What generation_config.json holds for serving.
struct GenerationConfig {
  std::vector<int32_t> eos_ids;  // eos_token_id: an int or a list
  std::optional<GenerationDefaults> defaults;
};

// A number field of `j` in [lo, hi] (lo excluded when lo_open), if present.
absl::Status ReadNumber(const nlohmann::json& j, const std::string& path,
                        const char* field, double lo, double hi, bool lo_open,
                        std::optional<double>* out) {
  if (!j.contains(field) || j[field].is_null()) return absl::OkStatus();
  const nlohmann::json& v = j[field];
  const double x = v.is_number() ? v.get<double>() : std::nan("");
  if (!(lo_open ? x > lo : x >= lo) || !(x <= hi)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": field '", field, "' must be a number in ",
                     lo_open ? "(" : "[", lo, ", ", hi, "]"));
  }
  *out = x;
  return absl::OkStatus();
}

absl::StatusOr<GenerationConfig> ReadGenerationConfig(const std::string& path,
                                                      int32_t vocab_size) {
  GenerationConfig config;
  std::ifstream in(path);
  if (!in) return config;
  std::stringstream s;
  s << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(s.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a JSON object"));
  }
  if (j.contains("eos_token_id") && !j["eos_token_id"].is_null()) {
    nlohmann::json eos = j["eos_token_id"];
    if (!eos.is_array()) eos = nlohmann::json::array({eos});
    for (const auto& id : eos) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          id.get<int64_t>() >= vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": field 'eos_token_id' must hold ids in [0, ",
                         vocab_size, ")"));
      }
      config.eos_ids.push_back(id.get<int32_t>());
    }
  }
  std::optional<double> temperature, top_k, top_p, min_p, penalty;
  MOH_RETURN_IF_ERROR(
      ReadNumber(j, path, "temperature", 0.0, 100.0, false, &temperature));
  MOH_RETURN_IF_ERROR(ReadNumber(j, path, "top_k", 0.0, 1e9, false, &top_k));
  MOH_RETURN_IF_ERROR(ReadNumber(j, path, "top_p", 0.0, 1.0, true, &top_p));
  MOH_RETURN_IF_ERROR(ReadNumber(j, path, "min_p", 0.0, 1.0, false, &min_p));
  MOH_RETURN_IF_ERROR(
      ReadNumber(j, path, "repetition_penalty", 0.0, 1e6, true, &penalty));
  const bool has_do_sample =
      j.contains("do_sample") && !j["do_sample"].is_null();
  if (has_do_sample && !j["do_sample"].is_boolean()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": field 'do_sample' must be true or false"));
  }
  if (has_do_sample || temperature || top_k || top_p || min_p || penalty) {
    GenerationDefaults d;
    d.do_sample = has_do_sample && j["do_sample"].get<bool>();
    if (temperature) d.temperature = static_cast<float>(*temperature);
    if (top_k) d.top_k = static_cast<int32_t>(*top_k);
    if (top_p) d.top_p = static_cast<float>(*top_p);
    if (min_p) d.min_p = static_cast<float>(*min_p);
    if (penalty) d.repetition_penalty = static_cast<float>(*penalty);
    config.defaults = d;
  }
  return config;
}

}  // namespace

absl::StatusOr<LanguageModel> LanguageModel::Load(const std::string& dir,
                                                  const DeviceOptions& device) {
  LanguageModel lm;
  MOH_ASSIGN_OR_RETURN(lm.model, LlamaModel::Load(dir, device));
  const int32_t vocab = lm.model->config().vocab_size;
  const std::string tokenizer_path = dir + "/tokenizer.json";
  if (std::filesystem::exists(tokenizer_path)) {
    MOH_ASSIGN_OR_RETURN(lm.tokenizer, Tokenizer::FromFile(tokenizer_path));
    if (lm.tokenizer->vocab_size() > vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat(tokenizer_path, ": has ", lm.tokenizer->vocab_size(),
                       " tokens but the model's vocab_size is ", vocab));
    }
  }
  lm.eos_ids = lm.model->config().eos_token_ids;
  MOH_ASSIGN_OR_RETURN(
      GenerationConfig generation,
      ReadGenerationConfig(dir + "/generation_config.json", vocab));
  lm.eos_ids.insert(lm.eos_ids.end(), generation.eos_ids.begin(),
                    generation.eos_ids.end());
  lm.generation_defaults = generation.defaults;
  if (lm.tokenizer && lm.tokenizer->eos_id()) {
    lm.eos_ids.push_back(*lm.tokenizer->eos_id());
  }
  std::sort(lm.eos_ids.begin(), lm.eos_ids.end());
  lm.eos_ids.erase(std::unique(lm.eos_ids.begin(), lm.eos_ids.end()),
                   lm.eos_ids.end());
  return lm;
}

}  // namespace moh
