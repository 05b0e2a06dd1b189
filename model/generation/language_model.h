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

// generation_config.json's sampling defaults, read as Hugging Face reads
// them: with do_sample true, temperature (default 1), top_k (default 50),
// top_p (default 1) and min_p (default off) sample; without it decoding is
// greedy.
// repetition_penalty (default 1) applies either way.
struct GenerationDefaults {
  bool do_sample = false;
  float temperature = 1.0f;
  int32_t top_k = 50;
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
};

struct LanguageModel {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;  // null when the directory has none
  std::vector<int32_t> eos_ids;
  // Present when generation_config.json sets any sampling field (do_sample,
  // temperature, top_k, top_p, min_p, repetition_penalty).
  std::optional<GenerationDefaults> generation_defaults;

  // Loads `dir`: config.json, the checkpoint, tokenizer.json (optional) and
  // generation_config.json (optional).
  static absl::StatusOr<LanguageModel> Load(const std::string& dir,
                                            const DeviceOptions& device);
};

}  // namespace moh
