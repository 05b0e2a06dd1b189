// The DiT sampler's diffusion (MoH-DiT/diffusion, after OpenAI's improved
// diffusion): a linear beta schedule 1e-4..0.02 over 1000 steps in float64,
// respaced to N steps (space_timesteps with one section), and ancestral DDPM
// steps with the learned-range variance the model predicts; the model is
// called with the original timestep of each respaced step. Coefficients are
// computed in double as numpy does and used in float32 as the official
// _extract_into_tensor does, so a step equals the official one.
//
// Immutable after construction; thread-compatible.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace moh {

// The steps a sampler may take: the training schedule's 1000, respaced to as
// few as 2 (one step cannot be sampled: the official posterior log-variance
// table is empty then).
inline constexpr int32_t kMinSamplingSteps = 2;
inline constexpr int32_t kTrainingSteps = 1000;

class Diffusion {
 public:
  // Respaced to `steps` in [kMinSamplingSteps, kTrainingSteps].
  static absl::StatusOr<Diffusion> Respaced(int32_t steps);

  int32_t steps() const { return static_cast<int32_t>(timesteps_.size()); }
  // The original (1000-step) timestep of respaced step i, the model's input.
  int64_t timestep(int32_t i) const { return timesteps_[i]; }

  // One ancestral step from respaced step `i` (counting down to 0): x and
  // eps [C, H, W], var_values [C, H, W] in [-1, 1] (the model's second half
  // of channels), noise [C, H, W] standard normal (unused at i == 0, as the
  // official code draws it but masks it). float32.
  at::Tensor Step(int32_t i, const at::Tensor& x, const at::Tensor& eps,
                  const at::Tensor& var_values, const at::Tensor& noise) const;

 private:
  std::vector<int64_t> timesteps_;
  // Per respaced step, as the official GaussianDiffusion computes them.
  std::vector<double> log_betas_, posterior_log_variance_clipped_;
  std::vector<double> sqrt_recip_alphas_cumprod_, sqrt_recipm1_alphas_cumprod_;
  std::vector<double> posterior_mean_coef1_, posterior_mean_coef2_;
};

// The steps space_timesteps(num_timesteps, "N") keeps, ascending: N points
// evenly strided over [0, num_timesteps - 1], rounded half to even as
// Python's round. INVALID_ARGUMENT unless 1 <= N <= num_timesteps.
absl::StatusOr<std::vector<int64_t>> SpaceTimesteps(int32_t num_timesteps,
                                                    int32_t steps);

}  // namespace moh
