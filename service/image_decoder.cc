#include "service/image_decoder.h"

#include <csetjmp>
#include <cstddef>  // before jpeglib.h, which needs size_t and FILE
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>

#include "absl/base/attributes.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "jpeglib.h"
#include "png.h"

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
// to 8); colour conversions are ToFloat's, the same for both formats.
class PngReader {
 public:
  explicit PngReader(absl::string_view bytes) : bytes_(bytes) {
    std::memset(&image_, 0, sizeof(image_));
    image_.version = PNG_IMAGE_VERSION;
  }
  ~PngReader() { png_image_free(&image_); }
  PngReader(const PngReader&) = delete;
  PngReader& operator=(const PngReader&) = delete;

  absl::StatusOr<ImageHeader> ReadHeader(int /*channels*/) {
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

// JPEG through libjpeg-turbo, decoding straight to grey or RGB as asked.
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

  absl::StatusOr<ImageHeader> ReadHeader(int channels) {
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
    cinfo_.out_color_space = channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
    ImageHeader header{cinfo_.image_width, cinfo_.image_height, channels, 0};
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

// [1, channels, height, width] floats in [0, 1] from 8-bit `samples` laid out
// as `header` says. As stb_image, which decoded before: alpha is dropped, grey
// is (77 r + 150 g + 29 b) >> 8, and grey becomes RGB repeated.
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

template <typename Reader>
absl::StatusOr<at::Tensor> Decode(Reader& reader, int channels, int size,
                                  ImageDecodeBudget* budget) {
  MOH_ASSIGN_OR_RETURN(const ImageHeader header, reader.ReadHeader(channels));
  MOH_RETURN_IF_ERROR(CheckSize(header));
  // Held at once: the samples, their float copy, the decoder's own memory
  // and the resize's intermediate (the width resized first).
  const int64_t pixels = header.width * header.height;
  const int64_t sample_bytes = pixels * header.components;
  const int64_t bytes = sample_bytes + pixels * channels * kFloatBytes +
                        header.decoder_bytes +
                        header.height * size * channels * kFloatBytes;
  std::optional<ImageDecodeBudget::Reservation> reservation;
  if (budget != nullptr) {
    MOH_ASSIGN_OR_RETURN(reservation, budget->Reserve(bytes));
  }
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

}  // namespace

absl::StatusOr<at::Tensor> DecodeImage(absl::string_view bytes, int channels,
                                       int size, ImageDecodeBudget* budget) {
  if (bytes.empty()) return absl::InvalidArgumentError("image is empty");
  const bool png = absl::StartsWith(bytes, kPngSignature);
  // The API promises PNG and JPEG: recognized by their signatures.
  if (!png && !absl::StartsWith(bytes, kJpegSignature)) {
    return absl::InvalidArgumentError(
        "image must be an encoded PNG or JPEG (its first bytes are neither "
        "signature)");
  }
  if (channels != 1 && channels != 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "image: models with ", channels, " channels take pixels, not images"));
  }
  if (png) {
    PngReader reader(bytes);
    return Decode(reader, channels, size, budget);
  }
  JpegReader reader(bytes);
  return Decode(reader, channels, size, budget);
}

}  // namespace moh
