#include "service/vision/image_decoder.h"

#include <csetjmp>
#include <cstddef>  // before jpeglib.h, which needs size_t and FILE
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>

#include "absl/base/attributes.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "jpeglib.h"
#include "png.h"
#include "service/vision/image_resize.h"

namespace moh {
namespace {

constexpr int64_t kMaxSide = 8192;
// Decoded pixels at most (4096 x 4096): bounds a request's decode memory.
constexpr int64_t kMaxPixels = int64_t{1} << 24;
// Scans of a progressive JPEG at most: each one re-reads the whole image, so
// a file of many tiny scans costs time out of proportion to its size.
constexpr int kMaxJpegScans = 500;

constexpr int64_t kFloatBytes = sizeof(float);

constexpr absl::string_view kPngSignature("\x89PNG\r\n\x1a\n", 8);
constexpr absl::string_view kJpegSignature("\xff\xd8\xff", 3);

// What a header tells before any pixel is decoded.
struct ImageHeader {
  int64_t width = 0;
  int64_t height = 0;
  // 8-bit samples per pixel the reader writes: 1 grey, 2 grey+alpha, 3 RGB,
  // 4 RGBA.
  int components = 0;
  // Memory the decoder itself holds while decoding, in bytes.
  int64_t decoder_bytes = 0;
};

// PNG through libpng's simplified API, which catches libpng's errors itself.
// The samples keep the file's colour type (palette expanded, 16 bits scaled
// to 8); colour conversions come after, the same for both formats.
class PngReader {
 public:
  explicit PngReader(absl::string_view bytes) : bytes_(bytes) {
    std::memset(&image_, 0, sizeof(image_));
    image_.version = PNG_IMAGE_VERSION;
  }
  ~PngReader() { png_image_free(&image_); }
  PngReader(const PngReader&) = delete;
  PngReader& operator=(const PngReader&) = delete;

  absl::StatusOr<ImageHeader> ReadHeader(int /*channels*/, bool /*pillow*/) {
    if (!png_image_begin_read_from_memory(&image_, bytes_.data(),
                                          bytes_.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("image must be an encoded PNG or JPEG (could not read "
                       "its PNG header: ",
                       image_.message, ")"));
    }
    // Without a gAMA or sRGB chunk libpng takes 16-bit samples as linear and
    // would re-encode them; they are sRGB like the 8-bit ones.
    image_.flags |= PNG_IMAGE_FLAG_16BIT_sRGB;
    image_.format &= PNG_FORMAT_FLAG_COLOR | PNG_FORMAT_FLAG_ALPHA;
    return ImageHeader{
        image_.width, image_.height,
        static_cast<int>(PNG_IMAGE_PIXEL_CHANNELS(image_.format)), 0};
  }

  absl::Status ReadSamples(uint8_t* samples) {
    if (!png_image_finish_read(&image_, /*background=*/nullptr, samples,
                               /*row_stride=*/0, /*colormap=*/nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "image could not be decoded as a PNG: ", image_.message));
    }
    return absl::OkStatus();
  }

 private:
  const absl::string_view bytes_;
  png_image image_;
};

// libjpeg reports errors through error_exit, which must not return: it jumps
// back to the setjmp of the JpegReader call that called libjpeg.
struct JpegErrorManager {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

void JpegErrorExit(j_common_ptr cinfo) {
  auto* error = reinterpret_cast<JpegErrorManager*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, error->message);
  std::longjmp(error->jump, 1);
}

// Warnings (msg_level -1) are corrupt data (a truncated file, a bad Huffman
// code): errors here. Trace messages are dropped; nothing goes to stderr.
void JpegEmitMessage(j_common_ptr cinfo, int msg_level) {
  if (msg_level < 0) JpegErrorExit(cinfo);
}

void JpegProgress(j_common_ptr cinfo) {
  auto* dinfo = reinterpret_cast<j_decompress_ptr>(cinfo);
  if (dinfo->input_scan_number > kMaxJpegScans) {
    auto* error = reinterpret_cast<JpegErrorManager*>(cinfo->err);
    std::snprintf(error->message, sizeof(error->message), "more than %d scans",
                  kMaxJpegScans);
    std::longjmp(error->jump, 1);
  }
}

// JPEG through libjpeg-turbo, decoding to grey or RGB: as the model's
// channels ask (libjpeg's luma for grey), or as Pillow does, grey files to
// grey and colour ones to RGB.
// The functions that call libjpeg (Start, Decompress; never inlined into a
// caller) hold no object with a destructor, so the longjmp of an error skips
// none.
class JpegReader {
 public:
  explicit JpegReader(absl::string_view bytes) : bytes_(bytes) {
    std::memset(&cinfo_, 0, sizeof(cinfo_));
    std::memset(&error_, 0, sizeof(error_));
    cinfo_.err = jpeg_std_error(&error_.pub);
    error_.pub.error_exit = JpegErrorExit;
    error_.pub.emit_message = JpegEmitMessage;
    progress_.progress_monitor = JpegProgress;
  }
  ~JpegReader() { jpeg_destroy_decompress(&cinfo_); }
  JpegReader(const JpegReader&) = delete;
  JpegReader& operator=(const JpegReader&) = delete;

