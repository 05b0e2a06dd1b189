#include "service/vision/image_decoder.h"

#include <zlib.h>

#include <algorithm>
#include <cstdio>  // before jpeglib.h, which needs FILE and size_t
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "jpeglib.h"
#include "service/diffusion/image_encoder.h"
#include "service/engine/image_decode_budget.h"
#include "service/vision/image_resize.h"
#include "tests/base/test_paths.h"

namespace moh {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

void Put32(std::string& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(char(v >> shift));
}

void Chunk(std::string& png, const char* type, const std::string& data) {
  Put32(png, data.size());
  std::string body = std::string(type, 4) + data;
  png += body;
  Put32(png,
        crc32(0, reinterpret_cast<const Bytef*>(body.data()), body.size()));
}

enum PngColour { kGrey = 0, kRgb = 2, kPalette = 3, kGreyAlpha = 4, kRgba = 6 };

struct PngSpec {
  uint32_t width = 0;
  uint32_t height = 0;
  PngColour colour = kRgb;
  int bit_depth = 8;
  bool interlaced = false;
  // Filtered scanlines (a filter byte, 0, before each row; Adam7's passes one
  // after the other when interlaced), compressed into IDAT.
  std::string rows;
  std::string plte, trns;  // chunks written when not empty
};

std::string Png(const PngSpec& spec) {
  uLongf size = compressBound(spec.rows.size());
  std::string z(size, '\0');
  compress(reinterpret_cast<Bytef*>(z.data()), &size,
           reinterpret_cast<const Bytef*>(spec.rows.data()), spec.rows.size());
  z.resize(size);
  std::string png = "\x89PNG\r\n\x1a\n";
  std::string header;
  Put32(header, spec.width);
  Put32(header, spec.height);
  header +=
      {char(spec.bit_depth), char(spec.colour), 0, 0, char(spec.interlaced)};
  Chunk(png, "IHDR", header);
  if (!spec.plte.empty()) Chunk(png, "PLTE", spec.plte);
  if (!spec.trns.empty()) Chunk(png, "tRNS", spec.trns);
  Chunk(png, "IDAT", z);
  Chunk(png, "IEND", "");
  return png;
}

// An 8-bit RGB PNG whose pixel (x, y) is (r(x, y), g(x, y), b(x, y)).
std::string Png(int width, int height, int (*r)(int, int), int (*g)(int, int),
                int (*b)(int, int)) {
  PngSpec spec{uint32_t(width), uint32_t(height)};
  for (int y = 0; y < height; ++y) {
    spec.rows.push_back(0);  // filter: none
    for (int x = 0; x < width; ++x) {
      spec.rows += {char(r(x, y)), char(g(x, y)), char(b(x, y))};
    }
  }
  return Png(spec);
}

std::string BlackPng(int width, int height) {
  return Png(
      width, height, [](int, int) { return 0; }, [](int, int) { return 0; },
      [](int, int) { return 0; });
}

// A JPEG of `components` samples per pixel (1 grey, 3 RGB, 4 CMYK) whose
// sample c of pixel (x, y) is value(x, y, c); quality 100; progressive with
// libjpeg's scans, or with `scans` when given. The test dies if libjpeg fails
// (its default error handler exits).
std::string Jpeg(int width, int height, int components,
                 int (*value)(int, int, int), bool progressive = false,
                 const std::vector<jpeg_scan_info>& scans = {}) {
  jpeg_compress_struct cinfo;
  jpeg_error_mgr error;
  cinfo.err = jpeg_std_error(&error);
  jpeg_create_compress(&cinfo);
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&cinfo, &buffer, &size);
  cinfo.image_width = width;
  cinfo.image_height = height;
  cinfo.input_components = components;
  cinfo.in_color_space = components == 1   ? JCS_GRAYSCALE
                         : components == 3 ? JCS_RGB
                                           : JCS_CMYK;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, 100, TRUE);
  if (progressive) jpeg_simple_progression(&cinfo);
  if (!scans.empty()) {
    cinfo.scan_info = scans.data();
    cinfo.num_scans = scans.size();
  }
  jpeg_start_compress(&cinfo, TRUE);
  std::vector<JSAMPLE> row(width * components);
  while (cinfo.next_scanline < cinfo.image_height) {
    for (int x = 0; x < width; ++x) {
      for (int c = 0; c < components; ++c) {
        row[x * components + c] = value(x, cinfo.next_scanline, c);
      }
    }
    JSAMPROW rows[] = {row.data()};
    jpeg_write_scanlines(&cinfo, rows, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  std::string jpeg(reinterpret_cast<char*>(buffer), size);
  std::free(buffer);
  return jpeg;
}

// Flat colours in 8x8 blocks: left half (200, 40, 90), right half (30, 160,
// 220), which survive JPEG's colour subsampling within a few levels.
int Halves(int x, int, int c) {
  static constexpr int kLeft[] = {200, 40, 90}, kRight[] = {30, 160, 220};
  return x < 8 ? kLeft[c] : kRight[c];
}

void ExpectInvalidImage(absl::string_view bytes, const std::string& what) {
  auto image = DecodeImage(bytes, 3, 4);
  ASSERT_FALSE(image.ok()) << what;
  EXPECT_EQ(image.status().code(), absl::StatusCode::kInvalidArgument) << what;
  EXPECT_THAT(std::string(image.status().message()), HasSubstr("image"))
      << what;
}

TEST(ImageDecoderTest, DecodesPngAtModelSize) {
  const std::string png = Png(
      4, 4, [](int x, int) { return x * 64; },
      [](int, int y) { return y * 64; }, [](int, int) { return 255; });
  auto image = DecodeImage(png, 3, 4);
  ASSERT_TRUE(image.ok()) << image.status();
  ASSERT_EQ(image->sizes(), (std::vector<int64_t>{3, 4, 4}));
  EXPECT_FLOAT_EQ((*image)[0][1][2].item<float>(), 128 / 255.0f);  // r = x*64
  EXPECT_FLOAT_EQ((*image)[1][3][0].item<float>(), 192 / 255.0f);  // g = y*64
  EXPECT_FLOAT_EQ((*image)[2][0][0].item<float>(), 1.0f);
}

TEST(ImageDecoderTest, ResizesAndConvertsToGrey) {
  const std::string png = Png(
      32, 32, [](int, int) { return 200; }, [](int, int) { return 200; },
      [](int, int) { return 200; });
  auto image = DecodeImage(png, 1, 8);
  ASSERT_TRUE(image.ok()) << image.status();
  ASSERT_EQ(image->sizes(), (std::vector<int64_t>{1, 8, 8}));
  EXPECT_NEAR(image->mean().item<float>(), 200 / 255.0f, 1e-3);
}

// A 1x1 PNG whose one pixel has the samples `pixel`.
PngSpec OnePixel(PngColour colour, int bit_depth, const std::string& pixel) {
  return {1, 1, colour, bit_depth, false, std::string(1, '\0') + pixel};
}

// One 1x1 PNG of each colour type; as stb_image decoded them before: alpha
// dropped (whatever its value), 16-bit samples to their high byte, grey as
// (77 r + 150 g + 29 b) >> 8.
TEST(ImageDecoderTest, DecodesEveryPngColourTypeDroppingAlpha) {
  constexpr int kGreyOfRgb = (77 * 200 + 150 * 40 + 29 * 90) >> 8;
  const std::string rgb = "\xc8\x28\x5a";  // (200, 40, 90)
  const std::string grey = "\x4d";         // 77
  PngSpec palette = OnePixel(kPalette, 8, "\x01");
  palette.plte = std::string(3, '\0') + rgb;  // entry 1 is rgb
  palette.trns = std::string("\xff\x00", 2);  // and transparent
  struct Case {
    const char* name;
    PngSpec spec;
    int r, g, b, grey;
  };
  const Case cases[] = {
      {"grey", OnePixel(kGrey, 8, grey), 77, 77, 77, 77},
      {"grey 1-bit", OnePixel(kGrey, 1, "\x80"), 255, 255, 255, 255},
      {"grey+alpha", OnePixel(kGreyAlpha, 8, grey + '\0'), 77, 77, 77, 77},
      {"rgb", OnePixel(kRgb, 8, rgb), 200, 40, 90, kGreyOfRgb},
      {"rgba", OnePixel(kRgba, 8, rgb + '\x0a'), 200, 40, 90, kGreyOfRgb},
      {"rgb 16-bit", OnePixel(kRgb, 16, "\xc8\xff\x28\x10\x5a\x7f"), 200, 40,
       90, kGreyOfRgb},
      {"grey+alpha 16-bit",
       OnePixel(kGreyAlpha, 16, std::string("\x4d\x20\x00\x01", 4)), 77, 77, 77,
       77},
      {"palette with transparency", palette, 200, 40, 90, kGreyOfRgb},
  };
  for (const Case& c : cases) {
    const std::string png = Png(c.spec);
    auto image = DecodeImage(png, 3, 1);
    ASSERT_TRUE(image.ok()) << c.name << ": " << image.status();
    const float tolerance = 0.5f / 255;  // 16 bits: the high byte or rounded
    EXPECT_NEAR((*image)[0][0][0].item<float>(), c.r / 255.0f, tolerance)
        << c.name;
    EXPECT_NEAR((*image)[1][0][0].item<float>(), c.g / 255.0f, tolerance)
        << c.name;
    EXPECT_NEAR((*image)[2][0][0].item<float>(), c.b / 255.0f, tolerance)
        << c.name;
    auto grey = DecodeImage(png, 1, 1);
    ASSERT_TRUE(grey.ok()) << c.name << ": " << grey.status();
    EXPECT_NEAR((*grey)[0][0][0].item<float>(), c.grey / 255.0f, tolerance)
        << c.name;
  }
}

TEST(ImageDecoderTest, DecodesInterlacedPng) {
  // 2x2 grey, Adam7: pass 1 holds (0, 0), pass 6 (1, 0), pass 7 row 1.
  PngSpec spec{2, 2, kGrey, 8, /*interlaced=*/true};
  spec.rows = {0, 10, 0, 20, 0, 30, 40};
  auto image = DecodeImage(Png(spec), 1, 2);
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_TRUE(at::allclose(
      *image, at::tensor({10.0f, 20.0f, 30.0f, 40.0f}).view({1, 2, 2}) / 255));
}

TEST(ImageDecoderTest, DecodesJpegBaselineAndProgressive) {
  for (bool progressive : {false, true}) {
    SCOPED_TRACE(progressive ? "progressive" : "baseline");
    const std::string jpeg = Jpeg(16, 8, 3, Halves, progressive);
    auto image = DecodeImage(jpeg, 3, 16);
    ASSERT_TRUE(image.ok()) << image.status();
    ASSERT_EQ(image->sizes(), (std::vector<int64_t>{3, 16, 16}));
    for (int c = 0; c < 3; ++c) {
      EXPECT_NEAR((*image)[c][4][2].item<float>(), Halves(0, 0, c) / 255.0f,
                  3 / 255.0f);
      EXPECT_NEAR((*image)[c][4][13].item<float>(), Halves(15, 0, c) / 255.0f,
                  3 / 255.0f);
    }
    // Grey from a colour JPEG is its luma, Y = 0.299 R + 0.587 G + 0.114 B.
    auto grey = DecodeImage(jpeg, 1, 16);
    ASSERT_TRUE(grey.ok()) << grey.status();
    EXPECT_NEAR((*grey)[0][4][2].item<float>(),
                (0.299 * 200 + 0.587 * 40 + 0.114 * 90) / 255, 3 / 255.0f);
  }
  const std::string grey_jpeg =
      Jpeg(8, 8, 1, [](int, int, int) { return 128; });
  auto rgb = DecodeImage(grey_jpeg, 3, 8);
  ASSERT_TRUE(rgb.ok()) << rgb.status();
  EXPECT_TRUE(at::allclose(*rgb, at::full({3, 8, 8}, 128 / 255.0f)));
}

// Every scan re-reads the image: a file of many tiny scans would cost time
// out of proportion to its size.
TEST(ImageDecoderTest, RefusesJpegWithMoreThan500Scans) {
  // A valid grey script of 694 scans: DC, then each AC coefficient alone,
  // first to 10 bits of approximation then refined one bit at a time.
  std::vector<jpeg_scan_info> scans;
  auto add = [&scans](int spectral, int high, int low) {
    jpeg_scan_info scan{};
    scan.comps_in_scan = 1;
    scan.Ss = scan.Se = spectral;
    scan.Ah = high;
    scan.Al = low;
    scans.push_back(scan);
  };
  add(0, 0, 0);
  for (int k = 1; k < DCTSIZE2; ++k) {
    add(k, 0, 10);
    for (int bit = 10; bit > 0; --bit) add(k, bit, bit - 1);
  }
  ASSERT_EQ(scans.size(), 694u);
  const std::string jpeg = Jpeg(
      8, 8, 1, [](int x, int y, int) { return x * 30 + y; },
      /*progressive=*/false, scans);
  auto image = DecodeImage(jpeg, 1, 8);
  ASSERT_FALSE(image.ok());
  EXPECT_EQ(image.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(image.status().message()),
              HasSubstr("more than 500 scans"));
}

TEST(ImageDecoderTest, RefusesCmykJpeg) {
  auto image =
      DecodeImage(Jpeg(8, 8, 4, [](int, int, int) { return 50; }), 3, 8);
  ASSERT_FALSE(image.ok());
  EXPECT_EQ(image.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(image.status().message()),
              HasSubstr("image: CMYK JPEGs are not supported"));
}

TEST(ImageDecoderTest, RejectsBadInputNamingTheField) {
  for (const std::string& bytes :
       {std::string(), std::string("not an image"),
        std::string("\x89PNG\r\n\x1a\ntruncated", 17),
        std::string("\xff\xd8\xff\xe0 truncated", 15)}) {
    ExpectInvalidImage(bytes, bytes);
  }
}

// Every prefix of a PNG and of a JPEG (up to PNG's IEND, which carries no
// pixels), and each of them with one byte flipped in the middle: refused,
// never a crash (run it under ASan to see leaks).
TEST(ImageDecoderTest, RefusesTruncatedAndCorruptPngAndJpeg) {
  const std::string png = Png(
      16, 16, [](int x, int y) { return x * y; },
      [](int x, int) { return x * 16; }, [](int, int y) { return y * 16; });
  for (size_t n = 1; n < png.size() - 12; ++n) {
    ExpectInvalidImage(png.substr(0, n), "PNG prefix " + std::to_string(n));
  }
  std::string corrupt = png;
  corrupt[png.size() / 2] ^= 0x55;  // inside IDAT: its CRC no longer matches
  ExpectInvalidImage(corrupt, "PNG with a flipped byte");

  for (bool progressive : {false, true}) {
    const std::string jpeg = Jpeg(16, 16, 3, Halves, progressive);
    for (size_t n = 1; n < jpeg.size(); ++n) {
      ExpectInvalidImage(jpeg.substr(0, n), "JPEG prefix " + std::to_string(n));
    }
    // A flipped byte of entropy-coded data may still decode (JPEG has no
    // checksum): only a clean outcome is asked for.
    for (size_t i = 2; i < jpeg.size(); i += 7) {
      std::string flipped = jpeg;
      flipped[i] ^= 0x5a;
      auto image = DecodeImage(flipped, 3, 4);
      if (!image.ok()) {
        EXPECT_EQ(image.status().code(), absl::StatusCode::kInvalidArgument);
      }
    }
  }
}

TEST(ImageDecoderTest, OnlyPngAndJpegSignaturesAreDecoded) {
  // A valid 1x1 GIF: a format some decoders know, which the API does not
  // promise.
  const std::string gif(
      "GIF89a\x01\x00\x01\x00\x80\x00\x00\xff\xff\xff\x00\x00\x00!\xf9"
      "\x04\x01\x00\x00\x00\x00,\x00\x00\x00\x00\x01\x00\x01\x00\x00\x02"
      "\x02"
      "D\x01\x00;",
      43);
  auto image = DecodeImage(gif, 3, 1);
  ASSERT_FALSE(image.ok());
  EXPECT_THAT(std::string(image.status().message()),
              HasSubstr("image must be an encoded PNG or JPEG"));
}

// The headers say more pixels than allowed while the files hold 4x4 or 8x8
// ones: the size is refused from the header, before pixels are decoded or a
// byte of the budget reserved.
TEST(ImageDecoderTest, RefusesOversizedImagesFromTheirHeader) {
  ImageDecodeBudget budget(int64_t{1} << 40);
  PngSpec huge{5000, 5000, kRgb, 8, false, std::string(13, 0)};
  PngSpec wide{10000, 1, kRgb, 8, false, std::string(13, 0)};
  std::string jpeg = Jpeg(8, 8, 1, [](int, int, int) { return 0; });
  const size_t sof = jpeg.find("\xff\xc0");  // SOF0: FF C0, length, P, H, W
  ASSERT_NE(sof, std::string::npos);
  jpeg.replace(sof + 5, 4, "\x13\x88\x13\x88");  // 5000 x 5000
  const std::pair<std::string, const char*> cases[] = {
      {Png(huge), "at most 16777216 pixels, got 5000x5000"},
      {Png(wide), "image sides must be in [1, 8192] pixels, got 10000x1"},
      {jpeg, "at most 16777216 pixels, got 5000x5000"},
  };
  for (const auto& [bytes, message] : cases) {
    auto image = DecodeImage(bytes, 3, 4, &budget);
    ASSERT_FALSE(image.ok());
    EXPECT_EQ(image.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(image.status().message()), HasSubstr(message));
    EXPECT_EQ(budget.reserved_bytes(), 0);
  }
}

// Files from tests/reference/make_image_fixtures.py: images and what
// torchvision's Resize + CenterCrop on Pillow made of them, before /255.
const std::string kImageFixtures = test_paths::ImageFixturesDir();

std::string ReadFixture(const std::string& name) {
  std::ifstream file(kImageFixtures + "/" + name, std::ios::binary);
  EXPECT_TRUE(file.good()) << kImageFixtures << "/" << name
                           << " is missing: run the test through ctest, or "
                              "tests/reference/make_image_fixtures.py";
  std::ostringstream bytes;
  bytes << file.rdbuf();
  return bytes.str();
}

// The [channels, size, size] floats of `image` as 8-bit HWC samples, after
// checking that each float is exactly sample / 255 as ToTensor makes it.
std::string ToSamples(const at::Tensor& image) {
  const at::Tensor samples =
      (image * 255).round_().to(at::kByte).permute({1, 2, 0}).contiguous();
  EXPECT_TRUE(
      at::equal(samples.permute({2, 0, 1}).to(at::kFloat) / 255, image));
  return std::string(reinterpret_cast<const char*>(samples.data_ptr<uint8_t>()),
                     samples.numel());
}

// Differences between two equally long byte strings: how many, and the
// largest.
std::pair<int, int> Differences(const std::string& a, const std::string& b) {
  int count = 0, largest = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const int d = std::abs(uint8_t(a[i]) - uint8_t(b[i]));
    count += d != 0;
    largest = std::max(largest, d);
  }
  return {count, largest};
}

