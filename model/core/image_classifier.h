// What every image classifier family offers the service: a batched forward
// with the routed K of every layer per row, its MoH layout and the routing
// shape of its layers (heads and tokens differ per layer in TransNeXt), and
// its preprocessing parameters.
//
// Thread-compatible: a loaded model is immutable; ForwardWithTopK may run
// concurrently.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/core/activation.h"
#include "model/core/head_sparse_attention.h"
#include "model/core/model_config.h"
#include "model/core/runtime.h"

namespace moh {

struct ClassifierOutput {
  at::Tensor logits;  // float32 CPU [B, num_classes]
  // int64 CPU [B, L, H]: tokens each head served per layer; layers with fewer
  // than H heads (H = the most heads of any layer) are padded with zeros.
  at::Tensor head_token_counts;
  std::vector<at::Tensor>
      gates;  // when recorded: per layer float32 CPU [B, N_l, H_l]
};

// How an image becomes the model's input.
struct ImagePreprocessing {
  int32_t image_size = 0;  // the model's input side
  // 0: resized straight to the square (antialiased bilinear); else the
  // shorter side is resized to this, then the centre square is cut (as
  // torchvision's Resize + CenterCrop on a PIL image).
  int32_t resize_size = 0;
  bool bicubic = false;  // PIL's bicubic (else bilinear)
  int32_t num_channels = 3;
};

class ImageClassifier {
 public:
  virtual ~ImageClassifier() = default;

  // pixels: [B, C, S, S] float, normalized (NormalizePixels); top_k: the
  // routed K of every layer per row (Activation::top_k).
  virtual absl::StatusOr<ClassifierOutput> ForwardWithTopK(
      const at::Tensor& pixels, const std::vector<LayerTopK>& top_k,
      bool record_gates = false) const = 0;
  // The same with one ratio per row (<= 0: the trained default).
  absl::StatusOr<ClassifierOutput> Forward(const at::Tensor& pixels,
                                           const std::vector<float>& ratios,
                                           bool record_gates = false) const;

  virtual const MohConfig& moh() const = 0;
  virtual const std::vector<std::string>& labels() const = 0;
  // Where the model's weights lie and its forward runs.
  virtual at::Device device() const = 0;
  virtual ImagePreprocessing preprocessing() const = 0;
  // Tokens of one image that each layer routes.
  virtual std::vector<int64_t> LayerTokens() const = 0;
  // How the linear weights are held (DeviceOptions::weights).
  virtual WeightFormat linear_weights() const = 0;
  // See AttentionMode (head_sparse_attention.h). Set before use.
  virtual void set_attention_mode(AttentionMode mode) = 0;

  // (pixels in [0, 1] - image_mean) / image_std, per channel; pixels [B, C, S,
  // S].
  at::Tensor NormalizePixels(const at::Tensor& pixels) const;

 protected:
  virtual const std::vector<float>& image_mean() const = 0;
  virtual const std::vector<float>& image_std() const = 0;
};

// Tokens x heads of every layer, summed: the pairs a request at ratio 1.0
// would compute (the denominator of its effective ratio).
int64_t RoutablePairs(const MohConfig& moh,
                      const std::vector<int64_t>& layer_tokens);

}  // namespace moh
