// Device helpers the CUDA kernels share: loads and conversions between the
// model's element types (float32, bfloat16, float16) and float, and warp
// reductions. Device code only (included by .cu files).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <utility>

#include "model/kernels/cuda_element.h"
#include "model/kernels/cuda_launch.h"

// kernel<<<grid, block, 0, stream>>>(args...), then the launch's error; with
// ProgrammaticLaunch() on, launched to overlap the kernel before it in the
// stream (cuda_launch.h). A test may define these three first to run the
// kernels elsewhere (tests/model/kernels/cuda_host_emulation.h: on the CPU).
#ifndef MOH_CUDA_LAUNCH
namespace moh::cuda {
template <typename... Params, typename... Args>
cudaError_t Launch(void (*kernel)(Params...), dim3 grid, dim3 block,
                   size_t bytes, cudaStream_t stream, Args&&... args) {
  if (!ProgrammaticLaunch()) {
    kernel<<<grid, block, bytes, stream>>>(std::forward<Args>(args)...);
    return cudaGetLastError();
  }
  cudaLaunchAttribute overlap[1] = {};
  overlap[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = bytes;
  config.stream = stream;
  config.attrs = overlap;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}
}  // namespace moh::cuda
#define MOH_CUDA_LAUNCH(kernel, grid, block, stream, ...) \
  moh::cuda::Launch(kernel, grid, block, 0, stream, __VA_ARGS__)
// The same with `bytes` of dynamic shared memory, which the kernel names
// with MOH_DYNAMIC_SHARED(name) (float name[]).
#define MOH_CUDA_LAUNCH_SHARED(kernel, grid, block, bytes, stream, ...) \
  moh::cuda::Launch(kernel, grid, block, bytes, stream, __VA_ARGS__)
#define MOH_DYNAMIC_SHARED(name) extern __shared__ float name[]
#endif

namespace moh {
namespace cuda {

// The first statement of every kernel here: waits until the kernel before
// it in the stream has finished and its writes are visible (at once unless
// this one was launched to overlap it: ProgrammaticLaunch), then lets the
// kernel after it start its blocks, which wait here in turn. Hopper (sm_90)
// and later; a no-op before, and on the host.
__device__ inline void StartAfterPriorGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();
  cudaTriggerProgrammaticLaunchCompletion();
#endif
}

// Eight consecutive elements as float; p is 16-byte aligned (32 for float).
__device__ inline void Load8(const float* p, float* x) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
  x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}
__device__ inline void Load8(const __nv_bfloat16* p, float* x) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    x[2 * i] = f.x, x[2 * i + 1] = f.y;
  }
}
__device__ inline void Load8(const __half* p, float* x) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    x[2 * i] = f.x, x[2 * i + 1] = f.y;
  }
}

// Eight floats stored as consecutive elements, each rounded to nearest
// even; p as Load8's.
__device__ inline void Store8(float* p, const float* x) {
  reinterpret_cast<float4*>(p)[0] = make_float4(x[0], x[1], x[2], x[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(x[4], x[5], x[6], x[7]);
}
__device__ inline void Store8(__nv_bfloat16* p, const float* x) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    h[i] = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}
__device__ inline void Store8(__half* p, const float* x) {
  uint4 raw;
  __half2* h = reinterpret_cast<__half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(x[2 * i], x[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

__device__ inline float ToFloat(float v) { return v; }
__device__ inline float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ inline float ToFloat(__half v) { return __half2float(v); }

// Rounded to nearest even, as ATen rounds an op's float result.
template <typename T>
__device__ inline T FromFloat(float v);
template <>
__device__ inline float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ inline __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}
template <>
__device__ inline __half FromFloat<__half>(float v) {
  return __float2half(v);
}

// v rounded to T and back: the value an ATen op of type T leaves.
template <typename T>
__device__ inline float Round(float v) {
  return ToFloat(FromFloat<T>(v));
}

__device__ inline float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(~0u, v, o));
  return v;
}
__device__ inline float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(~0u, v, o);
  return v;
}

// fn(T{}) for the element type `type` names: a launch for each type.
template <typename Fn>
cudaError_t ByElement(CudaElement type, Fn&& fn) {
  switch (type) {
    case CudaElement::kFloat32:
      return fn(float{});
    case CudaElement::kBFloat16:
      return fn(__nv_bfloat16{});
    case CudaElement::kFloat16:
      return fn(__half{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace moh
