#include "model/core/runtime.h"

#include <ATen/Parallel.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <dlfcn.h>
#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <new>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/abbreviate.h"
#include "model/core/device_context.h"

namespace moh {

absl::StatusOr<at::Device> ResolveDevice(absl::string_view name) {
  const bool has_cuda = at::hasCUDA();
  if (name == "auto" || name.empty()) {
    return has_cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  }
  if (name == "cpu") return at::Device(at::kCPU);
  if (name == "cuda" || absl::StartsWith(name, "cuda:")) {
    if (!has_cuda) {
      return absl::FailedPreconditionError(
          "device: CUDA requested but this LibTorch build has no CUDA device");
    }
    int index = 0;
    if (name != "cuda" && !absl::SimpleAtoi(name.substr(5), &index)) {
      return absl::InvalidArgumentError(
          absl::StrCat("device: bad CUDA index in \"", name, "\""));
    }
    const int count = at::detail::getCUDAHooks().getNumGPUs();
    if (index < 0 || index >= count) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device: CUDA index must be in [0, ", count, "), got ", index));
    }
    return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("device must be \"auto\", \"cpu\", \"cuda\" or \"cuda:N\", "
                   "got \"",
                   name, "\""));
}

absl::StatusOr<at::ScalarType> ResolveDtype(absl::string_view name,
                                            const at::Device& device,
                                            absl::string_view field) {
  if (name == "auto" || name.empty()) {
    return device.is_cuda() ? at::kBFloat16 : at::kFloat;
  }
  if (name == "float32" || name == "fp32") return at::kFloat;
  if (name == "bfloat16" || name == "bf16") return at::kBFloat16;
  if (name == "float16" || name == "fp16") {
    if (!device.is_cuda()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field,
          " \"float16\" needs a CUDA device; on CPU use \"float32\" or "
          "\"bfloat16\""));
    }
    return at::kHalf;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field,
                   " must be \"auto\", \"float32\", \"bfloat16\" or "
                   "\"float16\", got \"",
                   Abbreviate(name), "\""));
}

absl::StatusOr<at::ScalarType> ResolveKvCacheDtype(
    absl::string_view name, const at::TensorOptions& model,
    absl::string_view field) {
  if (name == "auto" || name.empty()) {
    return at::typeMetaToScalarType(model.dtype());
  }
  return ResolveDtype(name, model.device(), field);
}

absl::StatusOr<WeightFormat> ResolveWeightFormat(absl::string_view name,
                                                 const at::TensorOptions& model,
                                                 absl::string_view field) {
  if (name.empty() || name == "auto") return WeightFormat::kAsLoaded;
  WeightFormat format;
  if (name == "bfloat16" || name == "bf16") {
    format = WeightFormat::kBfloat16;
  } else if (name == "int8") {
    format = WeightFormat::kInt8;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be \"\", \"auto\", \"bfloat16\" or ",
                     "\"int8\", got \"", Abbreviate(name), "\""));
  }
  if (!model.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", WeightFormatName(format),
        " weights under float32 activations are for the CPU; on CUDA set "
        "dtype: \"bfloat16\""));
  }
  const at::ScalarType dtype = at::typeMetaToScalarType(model.dtype());
  if (dtype != at::kFloat) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", WeightFormatName(format),
                     " weights need dtype float32, got ", DtypeName(dtype)));
  }
  return format;
}

const char* WeightFormatName(WeightFormat format) {
  switch (format) {
    case WeightFormat::kAsLoaded:
      return "";
    case WeightFormat::kBfloat16:
      return "bfloat16";
    case WeightFormat::kInt8:
      return "int8";
  }
  return "";
}

absl::StatusOr<at::TensorOptions> ResolveTensorOptions(
    const DeviceOptions& options) {
  auto device = ResolveDevice(options.device);
  if (!device.ok()) return device.status();
  auto dtype = ResolveDtype(options.dtype, *device);
  if (!dtype.ok()) return dtype.status();
  LimitGpuMemory(*device);
  return at::TensorOptions().device(*device).dtype(*dtype);
}

namespace {
std::atomic<double> gpu_memory_fraction{1.0};
}  // namespace

void SetGpuMemoryFraction(double fraction) {
  gpu_memory_fraction.store(fraction, std::memory_order_relaxed);
}

double GpuMemoryFraction() {
  return gpu_memory_fraction.load(std::memory_order_relaxed);
}

namespace {

// OpenBLAS's threading model: 0 sequential, 1 pthreads, 2 OpenMP; -1 when
// the BLAS in use is not OpenBLAS.
int OpenBlasParallelism() {
  using Fn = int (*)();
  auto fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "openblas_get_parallel"));
  return fn != nullptr ? fn() : -1;
}

}  // namespace

void ConfigureCpuThreads(int num_threads) {
  if (num_threads <= 0) {
    // Every core but one, which stays free for the gRPC, tokenizer and
    // metrics threads: an OpenMP thread that loses its core to them stalls
    // every parallel region (its partner spins at the barrier).
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    num_threads = OpenBlasParallelism() == 2 ? std::max(1, cores - 1) : 1;
  }
  at::set_num_threads(num_threads);
}

void ConfigureCpuAllocator() {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables != nullptr && absl::StrContains(tunables, "glibc.malloc.")) {
    return;
  }
  struct Setting {
    int param;
    const char* variable;
    int value;
  };
  constexpr int kMiB = 1 << 20;
  for (const Setting& s :
       {Setting{M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", 32 * kMiB},
        Setting{M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", 256 * kMiB},
        Setting{M_TOP_PAD, "MALLOC_TOP_PAD_", 64 * kMiB}}) {
    if (std::getenv(s.variable) == nullptr) mallopt(s.param, s.value);
  }
}

std::string CpuThreadingSummary() {
  const char* blas = "unknown BLAS";
  switch (OpenBlasParallelism()) {
    case 0:
      blas = "OpenBLAS (sequential)";
      break;
    case 1:
      blas = "OpenBLAS (pthreads: own thread pool)";
      break;
    case 2:
      blas = "OpenBLAS (OpenMP: shared thread pool)";
      break;
  }
  return absl::StrCat(at::get_num_threads(), " intra-op threads, ", blas);
}

absl::Status StatusFromException(const std::exception& e,
                                 absl::string_view what) {
  const auto* torch = dynamic_cast<const c10::Error*>(&e);
  const std::string message = absl::StrCat(
      what, what.empty() ? "" : ": ",
      torch != nullptr ? torch->what_without_backtrace() : e.what());
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr ||
      dynamic_cast<const std::bad_alloc*>(&e) != nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("out of memory: ", message));
  }
  return absl::InternalError(message);
}

std::string DtypeName(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return "float32";
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    default:
      return c10::toString(dtype);
  }
}

}  // namespace moh
