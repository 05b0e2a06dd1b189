#include "model/generation/language_model.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"

namespace moh {
namespace {

// eos_token_id of generation_config.json (an int or a list), if any.
absl::StatusOr<std::vector<int32_t>> GenerationConfigEos(
    const std::string& path, int32_t vocab_size) {
  std::vector<int32_t> ids;
  std::ifstream in(path);
  if (!in) return ids;
  std::stringstream s;
  s << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(s.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a JSON object"));
  }
  if (!j.contains("eos_token_id") || j["eos_token_id"].is_null()) return ids;
  nlohmann::json eos = j["eos_token_id"];
  if (!eos.is_array()) eos = nlohmann::json::array({eos});
  for (const auto& id : eos) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        id.get<int64_t>() >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": field 'eos_token_id' must hold ids in [0, ",
                       vocab_size, ")"));
    }
    ids.push_back(id.get<int32_t>());
  }
  return ids;
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
      std::vector<int32_t> generation_eos,
      GenerationConfigEos(dir + "/generation_config.json", vocab));
  lm.eos_ids.insert(lm.eos_ids.end(), generation_eos.begin(),
                    generation_eos.end());
  if (lm.tokenizer && lm.tokenizer->eos_id()) {
    lm.eos_ids.push_back(*lm.tokenizer->eos_id());
  }
  std::sort(lm.eos_ids.begin(), lm.eos_ids.end());
  lm.eos_ids.erase(std::unique(lm.eos_ids.begin(), lm.eos_ids.end()),
                   lm.eos_ids.end());
  return lm;
}

}  // namespace moh
