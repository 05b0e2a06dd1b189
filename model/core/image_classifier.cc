#include "model/core/image_classifier.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace moh {

absl::StatusOr<ClassifierOutput> ImageClassifier::Forward(
    const at::Tensor& pixels, const std::vector<float>& ratios,
    bool record_gates) const {
  if (!pixels.defined() || pixels.dim() != 4 ||
      ratios.size() != static_cast<size_t>(pixels.size(0))) {
    return absl::InvalidArgumentError(
        "ratios needs one entry per row of pixels [B, C, S, S]");
  }
  for (size_t b = 0; b < ratios.size(); ++b) {
    if (!(ratios[b] <= 1.0f)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ratios[", b, "] must be in (0, 1] or <= 0 for the default, got ",
          ratios[b]));
    }
  }
  return ForwardWithTopK(pixels, TopKForRatios(moh(), ratios), record_gates);
}

at::Tensor ImageClassifier::NormalizePixels(const at::Tensor& pixels) const {
  const int64_t ch = image_mean().size();
  at::Tensor mean = at::tensor(image_mean()).view({1, ch, 1, 1});
  at::Tensor std = at::tensor(image_std()).view({1, ch, 1, 1});
  return (pixels.to(at::kFloat).cpu() - mean) / std;
}

int64_t RoutablePairs(const MohConfig& moh,
                      const std::vector<int64_t>& layer_tokens) {
  int64_t pairs = 0;
  for (size_t l = 0; l < moh.layers.size() && l < layer_tokens.size(); ++l) {
    pairs += layer_tokens[l] * moh.layers[l].num_heads;
  }
  return pairs;
}

}  // namespace moh