constexpr const char* kFixtureImages[] = {
    "rgb_300x200.png",   "grey_150x401.png",  "rgba_257x257.png",
    "palette_31x47.png", "photo_320x240.jpg", "grey_progressive_97x130.jpg",
};

// Every case make_image_fixtures.py writes: landscape, portrait and square;
// down- and upscaled (the palette image); resized on one side only (257x257
// to 256, 48x48 plain); grey, RGBA, palette with transparency; baseline
// colour and progressive grey JPEG; grey out of colour.
TEST(ImageDecoderPillowTest, EqualsTorchvisionOnPillowExactly) {
  struct Case {
    int shorter_side, size;
    const char* mode;
    bool bicubic;
  };
  const Case cases[] = {{256, 224, "RGB", true}, {73, 64, "RGB", true},
                        {73, 64, "L", true},     {0, 48, "RGB", true},
                        {48, 48, "RGB", true},   {73, 64, "RGB", false}};
  for (const char* name : kFixtureImages) {
    const std::string bytes = ReadFixture(name);
    for (const Case& c : cases) {
      const std::string expected_name =
          absl::StrCat(name, ".s", c.shorter_side, "_c", c.size,
                       c.bicubic ? "" : "_bilinear", ".", c.mode);
      SCOPED_TRACE(expected_name);
      ImageResize resize;
      resize.channels = c.mode == std::string("L") ? 1 : 3;
      resize.size = c.size;
      resize.shorter_side = c.shorter_side;
      resize.bicubic = c.bicubic;
      auto image = DecodeImage(bytes, resize);
      ASSERT_TRUE(image.ok()) << image.status();
      ASSERT_EQ(image->sizes(),
                (std::vector<int64_t>{resize.channels, c.size, c.size}));
      const std::string expected = ReadFixture(expected_name);
      const std::string actual = ToSamples(*image);
      const auto [count, largest] = Differences(actual, expected);
      ASSERT_EQ(actual.size(), expected.size());
      EXPECT_EQ(count, 0) << "samples differ, by up to " << largest;
    }
  }
}

