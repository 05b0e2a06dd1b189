// ConfigureCpuAllocator (model/core/runtime.h): after it, a freed
// activation-sized block is reused from the heap instead of being mapped and
// unmapped again, unless the environment set glibc's own variable. Each case
// runs in a child process: glibc's settings are process-wide.
#include "model/core/runtime.h"

#include <gtest/gtest.h>
#include <malloc.h>

#include <cstdlib>
#include <new>
#include <stdexcept>

namespace moh {
namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kGlibcMalloc = false;  // the sanitizer has its own allocator
#else
constexpr bool kGlibcMalloc = true;
#endif

// Whether an 8 MiB block (a 512-token prefill's MLP activations are 2.8 MB)
// is served by a mapping of its own rather than from the heap.
bool BlockIsMapped() {
  // Volatile: the compiler may otherwise drop an unused malloc/free pair.
  static void *volatile block;
  const size_t before = mallinfo2().hblkhd;
  block = std::malloc(8 << 20);
  const bool mapped = mallinfo2().hblkhd > before;
  std::free(block);
  return mapped;
}

TEST(ConfigureCpuAllocatorTest, KeepsActivationBlocksOnTheHeap) {
  if (!kGlibcMalloc) GTEST_SKIP() << "not glibc's allocator";
  EXPECT_EXIT(
      {
        // glibc's starting point (its threshold adapts upwards as mapped
        // blocks are freed, so the test process's history would decide).
        mallopt(M_MMAP_THRESHOLD, 128 << 10);
        unsetenv("MALLOC_MMAP_THRESHOLD_");
        unsetenv("GLIBC_TUNABLES");
        const bool mapped_before = BlockIsMapped();
        ConfigureCpuAllocator();
        std::exit(mapped_before && !BlockIsMapped() ? 0 : 1);
      },
      testing::ExitedWithCode(0), "");
}

TEST(ConfigureCpuAllocatorTest, LeavesTheEnvironmentsSettingAlone) {
  if (!kGlibcMalloc) GTEST_SKIP() << "not glibc's allocator";
  EXPECT_EXIT(
      {
        // As glibc does at start-up when the variable is set.
        setenv("MALLOC_MMAP_THRESHOLD_", "131072", 1);
        mallopt(M_MMAP_THRESHOLD, 128 << 10);
        ConfigureCpuAllocator();
        std::exit(BlockIsMapped() ? 0 : 1);
      },
      testing::ExitedWithCode(0), "");
}

// Running out of memory is RESOURCE_EXHAUSTED (the device is sound: a
// smaller batch, or later, may fit); every other failure INTERNAL; either
// names where it happened and leaves LibTorch's backtrace out.
TEST(StatusFromExceptionTest, OutOfMemoryIsRetryableTheRestInternal) {
  try {
    TORCH_CHECK_WITH(OutOfMemoryError, false,
                     "CUDA out of memory. Tried 2 GiB");
  } catch (const std::exception& e) {
    const absl::Status status = StatusFromException(e, "forward");
    EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(status.message(),
              "out of memory: forward: CUDA out of memory. Tried 2 GiB");
  }
  const absl::Status bad_alloc = StatusFromException(std::bad_alloc());
  EXPECT_EQ(bad_alloc.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(bad_alloc.message(), "out of memory: std::bad_alloc");
  try {
    TORCH_CHECK(false, "shapes do not match");
  } catch (const std::exception& e) {
    const absl::Status status = StatusFromException(e, "forward");
    EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
    EXPECT_EQ(status.message(), "forward: shapes do not match");
  }
  const absl::Status other = StatusFromException(std::runtime_error("boom"));
  EXPECT_EQ(other.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(other.message(), "boom");
}

// CatchTorchErrors gives a model's forward the same statuses.
TEST(StatusFromExceptionTest, CatchTorchErrorsMapsThem) {
  const absl::StatusOr<int> oom = CatchTorchErrors("forward", [] {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory");
    return absl::StatusOr<int>(1);
  });
  EXPECT_EQ(oom.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(oom.status().message(),
            "out of memory: forward: CUDA out of memory");
  const absl::StatusOr<int> other = CatchTorchErrors("forward", [] {
    at::zeros({2}).view({3});  // a shape error
    return absl::StatusOr<int>(1);
  });
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(other.status().message().find("forward: "), 0u) << other.status();
  EXPECT_EQ(other.status().message().find("Exception raised from"),
            std::string::npos);
}

}  // namespace
}  // namespace moh
