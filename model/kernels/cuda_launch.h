// Programmatic dependent launch (Hopper and later): a kernel launched so
// may start its thread blocks while the kernel before it in the stream
// finishes, each block waiting in cuda::StartAfterPriorGrid
// (cuda_element.cuh) until that kernel's writes are visible. In a replayed
// CUDA graph this hides the launch of each next kernel behind the tail of
// the one before: a decode step is a few hundred dependent kernels, and run
// 7's profile put about 3 µs of the device's idle time between two of them.
// Off by default (not yet measured on a GPU): moh-generate
// --cuda_programmatic_launch, moh_cuda_linear_bench.
#pragma once

namespace moh::cuda {

// Process-wide; kernels launched from then on (and graphs recorded) take
// it. Thread-safe.
void SetProgrammaticLaunch(bool on);
// Whether a launch now overlaps: set, and the current device is of compute
// capability 9.0 or later.
bool ProgrammaticLaunch();

}  // namespace moh::cuda
