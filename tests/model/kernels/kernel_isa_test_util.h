// What the kernel tests share: each test binary is registered once per
// instruction set (tests/CMakeLists.txt sets MOH_CPU_ISA to avx512, avx2 or
// portable), and a test of the kernels' results skips where that run's
// kernels do not run: the avx512 run on a CPU without AVX-512F, and every
// run under portable (where the kernels refuse, which
// KernelIsaTest.RequestedInstructionSetIsTheOneThatRuns checks).
#pragma once

#include <gtest/gtest.h>

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

}  // namespace moh
