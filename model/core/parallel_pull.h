// ParallelPull: work items of uneven size on the intra-op pool, each thread
// pulling the next index from an atomic counter so that short and long items
// balance. The translation unit that calls it needs OpenMP (at::parallel_for
// is a header template; see model/CMakeLists.txt).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace moh {

// Below this many multiply-adds a parallel region costs more than it saves
// (waking the pool and the barrier take 2-4 microseconds; 2^18 is about 30
// of one thread's work). A batch-1 decode step's attention reaches it from
// about 250 keys (bench model, 8 heads of 64); at 2^20 it stayed on one
// thread up to 1,000 keys, and 2^18 made such steps 1.08x faster (2
// threads, 512-token prompts).
inline constexpr int64_t kMinParallelWork = 1 << 18;

// Runs fn(i) for i in [0, count) on the intra-op pool, each thread pulling
// the next index (callers order work from the largest item down); inline when
// `work` (multiply-adds in all) is too small to share.
template <typename Fn>
void ParallelPull(int64_t count, int64_t work, const Fn &fn) {
  if (count == 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  if (threads < 2 || work < kMinParallelWork) {
    for (int64_t i = 0; i < count; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  // The caller's LibTorch thread state (inference mode above all: the pool's
  // threads would otherwise refuse in-place updates of inference tensors).
  const at::ThreadLocalState state;
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(state);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = next++; i < count; i = next++) fn(i);
    }
  });
}

}  // namespace moh
