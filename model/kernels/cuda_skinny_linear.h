// x W^T (+ bias) for the few rows of a decode step, one kernel, no split-K
// reduction: at batch 1 cuBLAS runs a product with few outputs (the
// attention's projections and the MLP's down projection of an 8B layer) as
// a split-K kernel plus a reduction kernel, and took 3.07 TB/s for a
// 4096 x 4096 weight where its wide products took 4.2 (run 7, H200; 128
// reductions a step at about 1.6 µs each, besides the gaps between them).
// The product may also take SwiGLU's input: silu(gate) * up over the
// [gate | up] product, rounded as the fused SiluMul (cuda_layer_ops.h)
// rounds it, so the MLP's down projection needs no SiluMul launch.
//
// Each thread block makes kSkinnyColumns outputs of every row: its threads
// split the inner dimension in chunks of 8 elements (16-byte loads of the
// weight's rows and of x), sum in float32, and the block adds up its
// threads' sums (warp shuffles, then shared memory). Every element of W is
// read once; x's rows are read by every block, from the cache.
//
// Plain pointers and strides (the wrapper is model/core/fused_layer_ops.cc).
#pragma once

#include <cstdint>

#include "model/kernels/cuda_element.h"
#include "model/kernels/cuda_layer_ops.h"

namespace moh {

// Rows a launch takes: a decode step's batch up to this; more rows go to
// cuBLAS, whose tiles then fill the device.
inline constexpr int kSkinnyMaxRows = 8;
// Outputs (rows of W) a thread block makes.
inline constexpr int kSkinnyColumns = 4;

struct SkinnyLinearArgs {
  CudaElement type = CudaElement::kFloat32;  // of x, W, bias and out
  CudaRows x;                  // [rows, k]; [rows, 2k] with silu_mul
  bool silu_mul = false;       // input = silu(x[:, :k]) * x[:, k:]
  CudaRows weight;             // [n, k]
  const void* bias = nullptr;  // [n] contiguous, or none
  CudaRows out;                // [rows, n]
  int rows = 0, n = 0, k = 0;
  void* stream = nullptr;  // cudaStream_t
};

// Whether LaunchSkinnyLinear takes these shapes (out aside): 1 to
// kSkinnyMaxRows rows, n >= 1, k a positive multiple of 8, x's and W's rows
// 16-byte aligned.
inline bool SkinnyLinearTakes(const SkinnyLinearArgs& a) {
  return a.rows >= 1 && a.rows <= kSkinnyMaxRows && a.n >= 1 && a.k >= 8 &&
         a.k % 8 == 0 && a.x.data != nullptr && a.weight.data != nullptr &&
         Aligned8(a.type, a.x.data, a.x.row_stride) &&
         Aligned8(a.type, a.weight.data, a.weight.row_stride);
}

// nullptr, or the error's text (shapes it does not take included).
const char* LaunchSkinnyLinear(const SkinnyLinearArgs& args);

}  // namespace moh