// Pillow's JPEG decode (libjpeg-turbo, ISLOW DCT, fancy upsampling) and
// ours agree; the resize alone equals Pillow's on Pillow's decoded pixels.
TEST(ImageDecoderPillowTest, ResizesPillowsJpegPixelsExactly) {
  const std::string decoded = ReadFixture("photo_320x240.jpg.decoded.RGB");
  ASSERT_EQ(decoded.size(), 320u * 240 * 3);
  const ResizeWindow window = ShorterSideCentreCrop(320, 240, 256, 224);
  std::string resized(224 * 224 * 3, '\0');
  PillowResize(reinterpret_cast<const uint8_t*>(decoded.data()), 320, 240, 3,
               window, ResizeFilter::kBicubic,
               reinterpret_cast<uint8_t*>(resized.data()));
  EXPECT_EQ(resized, ReadFixture("photo_320x240.jpg.s256_c224.RGB"));

  ImageResize unresized;  // square JPEG pixels as they are: 240x240 of them
  unresized.size = 240;
  unresized.bicubic = true;
  unresized.shorter_side = 240;
  auto image = DecodeImage(ReadFixture("photo_320x240.jpg"), unresized);
  ASSERT_TRUE(image.ok()) << image.status();
  std::string centre;
  for (int y = 0; y < 240; ++y)
    centre += decoded.substr((y * 320 + 40) * 3, 720);
  EXPECT_EQ(ToSamples(*image), centre);
}

