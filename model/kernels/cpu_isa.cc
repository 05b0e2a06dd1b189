#include "model/kernels/cpu_isa.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace moh {
namespace {

const char *IsaCap() {
  const char *cap = std::getenv("MOH_CPU_ISA");
  return cap != nullptr ? cap : "";
}

CpuIsa ReadActiveIsa() {
  const CpuIsa best = BestCpuIsa();
  const char *cap = IsaCap();
  if (*cap == '\0') return best;
  if (std::strcmp(cap, "avx512f") == 0) return std::min(best, CpuIsa::kAvx512);
  for (CpuIsa isa : {CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (std::strcmp(cap, IsaName(isa)) == 0) return std::min(best, isa);
  }
  std::fprintf(stderr,
               "MOH_CPU_ISA=%s is not avx512, avx512f, avx2 or portable; "
               "ignored (the CPU kernels run %s)\n",
               cap, IsaName(best));
  return best;
}

// The CPU has the extension (`has`, from __builtin_cpu_supports, which takes
// only a literal) and the kernels may use it.
bool ExtensionAllowed(bool has) {
  return has && ActiveIsa() == CpuIsa::kAvx512 &&
         std::strcmp(IsaCap(), "avx512f") != 0;
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

bool ActiveExtension(CpuExtension ext) {
  static const bool bf16 =
      ExtensionAllowed(__builtin_cpu_supports("avx512bf16"));
  static const bool vnni =
      ExtensionAllowed(__builtin_cpu_supports("avx512vnni"));
  return ext == CpuExtension::kAvx512Bf16 ? bf16 : vnni;
}

const char *ActiveIsaLabel() {
  if (ActiveIsa() != CpuIsa::kAvx512) return IsaName(ActiveIsa());
  const bool bf16 = ActiveExtension(CpuExtension::kAvx512Bf16);
  const bool vnni = ActiveExtension(CpuExtension::kAvx512Vnni);
  return bf16 && vnni ? "avx512+bf16+vnni"
         : bf16       ? "avx512+bf16"
         : vnni       ? "avx512+vnni"
                      : "avx512";
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
