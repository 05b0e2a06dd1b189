// Flash-decoding over the paged KV cache (see cuda_paged_decode.h).
//
// Kernel 1, a thread block per (row, KV head, split of args.split_keys
// keys):
//   1. each key's place in the caches through the block table;
//   2. scores: head_dim / 8 threads per key, each holding 8 dimensions of
//      the G queries (scaled, float) in registers, read 16 bytes of the key
//      and sum their G partial dot products across the key's threads
//      (warp shuffles); the block's 128 / (head_dim / 8) key lanes take
//      every lane-th key, several loads in flight per thread;
//   3. per query head (a warp each): the split's max, exp(score - max) in
//      place and their sum;
//   4. values: head_dim / 8 threads per key read 16 bytes each, the thread
//      block's 128 / (head_dim / 8) key lanes take every lane-th key and
//      accumulate p * v for the G heads; the lanes are summed in shared
//      memory.
//   It writes the split's unnormalised output, max and sum. A (row, KV
//   group) whose heads' gates are all 0 (args.gates: MoH's work list) writes
//   an empty split at once, so the combined output of its heads is 0.
// Kernel 2, a thread block per (row, head): the splits combined, out =
// sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s, times the head's gate;
// the splits' weights in shared memory, 256 / head_dim threads per
// dimension summing every few splits' outputs.
#include <cfloat>

#include "model/kernels/cuda_element.cuh"
#include "model/kernels/cuda_paged_decode.h"

namespace moh {
namespace {

using cuda::FromFloat;
using cuda::Load8;
using cuda::Round;
using cuda::ToFloat;
using cuda::WarpMax;
using cuda::WarpSum;

constexpr int kSplit = kPagedDecodeSplit;
constexpr int kThreads = 128;
constexpr int kCombineThreads = 256;  // head_dim at most

// Keys row `row` reads.
__device__ inline int64_t RowKeys(const PagedDecodeArgs& a, int row) {
  return max(int64_t{0}, min(a.positions[row] + 1, a.row_len[row]));
}

template <typename T, int G>
__global__ void __launch_bounds__(kThreads)
    PagedDecodeSplitKernel(PagedDecodeArgs a) {
  cuda::StartAfterPriorGrid();
  const int row = blockIdx.x, kv = blockIdx.y, split = blockIdx.z;
  const int d_n = a.head_dim, tid = threadIdx.x;
  MOH_DYNAMIC_SHARED(shared);
  float* p = shared;                  // [G][kSplit]
  float* lanes = p + G * kSplit;      // [key lanes][D], one head at a time
  __shared__ int64_t offset[kSplit];  // each key's place in the caches
  __shared__ float split_max[G], split_sum[G];

  const int64_t begin = int64_t{split} * a.split_keys;
  const int n = static_cast<int>(
      max(int64_t{0}, min(int64_t{a.split_keys}, RowKeys(a, row) - begin)));
  const int64_t head0 = int64_t{row} * a.heads + int64_t{kv} * G;
  const int64_t partial0 = head0 * a.splits + split;  // (row, head0, split)
  bool active = a.gates == nullptr;
  if (!active) {
    const T* gates =
        static_cast<const T*>(a.gates) + int64_t{row} * a.gate_stride + kv * G;
#pragma unroll
    for (int g = 0; g < G; ++g) active = active || ToFloat(gates[g]) != 0.f;
  }
  if (n == 0 || !active) {  // nothing of this row here: an empty split
    for (int i = tid; i < G * d_n; i += kThreads) {
      const int g = i / d_n;
      a.partial_out[(partial0 + int64_t{g} * a.splits) * d_n + i % d_n] = 0.f;
    }
    if (tid < G) {
      a.partial_max_sum[(partial0 + int64_t{tid} * a.splits) * 2] = -FLT_MAX;
      a.partial_max_sum[(partial0 + int64_t{tid} * a.splits) * 2 + 1] = 0.f;
    }
    return;
  }
  const int64_t* table = a.block_table + int64_t{row} * a.table_stride;
  const int64_t head_offset = int64_t{kv} * a.stride_head;
  for (int j = tid; j < n; j += kThreads) {
    const int64_t key = begin + j;
    offset[j] = table[key / a.block_size] * a.stride_block +
                (key % a.block_size) * a.stride_position + head_offset;
  }
  // head_dim / 8 threads per key, 8 dimensions each (16-byte loads), in
  // both passes; the thread block's key lanes take every key_lanes-th key.
  const int per_key = d_n / 8, key_lanes = kThreads / per_key;
  const int d0 = (tid % per_key) * 8, key_lane = tid / per_key;
  // This thread's 8 dimensions of the G queries, scaled, in registers.
  float query[G][8];
  const T* queries = static_cast<const T*>(a.queries) + head0 * d_n + d0;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    Load8(queries + int64_t{g} * d_n, query[g]);
#pragma unroll
    for (int e = 0; e < 8; ++e) query[g][e] *= a.scale;
  }
  __syncthreads();

