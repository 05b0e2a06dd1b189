// RoPE on float32 vectors in place, the loop every CPU path shares (the
// model's Rotate, the KV-cache write, the pair kernel's queries).
#pragma once

#include <cstdint>

namespace moh {

// x[0, d) at the position whose table rows are cos[0, d) and sin[0, d):
// x * cos + RotateHalf(x) * sin, with RotateHalf(x) = [-x[half, d), x[0,
// half)], in that order of operations (the ATen path's), each pair (j, j +
// half) read before it is written.
inline void RotateInPlace(float* x, const float* cos, const float* sin,
                          int64_t d) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float low = x[j], high = x[j + half];
    x[j] = low * cos[j] + -high * sin[j];
    x[j + half] = high * cos[j + half] + low * sin[j + half];
  }
}

}  // namespace moh
