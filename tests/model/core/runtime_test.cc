// ConfigureCpuAllocator (model/core/runtime.h): after it, a freed
// activation-sized block is reused from the heap instead of being mapped and
// unmapped again, unless the environment set glibc's own variable. Each case
// runs in a child process: glibc's settings are process-wide.
#include "model/core/runtime.h"

#include <gtest/gtest.h>
#include <malloc.h>

#include <cstdlib>

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

}  // namespace
}  // namespace moh
