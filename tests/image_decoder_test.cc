#include "service/image_decoder.h"

#include <zlib.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moh {
namespace {

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

// An 8-bit RGB PNG whose pixel (x, y) is (r(x, y), g(x, y), b(x, y)).
std::string Png(int width, int height, int (*r)(int, int), int (*g)(int, int),
                int (*b)(int, int)) {
  std::string raw;
  for (int y = 0; y < height; ++y) {
    raw.push_back(0);  // filter: none
    for (int x = 0; x < width; ++x) {
      raw.push_back(char(r(x, y)));
      raw.push_back(char(g(x, y)));
      raw.push_back(char(b(x, y)));
    }
  }
  uLongf size = compressBound(raw.size());
  std::string z(size, '\0');
  compress(reinterpret_cast<Bytef*>(z.data()), &size,
           reinterpret_cast<const Bytef*>(raw.data()), raw.size());
  z.resize(size);
  std::string png = "\x89PNG\r\n\x1a\n";
  std::string header;
  Put32(header, width);
  Put32(header, height);
  header += std::string("\x08\x02\x00\x00\x00", 5);
  Chunk(png, "IHDR", header);
  Chunk(png, "IDAT", z);
  Chunk(png, "IEND", "");
  return png;
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

TEST(ImageDecoderTest, RejectsBadInputNamingTheField) {
  for (const std::string& bytes :
       {std::string(), std::string("not an image"),
        std::string("\x89PNG\r\n\x1a\ntruncated", 17)}) {
    auto image = DecodeImage(bytes, 3, 16);
    ASSERT_FALSE(image.ok());
    EXPECT_EQ(image.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(image.status().message()), HasSubstr("image"));
  }
  std::string png = Png(
      4, 4, [](int, int) { return 0; }, [](int, int) { return 0; },
      [](int, int) { return 0; });
  png.resize(png.size() - 20);  // cut inside IDAT
  EXPECT_FALSE(DecodeImage(png, 3, 4).ok());
}

TEST(ImageDecoderTest, OnlyPngAndJpegSignaturesAreDecoded) {
  // A valid 1x1 GIF: the decoder knows GIF, the API does not promise it.
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

TEST(ImageDecoderTest, RefusesMorePixelsThanTheLimitBeforeDecoding) {
  std::string png = Png(
      4, 4, [](int, int) { return 0; }, [](int, int) { return 0; },
      [](int, int) { return 0; });
  // IHDR's width and height (bytes 16..23) say 5000 x 5000 (25 M pixels).
  for (int offset : {16, 20}) {
    png[offset] = 0;
    png[offset + 1] = 0;
    png[offset + 2] = 0x13;
    png[offset + 3] = static_cast<char>(0x88);
  }
  auto image = DecodeImage(png, 3, 4);
  ASSERT_FALSE(image.ok());
  EXPECT_THAT(std::string(image.status().message()),
              HasSubstr("at most 16777216 pixels, got 5000x5000"));
}

}  // namespace
}  // namespace moh
