// Runs this project's CUDA kernels on the CPU, for tests on machines
// without a GPU: a .cu file included after this header, compiled by the
// host compiler (CUDA's headers declare the element types and their
// conversions for the host too), launches each kernel through
// MOH_CUDA_LAUNCH (model/kernels/cuda_element.cuh), which here runs the
// grid's thread blocks one after another on blockDim threads (std::thread)
// that meet at __syncthreads and exchange warp shuffles through a barrier
// of their warp's 32 threads. `__shared__` variables are
// function statics: shared by a block's threads, and a block's alone since
// blocks run in turn; dynamic shared memory (MOH_DYNAMIC_SHARED) is a
// buffer of the block's. Atomics are not emulated.
//
// What it checks: a kernel's indexing, its synchronization (a thread that
// reads another's value before a barrier sees stale data here, as on a
// GPU), its reductions and its rounding (float32 as IEEE operations,
// -ffp-contract=off, and the element types through CUDA's own host
// conversions). Not its speed, nor anything of the device's memory model
// beyond barriers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

// The builtins a kernel reads, per emulated thread.
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

namespace moh::emulation {

// A reusable barrier of `count` threads: a generation count the waiters
// sleep on (a futex), which the last to arrive advances and wakes them all
// from. With a mutex and condition variable each woken thread took the lock
// in turn: the emulated paged kernel's shuffles spent most of their time
// there.
class Barrier {
 public:
  explicit Barrier(int count) : count_(count) {}
  void Wait() {
    const uint32_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == count_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      Futex(FUTEX_WAKE_PRIVATE, INT_MAX);
      return;
    }
    while (generation_.load(std::memory_order_acquire) == generation) {
      Futex(FUTEX_WAIT_PRIVATE, static_cast<int>(generation));
    }
  }

 private:
  void Futex(int op, int value) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), op, value,
            nullptr, nullptr, 0);
  }

  const int count_;
  std::atomic<int> arrived_{0};
  std::atomic<uint32_t> generation_{0};
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));
};

// A warp's exchange for shuffles: two sets of values used in turn, so one
// barrier a shuffle suffices (a lane overwrites a set only after every lane
// has passed the next shuffle's barrier, so has read it).
struct Warp {
  explicit Warp(int lanes) : barrier(lanes) {}
  Barrier barrier;
  float values[2][32] = {};
};

// Shuffles this thread made: which of its warp's sets the next one uses.
inline thread_local unsigned shuffles = 0;

struct Block {
  Block(int threads, size_t dynamic_bytes)
      : barrier(threads), dynamic((dynamic_bytes + 3) / 4) {
    for (int first = 0; first < threads; first += 32) {
      warps.push_back(std::make_unique<Warp>(std::min(32, threads - first)));
    }
  }
  Barrier barrier;
  std::vector<std::unique_ptr<Warp>> warps;
  std::vector<float> dynamic;  // the launch's dynamic shared memory
};

inline thread_local Block* current_block = nullptr;

// Runs kernel(args...) over grid x block threads with `dynamic_bytes` of
// dynamic shared memory; cudaSuccess, or cudaErrorInvalidConfiguration for
// an empty or a 2-D or 3-D block. One std::thread per thread of a block,
// which runs the grid's blocks in turn, all of a block's threads done
// before any starts the next.
template <typename... Params, typename... Args>
cudaError_t Launch(void (*kernel)(Params...), dim3 grid, dim3 block,
                   size_t dynamic_bytes, Args&&... args) {
  const int threads = static_cast<int>(block.x);
  if (threads <= 0 || block.y != 1 || block.z != 1) {
    return cudaErrorInvalidConfiguration;
  }
  Block shared(threads, dynamic_bytes);
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      threadIdx = uint3{static_cast<unsigned>(t), 0, 0};
      blockDim = block;
      gridDim = grid;
      current_block = &shared;
      for (unsigned z = 0; z < grid.z; ++z) {
        for (unsigned y = 0; y < grid.y; ++y) {
          for (unsigned x = 0; x < grid.x; ++x) {
            blockIdx = uint3{x, y, z};
            kernel(args...);
            shared.barrier.Wait();  // the block's shared memory is free
          }
        }
      }
    });
  }
  for (std::thread& thread : pool) thread.join();
  return cudaSuccess;
}

}  // namespace moh::emulation

inline void __syncthreads() { moh::emulation::current_block->barrier.Wait(); }

// Lane `lane ^ offset`'s v, once all 32 lanes of the warp have given theirs.
inline float __shfl_xor_sync(unsigned, float v, int offset) {
  moh::emulation::Warp& warp =
      *moh::emulation::current_block->warps[threadIdx.x / 32];
  const int lane = static_cast<int>(threadIdx.x % 32);
  float* values = warp.values[moh::emulation::shuffles++ % 2];
  values[lane] = v;
  warp.barrier.Wait();
  return values[lane ^ offset];
}

// IEEE operations, rounded to nearest (the test target compiles with
// -ffp-contract=off, so none is fused with another).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
using std::isnan;
using std::max;
using std::min;

#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __shared__
#define __shared__ static
#define MOH_CUDA_LAUNCH(kernel, grid, block, stream, ...) \
  ((void)(stream), moh::emulation::Launch(kernel, grid, block, 0, __VA_ARGS__))
#define MOH_CUDA_LAUNCH_SHARED(kernel, grid, block, bytes, stream, ...) \
  ((void)(stream),                                                      \
   moh::emulation::Launch(kernel, grid, block, bytes, __VA_ARGS__))
#define MOH_DYNAMIC_SHARED(name) \
  float* const name = moh::emulation::current_block->dynamic.data()