  absl::StatusOr<ImageHeader> ReadHeader(int channels, bool pillow) {
    if (!Start()) {
      return absl::InvalidArgumentError(
          absl::StrCat("image must be an encoded PNG or JPEG (could not read "
                       "its JPEG header: ",
                       error_.message, ")"));
    }
    if (cinfo_.jpeg_color_space == JCS_CMYK ||
        cinfo_.jpeg_color_space == JCS_YCCK) {
      return absl::InvalidArgumentError(
          "image: CMYK JPEGs are not supported (send greyscale or RGB)");
    }
    const bool grey =
        pillow ? cinfo_.jpeg_color_space == JCS_GRAYSCALE : channels == 1;
    cinfo_.out_color_space = grey ? JCS_GRAYSCALE : JCS_RGB;
    ImageHeader header{cinfo_.image_width, cinfo_.image_height, grey ? 1 : 3,
                       0};
    // Progressive and other multi-scan files keep every DCT coefficient
    // until the last scan.
    if (jpeg_has_multiple_scans(&cinfo_)) {
      for (int i = 0; i < cinfo_.num_components; ++i) {
        const jpeg_component_info& c = cinfo_.comp_info[i];
        header.decoder_bytes += int64_t{c.width_in_blocks} *
                                (c.height_in_blocks + c.v_samp_factor) *
                                DCTSIZE2 * sizeof(JCOEF);
      }
    }
    return header;
  }

  absl::Status ReadSamples(uint8_t* samples) {
    if (!Decompress(samples)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "image could not be decoded as a JPEG: ", error_.message));
    }
    return absl::OkStatus();
  }

 private:
  ABSL_ATTRIBUTE_NOINLINE bool Start() {
    if (setjmp(error_.jump)) return false;
    jpeg_create_decompress(&cinfo_);
    cinfo_.progress = &progress_;
    jpeg_mem_src(&cinfo_, reinterpret_cast<const unsigned char*>(bytes_.data()),
                 bytes_.size());
    jpeg_read_header(&cinfo_, /*require_image=*/TRUE);
    return true;
  }

  ABSL_ATTRIBUTE_NOINLINE bool Decompress(uint8_t* samples) {
    if (setjmp(error_.jump)) return false;
    jpeg_start_decompress(&cinfo_);
    if (cinfo_.output_width != cinfo_.image_width ||
        cinfo_.output_height != cinfo_.image_height) {
      std::snprintf(error_.message, sizeof(error_.message),
                    "unexpected output size");
      return false;
    }
    const size_t stride =
        size_t{cinfo_.output_width} * cinfo_.output_components;
    while (cinfo_.output_scanline < cinfo_.output_height) {
      JSAMPROW row = samples + cinfo_.output_scanline * stride;
      jpeg_read_scanlines(&cinfo_, &row, 1);
    }
    jpeg_finish_decompress(&cinfo_);
    return true;
  }

  const absl::string_view bytes_;
  jpeg_decompress_struct cinfo_;
  JpegErrorManager error_;
  jpeg_progress_mgr progress_{};
};

