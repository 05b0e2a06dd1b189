// A tensor's scalar type as the CUDA kernels' element type
// (model/kernels/cuda_element.h), for the kernels' ATen wrappers.
#pragma once

#include <ATen/ATen.h>

#include "model/kernels/cuda_element.h"

namespace moh {

// False for a type the kernels do not take.
inline bool CudaElementOf(at::ScalarType type, CudaElement* out) {
  switch (type) {
    case at::kFloat:
      *out = CudaElement::kFloat32;
      return true;
    case at::kBFloat16:
      *out = CudaElement::kBFloat16;
      return true;
    case at::kHalf:
      *out = CudaElement::kFloat16;
      return true;
    default:
      return false;
  }
}

}  // namespace moh
