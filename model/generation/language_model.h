// A decoder LM directory loaded for use: weights, tokenizer and end-of-sequence
// ids (config.json, generation_config.json and the tokenizer's EOS token).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/core/llama_model.h"
#include "model/tokenizer/tokenizer.h"

namespace moh {

struct LanguageModel {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;  // null when the directory has none
  std::vector<int32_t> eos_ids;

  // Loads `dir`: config.json, the checkpoint, tokenizer.json (optional) and
  // generation_config.json (optional).
  static absl::StatusOr<LanguageModel> Load(const std::string& dir,
                                            const DeviceOptions& device);
};

}  // namespace moh