  // Scores: each thread's 8-dimension dot products, summed over the key's
  // threads (adjacent lanes of one warp). Every lane runs every round, so
  // the shuffles see the whole warp.
  const T* keys = static_cast<const T*>(a.key_cache);
  const T* values = static_cast<const T*>(a.value_cache);
#pragma unroll 4
  for (int j0 = 0; j0 < n; j0 += key_lanes) {
    const int j = j0 + key_lane;
    float x[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (j < n) Load8(keys + offset[j] + d0, x);
    float dot[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      dot[g] = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) dot[g] += query[g][e] * x[e];
    }
    for (int o = per_key / 2; o > 0; o >>= 1) {
#pragma unroll
      for (int g = 0; g < G; ++g) dot[g] += __shfl_xor_sync(~0u, dot[g], o);
    }
    if (j < n && d0 == 0) {
#pragma unroll
      for (int g = 0; g < G; ++g) p[g * kSplit + j] = dot[g];
    }
  }
  __syncthreads();

  const int warp = tid / 32, lane = tid % 32;
  for (int g = warp; g < G; g += kThreads / 32) {
    float m = -FLT_MAX;
    for (int j = lane; j < n; j += 32) m = fmaxf(m, p[g * kSplit + j]);
    m = WarpMax(m);
    float l = 0.f;
    for (int j = lane; j < n; j += 32) {
      const float e = __expf(p[g * kSplit + j] - m);
      p[g * kSplit + j] = e;
      l += e;
    }
    l = WarpSum(l);
    if (lane == 0) split_max[g] = m, split_sum[g] = l;
  }
  __syncthreads();

  // Values: each thread's 8 dimensions of p * v over its key lane's keys.
  float acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
  }
#pragma unroll 4
  for (int j = key_lane; j < n; j += key_lanes) {
    float v[8];
    Load8(values + offset[j] + d0, v);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float w = p[g * kSplit + j];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] += w * v[e];
    }
  }
  // The key lanes summed, one head at a time (kThreads * 8 floats).
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int e = 0; e < 8; ++e) lanes[key_lane * d_n + d0 + e] = acc[g][e];
    __syncthreads();
    for (int d = tid; d < d_n; d += kThreads) {
      float sum = 0.f;
      for (int l = 0; l < key_lanes; ++l) sum += lanes[l * d_n + d];
      a.partial_out[(partial0 + int64_t{g} * a.splits) * d_n + d] = sum;
    }
    __syncthreads();
  }
  if (tid < G) {
    a.partial_max_sum[(partial0 + int64_t{tid} * a.splits) * 2] =
        split_max[tid];
    a.partial_max_sum[(partial0 + int64_t{tid} * a.splits) * 2 + 1] =
        split_sum[tid];
  }
}

// The block's largest (or, `max` false, summed) v, on every thread;
// `scratch` holds a float per warp, free again on return.
__device__ inline float BlockReduce(float v, bool max, float* scratch) {
  v = max ? WarpMax(v) : WarpSum(v);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float total = scratch[0];
  for (int w = 1; w < kCombineThreads / 32; ++w) {
    total = max ? fmaxf(total, scratch[w]) : total + scratch[w];
  }
  __syncthreads();
  return total;
}

