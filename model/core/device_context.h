// What a model needs from its device beyond tensors: on CUDA, a current device
// and a stream of its own for the thread doing the model's work, host buffers
// that copy to the device without a sync, and the caching allocator's memory
// figures. One interface, two implementations: device_context_cuda.cc when
// the LibTorch in use has CUDA (the PyPI wheel's), device_context_cpu.cc
// otherwise (Debian's), where every call is a cheap no-op.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moh {

// "LibTorch 2.11.0 (CUDA 13.0 build, 1 GPU visible)" or
// "LibTorch 1.13.0 (CPU build)": for logs and --version.
std::string LibTorchBuildSummary();

// Whether this binary was built against a CUDA LibTorch.
bool CudaBuild();

// Caching-allocator memory of one CUDA device, in bytes.
struct GpuMemoryStats {
  int device = 0;
  int64_t allocated_bytes = 0;  // held by live tensors
  int64_t reserved_bytes = 0;   // held by the caching allocator (>= allocated)
  int64_t limit_bytes = 0;  // what the process may hold: DeviceMemoryCapacity
};

// One entry per visible CUDA device (empty on CPU builds or without GPUs).
// Reads counters only: no sync, no allocation on the device.
std::vector<GpuMemoryStats> GpuMemory();

// Memory of `device` this process may use, in bytes, when it is a CUDA
// device: its total times GpuMemoryFraction(); -1 otherwise (host memory is
// the operating system's to account).
int64_t DeviceMemoryCapacity(const at::Device& device);

// Applies GpuMemoryFraction() (model/core/runtime.h) to `device`'s caching
// allocator when it is a CUDA device: past that share of its memory an
// allocation fails as out of memory. Nothing otherwise, nor while the share
// is 1 and no smaller one was applied (the allocator stays as LibTorch
// leaves it). Initializes CUDA if nothing did yet.
void LimitGpuMemory(const at::Device& device);

// OK while `device` can still run work; UNAVAILABLE naming the error once
// it cannot: a CUDA context lost to a sticky error (an illegal memory
// access, a misaligned address, a kernel's trap or assertion, an
// uncorrectable ECC error), which every later call returns, so the process
// must restart. Waits for the device's work (one synchronization; an error
// that is not sticky is cleared and passes). For after a forward failed;
// always OK on CPU.
absl::Status DeviceLost(const at::Device& device);

// Tests only: makes a CUDA `device` lost for real. Launches, on its current
// stream, a gather whose index is out of range, which fails a device-side
// assertion, and waits for it: on return every later CUDA call of the
// process fails with that sticky error, as DeviceLost reports. Nothing on
// CPU (which cannot be lost).
void LaunchDeviceFault(const at::Device& device);

// A model's device context. On CUDA: the model's device and a stream taken
// from LibTorch's pool when the context is made; Enter() makes both current
// on the calling thread until the returned scope ends, so the kernels of
// different models (and of the model and other threads) do not serialize on
// the default stream. On CPU: nothing. Thread-compatible: one Enter() per
// thread at a time; the context outlives its scopes.
class DeviceContext {
 public:
  class Scope {
   public:
    virtual ~Scope() = default;
  };

  explicit DeviceContext(at::Device device);
  ~DeviceContext();
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;

  std::unique_ptr<Scope> Enter() const;

  // Copies a host tensor to the device without blocking the host: on CUDA
  // through a pinned block of LibTorch's caching host allocator (which hands
  // the block out again only after the copy ran), ordered on the model's
  // stream before any later kernel of it; on CPU a plain (aliasing when
  // nothing changes) conversion. Call inside a scope.
  at::Tensor Upload(const at::Tensor& host) const;

  // Upload() into an existing tensor of the device (same shape), with no
  // second copy there: what a recorded graph reads is refreshed so.
  void UploadInto(const at::Tensor& host, at::Tensor& device) const;

  // Copies `tensors` to host memory (pinned on CUDA) asynchronously and waits
  // once for the model's stream: the one sync a step needs to read its
  // results on the host. Call inside a scope.
  std::vector<at::Tensor> Download(
      const std::vector<at::Tensor>& tensors) const;

  // The kernels one call of a function launched on the model's stream,
  // recorded once (a CUDA graph) and launched again as one unit: each
  // Replay() reads the tensors the recording read, with whatever they hold
  // then, and overwrites the tensors it made. Call Replay() inside a scope.
  class Graph {
   public:
    virtual ~Graph() = default;
    virtual void Replay() = 0;
  };
  // Records what `body` launches, without running it. The graphs of one
  // context share one memory pool: replay them one at a time (never two at
  // once), and keep what one graph made that is read later alive (the pool
  // does not hand out the memory of a live tensor). FAILED_PRECONDITION
  // when `body` did what a graph cannot hold (a wait for the device, a copy
  // to the host); RESOURCE_EXHAUSTED when the pool could not get the memory
  // `body` asked (the same recording may fit later); UNIMPLEMENTED on CPU.
  // Call inside a scope.
  absl::StatusOr<std::unique_ptr<Graph>> Capture(
      const std::function<void()>& body) const;

 private:
  struct Impl;
  at::Device device_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moh
