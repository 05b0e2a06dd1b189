// The element types the CUDA kernels take (a tensor's scalar type, seen
// without ATen).
#pragma once

#include <cstdint>

namespace moh {

enum class CudaElement { kFloat32, kBFloat16, kFloat16 };

inline int ElementBytes(CudaElement type) {
  return type == CudaElement::kFloat32 ? 4 : 2;
}

// Whether Load8/Store8 (cuda_element.cuh) may read and write 8 elements at
// `data + i * stride` for every i, and at every multiple of 8 after it: 16
// bytes aligned.
inline bool Aligned8(CudaElement type, const void* data, int64_t stride = 0) {
  return reinterpret_cast<uintptr_t>(data) % 16 == 0 &&
         stride * ElementBytes(type) % 16 == 0;
}

// Whether a head of head_dim elements goes to head_dim / 8 adjacent threads
// reading 16 bytes each, a power-of-two group within a warp or spanning
// whole warps: head_dim a power of two in [8, 256] (the paged decode and
// router kernels).
inline bool ChunkedHeadDim(int head_dim) {
  return head_dim >= 8 && head_dim <= 256 && (head_dim & (head_dim - 1)) == 0;
}

}  // namespace moh
