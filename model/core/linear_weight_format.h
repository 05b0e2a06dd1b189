// A linear weight as a model takes it from its checkpoint, converted to the
// WeightFormat its DeviceOptions::weights resolved to (ResolveWeightFormat):
// what every family that accepts `weights` shares at load.
#pragma once

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/checkpoint/checkpoint.h"
#include "model/core/linear.h"
#include "model/core/model_config.h"
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

// OK for kAsLoaded, else ResolveWeightFormat's verdict on `format` with
// `options`: what a loader checks first, as its caller may not have resolved
// the format against the options it passes.
absl::Status CheckWeightFormat(WeightFormat format,
                               const at::TensorOptions& options);

// The linear weight `name` of `shape` taken from `store` in `options`, then
// ConvertedLinearWeight(…, format).
absl::StatusOr<LinearWeight> TakeConvertedLinear(
    TensorStore& store, const std::string& name, std::vector<int64_t> shape,
    const at::TensorOptions& options, WeightFormat format);

// INVALID_ARGUMENT "<file>: tensor '<name>' <what>", the checkpoint
// readers' error style (the store's description when no file holds `name`).
absl::Status TensorError(const TensorStore& store, const std::string& name,
                         const std::string& what);

// The linear weight `name` [shape[0], shape[1]] of a pre-quantized
// checkpoint, stored as int8 with its scale beside it in `layout`
// (model_config.h): in `format` kInt8, its int8 values and a float32 scale
// per row as they are stored (bitsandbytes' SCB divided by 127; a
// compressed-tensors scale for the whole matrix repeated per row);
// otherwise values * scale, in bfloat16 for kBfloat16 and in `options`'
// dtype and device for kAsLoaded. Takes the scale too, and what the layout
// stores beside them: bitsandbytes' weight_format (which must say row-major,
// 0), compressed-tensors' weight_zero_point (which must be zero) and
// input_scale / input_zero_point (static activation scales, not used: the
// activations stay float32, or are quantized per 32 values on VNNI CPUs).
// INVALID_ARGUMENT naming the tensor otherwise, or when a scale is missing
// (NOT_FOUND), mis-shaped, negative or not finite.
absl::StatusOr<LinearWeight> TakePrequantizedLinear(
    TensorStore& store, const std::string& name, at::IntArrayRef shape,
    PrequantizedLayout layout, const at::TensorOptions& options,
    WeightFormat format);

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
