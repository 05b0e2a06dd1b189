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
  // Staged models (TransNeXt): the layer's stage and block within it; -1
  // otherwise.
  int32_t stage = -1;
  int32_t block = -1;

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

// A checkpoint whose linear weights are stored as int8 with a float scale
// per output row (or one for the whole matrix), as config.json's
// quantization_config says, in the layout of the tool that wrote it:
// compressed-tensors' "int-quantized" (llm-compressor: `<name>.weight` I8
// and `<name>.weight_scale`) or bitsandbytes' 8-bit serialization
// (`<name>.weight` I8 and `<name>.SCB`, the row's largest |W|, so that
// W = weight * SCB / 127).
enum class PrequantizedLayout { kNone, kCompressedTensors, kBitsandbytes };

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
  PrequantizedLayout prequantized = PrequantizedLayout::kNone;
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

// One stage of a TransNeXt (MoH-ViT as released): an overlapping patch
// embedding, `depth` blocks at resolution image_size / 2^(stage + 2), a norm.
// Stages with sr_ratio > 1 use aggregated attention (a 3x3 window plus keys
// pooled to resolution / sr_ratio), sr_ratio 1 full attention.
struct TransNextStage {
  int32_t embed_dim = 0;
  int32_t num_heads = 0;
  int32_t depth = 0;
  int32_t sr_ratio = 1;
  double mlp_ratio = 4.0;
  int32_t shared_heads = 0;  // official shared_head
  int32_t top_k = 0;         // official routed_head: the trained routed K

  int32_t head_dim() const { return embed_dim / num_heads; }
  // ConvolutionalGLU's hidden width: int(2 * int(dim * mlp_ratio) / 3).
  int32_t glu_hidden() const;
};

// MoH-ViT (TransNeXt with MoH routing in every stage), `model_type:
// "moh_transnext"`. `variant` (one of the four released) fills every
// architecture field not given; tiny test models give them all.
struct TransNextConfig {
  std::string variant;  // "" when the architecture is spelled out
  int32_t image_size = 224;
  int32_t pretrain_size = 224;  // scales the CPB coordinates
  int32_t resize_size = 256;    // shorter side before the centre crop
  int32_t num_channels = 3;
  int32_t patch_size = 4;
  int32_t window_size = 3;  // odd: the local window's side
  bool qkv_bias = true;
  double layer_norm_eps = 1e-6;  // blocks and stage norms; the patch
                                 // embeddings' and the pooled features' norms
                                 // use LayerNorm's default 1e-5
  std::vector<TransNextStage> stages;  // 4
  std::vector<std::string> labels;
  std::vector<float> image_mean;
  std::vector<float> image_std;
  MohConfig moh;  // one layer per block, stage after stage

  // Token grid side of stage `s`: image_size / 2^(s + 2).
  int32_t resolution(int s) const { return image_size >> (s + 2); }
  // Pooled grid side of stage `s` (aggregated attention).
  int32_t pool_size(int s) const { return resolution(s) / stages[s].sr_ratio; }
  // The stage of each MoH layer (block), in order.
  std::vector<int32_t> LayerStages() const;
};

// The released variants' names, for messages.
const std::vector<std::string>& TransNextVariantNames();

// MoH-DiT (`model_type: "moh_dit"`): a class-conditional diffusion
// transformer whose attention is MoH (MoH-DiT/models.py). Heads and head_dim
// are per block (H * head_dim may differ from hidden_size); `variant` (one
// of the eight released configurations) fills every architecture field not
// given. Pixel-space models have no `vae`.
struct DitConfig {
  std::string variant;      // "" when the architecture is spelled out
  int32_t input_size = 32;  // latent (or pixel) side
  int32_t patch_size = 2;
  int32_t in_channels = 4;
  int32_t hidden_size = 0;
  int32_t depth = 0;
  std::vector<int32_t> num_heads;  // per block
  std::vector<int32_t> head_dim;   // per block
  double mlp_ratio = 4.0;
  int32_t num_classes = 1000;
  bool learn_sigma = true;
  std::vector<std::string> labels;  // num_classes names ("0".. when absent)
  // The VAE decoder's directory (relative to the model's), "" = pixel space.
  std::string vae;
  double latent_scale = 0.18215;
  int32_t default_steps = 250;
  double default_guidance = 4.0;
  MohConfig moh;

  int32_t out_channels() const {
    return learn_sigma ? 2 * in_channels : in_channels;
  }
  int32_t grid() const { return input_size / patch_size; }
  int32_t tokens() const { return grid() * grid(); }
  int32_t mlp_hidden() const {
    return static_cast<int32_t>(hidden_size * mlp_ratio);
  }
};

// The released MoH-DiT configurations' names ("MoH-DiT-XL/2-90", ...).
const std::vector<std::string>& DitVariantNames();

enum class ModelFamily { kLlama, kVit, kTransNext, kDit };

struct ModelConfig {
  ModelFamily family = ModelFamily::kLlama;
  LlamaConfig llama;          // valid when family == kLlama
  VitConfig vit;              // valid when family == kVit
  TransNextConfig transnext;  // valid when family == kTransNext
  DitConfig dit;              // valid when family == kDit

  // The routing configuration of whichever family this is.
  const MohConfig& moh() const {
    switch (family) {
      case ModelFamily::kVit:
        return vit.moh;
      case ModelFamily::kTransNext:
        return transnext.moh;
      case ModelFamily::kDit:
        return dit.moh;
      case ModelFamily::kLlama:
        break;
    }
    return llama.moh;
  }
};

// Parses `json_text`; `source` names the file in error messages.
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text,
                                             const std::string& source);
// Reads and parses `dir`/config.json.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir);
// The same, for a loader of `family`: INVALID_ARGUMENT
// "<dir>/config.json: not a <model_type> model" for another family.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir,
                                            ModelFamily family);

}  // namespace moh
