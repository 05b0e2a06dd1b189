// A decode step's narrow products on a CUDA device, per shape and row
// count, side by side in one run: cuBLAS (at::linear, as
// --cuda_skinny_linear=false runs them; the down projection after the
// SwiGLU kernel) against the skinny kernel (FusedSkinnyLinear;
// FusedSiluMulLinear: SwiGLU inside). Each path runs as a CUDA graph of one
// product per weight copy, replayed: launches as a decode step's graph has
// them, and enough copies of the weight (256 MB of them at least) that none
// is read from the L2 cache, as a step reads each layer's weights once.
// Shapes of the MoH-LLaMA3-8B and 1B layouts in bfloat16; rounds
// alternate the two paths and each figure is the median of its rounds.
//   moh_cuda_linear_bench [rounds]      (default 5)
// Prints a Markdown table: µs a product, the weight's bytes over it
// (TB/s), cuBLAS's time over the kernel's, the kernel's graph recorded with
// programmatic dependent launch (SetCudaProgrammaticLaunch: each product
// starting its blocks while the one before finishes), and the largest
// difference of the outputs relative to the largest output. Without a CUDA
// device it says so and exits 0 (a CPU LibTorch builds it too).
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/core/device_context.h"
#include "model/core/fused_layer_ops.h"

namespace moh {
namespace {

struct Shape {
  const char* name;
  int64_t n, k, row_stride;  // W [n, k], its rows row_stride apart
  bool silu_mul;             // the input is [gate | up]: SwiGLU first
};

// The products a decode step sends to the skinny kernel (at most
// kSkinnyLinearMaxOutputs outputs), and the wide ones it leaves to cuBLAS
// (run here through it too: where the limit should lie).
const Shape kShapes[] = {
    {"8b k,v,q (ratio > 0.5)", 6144, 4096, 4096, false},
    {"8b k,v,shared q (ratio 0.5)", 4096, 4096, 4096, false},
    {"8b o", 4096, 4096, 4096, false},
    {"8b o, shared heads (ratio 0.5)", 4096, 2048, 4096, false},
    {"8b SwiGLU + down", 4096, 14336, 14336, true},
    {"1b k,v,q", 3072, 2048, 2048, false},
    {"1b o", 2048, 2048, 2048, false},
    {"1b SwiGLU + down", 2048, 8192, 8192, true},
    {"8b gate | up (cuBLAS in the model)", 28672, 4096, 4096, false},
    {"8b LM head (cuBLAS in the model)", 128256, 4096, 4096, false},
    {"1b gate | up (cuBLAS in the model)", 16384, 2048, 2048, false},
};
constexpr int64_t kAnyOutputs = int64_t{1} << 30;

constexpr int64_t kRows[] = {1, 2, 4, 8};
constexpr int64_t kColdBytes = int64_t{256} << 20;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds a replay of `graph` takes, over enough replays for about 20 ms.
double ReplaySeconds(DeviceContext::Graph& graph, const at::Tensor& sync) {
  using Clock = std::chrono::steady_clock;
  auto run = [&](int replays) {
    const auto start = Clock::now();
    for (int i = 0; i < replays; ++i) graph.Replay();
    sync.sum().item<float>();  // waits for the stream
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  const double once = run(1);
  const int replays = std::clamp(static_cast<int>(0.02 / once), 3, 1000);
  return run(replays) / replays;
}

int Run(int rounds) {
  if (!at::hasCUDA()) {
    std::printf("moh_cuda_linear_bench: no CUDA device; nothing measured\n");
    return 0;
  }
  DeviceContext context(at::Device(at::kCUDA, 0));
  const auto scope = context.Enter();
  const at::TensorOptions options =
      at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  std::printf(
      "| product | n x k | rows | cuBLAS µs (TB/s) | skinny µs (TB/s) | "
      "cuBLAS / skinny | skinny, overlapped launches µs | max diff |\n"
      "|---|---|---|---|---|---|---|---|\n");
  for (const Shape& shape : kShapes) {
    const int64_t bytes = shape.n * shape.k * 2;
    const int64_t copies =
        std::clamp<int64_t>((kColdBytes + bytes - 1) / bytes, 2, 64);
    at::manual_seed(3);
    std::vector<at::Tensor> weights;
    for (int64_t c = 0; c < copies; ++c) {
      weights.push_back((at::randn({shape.n, shape.row_stride}, options) /
                         std::sqrt(static_cast<double>(shape.k)))
                            .narrow(1, 0, shape.k));
    }
    for (const int64_t rows : kRows) {
      const at::Tensor x =
          at::randn({rows, (shape.silu_mul ? 2 : 1) * shape.k}, options);
      auto cublas = [&](const at::Tensor& w) {
        return at::linear(shape.silu_mul ? FusedSiluMul(x) : x, w);
      };
      auto skinny = [&](const at::Tensor& w) {
        return shape.silu_mul
                   ? FusedSiluMulLinear(x, w, kAnyOutputs)
                   : FusedSkinnyLinear(x, w, at::Tensor(), kAnyOutputs);
      };
      const at::Tensor want = cublas(weights[0]), got = skinny(weights[0]);
      if (!got.defined()) {
        std::fprintf(stderr, "%s: the skinny kernel refused %lld rows\n",
                     shape.name, static_cast<long long>(rows));
        return 1;
      }
      const double diff =
          ((got.to(at::kFloat) - want.to(at::kFloat)).abs().max() /
           want.to(at::kFloat).abs().max().clamp_min(1e-30))
              .item<double>();
      std::vector<at::Tensor> outputs;  // alive while the graphs replay
      auto record = [&](const std::function<at::Tensor(const at::Tensor&)>& f) {
        absl::StatusOr<std::unique_ptr<DeviceContext::Graph>> graph =
            context.Capture([&] {
              for (const at::Tensor& w : weights) outputs.push_back(f(w));
            });
        if (!graph.ok()) {
          std::fprintf(stderr, "%s: %s\n", shape.name,
                       std::string(graph.status().message()).c_str());
          std::exit(1);
        }
        return *std::move(graph);
      };
      const std::unique_ptr<DeviceContext::Graph> a = record(cublas);
      const std::unique_ptr<DeviceContext::Graph> b = record(skinny);
      SetCudaProgrammaticLaunch(true);
      const std::unique_ptr<DeviceContext::Graph> c = record(skinny);
      SetCudaProgrammaticLaunch(false);
      std::vector<double> t_cublas, t_skinny, t_overlapped;
      for (int r = 0; r < rounds; ++r) {
        t_cublas.push_back(ReplaySeconds(*a, outputs.front()) / copies);
        t_skinny.push_back(ReplaySeconds(*b, outputs.back()) / copies);
        t_overlapped.push_back(ReplaySeconds(*c, outputs.back()) / copies);
      }
      const double tc = Median(t_cublas), ts = Median(t_skinny);
      std::printf(
          "| %s | %lld x %lld | %lld | %.1f (%.2f) | %.1f (%.2f) | "
          "%.2f | %.1f | %.1e |\n",
          shape.name, static_cast<long long>(shape.n),
          static_cast<long long>(shape.k), static_cast<long long>(rows),
          tc * 1e6, bytes / tc / 1e12, ts * 1e6, bytes / ts / 1e12, tc / ts,
          Median(t_overlapped) * 1e6, diff);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace moh

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 5;
  if (rounds < 1 || rounds > 100) {
    std::fprintf(stderr, "usage: moh_cuda_linear_bench [rounds: 1 to 100]\n");
    return 2;
  }
  return moh::Run(rounds);
}
