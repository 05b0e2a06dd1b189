// Encodes model output images as PNG (libpng's simplified write API).
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "absl/status/statusor.h"

namespace moh {

// `pixels`: uint8 [C, H, W] on the CPU, C 1 (grey) or 3 (RGB). Returns the
// PNG file's bytes. INVALID_ARGUMENT for another shape or type, INTERNAL if
// libpng fails.
absl::StatusOr<std::string> EncodePng(const at::Tensor& pixels);

}  // namespace moh
