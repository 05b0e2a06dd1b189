// What the kernel tests share: each test binary is registered once per
// instruction set (tests/CMakeLists.txt sets MOH_CPU_ISA to avx512, avx2 or
// portable), and a test of the kernels' results skips where that run's
// kernels do not run: the avx512 run on a CPU without AVX-512F, and every
// run under portable (where the kernels refuse, which
// KernelIsaTest.RequestedInstructionSetIsTheOneThatRuns checks).
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>

#include "model/kernels/cpu_isa.h"

namespace moh {

// Why this run's kernels do not run, or "" when they do.
inline std::string KernelsSkipReason() {
  const char *requested = std::getenv("MOH_CPU_ISA");
  const CpuIsa active = ActiveIsa();
  if (requested != nullptr && *requested != '\0' &&
      std::string(requested) != IsaName(active)) {
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

}  // namespace moh
