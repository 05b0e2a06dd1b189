// x W^T for a decode step's few rows (see cuda_skinny_linear.h).
#include <algorithm>

#include "model/kernels/cuda_element.cuh"
#include "model/kernels/cuda_skinny_linear.h"

namespace moh {
namespace {

constexpr int kSkinnyThreads = 256;
constexpr int kSkinnyWarps = kSkinnyThreads / 32;

// Outputs [j0, j0 + kSkinnyColumns) of rows [0, a.rows) (kRows at most):
// thread t sums the chunks t, t + 256, ... of 8 elements of the inner
// dimension for each (row, output), in float32; the warps' sums meet in
// shared memory, and one thread an output adds them up, adds the bias and
// rounds once (as cuBLAS's float32 accumulation).
// With kSiluMul each thread block makes SwiGLU's input afresh (every block
// reads all of it): 1,024 blocks x 14,336 elements a row for the 8B layer's
// down projection. With SiluMul's IEEE exponential and division that is
// about 25 instructions an element, more than the block's products with
// it (4 multiply-adds); the fast ones (__expf, __fdividef: within 2 ulp of
// float32) take about 6, so the kernel stays bound by the weight's reads.
template <typename T, int kRows, bool kSiluMul>
__global__ void __launch_bounds__(kSkinnyThreads)
    SkinnyLinearKernel(SkinnyLinearArgs a) {
  cuda::StartAfterPriorGrid();
  const int j0 = blockIdx.x * kSkinnyColumns;
  const int columns = min(kSkinnyColumns, a.n - j0);
  const T* w =
      static_cast<const T*>(a.weight.data) + int64_t{j0} * a.weight.row_stride;
  const T* x = static_cast<const T*>(a.x.data);
  float sums[kRows][kSkinnyColumns] = {};
  for (int i = threadIdx.x * 8; i < a.k; i += kSkinnyThreads * 8) {
    float wv[kSkinnyColumns][8];
#pragma unroll
    for (int c = 0; c < kSkinnyColumns; ++c) {
      if (c < columns) {
        cuda::Load8(w + c * a.weight.row_stride + i, wv[c]);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) wv[c][e] = 0.f;
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= a.rows) break;
      const T* row = x + r * a.x.row_stride + i;
      float xv[8];
      cuda::Load8(row, xv);
      if (kSiluMul) {  // SiluMul's output, rounded where it rounds
        float up[8];
        cuda::Load8(row + a.k, up);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float silu =
              cuda::Round<T>(__fdividef(xv[e], 1.f + __expf(-xv[e])));
          xv[e] = cuda::Round<T>(silu * up[e]);
        }
      }
#pragma unroll
      for (int c = 0; c < kSkinnyColumns; ++c) {
#pragma unroll
        for (int e = 0; e < 8; ++e) sums[r][c] += xv[e] * wv[c][e];
      }
    }
  }
  __shared__ float partial[kSkinnyWarps][kRows * kSkinnyColumns];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r >= a.rows) break;  // the same on every thread: shuffles stay paired
#pragma unroll
    for (int c = 0; c < kSkinnyColumns; ++c) {
      const float s = cuda::WarpSum(sums[r][c]);
      if (lane == 0) partial[warp][r * kSkinnyColumns + c] = s;
    }
  }
  __syncthreads();
  const int r = threadIdx.x / kSkinnyColumns, c = threadIdx.x % kSkinnyColumns;
  if (r >= a.rows || r >= kRows || c >= columns) return;
  float total = 0.f;
#pragma unroll
  for (int v = 0; v < kSkinnyWarps; ++v) total += partial[v][threadIdx.x];
  if (a.bias != nullptr) {
    total += cuda::ToFloat(static_cast<const T*>(a.bias)[j0 + c]);
  }
  static_cast<T*>(a.out.data)[r * a.out.row_stride + j0 + c] =
      cuda::FromFloat<T>(total);
}

// The kernel for up to kRows rows.
template <typename T, int kRows>
cudaError_t LaunchRows(const SkinnyLinearArgs& a) {
  const int blocks = (a.n + kSkinnyColumns - 1) / kSkinnyColumns;
  const cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  if (a.silu_mul) {
    return MOH_CUDA_LAUNCH((SkinnyLinearKernel<T, kRows, true>), blocks,
                           kSkinnyThreads, stream, a);
  }
  return MOH_CUDA_LAUNCH((SkinnyLinearKernel<T, kRows, false>), blocks,
                         kSkinnyThreads, stream, a);
}

}  // namespace

const char* LaunchSkinnyLinear(const SkinnyLinearArgs& args) {
  if (!SkinnyLinearTakes(args) || args.out.data == nullptr) {
    return "skinny linear: rows out of [1, 8], k not a multiple of 8, or "
           "rows not 16-byte aligned";
  }
  const cudaError_t error = cuda::ByElement(args.type, [&](auto element) {
    using T = decltype(element);
    if (args.rows == 1) return LaunchRows<T, 1>(args);
    if (args.rows == 2) return LaunchRows<T, 2>(args);
    if (args.rows <= 4) return LaunchRows<T, 4>(args);
    return LaunchRows<T, kSkinnyMaxRows>(args);
  });
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace moh
