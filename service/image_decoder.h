// Decodes encoded images (PNG with libpng, JPEG with libjpeg-turbo) into
// model input.
#pragma once

#include <ATen/ATen.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "service/image_decode_budget.h"

namespace moh {

// Decodes `bytes` into a float32 [channels, size, size] tensor with values in
// [0, 1], converting colour (channels 1: grey, 3: RGB; alpha is dropped) and
// resizing with antialiased bilinear interpolation.
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
//
// `budget`, when not null, bounds the memory of concurrent decodes: the bytes
// a decode holds (estimated from the header) are reserved before decoding and
// released on return; RESOURCE_EXHAUSTED naming `image` when they do not fit.
absl::StatusOr<at::Tensor> DecodeImage(absl::string_view bytes, int channels,
                                       int size,
                                       ImageDecodeBudget* budget = nullptr);

}  // namespace moh
