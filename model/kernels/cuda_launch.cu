// Programmatic dependent launch's switch (cuda_launch.h).
#include <cuda_runtime.h>

#include <array>
#include <atomic>

#include "model/kernels/cuda_launch.h"

namespace moh::cuda {
namespace {

std::atomic<bool> requested{false};
// Per device: 0 not yet asked, 1 before Hopper, 2 Hopper or later.
std::array<std::atomic<int>, 64> capable{};

bool DeviceCapable() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 ||
      device >= static_cast<int>(capable.size())) {
    return false;
  }
  int known = capable[device].load(std::memory_order_relaxed);
  if (known == 0) {
    int major = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    known = major >= 9 ? 2 : 1;
    capable[device].store(known, std::memory_order_relaxed);
  }
  return known == 2;
}

}  // namespace

void SetProgrammaticLaunch(bool on) {
  requested.store(on, std::memory_order_relaxed);
}

bool ProgrammaticLaunch() {
  return requested.load(std::memory_order_relaxed) && DeviceCapable();
}

}  // namespace moh::cuda
