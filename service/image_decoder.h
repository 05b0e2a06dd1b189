// Decodes encoded images (PNG, JPEG, and the other formats stb_image reads)
// into model input.
#pragma once

#include <ATen/ATen.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moh {

// Decodes `bytes` into a float32 [channels, size, size] tensor with values in
// [0, 1], converting colour (channels 1: grey, 3: RGB; alpha is dropped) and
// resizing with antialiased bilinear interpolation. INVALID_ARGUMENT naming
// the field `image` for empty, corrupt or oversized (> 8192 pixels a side)
// input.
absl::StatusOr<at::Tensor> DecodeImage(absl::string_view bytes, int channels,
                                       int size);

}  // namespace moh
