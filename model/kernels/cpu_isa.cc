#include "model/kernels/cpu_isa.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

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

// AMX-BF16 usable: the extensions are allowed (AVX-512 active, which GCC
// reports only where the OS saves its state, so xgetbv is there), the CPU
// has AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22; GCC 12's
// __builtin_cpu_supports does not report them), the OS saves the tile state
// (XCR0 bits 17 and 18), the kernel grants this process the tile data
// (arch_prctl; it refuses without it), and MOH_CPU_AMX is not 0.
bool ReadAmxBf16() {
  if (!ExtensionAllowed(true)) return false;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (((edx >> 24) & 1) == 0 || ((edx >> 22) & 1) == 0) return false;
  unsigned xcr0_low = 0, xcr0_high = 0;
  __asm__("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  if (((xcr0_low >> 17) & 3) != 3) return false;
  const char *amx = std::getenv("MOH_CPU_AMX");
  if (amx != nullptr && std::strcmp(amx, "0") == 0) return false;
  constexpr long kReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
  constexpr long kXtileData = 18;         // XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
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
  static const bool amx = ReadAmxBf16();
  switch (ext) {
    case CpuExtension::kAvx512Bf16:
      return bf16;
    case CpuExtension::kAvx512Vnni:
      return vnni;
    case CpuExtension::kAmxBf16:
      return amx;
  }
  return false;
}

const char *ActiveIsaLabel() {
  if (ActiveIsa() != CpuIsa::kAvx512) return IsaName(ActiveIsa());
  const bool bf16 = ActiveExtension(CpuExtension::kAvx512Bf16);
  const bool vnni = ActiveExtension(CpuExtension::kAvx512Vnni);
  const bool amx = ActiveExtension(CpuExtension::kAmxBf16);
  return bf16 && vnni && amx ? "avx512+bf16+vnni+amx"
         : bf16 && vnni      ? "avx512+bf16+vnni"
         : bf16              ? "avx512+bf16"
         : vnni              ? "avx512+vnni"
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
