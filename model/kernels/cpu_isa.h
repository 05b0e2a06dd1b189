// The instruction set the hand-written CPU kernels (model/kernels) run: the
// best the CPU has (AVX-512F, else AVX2 + FMA, else none), capped by the
// environment variable MOH_CPU_ISA = avx512 | avx2 | portable, so that the
// AVX2 paths can be tested and timed on an AVX-512 machine and the portable
// paths (LibTorch / OpenBLAS) on any. Read once, on first use; an unknown
// value is ignored with one line on stderr. A cap above what the CPU has
// changes nothing. Thread-safe.
#pragma once

namespace moh {

// Ordered: each includes what the ones before it need.
enum class CpuIsa { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

// The best instruction set this CPU has (kAvx2 means AVX2 and FMA).
CpuIsa BestCpuIsa();

// What the kernels run: BestCpuIsa() capped by MOH_CPU_ISA.
CpuIsa ActiveIsa();

// "avx512", "avx2" or "portable": MOH_CPU_ISA's spelling of it.
const char *IsaName(CpuIsa isa);

}  // namespace moh
