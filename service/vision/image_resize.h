// Resizing 8-bit images as the released vision models were evaluated:
// torchvision's Resize(shorter side) + CenterCrop geometry and Pillow's
// Image.resize, bit for bit.
#pragma once

#include <cstdint>

namespace moh {

// Pillow's resampling filters (both antialiased: the kernel widens by the
// downscaling factor).
enum class ResizeFilter { kBilinear, kBicubic };

// A resize to resized_width x resized_height of which only the window
// [left, left + width) x [top, top + height) is kept.
struct ResizeWindow {
  int resized_width = 0;
  int resized_height = 0;
  int left = 0;
  int top = 0;
  int width = 0;
  int height = 0;
};

// torchvision 0.15's Resize(shorter_side) then CenterCrop(crop) of a
// width x height image: the shorter side becomes shorter_side, the longer
// int(shorter_side * long / short) (a double quotient, truncated); the crop's
// top is round((resized_height - crop) / 2) with halves to even, and its left
// likewise. Requires 1 <= crop <= shorter_side <= 8192 and sides in
// [1, 8192].
ResizeWindow ShorterSideCentreCrop(int width, int height, int shorter_side,
                                   int crop);

// Bytes PillowResize allocates (its coefficients and its intermediate image)
// for these arguments.
int64_t PillowResizeBytes(int width, int height, int bands,
                          const ResizeWindow& window, ResizeFilter filter);

// Writes to `out` the window.width x window.height pixels of the window of
// Pillow's Image.resize((resized_width, resized_height), filter) of the
// width x height image `in`; both hold `bands` interleaved 8-bit samples per
// pixel, rows without padding. Equal bit for bit to Pillow 9.x on x86-64
// (where its coefficients are computed without fused multiply-adds): only
// the window is computed, which changes no value.
void PillowResize(const uint8_t* in, int width, int height, int bands,
                  const ResizeWindow& window, ResizeFilter filter,
                  uint8_t* out);

}  // namespace moh
