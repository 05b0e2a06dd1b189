#include "model/generation/diffusion.h"

#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace moh {
namespace {

constexpr double kBetaStart = 0.0001, kBetaEnd = 0.02;

// np.linspace(start, end, n): i * step + start, the last exactly `end`.
std::vector<double> Linspace(double start, double end, int32_t n) {
  std::vector<double> out(n);
  const double step = (end - start) / (n - 1);
  for (int32_t i = 0; i < n; ++i) out[i] = i * step + start;
  out[n - 1] = end;
  return out;
}

// np.cumprod(1 - betas).
std::vector<double> AlphasCumprod(const std::vector<double>& betas) {
  std::vector<double> out(betas.size());
  double product = 1.0;
  for (size_t i = 0; i < betas.size(); ++i) {
    product *= 1.0 - betas[i];
    out[i] = product;
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<int64_t>> SpaceTimesteps(int32_t num_timesteps,
                                                    int32_t steps) {
  if (steps < 1 || steps > num_timesteps) {
    return absl::InvalidArgumentError(
        absl::StrCat("steps must be in [1, ", num_timesteps, "], got ", steps));
  }
  const double stride =
      steps <= 1 ? 1.0 : (num_timesteps - 1) / static_cast<double>(steps - 1);
  std::set<int64_t> taken;
  double index = 0.0;
  for (int32_t i = 0; i < steps; ++i) {
    taken.insert(static_cast<int64_t>(std::nearbyint(index)));  // half even
    index += stride;
  }
  return std::vector<int64_t>(taken.begin(), taken.end());
}

absl::StatusOr<Diffusion> Diffusion::Respaced(int32_t steps) {
  if (steps < kMinSamplingSteps || steps > kTrainingSteps) {
    return absl::InvalidArgumentError(
        absl::StrCat("steps must be in [", kMinSamplingSteps, ", ",
                     kTrainingSteps, "], got ", steps));
  }
  MOH_ASSIGN_OR_RETURN(std::vector<int64_t> kept,
                       SpaceTimesteps(kTrainingSteps, steps));
  const std::vector<double> base_cumprod =
      AlphasCumprod(Linspace(kBetaStart, kBetaEnd, kTrainingSteps));
  // SpacedDiffusion: the betas that take the kept steps' alphas_cumprod
  // from one kept step to the next.
  std::vector<double> betas;
  double last = 1.0;
  for (int64_t t : kept) {
    betas.push_back(1.0 - base_cumprod[t] / last);
    last = base_cumprod[t];
  }
  const std::vector<double> cumprod = AlphasCumprod(betas);
  const size_t n = betas.size();
  Diffusion d;
  d.timesteps_ = kept;
  std::vector<double> posterior_variance(n);
  for (size_t i = 0; i < n; ++i) {
    const double prev = i == 0 ? 1.0 : cumprod[i - 1];
    const double alpha = 1.0 - betas[i];
    posterior_variance[i] = betas[i] * (1.0 - prev) / (1.0 - cumprod[i]);
    d.log_betas_.push_back(std::log(betas[i]));
    d.sqrt_recip_alphas_cumprod_.push_back(std::sqrt(1.0 / cumprod[i]));
    d.sqrt_recipm1_alphas_cumprod_.push_back(std::sqrt(1.0 / cumprod[i] - 1));
    d.posterior_mean_coef1_.push_back(betas[i] * std::sqrt(prev) /
                                      (1.0 - cumprod[i]));
    d.posterior_mean_coef2_.push_back((1.0 - prev) * std::sqrt(alpha) /
                                      (1.0 - cumprod[i]));
  }
  // The first entry is the second's: the posterior variance is 0 at step 0.
  for (size_t i = 0; i < n; ++i) {
    d.posterior_log_variance_clipped_.push_back(
        std::log(posterior_variance[i == 0 ? 1 : i]));
  }
  return d;
}

at::Tensor Diffusion::Step(int32_t i, const at::Tensor& x,
                           const at::Tensor& eps, const at::Tensor& var_values,
                           const at::Tensor& noise) const {
  // Every coefficient as float32, as _extract_into_tensor gives it.
  auto f = [](double v) { return static_cast<float>(v); };
  const float min_log = f(posterior_log_variance_clipped_[i]);
  const float max_log = f(log_betas_[i]);
  at::Tensor frac = (var_values + 1) / 2;
  at::Tensor log_variance = frac * max_log + (1 - frac) * min_log;
  at::Tensor x_start = f(sqrt_recip_alphas_cumprod_[i]) * x -
                       f(sqrt_recipm1_alphas_cumprod_[i]) * eps;
  at::Tensor mean =
      f(posterior_mean_coef1_[i]) * x_start + f(posterior_mean_coef2_[i]) * x;
  if (i == 0) return mean;
  return mean + at::exp(0.5 * log_variance) * noise;
}

}  // namespace moh
