// DeviceContext and GPU figures for a CUDA LibTorch (compiled only when the
// LibTorch found has CUDA; see model/CMakeLists.txt).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/version.h>

#include <atomic>
#include <exception>
#include <optional>

#include "absl/strings/str_cat.h"
#include "model/core/device_context.h"
#include "model/core/runtime.h"

namespace moh {

bool CudaBuild() { return true; }

std::string LibTorchBuildSummary() {
  const int devices = static_cast<int>(c10::cuda::device_count());
  return absl::StrCat("LibTorch ", TORCH_VERSION, " (CUDA ",
                      CUDART_VERSION / 1000, ".", CUDART_VERSION % 1000 / 10,
                      " build, ", devices, devices == 1 ? " GPU" : " GPUs",
                      " visible)");
}

std::vector<GpuMemoryStats> GpuMemory() {
  std::vector<GpuMemoryStats> out;
  const int devices = static_cast<int>(c10::cuda::device_count());
  for (int d = 0; d < devices; ++d) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(
        static_cast<c10::DeviceIndex>(d));
    constexpr size_t kAll = 0;  // StatType::AGGREGATE
    out.push_back({d, stats.allocated_bytes[kAll].current,
                   stats.reserved_bytes[kAll].current,
                   DeviceMemoryCapacity(at::Device(
                       at::kCUDA, static_cast<c10::DeviceIndex>(d)))});
  }
  return out;
}

int64_t DeviceMemoryCapacity(const at::Device& device) {
  if (!device.is_cuda()) return -1;
  const double total = static_cast<double>(
      at::cuda::getDeviceProperties(device.index())->totalGlobalMem);
  return static_cast<int64_t>(total * GpuMemoryFraction());
}

void LimitGpuMemory(const at::Device& device) {
  // Untouched until a share below 1 is asked for: the allocator as ever.
  static std::atomic<bool> capped{false};
  const double fraction = GpuMemoryFraction();
  if (!device.is_cuda() || (fraction >= 1 && !capped.load())) return;
  capped.store(true);
  // The allocator knows its devices once CUDA is initialized (a process's
  // first CUDA tensor does it; this may come before).
  at::globalContext().lazyInitDevice(at::kCUDA);
  c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, device.index());
}

namespace {

// The errors that leave a CUDA context unusable: CUDA's documentation calls
// them sticky (every later call of the process returns them). Others (a
// launch's bad configuration, a call refused while another thread records a
// graph) pass.
bool Sticky(cudaError_t error) {
  switch (error) {
    case cudaErrorIllegalAddress:
    case cudaErrorMisalignedAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorIllegalInstruction:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

}  // namespace

absl::Status DeviceLost(const at::Device& device) {
  if (!device.is_cuda()) return absl::OkStatus();
  c10::cuda::CUDAGuard guard(device);
  const cudaError_t error = cudaDeviceSynchronize();
  if (error == cudaSuccess) return absl::OkStatus();
  if (!Sticky(error)) {
    (void)cudaGetLastError();  // this thread's, cleared
    return absl::OkStatus();
  }
  return absl::UnavailableError(
      absl::StrCat(device.str(), " lost: ", cudaGetErrorString(error),
                   " (the process must restart to use it again)"));
}

void LaunchDeviceFault(const at::Device& device) {
  if (!device.is_cuda()) return;
  c10::cuda::CUDAGuard guard(device);
  const at::Tensor table = at::zeros({1}, at::TensorOptions().device(device));
  const at::Tensor index =
      at::full({1}, int64_t{1} << 20,
               at::TensorOptions().dtype(at::kLong).device(device));
  (void)table.index_select(0, index);  // asserts on the device, not here
  // Waits for it: the error is there (for every later call) on return.
  (void)cudaDeviceSynchronize();
}

struct DeviceContext::Impl {
  std::optional<c10::cuda::CUDAStream> stream;
  // The memory pool of this context's graphs, made at the first capture.
  std::optional<c10::MempoolId_t> graph_pool;
};

namespace {

class CudaScope final : public DeviceContext::Scope {
 public:
  explicit CudaScope(const c10::cuda::CUDAStream& stream) : guard_(stream) {}

 private:
  c10::cuda::CUDAStreamGuard guard_;  // sets the device and the stream
};

class NoScope final : public DeviceContext::Scope {};

class CudaGraph final : public DeviceContext::Graph {
 public:
  void Replay() override { graph.replay(); }
  at::cuda::CUDAGraph graph;
};

}  // namespace

DeviceContext::DeviceContext(at::Device device)
    : device_(device), impl_(std::make_unique<Impl>()) {
  if (device_.is_cuda()) {
    impl_->stream =
        c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index());
  }
}

DeviceContext::~DeviceContext() = default;

std::unique_ptr<DeviceContext::Scope> DeviceContext::Enter() const {
  if (!impl_->stream) return std::make_unique<NoScope>();
  return std::make_unique<CudaScope>(*impl_->stream);
}

at::Tensor DeviceContext::Upload(const at::Tensor& host) const {
  if (!device_.is_cuda() || !host.is_cpu()) return host.to(device_);
  // pin_memory() takes a block of LibTorch's caching host allocator, which
  // records the copy's stream and reuses the block only after it ran.
  return host.pin_memory().to(device_, /*non_blocking=*/true);
}

void DeviceContext::UploadInto(const at::Tensor& host,
                               at::Tensor& device) const {
  if (!device_.is_cuda() || !host.is_cpu()) {
    device.copy_(host);
    return;
  }
  device.copy_(host.pin_memory(), /*non_blocking=*/true);
}

std::vector<at::Tensor> DeviceContext::Download(
    const std::vector<at::Tensor>& tensors) const {
  std::vector<at::Tensor> host;
  bool wait = false;
  for (const at::Tensor& t : tensors) {
    if (!t.is_cuda()) {
      host.push_back(t);
      continue;
    }
    host.push_back(
        at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true)));
    host.back().copy_(t, /*non_blocking=*/true);
    wait = true;
  }
  if (wait) c10::cuda::getCurrentCUDAStream(device_.index()).synchronize();
  return host;
}

absl::StatusOr<std::unique_ptr<DeviceContext::Graph>> DeviceContext::Capture(
    const std::function<void()>& body) const {
  if (!impl_->stream) {
    return absl::UnimplementedError("graphs need a CUDA device");
  }
  if (!impl_->graph_pool) impl_->graph_pool = at::cuda::graph_pool_handle();
  auto graph = std::make_unique<CudaGraph>();
  try {
    // Thread-local: other threads' CUDA calls (another model, a download)
    // go on while this one records.
    graph->graph.capture_begin(*impl_->graph_pool,
                               cudaStreamCaptureModeThreadLocal);
    try {
      body();
    } catch (...) {
      try {  // leaves the stream out of capture mode; the graph is void
        graph->graph.capture_end();
      } catch (const std::exception&) {
      }
      throw;
    }
    graph->graph.capture_end();
  } catch (const std::exception& e) {
    // A failed capture can leave a sticky "operation not permitted when
    // capturing" error behind; clear it so the next launch does not fail.
    (void)cudaGetLastError();
    absl::Status status = StatusFromException(e, "CUDA graph capture failed");
    if (absl::IsResourceExhausted(status)) return status;
    return absl::FailedPreconditionError(status.message());
  }
  return std::unique_ptr<DeviceContext::Graph>(std::move(graph));
}

}  // namespace moh