absl::Status CheckSize(const ImageHeader& header) {
  if (header.width < 1 || header.height < 1 || header.width > kMaxSide ||
      header.height > kMaxSide) {
    return absl::InvalidArgumentError(
        absl::StrCat("image sides must be in [1, ", kMaxSide, "] pixels, got ",
                     header.width, "x", header.height));
  }
  if (header.width * header.height > kMaxPixels) {
    return absl::InvalidArgumentError(
        absl::StrCat("image must have at most ", kMaxPixels, " pixels, got ",
                     header.width, "x", header.height));
  }
  return absl::OkStatus();
}

// [1, channels, height, width] floats in [0, 1] (value / 255) from 8-bit
// `samples` laid out as `header` says. As stb_image, which decoded before:
// alpha is dropped, grey is (77 r + 150 g + 29 b) >> 8, and grey becomes RGB
// repeated.
at::Tensor ToFloat(const uint8_t* samples, const ImageHeader& header,
                   int channels) {
  float scale[256];
  for (int v = 0; v < 256; ++v) scale[v] = static_cast<float>(v) / 255.0f;
  at::Tensor image =
      at::empty({1, channels, header.height, header.width}, at::kFloat);
  float* out = image.data_ptr<float>();
  const int64_t plane = header.width * header.height;
  const int components = header.components;
  const bool colour = components >= 3;
  for (int64_t i = 0; i < plane; ++i) {
    const uint8_t* p = samples + i * components;
    if (channels == 1) {
      out[i] = scale[colour ? (77 * p[0] + 150 * p[1] + 29 * p[2]) >> 8 : p[0]];
    } else {
      for (int c = 0; c < 3; ++c) out[c * plane + i] = scale[p[colour ? c : 0]];
    }
  }
  return image;
}

// Pillow's convert("L") or convert("RGB") of 8-bit pixels of `components`
// samples, in place, into `bands` (1 or 3, at most `components`) samples per
// pixel: alpha dropped, grey from colour as Pillow's ITU-R 601-2 luma.
// (Pillow's grey to RGB repeats the sample: ToFloat does it after resizing.)
void ConvertLikePillow(uint8_t* samples, int64_t pixels, int components,
                       int bands) {
  if (components == bands) return;
  const bool colour = components >= 3;
  for (int64_t i = 0; i < pixels; ++i) {
    const uint8_t* p = samples + i * components;
    uint8_t* out = samples + i * bands;  // never past p: bands <= components
    if (bands == 1) {
      *out = colour ? (19595 * p[0] + 38470 * p[1] + 7471 * p[2] + 0x8000) >> 16
                    : p[0];
    } else {
      const uint8_t r = p[0], g = p[1], b = p[2];
      out[0] = r;
      out[1] = g;
      out[2] = b;
    }
  }
}

absl::StatusOr<std::optional<ImageDecodeBudget::Reservation>> Reserve(
    ImageDecodeBudget* budget, int64_t bytes) {
  if (budget == nullptr) return std::nullopt;
  MOH_ASSIGN_OR_RETURN(ImageDecodeBudget::Reservation reservation,
                       budget->Reserve(bytes));
  return std::optional<ImageDecodeBudget::Reservation>(std::move(reservation));
}

// Resized straight to size x size in floats (antialiased bilinear).
template <typename Reader>
absl::StatusOr<at::Tensor> DecodeToFloatAndResize(Reader& reader,
                                                  const ImageHeader& header,
                                                  int channels, int size,
                                                  ImageDecodeBudget* budget) {
  // Held at once: the samples, their float copy, the decoder's own memory
  // and the resize's intermediate (the width resized first).
  const int64_t pixels = header.width * header.height;
  const int64_t sample_bytes = pixels * header.components;
  const int64_t bytes = sample_bytes + pixels * channels * kFloatBytes +
                        header.decoder_bytes +
                        header.height * size * channels * kFloatBytes;
  MOH_ASSIGN_OR_RETURN(const auto reservation, Reserve(budget, bytes));
  at::Tensor image;
  {
    std::unique_ptr<uint8_t[]> samples(new uint8_t[sample_bytes]);
    MOH_RETURN_IF_ERROR(reader.ReadSamples(samples.get()));
    image = ToFloat(samples.get(), header, channels);
  }
  if (header.height != size || header.width != size) {
    image = at::_upsample_bilinear2d_aa(image, {size, size},
                                        /*align_corners=*/false);
  }
  return image.squeeze(0).clamp_(0.0, 1.0).contiguous();
}

