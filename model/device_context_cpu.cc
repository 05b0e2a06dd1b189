// DeviceContext and GPU figures for a LibTorch without CUDA (Debian's): no
// GPU exists for this build, so every call is a no-op or a plain copy.
#include <torch/version.h>

#include "absl/strings/str_cat.h"
#include "model/device_context.h"

namespace moh {

bool CudaBuild() { return false; }

std::string LibTorchBuildSummary() {
  return absl::StrCat("LibTorch ", TORCH_VERSION, " (CPU build)");
}

std::vector<GpuMemoryStats> GpuMemory() { return {}; }

struct DeviceContext::Impl {};

DeviceContext::DeviceContext(at::Device device)
    : device_(device), impl_(std::make_unique<Impl>()) {}

DeviceContext::~DeviceContext() = default;

std::unique_ptr<DeviceContext::Scope> DeviceContext::Enter() const {
  return std::make_unique<Scope>();
}

at::Tensor DeviceContext::Upload(const at::Tensor& host) const {
  return host.to(device_);
}

at::Tensor DeviceContext::Download(const at::Tensor& device_tensor) const {
  return device_tensor.cpu();
}

}  // namespace moh
