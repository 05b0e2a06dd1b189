// DeviceContext and GPU figures for a LibTorch without CUDA (Debian's): no
// GPU exists for this build, so every call is a no-op or a plain copy.
#include <torch/version.h>

#include "absl/strings/str_cat.h"
#include "model/core/device_context.h"

namespace moh {

bool CudaBuild() { return false; }

std::string LibTorchBuildSummary() {
  return absl::StrCat("LibTorch ", TORCH_VERSION, " (CPU build)");
}

std::vector<GpuMemoryStats> GpuMemory() { return {}; }

int64_t DeviceMemoryCapacity(const at::Device&) { return -1; }

void LimitGpuMemory(const at::Device&) {}

absl::Status DeviceLost(const at::Device&) { return absl::OkStatus(); }

void LaunchDeviceFault(const at::Device&) {}

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

void DeviceContext::UploadInto(const at::Tensor& host,
                               at::Tensor& device) const {
  device.copy_(host);
}

std::vector<at::Tensor> DeviceContext::Download(
    const std::vector<at::Tensor>& tensors) const {
  return tensors;  // already on the host
}

absl::StatusOr<std::unique_ptr<DeviceContext::Graph>> DeviceContext::Capture(
    const std::function<void()>&) const {
  return absl::UnimplementedError("graphs need a CUDA build and device");
}

}  // namespace moh