template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    PagedDecodeCombineKernel(PagedDecodeArgs a) {
  cuda::StartAfterPriorGrid();
  const int64_t head = blockIdx.x;  // row * heads + h
  const int d_n = a.head_dim, tid = threadIdx.x;
  MOH_DYNAMIC_SHARED(shared);
  float* weight = shared;               // [splits]: e^(m_s - M), 0 if empty
  float* part_out = shared + a.splits;  // [parts][D]
  __shared__ float scratch[kCombineThreads / 32];
  const float* ms = a.partial_max_sum + head * a.splits * 2;
  float m = -FLT_MAX;
  for (int s = tid; s < a.splits; s += kCombineThreads) {
    if (ms[2 * s + 1] > 0.f) m = fmaxf(m, ms[2 * s]);
  }
  m = BlockReduce(m, true, scratch);
  float sum = 0.f;
  for (int s = tid; s < a.splits; s += kCombineThreads) {
    const float w = ms[2 * s + 1] > 0.f ? __expf(ms[2 * s] - m) : 0.f;
    weight[s] = w;
    sum += w * ms[2 * s + 1];
  }
  sum = BlockReduce(sum, false, scratch);  // and weight[] is whole
  // `parts` threads per dimension, each over every parts-th split, several
  // loads in flight; then the parts summed.
  const int parts = kCombineThreads / d_n, part = tid / d_n, d = tid % d_n;
  if (part < parts) {
    const float* out = a.partial_out + head * a.splits * d_n + d;
    float acc = 0.f;
#pragma unroll 4
    for (int s = part; s < a.splits; s += parts) {
      acc += weight[s] * out[int64_t{s} * d_n];
    }
    part_out[part * d_n + d] = acc;
  }
  __syncthreads();
  if (tid >= d_n) return;
  float total = 0.f;
  for (int p = 0; p < parts; ++p) total += part_out[p * d_n + tid];
  float value = sum > 0.f ? total / sum : 0.f;
  if (a.gates != nullptr) {
    const int64_t row = head / a.heads, h = head % a.heads;
    value = Round<T>(value) *
            ToFloat(static_cast<const T*>(a.gates)[row * a.gate_stride + h]);
  }
  static_cast<T*>(a.out)[head * a.head_dim + tid] = FromFloat<T>(value);
}

template <typename T, int G>
cudaError_t Launch(const PagedDecodeArgs& a) {
  const cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  const size_t shared = sizeof(float) * (G * kSplit + kThreads * 8);
  auto* const split_kernel = &PagedDecodeSplitKernel<T, G>;
  const cudaError_t split =
      MOH_CUDA_LAUNCH_SHARED(split_kernel, dim3(a.rows, a.kv_heads, a.splits),
                             kThreads, shared, stream, a);
  if (split != cudaSuccess) return split;
  const size_t combine_shared = sizeof(float) * (a.splits + kCombineThreads);
  return MOH_CUDA_LAUNCH_SHARED(PagedDecodeCombineKernel<T>, a.rows * a.heads,
                                kCombineThreads, combine_shared, stream, a);
}

template <typename T>
cudaError_t LaunchType(const PagedDecodeArgs& a) {
  switch (a.heads / a.kv_heads) {
    case 1:
      return Launch<T, 1>(a);
    case 2:
      return Launch<T, 2>(a);
    case 4:
      return Launch<T, 4>(a);
    default:
      return Launch<T, 8>(a);
  }
}

}  // namespace

bool PagedDecodeShapeSupported(int heads, int kv_heads, int head_dim) {
  if (kv_heads <= 0 || heads % kv_heads != 0) return false;
  const int group = heads / kv_heads;
  // Whole 8-element loads, and key lanes of head_dim / 8 threads that
  // fill the thread block.
  return (group == 1 || group == 2 || group == 4 || group == 8) &&
         ChunkedHeadDim(head_dim);
}

const char* LaunchPagedDecode(const PagedDecodeArgs& args) {
  if (!PagedDecodeShapeSupported(args.heads, args.kv_heads, args.head_dim)) {
    return "paged decode: unsupported heads / kv_heads / head_dim";
  }
  if (args.split_keys < 1 || args.split_keys > kSplit) {
    return "paged decode: split_keys out of [1, 256]";
  }
  if (args.rows == 0) return nullptr;
  cudaError_t error = cudaSuccess;
  switch (args.type) {
    case CudaElement::kFloat32:
      error = LaunchType<float>(args);
      break;
    case CudaElement::kBFloat16:
      error = LaunchType<__nv_bfloat16>(args);
      break;
    case CudaElement::kFloat16:
      error = LaunchType<__half>(args);
      break;
  }
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace moh
