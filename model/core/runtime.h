// Device, dtype and thread settings shared by every model.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace moh {

// Where and in which precision a model runs.
struct DeviceOptions {
  std::string device =
      "auto";  // "auto" (CUDA when LibTorch has it), "cpu", "cuda", "cuda:N"
  std::string dtype = "auto";  // "auto" (bf16 on CUDA, fp32 on CPU), "float32",
                               // "bfloat16", "float16"
  // A language model's or a MoH-ViT's linear weights (ResolveWeightFormat):
  // "" or "auto" (as dtype), "bfloat16" or "int8", converted as they load.
  std::string weights;
};

// How a model holds its linear weights (attention, MLP, head) under float32
// activations on the CPU: as the model's dtype, bfloat16 (Bf16Linear) or
// weight-only int8 with a scale per output row (Int8Linear).
enum class WeightFormat { kAsLoaded, kBfloat16, kInt8 };

// `name` ("", "auto", "bfloat16", "int8") for a model of `model`'s device
// and dtype: INVALID_ARGUMENT naming `field` for another name, on CUDA, or
// for a dtype other than float32.
absl::StatusOr<WeightFormat> ResolveWeightFormat(
    absl::string_view name, const at::TensorOptions& model,
    absl::string_view field = "weights");
// "" (kAsLoaded), "bfloat16" or "int8".
const char* WeightFormatName(WeightFormat format);

// INVALID_ARGUMENT naming `device` and the accepted values; FAILED_PRECONDITION
// when CUDA is asked for and this LibTorch has none.
absl::StatusOr<at::Device> ResolveDevice(absl::string_view name);
// `field`: the setting's name in error messages.
absl::StatusOr<at::ScalarType> ResolveDtype(absl::string_view name,
                                            const at::Device& device,
                                            absl::string_view field = "dtype");
// The KV cache's element type for kv_cache_dtype `name`: "auto" is the
// model's own (`model`); otherwise as ResolveDtype, errors naming `field`.
absl::StatusOr<at::ScalarType> ResolveKvCacheDtype(
    absl::string_view name, const at::TensorOptions& model,
    absl::string_view field = "kv_cache_dtype");
// Also applies GpuMemoryFraction() to a CUDA device (LimitGpuMemory): every
// model resolves its options so before its weights load.
absl::StatusOr<at::TensorOptions> ResolveTensorOptions(
    const DeviceOptions& options);

// The share of each GPU's memory, in (0, 1], that LibTorch's caching
// allocator may hold for this process (moh-server's gpu_memory_fraction: a
// GPU shared with other processes; default 1). Past it an allocation fails
// as out of memory, as on a smaller device, and DeviceMemoryCapacity reports
// the share. Set it before models load: a device takes it when a model is
// placed there (ResolveTensorOptions).
void SetGpuMemoryFraction(double fraction);
double GpuMemoryFraction();

// Sets LibTorch's intra-op (OpenMP) thread count; <= 0 means the default.
// With OpenBLAS's OpenMP build, LibTorch and OpenBLAS share one pool and a
// matrix product inside at::parallel_for runs on its caller's thread; the
// default is then every core but one (left to the gRPC, tokenizer and metrics
// threads: an OpenMP thread that loses its core stalls each parallel region
// while its partner spins at the barrier). With the pthreads build, two pools
// of spinning threads oversubscribe the cores (on the 2-core CI machine that
// made batched decode 5-50x slower), so the default is 1 and OpenBLAS alone
// threads the products.
void ConfigureCpuThreads(int num_threads);

// Keeps the memory of freed tensors in the process for the next step instead
// of returning it to the kernel: glibc serves a block above its (adaptive)
// mmap threshold with a fresh mapping and trims the heap top past twice that,
// so every forward pass re-faulted its activations page by page (perf: 8% of
// a 512-token prefill of the bench model in the kernel's page-fault path;
// removing it made that prefill 1.2x faster). Blocks up to 32 MiB come from
// the heap, and up to 256 MiB of freed heap top stays mapped. Each setting
// the environment already gives (MALLOC_*_ variables, or glibc.malloc
// tunables in GLIBC_TUNABLES) is left to it.
void ConfigureCpuAllocator();

// One line for logs: intra-op threads and the BLAS threading in use.
std::string CpuThreadingSummary();

std::string DtypeName(at::ScalarType dtype);

// The status for an exception thrown while running a model: "<what>: "
// (when given) and its message, without LibTorch's backtrace.
// RESOURCE_EXHAUSTED, "out of memory: ...", when an allocator could not give
// the memory asked (c10::OutOfMemoryError: CUDA's caching allocator once it
// has freed its cache and retried; std::bad_alloc): the device is sound,
// and the same work in a smaller batch, or later, may fit. INTERNAL
// otherwise (LibTorch's CPU allocator fails with a plain c10::Error: on the
// host, memory runs out through the kernel's OOM killer first).
absl::Status StatusFromException(const std::exception& e,
                                 absl::string_view what = {});

// Runs `fn` (returning an absl::Status or StatusOr) and turns an exception
// into StatusFromException(e, what).
template <typename Fn>
auto CatchTorchErrors(const char* what, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const std::exception& e) {
    return StatusFromException(e, what);
  }
}

}  // namespace moh
