// A request's activation (SPEC §2): how many heads each token may use.
//
// A request asks for a ratio (0 = the model's trained default) and optionally
// a floor `min_ratio` that adaptive activation may lower it to under load.
// Activation resolves both against one model once, at admission: it validates
// them (messages name the API fields), substitutes the trained default, and
// computes the routed K of every layer. Batches carry the resolved K per row;
// nothing downstream turns a ratio into K again. A value type: cheap to copy.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "model/core/model_config.h"

namespace moh {

// Routed heads per token, one entry per attention layer.
using LayerTopK = std::vector<int32_t>;

class Activation {
 public:
  // Unresolved (no layers): assign a resolved one before use.
  Activation() = default;
  // Checks activation.ratio (0 for the default, or (0, 1]) and
  // activation.min_ratio (0 for off, or (0, ratio], where ratio 0 stands for
  // the model's default), then resolves. INVALID_ARGUMENT naming the field.
  static absl::StatusOr<Activation> Resolve(const MohConfig& moh, float ratio,
                                            float min_ratio = 0.0f);
  // For in-process callers whose ratio is already checked: ratio <= 0 means
  // the trained default; no floor.
  static Activation AtRatio(const MohConfig& moh, float ratio);

  // The ratio as requested (0 = the trained default), after any lowering.
  float requested_ratio() const { return requested_; }
  // The ratio it stands for: requested, or the model's trained default.
  double nominal_ratio() const { return nominal_; }
  float min_ratio() const { return min_ratio_; }
  // Whether it was lowered to its floor (see Lowered()).
  bool lowered() const { return lowered_; }
  // A floor is set and lies below the nominal ratio.
  bool CanLower() const { return min_ratio_ > 0.0f && min_ratio_ < nominal_; }
  // This activation at its floor (each layer's K at min_ratio, never above
  // its K now); itself when !CanLower().
  Activation Lowered(const MohConfig& moh) const;
  // Routed K per layer, each in [0, routed heads of the layer].
  const LayerTopK& top_k() const { return top_k_; }

 private:
  Activation(const MohConfig& moh, float requested, float min_ratio,
             bool lowered);

  float requested_ = 0.0f;
  double nominal_ = 1.0;
  float min_ratio_ = 0.0f;
  bool lowered_ = false;
  LayerTopK top_k_;
};

// The routed K of every layer for each ratio (<= 0: the trained default).
std::vector<LayerTopK> TopKForRatios(const MohConfig& moh,
                                     const std::vector<float>& ratios);

// Checks per-row K handed to a model: `rows` entries, one K per layer, each in
// [0, routed heads]. INVALID_ARGUMENT naming `field`.
absl::Status ValidateTopK(const MohConfig& moh,
                          const std::vector<LayerTopK>& top_k, size_t rows,
                          const char* field);

// Checks a ratio handed to a model or a tool: 0 (the default) or in (0, 1].
// INVALID_ARGUMENT naming `field`.
absl::Status ValidateRatio(float ratio, const char* field);

}  // namespace moh
