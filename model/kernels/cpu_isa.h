// The instruction set the hand-written CPU kernels (model/kernels) run: the
// best the CPU has (AVX-512F, else AVX2 + FMA, else none), capped by the
// environment variable MOH_CPU_ISA = avx512 | avx512f | avx2 | portable, so
// that the AVX2 paths can be tested and timed on an AVX-512 machine and the
// portable paths (LibTorch / OpenBLAS) on any. avx512f is AVX-512 without
// the dot-product extensions below (CpuExtension): the float32-widening
// paths those replace. Read once, on first use; an unknown value is ignored
// with one line on stderr. A cap above what the CPU has changes nothing.
// Thread-safe.
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

// AVX-512 extensions beyond AVX-512F that some kernels use for products with
// low-precision weights: AVX512_BF16 (vdpbf16ps, pairs of bfloat16 products
// summed into float32), AVX512_VNNI (vpdpbusd, four u8 x s8 products summed
// into int32) and AMX-BF16 (tdpbf16ps: a 16 x 16 float32 tile of y from
// 16 x 32 bfloat16 tiles of x and W, Sapphire Rapids and later).
enum class CpuExtension { kAvx512Bf16, kAvx512Vnni, kAmxBf16 };

// Whether the kernels may use `ext`: ActiveIsa() is kAvx512, the CPU has it,
// and MOH_CPU_ISA is not avx512f. AMX also needs the kernel's leave to use
// its tile registers (arch_prctl ARCH_REQ_XCOMP_PERM, asked once for the
// process; Linux 5.16 on) and MOH_CPU_AMX not 0 (the AVX512_BF16 path
// beside it, for benchmarks).
bool ActiveExtension(CpuExtension ext);

// What the kernels run, extensions included: "avx512+bf16+vnni+amx",
// "avx512+bf16+vnni", "avx512", "avx2" or "portable" (the benchmarks' and
// tools' label).
const char *ActiveIsaLabel();

}  // namespace moh