// torchvision 0.15: the longer side int(S * long / short), the crop's offsets
// round((excess) / 2) with halves to even.
TEST(ImageDecoderPillowTest, ShorterSideCentreCropGeometry) {
  struct Case {
    int width, height, shorter_side, crop;
    ResizeWindow expected;
  };
  const Case cases[] = {
      {300, 200, 256, 224, {384, 256, 80, 16, 224, 224}},
      {150, 401, 256, 224, {256, 684, 16, 230, 224, 224}},  // 684.37
      {31, 47, 73, 64, {73, 110, 4, 23, 64, 64}},           // 110.68; 4.5 to 4
      {200, 203, 200, 200, {200, 203, 0, 2, 200, 200}},     // 1.5 to 2
      {200, 201, 200, 200, {200, 201, 0, 0, 200, 200}},     // 0.5 to 0
      {1, 8192, 8192, 64, {8192, 67108864, 4064, 33554400, 64, 64}},
  };
  for (const Case& c : cases) {
    const ResizeWindow w =
        ShorterSideCentreCrop(c.width, c.height, c.shorter_side, c.crop);
    const ResizeWindow& e = c.expected;
    EXPECT_EQ(std::vector<int>({w.resized_width, w.resized_height, w.left,
                                w.top, w.width, w.height}),
              std::vector<int>({e.resized_width, e.resized_height, e.left,
                                e.top, e.width, e.height}))
        << c.width << "x" << c.height << " to " << c.shorter_side;
  }
}

