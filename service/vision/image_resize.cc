// Written for moh-serve from the facts of Pillow 9.4's libImaging/Resample.c
// (its algorithm and arithmetic, not its code): a separable convolution,
// horizontal pass first, each pass rounding to 8 bits. Per output sample the
// kernel spans support = filter support * max(in / out, 1) input samples each
// side of the centre (out + 0.5) * in / out; its weights, normalized to sum 1
// in doubles, are rounded half away from zero to fixed point with 22
// fractional bits (32 - 8 - 2: 8-bit samples, 2 bits for the kernel's
// negative lobes); a sum starts at one half and is shifted back and clipped
// to [0, 255]. Bit-exactness needs the doubles computed as Pillow's C does,
// so this file is compiled with -ffp-contract=off (service/CMakeLists.txt).
#include "service/vision/image_resize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace moh {
namespace {

constexpr int kPrecisionBits = 32 - 8 - 2;
constexpr int32_t kHalf = int32_t{1} << (kPrecisionBits - 1);

double BilinearKernel(double x) {
  if (x < 0.0) x = -x;
  return x < 1.0 ? 1.0 - x : 0.0;
}

// Keys' cubic convolution with a = -0.5.
double BicubicKernel(double x) {
  constexpr double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

double Support(ResizeFilter filter, int in_size, int out_size) {
  const double scale = static_cast<double>(in_size) / out_size;
  return (filter == ResizeFilter::kBicubic ? 2.0 : 1.0) * std::max(scale, 1.0);
}

// Weights per output at most.
int KernelSize(ResizeFilter filter, int in_size, int out_size) {
  return static_cast<int>(std::ceil(Support(filter, in_size, out_size))) * 2 +
         1;
}

// The fixed-point weights of outputs [first, first + count) of a resize of
// in_size samples to out_size.
struct Taps {
  int kernel_size = 0;
  std::vector<int> start;        // each output's first input sample
  std::vector<int> length;       // and how many it reads
  std::vector<int32_t> weights;  // kernel_size per output

  const int32_t* Weights(int i) const {
    return weights.data() + int64_t{i} * kernel_size;
  }
};

int64_t TapsBytes(ResizeFilter filter, int in_size, int out_size, int count) {
  const int64_t kernel = KernelSize(filter, in_size, out_size);
  return count *
             (kernel * int64_t{sizeof(int32_t)} + 2 * int64_t{sizeof(int)}) +
         kernel * int64_t{sizeof(double)};
}

Taps ComputeTaps(ResizeFilter filter, int in_size, int out_size, int first,
                 int count) {
  double (*kernel)(double) =
      filter == ResizeFilter::kBicubic ? BicubicKernel : BilinearKernel;
  const double scale = static_cast<double>(in_size) / out_size;
  const double inverse_scale = 1.0 / std::max(scale, 1.0);
  const double support = Support(filter, in_size, out_size);
  Taps taps;
  taps.kernel_size = KernelSize(filter, in_size, out_size);
  taps.start.resize(count);
  taps.length.resize(count);
  taps.weights.assign(int64_t{count} * taps.kernel_size, 0);
  std::vector<double> w(taps.kernel_size);
  for (int i = 0; i < count; ++i) {
    const double center = (first + i + 0.5) * scale;
    const int begin = std::max(static_cast<int>(center - support + 0.5), 0);
    const int end = std::min(static_cast<int>(center + support + 0.5), in_size);
    const int n = end - begin;
    double sum = 0.0;
    for (int x = 0; x < n; ++x) {
      w[x] = kernel((x + begin - center + 0.5) * inverse_scale);
      sum += w[x];
    }
    int32_t* fixed = taps.weights.data() + int64_t{i} * taps.kernel_size;
    for (int x = 0; x < n; ++x) {
      const double v = (sum != 0.0 ? w[x] / sum : w[x]) * (1 << kPrecisionBits);
      fixed[x] = static_cast<int32_t>(v < 0 ? v - 0.5 : v + 0.5);
    }
    taps.start[i] = begin;
    taps.length[i] = n;
  }
  return taps;
}

uint8_t Clip8(int32_t sum) {
  return static_cast<uint8_t>(std::clamp(sum >> kPrecisionBits, 0, 255));
}

// Horizontal pass: `rows` rows of `src` (`stride` samples apart) to rows of
// taps.start.size() pixels, packed in `out`.
void ResizeRows(const uint8_t* src, int64_t stride, int rows, int bands,
                const Taps& taps, uint8_t* out) {
  const int outputs = static_cast<int>(taps.start.size());
  for (int y = 0; y < rows; ++y) {
    const uint8_t* row = src + y * stride;
    for (int i = 0; i < outputs; ++i) {
      const uint8_t* p = row + int64_t{taps.start[i]} * bands;
      const int32_t* k = taps.Weights(i);
      for (int b = 0; b < bands; ++b) {
        int32_t sum = kHalf;
        for (int x = 0; x < taps.length[i]; ++x) sum += p[x * bands + b] * k[x];
        *out++ = Clip8(sum);
      }
    }
  }
}

// Vertical pass: the first `samples` samples of the rows of `src` (`stride`
// apart) to taps.start.size() rows of `samples`, packed in `out`. The sums of
// a row run side by side (integer sums: the order changes nothing).
void ResizeColumns(const uint8_t* src, int64_t stride, int64_t samples,
                   const Taps& taps, uint8_t* out) {
  std::vector<int32_t> sums(samples);
  for (size_t i = 0; i < taps.start.size(); ++i) {
    std::fill(sums.begin(), sums.end(), kHalf);
    const int32_t* k = taps.Weights(i);
    for (int y = 0; y < taps.length[i]; ++y) {
      const uint8_t* row = src + (taps.start[i] + y) * stride;
      for (int64_t s = 0; s < samples; ++s) sums[s] += row[s] * k[y];
    }
    for (int64_t s = 0; s < samples; ++s) *out++ = Clip8(sums[s]);
  }
}

// round(excess / 2.0) as Python rounds: halves to even.
int CentreOffset(int excess) {
  int half = excess / 2;
  if (excess % 2 == 1 && half % 2 == 1) ++half;
  return half;
}

}  // namespace

ResizeWindow ShorterSideCentreCrop(int width, int height, int shorter_side,
                                   int crop) {
  const bool portrait = width <= height;
  const int shorter = portrait ? width : height;
  const int longer = portrait ? height : width;
  const int resized_longer = static_cast<int>(
      static_cast<double>(int64_t{shorter_side} * longer) / shorter);
  ResizeWindow window;
  window.resized_width = portrait ? shorter_side : resized_longer;
  window.resized_height = portrait ? resized_longer : shorter_side;
  window.left = CentreOffset(window.resized_width - crop);
  window.top = CentreOffset(window.resized_height - crop);
  window.width = window.height = crop;
  return window;
}

int64_t PillowResizeBytes(int width, int height, int bands,
                          const ResizeWindow& window, ResizeFilter filter) {
  const bool horizontal = window.resized_width != width;
  const bool vertical = window.resized_height != height;
  const int64_t out_row = int64_t{window.width} * bands;
  int64_t bytes = 0;
  if (horizontal) {
    bytes += TapsBytes(filter, width, window.resized_width, window.width);
  }
  if (vertical) {
    bytes += TapsBytes(filter, height, window.resized_height, window.height) +
             out_row * int64_t{sizeof(int32_t)};
  }
  // The horizontal pass's rows: at most every row of the image.
  if (horizontal && vertical) bytes += out_row * height;
  return bytes;
}

void PillowResize(const uint8_t* in, int width, int height, int bands,
                  const ResizeWindow& window, ResizeFilter filter,
                  uint8_t* out) {
  // As Pillow, a pass runs only when its side changes.
  const bool horizontal = window.resized_width != width;
  const bool vertical = window.resized_height != height;
  const int64_t stride = int64_t{width} * bands;
  const int64_t out_row = int64_t{window.width} * bands;
  if (!vertical) {
    const uint8_t* rows = in + window.top * stride;
    if (horizontal) {
      ResizeRows(rows, stride, window.height, bands,
                 ComputeTaps(filter, width, window.resized_width, window.left,
                             window.width),
                 out);
    } else {
      for (int y = 0; y < window.height; ++y) {
        std::memcpy(out + y * out_row, rows + y * stride + window.left * bands,
                    out_row);
      }
    }
    return;
  }
  Taps columns = ComputeTaps(filter, height, window.resized_height, window.top,
                             window.height);
  if (!horizontal) {
    ResizeColumns(in + int64_t{window.left} * bands, stride, out_row, columns,
                  out);
    return;
  }
  // Only the rows the vertical pass reads go through the horizontal one.
  const int first = columns.start.front();
  const int rows = columns.start.back() + columns.length.back() - first;
  for (int& start : columns.start) start -= first;
  std::vector<uint8_t> resized_rows(rows * out_row);
  ResizeRows(in + first * stride, stride, rows, bands,
             ComputeTaps(filter, width, window.resized_width, window.left,
                         window.width),
             resized_rows.data());
  ResizeColumns(resized_rows.data(), out_row, out_row, columns, out);
}

}  // namespace moh
