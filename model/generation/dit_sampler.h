// Sampling images from a MoH-DiT as the official sample.py does, one request
// at a time or many in one forward: each request has its own class, seed,
// number of steps, guidance scale and routed K, and its own CPU random
// generator seeded with its seed, drawn in the official order (the initial
// noise [1, C, S, S]; then, every step, noise for the guided pair of rows
// [R, C, S, S] in one draw, R = 2 when guided, of which the conditional
// row's is used), so a request's image does not depend on what else is in
// the batch. (The official scripts seed the global generator before they
// build the model, whose initialization draws from it too; the contract here
// is their sampling loop from a freshly seeded generator.)
//
// Classifier-free guidance as forward_with_cfg: the conditional row and a
// null-class row of the same input; the first three output channels are
// guided, the rest (and the learned variance) are the conditional row's.
// Guidance 1 is no guidance: one row, as sample_ddp.py samples then.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/core/activation.h"
#include "model/core/dit_model.h"
#include "model/core/vae_decoder.h"
#include "model/generation/diffusion.h"

namespace moh {

// Classifier-free guidance scales a request may ask for (1: none).
inline constexpr float kMinGuidance = 1.0f;
inline constexpr float kMaxGuidance = 100.0f;

struct ImageRequest {
  int64_t class_id = 0;  // in [0, num_classes)
  uint64_t seed = 0;
  float guidance = 1.0f;  // in [kMinGuidance, kMaxGuidance]
  LayerTopK top_k;        // routed K per block (Activation::top_k)
};

// One request's image being sampled.
class ImageSample {
 public:
  // `diffusion` (respaced to the request's steps) must outlive the sample.
  static absl::StatusOr<std::unique_ptr<ImageSample>> Start(
      const DitModel& model, const Diffusion* diffusion,
      const ImageRequest& request);

  bool done() const { return next_ < 0; }
  // Steps done so far, of steps().
  int32_t steps_done() const { return diffusion_->steps() - 1 - next_; }
  int32_t steps() const { return diffusion_->steps(); }
  bool guided() const { return request_.guidance != 1.0f; }
  // Rows of the model's batch this sample takes per step: 2 guided, else 1.
  int32_t rows() const { return guided() ? 2 : 1; }
  const ImageRequest& request() const { return request_; }
  // The current sample [C, S, S] (the image or latent once done()).
  const at::Tensor& x() const { return x_; }
  // Tokens each head served, summed over steps and rows: [L, H].
  const at::Tensor& head_token_counts() const { return head_tokens_; }
  // The (token, head) pairs computed / every pair of every block, over the
  // steps done and their rows (1.0 before the first step).
  double effective_ratio() const;
  // Another activation before the first step (adaptive lowering at
  // admission); `top_k` as ValidateTopK accepts.
  void set_top_k(LayerTopK top_k) { request_.top_k = std::move(top_k); }

 private:
  friend absl::Status SampleStep(const DitModel& model,
                                 const std::vector<ImageSample*>& samples);
  ImageSample(const Diffusion* diffusion, const ImageRequest& request)
      : diffusion_(diffusion), request_(request) {}

  const Diffusion* diffusion_;
  ImageRequest request_;
  at::Generator generator_;
  at::Tensor x_;
  at::Tensor head_tokens_;
  int64_t pairs_per_row_ = 0;  // tokens x heads, summed over blocks
  int32_t next_ = 0;  // the next respaced step, counting down; -1 = done
};

// Advances every sample (none done) by one step in one forward of `model`.
// On error no sample has advanced (nor drawn noise): the step can run again.
absl::Status SampleStep(const DitModel& model,
                        const std::vector<ImageSample*>& samples);

// The finished sample as image bytes, uint8 [C, H, W]: decoded by `vae` from
// latents (divided by `latent_scale` first) or, without a VAE, the sample
// itself (pixel space); mapped from [-1, 1] as torchvision's save_image.
absl::StatusOr<at::Tensor> SampleImage(const ImageSample& sample,
                                       const VaeDecoder* vae,
                                       double latent_scale);

// The VAE decoder that the config of `model`, loaded from `model_dir`, names
// (its `vae`, relative to `model_dir` unless absolute), with the model's
// tensor options; null when it names none (a pixel-space model).
// INVALID_ARGUMENT when its latent channels are not the model's in_channels.
absl::StatusOr<std::unique_ptr<VaeDecoder>> LoadDitVae(
    const std::string& model_dir, const DitModel& model);

}  // namespace moh
