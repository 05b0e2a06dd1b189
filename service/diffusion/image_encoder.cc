#include "service/diffusion/image_encoder.h"

#include <png.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace moh {

absl::StatusOr<std::string> EncodePng(const at::Tensor& pixels) {
  if (!pixels.defined() || pixels.dim() != 3 ||
      pixels.scalar_type() != at::kByte || !pixels.device().is_cpu() ||
      (pixels.size(0) != 1 && pixels.size(0) != 3) || pixels.size(1) < 1 ||
      pixels.size(2) < 1) {
    return absl::InvalidArgumentError(
        "EncodePng: pixels must be uint8 [1 or 3, H, W] on the CPU");
  }
  const int64_t channels = pixels.size(0);
  // Interleaved rows: [H, W, C].
  at::Tensor rows = pixels.permute({1, 2, 0}).contiguous();
  png_image image;
  std::memset(&image, 0, sizeof(image));
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(pixels.size(2));
  image.height = static_cast<png_uint_32>(pixels.size(1));
  image.format = channels == 1 ? PNG_FORMAT_GRAY : PNG_FORMAT_RGB;
  png_alloc_size_t size = 0;
  // First the size, then the bytes.
  if (!png_image_write_to_memory(&image, nullptr, &size, /*convert_to_8bit=*/0,
                                 rows.data_ptr<uint8_t>(), /*row_stride=*/0,
                                 nullptr)) {
    const std::string message = image.message;
    png_image_free(&image);
    return absl::InternalError(absl::StrCat("EncodePng: ", message));
  }
  std::string out(size, '\0');
  if (!png_image_write_to_memory(&image, out.data(), &size, 0,
                                 rows.data_ptr<uint8_t>(), 0, nullptr)) {
    const std::string message = image.message;
    png_image_free(&image);
    return absl::InternalError(absl::StrCat("EncodePng: ", message));
  }
  out.resize(size);
  png_image_free(&image);
  return out;
}

}  // namespace moh
