// Decodes encoded images (PNG with libpng, JPEG with libjpeg-turbo) into
// model input.
#pragma once

#include <ATen/ATen.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "service/engine/image_decode_budget.h"

namespace moh {

// How a decoded image becomes model input.
struct ImageResize {
  int channels = 3;  // 1: grey, 3: RGB
  int size = 0;      // output: [channels, size, size]; >= 1
  // 0: resized straight to size x size. Otherwise (in [size, 8192]) the
  // shorter side is resized to `shorter_side`, the longer in proportion, and
  // the centre size x size square is cut: torchvision's Resize(shorter_side)
  // then CenterCrop(size).
  int shorter_side = 0;
  // Pillow's BICUBIC resampling on 8-bit samples; when false, bilinear (see
  // DecodeImage).
  bool bicubic = false;
};

// Decodes `bytes` into a float32 [channels, size, size] tensor with values in
// [0, 1] (8-bit value / 255).
//
// With shorter_side == 0 and bicubic false (the overload below), as
// stb_image decoded before: alpha is dropped, grey is (77 r + 150 g + 29 b)
// >> 8 (JPEG: libjpeg's luma), grey becomes RGB repeated, and the image is
// resized in floats with antialiased bilinear interpolation.
//
// Otherwise as torchvision on PIL images, Image.open(f).convert("RGB" or "L"),
// Resize, CenterCrop when shorter_side is set, ToTensor: bit for bit for
// 8-bit PNGs and JPEGs (whose decode is libjpeg-turbo's, as Pillow's). The
// conversion is Pillow's: alpha and a palette's transparency dropped, grey is
// (19595 r + 38470 g + 7471 b + 32768) >> 16 of the decoded RGB (JPEG too);
// then Pillow's 8-bit resampling: BICUBIC when `bicubic`, else BILINEAR
// (torchvision's default). Not like Pillow: 16-bit PNG samples are scaled to
// 8 bits (Pillow keeps the high byte of 16-bit colour and clips 16-bit grey
// to [0, 255]), and libpng applies a gAMA chunk other than sRGB's (~1/2.2)
// where Pillow ignores it.
//
// Accepted: PNG and JPEG, recognized by their signatures. PNG: any bit depth
// and colour type (palette, grey, grey+alpha, RGB, RGBA; 16-bit samples are
// scaled to 8 bits), interlaced or not. JPEG: baseline or progressive, grey
// or colour (YCbCr or RGB), 8-bit samples.
//
// INVALID_ARGUMENT naming the field `image` for empty, corrupt (a truncated
// file, a bad checksum, a libjpeg warning), unsupported (another format, CMYK
// or 12-bit JPEG) or oversized (> 8192 pixels a side or > 16 M pixels) input;
// the size is checked from the header, before any pixel is allocated.
// INVALID_ARGUMENT naming `ImageResize.shorter_side` when it is neither 0 nor
// in [size, 8192] (`ImageResize.size` when it is < 1).
//
// `budget`, when not null, bounds the memory of concurrent decodes: the bytes
// a decode holds (estimated from the header) are reserved before decoding and
// released on return; RESOURCE_EXHAUSTED naming `image` when they do not fit.
absl::StatusOr<at::Tensor> DecodeImage(absl::string_view bytes,
                                       const ImageResize& resize,
                                       ImageDecodeBudget* budget = nullptr);

// DecodeImage(bytes, {channels, size}, budget): straight bilinear resize.
absl::StatusOr<at::Tensor> DecodeImage(absl::string_view bytes, int channels,
                                       int size,
                                       ImageDecodeBudget* budget = nullptr);

}  // namespace moh
