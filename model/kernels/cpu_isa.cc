#include "model/kernels/cpu_isa.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace moh {
namespace {

CpuIsa ReadActiveIsa() {
  const CpuIsa best = BestCpuIsa();
  const char *cap = std::getenv("MOH_CPU_ISA");
  if (cap == nullptr || *cap == '\0') return best;
  for (CpuIsa isa : {CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (std::strcmp(cap, IsaName(isa)) == 0) return std::min(best, isa);
  }
  std::fprintf(stderr,
               "MOH_CPU_ISA=%s is not avx512, avx2 or portable; ignored (the "
               "CPU kernels run %s)\n",
               cap, IsaName(best));
  return best;
}

}  // namespace

CpuIsa BestCpuIsa() {
  static const CpuIsa best =
      __builtin_cpu_supports("avx512f") ? CpuIsa::kAvx512
      : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
          ? CpuIsa::kAvx2
          : CpuIsa::kPortable;
  return best;
}

CpuIsa ActiveIsa() {
  static const CpuIsa active = ReadActiveIsa();
  return active;
}

const char *IsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kPortable:
      break;
  }
  return "portable";
}

}  // namespace moh