// As torchvision on a PIL image: Pillow's conversion and 8-bit resampling,
// torchvision's crop, then floats.
template <typename Reader>
absl::StatusOr<at::Tensor> DecodeLikePillow(Reader& reader,
                                            const ImageHeader& header,
                                            const ImageResize& resize,
                                            ImageDecodeBudget* budget) {
  const int width = static_cast<int>(header.width);
  const int height = static_cast<int>(header.height);
  const int size = resize.size;
  const ResizeWindow window =
      resize.shorter_side == 0
          ? ResizeWindow{size, size, 0, 0, size, size}
          : ShorterSideCentreCrop(width, height, resize.shorter_side, size);
  const ResizeFilter filter =
      resize.bicubic ? ResizeFilter::kBicubic : ResizeFilter::kBilinear;
  // Grey is resized as grey, and repeated into RGB after.
  const int bands = resize.channels == 1 || header.components <= 2 ? 1 : 3;
  // Held at once, at most: the samples, the decoder's own memory, the
  // resize's, its output and the floats.
  const int64_t sample_bytes = header.width * header.height * header.components;
  const int64_t out_pixels = int64_t{size} * size;
  const int64_t bytes =
      sample_bytes + header.decoder_bytes +
      PillowResizeBytes(width, height, bands, window, filter) +
      out_pixels * bands + out_pixels * resize.channels * kFloatBytes;
  MOH_ASSIGN_OR_RETURN(const auto reservation, Reserve(budget, bytes));
  std::unique_ptr<uint8_t[]> resized(new uint8_t[out_pixels * bands]);
  {
    std::unique_ptr<uint8_t[]> samples(new uint8_t[sample_bytes]);
    MOH_RETURN_IF_ERROR(reader.ReadSamples(samples.get()));
    ConvertLikePillow(samples.get(), header.width * header.height,
                      header.components, bands);
    PillowResize(samples.get(), width, height, bands, window, filter,
                 resized.get());
  }
  return ToFloat(resized.get(), ImageHeader{size, size, bands, 0},
                 resize.channels)
      .squeeze(0);
}

template <typename Reader>
absl::StatusOr<at::Tensor> Decode(Reader& reader, const ImageResize& resize,
                                  ImageDecodeBudget* budget) {
  const bool pillow = resize.shorter_side != 0 || resize.bicubic;
  MOH_ASSIGN_OR_RETURN(const ImageHeader header,
                       reader.ReadHeader(resize.channels, pillow));
  MOH_RETURN_IF_ERROR(CheckSize(header));
  if (pillow) return DecodeLikePillow(reader, header, resize, budget);
  return DecodeToFloatAndResize(reader, header, resize.channels, resize.size,
                                budget);
}

}  // namespace

absl::StatusOr<at::Tensor> DecodeImage(absl::string_view bytes,
                                       const ImageResize& resize,
                                       ImageDecodeBudget* budget) {
  if (resize.size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("ImageResize.size must be positive, got ", resize.size));
  }
  if (resize.shorter_side != 0 &&
      (resize.shorter_side < resize.size || resize.shorter_side > kMaxSide)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ImageResize.shorter_side must be 0 (no crop) or in [size, ", kMaxSide,
        "] = [", resize.size, ", ", kMaxSide, "], got ", resize.shorter_side));
  }
  if (bytes.empty()) return absl::InvalidArgumentError("image is empty");
  const bool png = absl::StartsWith(bytes, kPngSignature);
  // The API promises PNG and JPEG: recognized by their signatures.
  if (!png && !absl::StartsWith(bytes, kJpegSignature)) {
    return absl::InvalidArgumentError(
        "image must be an encoded PNG or JPEG (its first bytes are neither "
        "signature)");
  }
  if (resize.channels != 1 && resize.channels != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("image: models with ", resize.channels,
                     " channels take pixels, not images"));
  }
  if (png) {
    PngReader reader(bytes);
    return Decode(reader, resize, budget);
  }
  JpegReader reader(bytes);
  return Decode(reader, resize, budget);
}

absl::StatusOr<at::Tensor> DecodeImage(absl::string_view bytes, int channels,
                                       int size, ImageDecodeBudget* budget) {
  ImageResize resize;
  resize.channels = channels;
  resize.size = size;
  return DecodeImage(bytes, resize, budget);
}

}  // namespace moh
