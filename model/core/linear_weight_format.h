// A linear weight as a model takes it from its checkpoint, converted to the
// WeightFormat its DeviceOptions::weights resolved to (ResolveWeightFormat):
// what every family that accepts `weights` shares at load.
#pragma once

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <ATen/ATen.h>

#include "model/core/linear.h"
#include "model/core/runtime.h"

namespace moh {

// `weight` (just taken: the model's dtype, float32 for a converted format)
// in `format`: itself, a contiguous bfloat16 copy, or int8 values with a
// scale per row (QuantizedLinearWeight). The float32 tensor is released
// when the caller's copy goes.
inline LinearWeight ConvertedLinearWeight(at::Tensor weight,
                                          WeightFormat format) {
  switch (format) {
    case WeightFormat::kAsLoaded:
      return weight;
    case WeightFormat::kBfloat16:
      return weight.to(at::kBFloat16).contiguous();
    case WeightFormat::kInt8:
      return QuantizedLinearWeight(weight);
  }
  return weight;
}

// After a load that converted its weights (`format` not kAsLoaded): the
// float32 copies freed weight by weight would stay in the process's heap
// (ConfigureCpuAllocator keeps freed heap for activations), so their pages
// go back to the system now.
inline void ReleaseConversionHeap(WeightFormat format) {
#ifdef __GLIBC__
  if (format != WeightFormat::kAsLoaded) malloc_trim(0);
#endif
}

}  // namespace moh
