// Fuzzes the server's image decoder (service/vision/image_decoder.h,
// DecodeImage) on encoded PNG and JPEG bytes. The first input byte picks the
// channels (bit 0: 1 or 3), the model's image side (bits 1-6: 1 to 64) and the
// path (bit 7: Pillow's, bicubic with the shorter side 1 + side * 5 / 4 then
// the centre crop); the rest is the image. A decoded image must be float32
// [channels, side, side] with values in [0, 1].
#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "fuzz/fuzz_check.h"
#include "service/vision/image_decoder.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int channels = (data[0] & 1) ? 3 : 1;
  const int side = 1 + (data[0] >> 1) % 64;
  moh::ImageResize resize;
  resize.channels = channels;
  resize.size = side;
  if (data[0] & 0x80) {
    resize.shorter_side = 1 + side * 5 / 4;
    resize.bicubic = true;
  }
  absl::StatusOr<at::Tensor> image = moh::DecodeImage(
      absl::string_view(reinterpret_cast<const char*>(data + 1), size - 1),
      resize);
  if (!image.ok()) {
    moh::fuzz::CheckInvalidArgument(image.status());
    return 0;
  }
  MOH_FUZZ_CHECK(
      image->scalar_type() == at::kFloat &&
          image->sizes() == at::IntArrayRef({channels, side, side}),
      absl::StrCat("decoded image has shape ", c10::str(image->sizes())));
  const float lowest = image->min().item<float>();
  const float highest = image->max().item<float>();
  MOH_FUZZ_CHECK(lowest >= 0.0f && highest <= 1.0f,
                 absl::StrCat("pixel values span [", lowest, ", ", highest,
                              "], not inside [0, 1]"));
  return 0;
}
