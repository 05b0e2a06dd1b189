#include "service/image_decoder.h"

#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "stb/stb_image.h"

namespace moh {

namespace {

// The API promises PNG and JPEG: recognized by their signatures, so that no
// other format the decoder happens to know (GIF, BMP, PSD, ...) gets in.
bool IsPngOrJpeg(absl::string_view bytes) {
  return absl::StartsWith(bytes, absl::string_view("\x89PNG\r\n\x1a\n", 8)) ||
         absl::StartsWith(bytes, absl::string_view("\xff\xd8\xff", 3));
}

}  // namespace

absl::StatusOr<at::Tensor> DecodeImage(absl::string_view bytes, int channels,
                                       int size) {
  constexpr int kMaxSide = 8192;
  // Decoded pixels at most (4096 x 4096): bounds a request's decode memory.
  constexpr int64_t kMaxPixels = int64_t{1} << 24;
  if (bytes.empty()) return absl::InvalidArgumentError("image is empty");
  if (!IsPngOrJpeg(bytes)) {
    return absl::InvalidArgumentError(
        "image must be an encoded PNG or JPEG (its first bytes are neither "
        "signature)");
  }
  if (channels != 1 && channels != 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "image: models with ", channels, " channels take pixels, not images"));
  }
  const auto* data = reinterpret_cast<const stbi_uc*>(bytes.data());
  const int length = static_cast<int>(bytes.size());
  int width = 0, height = 0, components = 0;
  if (bytes.size() > (1u << 30) ||
      !stbi_info_from_memory(data, length, &width, &height, &components)) {
    return absl::InvalidArgumentError(
        "image must be an encoded PNG or JPEG (could not read its header)");
  }
  if (width < 1 || height < 1 || width > kMaxSide || height > kMaxSide) {
    return absl::InvalidArgumentError(
        absl::StrCat("image sides must be in [1, ", kMaxSide, "] pixels, got ",
                     width, "x", height));
  }
  if (int64_t{width} * height > kMaxPixels) {
    return absl::InvalidArgumentError(absl::StrCat("image must have at most ",
                                                   kMaxPixels, " pixels, got ",
                                                   width, "x", height));
  }
  std::unique_ptr<stbi_uc, void (*)(void*)> pixels(
      stbi_load_from_memory(data, length, &width, &height, &components,
                            channels),
      stbi_image_free);
  if (pixels == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("image could not be decoded: ", stbi_failure_reason()));
  }
  at::Tensor image =
      at::from_blob(pixels.get(), {height, width, channels}, at::kByte)
          .permute({2, 0, 1})
          .to(at::kFloat)
          .div_(255.0)
          .unsqueeze(0);  // [1, C, H, W], owns its memory
  if (height != size || width != size) {
    image = at::_upsample_bilinear2d_aa(image, {size, size},
                                        /*align_corners=*/false);
  }
  return image.squeeze(0).clamp_(0.0, 1.0).contiguous();
}

}  // namespace moh
