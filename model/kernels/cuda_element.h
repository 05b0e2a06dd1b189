// The element types the CUDA kernels take (a tensor's scalar type, seen
// without ATen).
#pragma once

namespace moh {

enum class CudaElement { kFloat32, kBFloat16, kFloat16 };

}  // namespace moh
