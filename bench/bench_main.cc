// The benchmarks' shared main (moh_attention_bench, moh_grammar_bench):
// threads and allocator configured as the server does, and the instruction
// set the hand-written CPU kernels run (model/kernels/cpu_isa.h) in the
// context, so that a result says which paths it timed.
//   MOH_BENCH_THREADS=N  LibTorch's thread count (default: every core;
//                        nothing else runs beside the benchmark).
//   MOH_CPU_ISA=avx512|avx2|portable  caps the kernels' instruction set, e.g.
//                        to time the AVX2 paths on an AVX-512 machine.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <thread>

#include "model/core/runtime.h"
#include "model/kernels/cpu_isa.h"

int main(int argc, char** argv) {
  const char* threads = std::getenv("MOH_BENCH_THREADS");
  moh::ConfigureCpuAllocator();
  moh::ConfigureCpuThreads(
      threads != nullptr
          ? std::atoi(threads)
          : static_cast<int>(std::thread::hardware_concurrency()));
  benchmark::AddCustomContext("instruction_set", moh::ActiveIsaLabel());
  benchmark::AddCustomContext("cpu_instruction_set",
                              moh::IsaName(moh::BestCpuIsa()));
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