// DecodeImage(bytes, channels, size) is ImageResize{channels, size}: the
// straight float resize, not Pillow's.
TEST(ImageDecoderPillowTest, StraightResizeStaysTheFloatOne) {
  const std::string bytes = ReadFixture("rgb_300x200.png");
  auto former = DecodeImage(bytes, 3, 48);
  ImageResize resize;
  resize.size = 48;
  auto straight = DecodeImage(bytes, resize);
  ASSERT_TRUE(former.ok() && straight.ok());
  EXPECT_TRUE(at::equal(*former, *straight));
  // Pillow's bicubic on the same plain resize differs (the image is sharp).
  resize.bicubic = true;
  auto bicubic = DecodeImage(bytes, resize);
  ASSERT_TRUE(bicubic.ok()) << bicubic.status();
  EXPECT_FALSE(at::equal(*former, *bicubic));
}

TEST(ImageDecoderPillowTest, RejectsShorterSideOutsideItsRange) {
  const std::string png = BlackPng(8, 8);
  for (int shorter_side : {223, 9000, -1}) {
    ImageResize resize;
    resize.size = 224;
    resize.shorter_side = shorter_side;
    resize.bicubic = true;
    auto image = DecodeImage(png, resize);
    ASSERT_FALSE(image.ok()) << shorter_side;
    EXPECT_EQ(image.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(image.status().message()),
                HasSubstr(absl::StrCat(
                    "ImageResize.shorter_side must be 0 (no crop) or in "
                    "[size, 8192] = [224, 8192], got ",
                    shorter_side)));
  }
  ImageResize resize;
  resize.size = 224;
  resize.shorter_side = 224;  // crops the longer side only
  EXPECT_TRUE(DecodeImage(png, resize).ok());
}

