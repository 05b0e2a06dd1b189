// The image decoder of latent diffusion: the decoder half of diffusers'
// AutoencoderKL (Stable Diffusion's sd-vae-ft-ema / sd-vae-ft-mse, which
// MoH-DiT decodes with): post_quant_conv, conv_in, a mid block (ResNet,
// single-head self-attention, ResNet), up blocks of ResNets each followed by
// a nearest x2 upsample and a 3x3 conv (but the last), GroupNorm, SiLU,
// conv_out. The attention's weights may be named as in current diffusers
// (to_q, to_k, to_v, to_out.0) or older releases (query, key, value,
// proj_attn). The encoder's weights, if present, are not loaded.
//
// Thread-compatible: a loaded decoder is immutable.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/checkpoint/checkpoint.h"

namespace moh {

struct VaeConfig {
  int32_t latent_channels = 4;
  int32_t out_channels = 3;
  std::vector<int32_t> block_out_channels = {128, 256, 512, 512};
  int32_t layers_per_block = 2;
  int32_t norm_num_groups = 32;
  bool mid_block_add_attention = true;
  // Latent side x this = image side.
  int32_t upscale() const {
    return 1 << (static_cast<int32_t>(block_out_channels.size()) - 1);
  }
};

// Parses diffusers' AutoencoderKL config.json (`source` names it).
absl::StatusOr<VaeConfig> ParseVaeConfig(const std::string& json_text,
                                         const std::string& source);

class VaeDecoder {
 public:
  // `dir`: config.json and diffusion_pytorch_model.safetensors (or .bin, or
  // the names LoadCheckpoint reads).
  static absl::StatusOr<std::unique_ptr<VaeDecoder>> Load(
      const std::string& dir, const at::TensorOptions& options);
  static absl::StatusOr<std::unique_ptr<VaeDecoder>> FromStore(
      TensorStore& store, const VaeConfig& config,
      const at::TensorOptions& options);

  // latents [B, latent_channels, h, w] (already divided by the scaling
  // factor) -> float32 [B, out_channels, h * upscale, w * upscale], about
  // [-1, 1].
  absl::StatusOr<at::Tensor> Decode(const at::Tensor& latents) const;

  const VaeConfig& config() const { return config_; }

 private:
  struct Resnet {
    at::Tensor norm1_w, norm1_b, conv1_w, conv1_b;
    at::Tensor norm2_w, norm2_b, conv2_w, conv2_b;
    at::Tensor shortcut_w, shortcut_b;  // undefined when in == out
  };
  struct AttentionBlock {
    at::Tensor norm_w, norm_b, q_w, q_b, k_w, k_b, v_w, v_b, out_w, out_b;
  };
  struct UpBlock {
    std::vector<Resnet> resnets;
    at::Tensor upsample_w, upsample_b;  // undefined for the last block
  };

  VaeDecoder(VaeConfig config, at::TensorOptions options)
      : config_(std::move(config)), options_(options) {}
  absl::StatusOr<Resnet> LoadResnet(TensorStore& store,
                                    const std::string& prefix, int64_t in,
                                    int64_t out);
  absl::StatusOr<AttentionBlock> LoadAttention(TensorStore& store,
                                               const std::string& prefix,
                                               int64_t channels);
  at::Tensor GroupNorm(const at::Tensor& x, const at::Tensor& w,
                       const at::Tensor& b) const;
  at::Tensor ResnetForward(const Resnet& r, const at::Tensor& x) const;
  at::Tensor AttentionForward(const AttentionBlock& a,
                              const at::Tensor& x) const;

  VaeConfig config_;
  at::TensorOptions options_;
  at::Tensor post_quant_w_, post_quant_b_, conv_in_w_, conv_in_b_;
  Resnet mid_first_, mid_second_;
  AttentionBlock mid_attention_;
  std::vector<UpBlock> up_blocks_;
  at::Tensor norm_out_w_, norm_out_b_, conv_out_w_, conv_out_b_;
};

// torchvision's save_image(normalize=True, value_range=(-1, 1)) on one
// image: clamp to [-1, 1], (x + 1) / 2, x 255 + 0.5, clamp, truncate to
// uint8. images [C, H, W] float -> uint8 [C, H, W] on the CPU.
at::Tensor ImageToBytes(const at::Tensor& image);

}  // namespace moh
