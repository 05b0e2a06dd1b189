// What the kernel tests share: each test binary is registered once per
// instruction set (tests/CMakeLists.txt sets MOH_CPU_ISA to avx512, avx512f,
// avx2 or portable), and a test of the kernels' results skips where that
// run's kernels do not run: the avx512 and avx512f runs on a CPU without
// AVX-512F, and every run under portable (where the kernels refuse, which
// KernelIsaTest.RequestedInstructionSetIsTheOneThatRuns checks).
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "model/kernels/cpu_isa.h"

namespace moh {

// Why this run's kernels do not run, or "" when they do.
inline std::string KernelsSkipReason() {
  const char *requested = std::getenv("MOH_CPU_ISA");
  const CpuIsa active = ActiveIsa();
  std::string wanted = requested != nullptr ? requested : "";
  // AVX-512 with its extensions left out (cpu_isa.h).
  if (wanted == "avx512f") wanted = IsaName(CpuIsa::kAvx512);
  if (!wanted.empty() && wanted != IsaName(active)) {
    return std::string("MOH_CPU_ISA=") + requested + " but this CPU runs " +
           IsaName(active);
  }
  if (active == CpuIsa::kPortable) return "the kernels refuse under portable";
  return "";
}

#define MOH_SKIP_UNLESS_KERNELS_RUN()                                         \
  if (const std::string reason = ::moh::KernelsSkipReason(); !reason.empty()) \
  GTEST_SKIP() << reason

// Runs `kernel(y)` (y [m, n] float32, poisoned with NaN first; it returns
// whether it ran) and expects at::linear(x, w, bias) (bias may be
// undefined) within float32's summation-order error, relative 1e-4 and
// absolute 1e-3 sqrt(k). `what` names the case in a failure.
template <typename Kernel>
void ExpectKernelEqualsLinear(const at::Tensor &x, const at::Tensor &w,
                              const at::Tensor &bias, const std::string &what,
                              const Kernel &kernel) {
  const at::Tensor want =
      bias.defined() ? at::linear(x, w, bias) : at::linear(x, w);
  at::Tensor got = at::full({x.size(0), w.size(0)}, std::nanf(""));
  ASSERT_TRUE(kernel(got.data_ptr<float>()))
      << "the kernel refused under " << IsaName(ActiveIsa());
  EXPECT_TRUE(
      at::allclose(got, want, 1e-4, 1e-3 * std::sqrt(double(x.size(1)))))
      << what << " m " << x.size(0) << " k " << x.size(1) << " n " << w.size(0)
      << " bias " << bias.defined() << " max error "
      << (got - want).abs().max().item<float>();
}

// The shapes the bf16 and int8 linear kernel tests run, each through
// expect(m, k, n, bias, extra_columns) (extra_columns widen W's row stride
// past k: a column slice).
// Every row count of the few-row path, up to max_rows.
template <typename Expect>
void ForFewRowCounts(int64_t max_rows, const Expect &expect) {
  for (int64_t m = 1; m <= max_rows; ++m) expect(m, 64, 37, m % 2 == 0, 0);
}
// Depth remainders of both vector widths (8, 16) and of a cache line (64
// int8, 32 bf16 values), column remainders, and a wider row stride.
template <typename Expect>
void ForRemainders(const Expect &expect) {
  for (int64_t k : {1, 7, 8, 9, 15, 16, 17, 31, 80, 95, 513}) {
    for (int64_t n : {1, 3, 65, 130}) {
      expect(3, k, n, true, 0);
      expect(1, k, n, false, 5);
      expect(8, k, n, true, 3);
    }
  }
}
// Row counts past the few-row path: a panel path into StreamedLinear and
// BlockedLinear; at k 2048 panels of 128 rows, so n 300 is three of them,
// the last short.
template <typename Expect>
void ForPanelPath(int64_t first_rows, const Expect &expect) {
  for (int64_t m : {first_rows, int64_t{40}, int64_t{200}}) {
    expect(m, 2048, 300, true, 0);
    expect(m, 33, 70, false, 3);
  }
}

// `bytes` of memory that end where an inaccessible page begins, holding a
// copy of `from`: a kernel that reads past them dies of SIGSEGV.
class GuardedBytes {
 public:
  GuardedBytes(const void *from, size_t bytes) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t pages = (bytes + page - 1) / page;
    size_ = (pages + 1) * page;
    region_ = mmap(nullptr, size_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (region_ == MAP_FAILED) {
      ADD_FAILURE() << "mmap of " << size_ << " bytes failed";
      region_ = nullptr;
      return;
    }
    char *guard = static_cast<char *>(region_) + pages * page;
    EXPECT_EQ(mprotect(guard, page, PROT_NONE), 0);
    data_ = guard - bytes;
    std::memcpy(data_, from, bytes);
  }
  ~GuardedBytes() {
    if (region_ != nullptr) munmap(region_, size_);
  }
  GuardedBytes(const GuardedBytes &) = delete;
  GuardedBytes &operator=(const GuardedBytes &) = delete;

  template <typename T>
  const T *As() const {
    return reinterpret_cast<const T *>(data_);
  }

 private:
  void *region_ = nullptr;
  size_t size_ = 0;
  char *data_ = nullptr;
};

}  // namespace moh
