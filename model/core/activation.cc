#include "model/core/activation.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/field_error.h"

namespace moh {

Activation::Activation(const MohConfig& moh, float requested, float min_ratio,
                       bool lowered)
    : requested_(requested),
      nominal_(requested > 0.0f ? requested : moh.DefaultRatio()),
      min_ratio_(min_ratio),
      lowered_(lowered) {
  top_k_.reserve(moh.layers.size());
  for (const MohLayerConfig& layer : moh.layers) {
    top_k_.push_back(layer.TopKForRatio(requested));
  }
}

absl::StatusOr<Activation> Activation::Resolve(const MohConfig& moh,
                                               float ratio, float min_ratio) {
  const absl::Status ratio_ok = ValidateRatio(ratio, "activation.ratio");
  if (!ratio_ok.ok()) return ratio_ok;
  // Slack for comparing a float min_ratio with a default computed in double.
  constexpr double kSlack = 1e-6;
  const double ceiling = ratio > 0.0f ? ratio : moh.DefaultRatio();
  if (min_ratio != 0.0f &&
      !(min_ratio > 0.0f && min_ratio <= ceiling + kSlack)) {
    return FieldError(
        "activation.min_ratio",
        absl::StrCat("must be 0 (off) or in (0, ", ceiling, "] (at most the ",
                     ratio > 0.0f ? "ratio" : "model's default ratio",
                     "), got ", min_ratio));
  }
  return Activation(moh, ratio, min_ratio, /*lowered=*/false);
}

Activation Activation::AtRatio(const MohConfig& moh, float ratio) {
  return Activation(moh, ratio > 0.0f ? ratio : 0.0f, 0.0f, false);
}

Activation Activation::Lowered(const MohConfig& moh) const {
  if (!CanLower()) return *this;
  Activation lowered(moh, min_ratio_, min_ratio_, /*lowered=*/true);
  // No layer's K rises: the default activation's trained Ks differ by layer,
  // and one floor ratio can ask a layer for more routed heads than it had
  // (trained K [1, 4, 8] of 8 heads, min_ratio 0.5: 4 for the first layer;
  // found by activation_fuzzer).
  for (size_t l = 0; l < top_k_.size(); ++l) {
    lowered.top_k_[l] = std::min(lowered.top_k_[l], top_k_[l]);
  }
  return lowered;
}

std::vector<LayerTopK> TopKForRatios(const MohConfig& moh,
                                     const std::vector<float>& ratios) {
  std::vector<LayerTopK> top_k;
  top_k.reserve(ratios.size());
  for (float ratio : ratios) {
    top_k.push_back(Activation::AtRatio(moh, ratio).top_k());
  }
  return top_k;
}

absl::Status ValidateTopK(const MohConfig& moh,
                          const std::vector<LayerTopK>& top_k, size_t rows,
                          const char* field) {
  if (top_k.size() != rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " needs one entry per row (", rows, "), got ", top_k.size()));
  }
  for (size_t b = 0; b < rows; ++b) {
    if (top_k[b].size() != moh.layers.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", b, "] needs one K per layer (",
                       moh.layers.size(), "), got ", top_k[b].size()));
    }
    for (size_t l = 0; l < moh.layers.size(); ++l) {
      const int32_t k = top_k[b][l];
      if (k < 0 || k > moh.layers[l].routed_heads()) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, "[", b, "][", l, "] must be in [0, ",
                         moh.layers[l].routed_heads(), "], got ", k));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateRatio(float ratio, const char* field) {
  if (ratio == 0.0f || (ratio > 0.0f && ratio <= 1.0f)) return absl::OkStatus();
  return FieldError(
      field,
      absl::StrCat("must be in (0, 1] (or 0 for the model's default), got ",
                   ratio));
}

}  // namespace moh
