// linear_weight_format.h: the loaders' format check and converted take, and
// TakePrequantizedLinear: a pre-quantized checkpoint's int8 linear weight and
// its scales, in the two layouts quantization_config names (model_config.h's
// PrequantizedLayout).
#include "model/core/linear_weight_format.h"

#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"

namespace moh {

absl::Status CheckWeightFormat(WeightFormat format,
                               const at::TensorOptions& options) {
  if (format == WeightFormat::kAsLoaded) return absl::OkStatus();
  return ResolveWeightFormat(WeightFormatName(format), options).status();
}

absl::StatusOr<LinearWeight> TakeConvertedLinear(
    TensorStore& store, const std::string& name, std::vector<int64_t> shape,
    const at::TensorOptions& options, WeightFormat format) {
  MOH_ASSIGN_OR_RETURN(at::Tensor weight,
                       store.Take(name, std::move(shape), options));
  return ConvertedLinearWeight(std::move(weight), format);
}

absl::Status TensorError(const TensorStore& store, const std::string& name,
                         const std::string& what) {
  const absl::StatusOr<std::string> file = store.SourceFile(name);
  return absl::InvalidArgumentError(absl::StrCat(
      file.ok() ? *file : store.description(), ": tensor '", name, "' ", what));
}

namespace {

std::string Shape(at::IntArrayRef sizes) {
  return absl::StrCat("[", absl::StrJoin(sizes, ", "), "]");
}

// The scale `scale_name` for `rows` rows: [rows], [rows, 1], or one value
// ([], [1], [1, 1]) for every row; float32 [rows], divided by `divisor`.
absl::StatusOr<at::Tensor> TakeRowScales(TensorStore& store,
                                         const std::string& scale_name,
                                         int64_t rows, double divisor) {
  MOH_ASSIGN_OR_RETURN(at::Tensor raw, store.Get(scale_name));
  const std::vector<int64_t> sizes = raw.sizes().vec();
  const bool per_row = raw.numel() == rows &&
                       (raw.dim() == 1 || (raw.dim() == 2 && raw.size(1) == 1));
  if (!per_row && raw.numel() != 1) {
    return TensorError(
        store, scale_name,
        absl::StrCat("has shape ", Shape(sizes), ", expected [", rows, "], [",
                     rows, ", 1] or one value for the whole matrix"));
  }
  if (!at::isFloatingType(raw.scalar_type())) {
    return TensorError(store, scale_name, "must hold floating-point scales");
  }
  MOH_ASSIGN_OR_RETURN(at::Tensor scale,
                       store.Take(scale_name, sizes, at::kFloat));
  scale = (scale.reshape({-1}).expand({rows}) / divisor).contiguous();
  if (!at::isfinite(scale).all().item<bool>() ||
      (scale < 0).any().item<bool>()) {
    return TensorError(store, scale_name,
                       "holds a negative or non-finite scale");
  }
  return scale;
}

// Takes `name` when the store has it, requiring every value to be
// `allowed` (e.g. a zero point of 0): what the layout stores beside a
// weight that changes nothing here.
absl::Status TakeIfAllEqual(TensorStore& store, const std::string& name,
                            int64_t allowed, const std::string& what) {
  if (!store.Contains(name)) return absl::OkStatus();
  MOH_ASSIGN_OR_RETURN(at::Tensor raw, store.Get(name));
  MOH_ASSIGN_OR_RETURN(at::Tensor values,
                       store.Take(name, raw.sizes().vec(), at::kLong));
  if (!(values == allowed).all().item<bool>()) {
    return TensorError(store, name, what);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LinearWeight> TakePrequantizedLinear(
    TensorStore& store, const std::string& name, at::IntArrayRef shape,
    PrequantizedLayout layout, const at::TensorOptions& options,
    WeightFormat format) {
  const std::string base =
      absl::EndsWith(name, ".weight") ? name.substr(0, name.size() - 7) : name;
  LinearWeight q;
  switch (layout) {
    case PrequantizedLayout::kCompressedTensors: {
      MOH_ASSIGN_OR_RETURN(q.scale,
                           TakeRowScales(store, name + "_scale", shape[0], 1));
      MOH_RETURN_IF_ERROR(TakeIfAllEqual(
          store, name + "_zero_point", 0,
          "holds a non-zero zero point (only symmetric int8 is supported)"));
      // Static activation scales of a W8A8 checkpoint: unused here.
      store.Discard(base + ".input_scale");
      store.Discard(base + ".input_zero_point");
      break;
    }
    case PrequantizedLayout::kBitsandbytes: {
      // SCB is each row's largest |W|: W = weight * SCB / 127.
      MOH_ASSIGN_OR_RETURN(q.scale,
                           TakeRowScales(store, base + ".SCB", shape[0], 127));
      MOH_RETURN_IF_ERROR(TakeIfAllEqual(
          store, name + "_format", 0,
          "must be 0 (row-major int8; bitsandbytes' tiled GPU layouts are not "
          "supported)"));
      break;
    }
    case PrequantizedLayout::kNone:
      return TensorError(store, name,
                         "is int8: config.json needs a quantization_config "
                         "naming its layout");
  }
  MOH_ASSIGN_OR_RETURN(q.values, store.Take(name, shape, at::kChar));
  if (format == WeightFormat::kInt8) return q;
  at::Tensor dense = q.Dense(at::kFloat);
  if (format == WeightFormat::kBfloat16) {
    return ConvertedLinearWeight(std::move(dense), format);
  }
  return LinearWeight(dense.to(options));
}

}  // namespace moh