// A 64x64 RGB PNG decoded for a 3x8x8 model holds 64*64*3 samples, their
// float copy (4 bytes each) and the 64x8x3 floats of the resize: 67584 bytes.
constexpr int64_t kDecodeBytes = 64 * 64 * 3 * 5 + 64 * 8 * 3 * 4;

TEST(ImageDecodeBudgetTest, DecodeOverTheBudgetIsResourceExhausted) {
  const std::string png = BlackPng(64, 64);
  ImageDecodeBudget small(kDecodeBytes - 1);
  auto refused = DecodeImage(png, 3, 8, &small);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("image needs 0.1 MiB to decode, more than the whole "
                        "decode budget (image_decode_memory_mb: 0.0644"));

  ImageDecodeBudget exact(kDecodeBytes);
  ASSERT_TRUE(DecodeImage(png, 3, 8, &exact).ok());
  EXPECT_EQ(exact.reserved_bytes(), 0);  // released on return
  ASSERT_TRUE(DecodeImage(png, 3, 8, &exact).ok());
}

TEST(ImageDecodeBudgetTest, ConcurrentDecodesShareTheBudget) {
  const std::string png = BlackPng(64, 64);
  ImageDecodeBudget budget(kDecodeBytes + 100);
  {
    auto other = budget.Reserve(101);  // another decode in flight
    ASSERT_TRUE(other.ok());
    auto refused = DecodeImage(png, 3, 8, &budget);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(std::string(refused.status().message()),
                AllOf(HasSubstr("other decodes hold 0.0 MiB of the decode "
                                "budget (image_decode_memory_mb: 0.0645"),
                      HasSubstr("retry later")));
    EXPECT_EQ(budget.reserved_bytes(), 101);
  }
  EXPECT_EQ(budget.reserved_bytes(), 0);
  EXPECT_TRUE(DecodeImage(png, 3, 8, &budget).ok());

  // A decode that fails after its header releases what it reserved.
  std::string corrupt = png;
  corrupt[png.size() / 2] ^= 0x55;
  EXPECT_EQ(DecodeImage(corrupt, 3, 8, &budget).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(budget.reserved_bytes(), 0);
}

// The same PNG through Pillow's path, shorter side 10 then the centre 8x8:
// its samples (64*64*3), the horizontal and vertical coefficients (bicubic,
// 64 to 10: kernels of 2 * ceil(2 * 6.4) + 1 = 27 weights; 8 outputs each
// with 27 int32 weights and two ints, and 27 doubles), the vertical pass's
// 8*3 int32 sums, the horizontal pass's rows (8*3 samples of at most 64),
// the 8x8x3 resized samples and their floats.
constexpr int64_t kCoefficientBytes = 8 * (27 * 4 + 2 * 4) + 27 * 8;
constexpr int64_t kPillowDecodeBytes = 64 * 64 * 3 + 2 * kCoefficientBytes +
                                       8 * 3 * 4 + 8 * 3 * 64 + 8 * 8 * 3 +
                                       8 * 8 * 3 * 4;

TEST(ImageDecodeBudgetTest, PillowPathReservesItsEstimate) {
  const std::string png = BlackPng(64, 64);
  ImageResize resize;
  resize.size = 8;
  resize.shorter_side = 10;
  resize.bicubic = true;
  ImageDecodeBudget small(kPillowDecodeBytes - 1);
  auto refused = DecodeImage(png, resize, &small);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(small.reserved_bytes(), 0);

  ImageDecodeBudget exact(kPillowDecodeBytes);
  ASSERT_TRUE(DecodeImage(png, resize, &exact).ok());
  EXPECT_EQ(exact.reserved_bytes(), 0);  // released on return
}

TEST(ImageDecodeBudgetTest, ReservationsMoveAndReleaseOnce) {
  ImageDecodeBudget budget(100);
  auto a = budget.Reserve(60);
  ASSERT_TRUE(a.ok());
  ImageDecodeBudget::Reservation moved = std::move(*a);
  EXPECT_EQ(moved.bytes(), 60);
  EXPECT_EQ(budget.reserved_bytes(), 60);
  EXPECT_FALSE(budget.Reserve(41).ok());
  auto b = budget.Reserve(40);
  ASSERT_TRUE(b.ok());
  moved = std::move(*b);  // releases the 60
  EXPECT_EQ(budget.reserved_bytes(), 40);
}

}  // namespace
}  // namespace moh

namespace moh {
namespace {

// Generated images go out as PNG: what EncodePng writes decodes (libpng) to
// the same pixels, grey and RGB (square, so the decoder does not resample).
TEST(ImageEncoderTest, PngRoundTripsThroughTheDecoder) {
  at::manual_seed(11);
  for (int64_t channels : {1, 3}) {
    at::Tensor pixels =
        at::randint(0, 256, {channels, 9, 9}, at::TensorOptions(at::kByte));
    auto png = EncodePng(pixels);
    ASSERT_TRUE(png.ok()) << png.status();
    EXPECT_EQ(png->substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
    auto decoded = DecodeImage(*png, static_cast<int>(channels), 9);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_TRUE(at::equal(at::round(*decoded * 255).to(at::kByte), pixels))
        << channels << " channels";
  }
}

TEST(ImageEncoderTest, RejectsOtherShapesAndTypes) {
  EXPECT_FALSE(EncodePng(at::zeros({2, 4, 4}, at::kByte)).ok());
  EXPECT_FALSE(EncodePng(at::zeros({3, 4, 4}, at::kFloat)).ok());
  EXPECT_FALSE(EncodePng(at::zeros({4, 4}, at::kByte)).ok());
}

}  // namespace
}  // namespace moh
