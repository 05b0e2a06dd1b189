// Model configurations parsed from a Hugging Face style `config.json`.
//
// Two families are understood: LLaMA-style decoders (`model_type: "llama"` or a
// `LlamaForCausalLM` architecture) and MoH-ViT classifiers (`model_type:
// "moh_vit"`). The MoH settings of each layer (shared heads S, trained routed
// top-K, router kind) are resolved here once, following SPEC §1:
//   - `moh_router`, `moh_shared_heads`, `moh_routed_top_k` (int or per-layer
//   list)
//     give a learned- or query-norm-router model;
//   - a LLaMA config without MoH fields whose `auto_map` names its own
//     `modeling_llama` (the released MoH-LLaMA3-8B) gets the query-norm router
//     with S = H/2, K = H/4;
//   - any other config without MoH fields is dense (every head, ratio 1.0).
// Errors are INVALID_ARGUMENT naming the file, the field and the allowed range.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moh {

enum class RouterKind { kDense, kLearned, kQueryNorm };

const char* RouterKindName(RouterKind kind);

// MoH layout of one attention layer: heads [0, shared) are always on, heads
// [shared, num_heads) are routed and each token uses `top_k` of them.
struct MohLayerConfig {
  int32_t num_heads = 0;
  int32_t shared_heads = 0;
  int32_t top_k = 0;  // trained K; 0 when the layer has no routed heads

  int32_t routed_heads() const { return num_heads - shared_heads; }
  // K for a requested activation ratio in (0, 1]; ratio <= 0 means the trained
  // K. K = clamp(floor(ratio * H + 0.5) - S, 0, R); layers without routed heads
  // keep K = 0.
  int32_t TopKForRatio(float ratio) const;
};

struct MohConfig {
  RouterKind router = RouterKind::kDense;
  std::vector<MohLayerConfig> layers;

  // Fraction of heads a token uses at the trained K, over all layers.
  double DefaultRatio() const;
  // Lowest ratio any request can reach (every routed K at 0).
  double MinRatio() const;
};

struct LlamaConfig {
  int32_t vocab_size = 0;
  int32_t hidden_size = 0;
  int32_t intermediate_size = 0;
  int32_t num_layers = 0;
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  int32_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  std::vector<int32_t> eos_token_ids;
  int32_t bos_token_id = -1;  // -1: none
  std::string torch_dtype;    // as stored, e.g. "bfloat16"; informational
  MohConfig moh;
};

struct VitConfig {
  int32_t image_size = 0;
  int32_t patch_size = 0;
  int32_t num_channels = 3;
  int32_t hidden_size = 0;
  int32_t num_layers = 0;
  int32_t num_heads = 0;
  int32_t intermediate_size = 0;
  double layer_norm_eps = 1e-6;
  bool qkv_bias = true;
  std::vector<std::string> labels;
  std::vector<float> image_mean;
  std::vector<float> image_std;
  MohConfig moh;

  int32_t num_patches() const {
    return (image_size / patch_size) * (image_size / patch_size);
  }
};

enum class ModelFamily { kLlama, kVit };

struct ModelConfig {
  ModelFamily family = ModelFamily::kLlama;
  LlamaConfig llama;  // valid when family == kLlama
  VitConfig vit;      // valid when family == kVit
};

// Parses `json_text`; `source` names the file in error messages.
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text,
                                             const std::string& source);
// Reads and parses `dir`/config.json.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir);

}  // namespace moh
