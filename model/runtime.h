// Device, dtype and thread settings shared by every model.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moh {

// Where and in which precision a model runs.
struct DeviceOptions {
  std::string device =
      "auto";  // "auto" (CUDA when LibTorch has it), "cpu", "cuda", "cuda:N"
  std::string dtype = "auto";  // "auto" (bf16 on CUDA, fp32 on CPU), "float32",
                               // "bfloat16", "float16"
};

// INVALID_ARGUMENT naming `device` and the accepted values; FAILED_PRECONDITION
// when CUDA is asked for and this LibTorch has none.
absl::StatusOr<at::Device> ResolveDevice(absl::string_view name);
absl::StatusOr<at::ScalarType> ResolveDtype(absl::string_view name,
                                            const at::Device& device);
absl::StatusOr<at::TensorOptions> ResolveTensorOptions(
    const DeviceOptions& options);

// Sets LibTorch's intra-op thread count (<= 0: one per available core).
// Debian's LibTorch otherwise defaults to a single thread.
void ConfigureCpuThreads(int num_threads);

std::string DtypeName(at::ScalarType dtype);

}  // namespace moh
