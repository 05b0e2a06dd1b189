// Adaptive activation (SPEC §2): under load, a request that allows it
// (0 < min_ratio < ratio, Activation::CanLower) runs at its floor instead of
// waiting longer. One rule for every RPC.
#pragma once

#include <cstdint>

namespace moh {

// Whether a request that `can_lower` runs at its floor when `waiting`
// requests wait at the moment of the decision; `queue_depth` 0 turns it off.
inline bool LowerActivation(int32_t queue_depth, int64_t waiting,
                            bool can_lower) {
  return queue_depth > 0 && can_lower && waiting > queue_depth;
}

}  // namespace moh
