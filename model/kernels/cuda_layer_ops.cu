// A layer's small per-token operations, one kernel each (see
// cuda_layer_ops.h). Every product and sum that is an op of its own in the
// ATen chain is rounded (__fmul_rn, __fadd_rn: no multiply-add contracted
// across them) and then rounded to the tensor's type, as that op's result.
#include <algorithm>
#include <cmath>

#include "model/kernels/cuda_element.cuh"
#include "model/kernels/cuda_layer_ops.h"

namespace moh {
namespace {

using cuda::ByElement;
using cuda::FromFloat;
using cuda::Load8;
using cuda::Round;
using cuda::Store8;
using cuda::ToFloat;
using cuda::WarpSum;

constexpr int kNormThreads = 256;
constexpr int kElementThreads = 256;
constexpr int kRouterThreads = 128;

int Blocks(int64_t items) {
  return static_cast<int>((items + kElementThreads - 1) / kElementThreads);
}

// The sum of every thread's v, on every thread of the block.
__device__ inline float BlockSum(float v) {
  __shared__ float warp_sums[kNormThreads / 32];
  v = WarpSum(v);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kNormThreads / 32; ++i) total += warp_sums[i];
  return total;
}

// This thread block's row of each operand.
template <typename T>
struct NormRow {
  __device__ explicit NormRow(const AddRmsNormArgs& a)
      : h(static_cast<T*>(a.hidden.data) +
          int64_t{blockIdx.x} * a.hidden.row_stride),
        r(static_cast<const T*>(a.residual.data) +
          int64_t{blockIdx.x} * a.residual.row_stride),
        w(static_cast<const T*>(a.weight)),
        out(static_cast<T*>(a.out.data) +
            int64_t{blockIdx.x} * a.out.row_stride) {}
  T* h;        // hidden
  const T* r;  // residual
  const T* w;  // weight
  T* out;
};

// A thread block per row: hidden += residual (rounded, as add_), then
// out = hidden * rsqrt(mean(hidden^2) + eps) * weight in float, rounded once
// (as at::rms_norm). Each thread reads back only what it wrote. Any width
// and alignment; AddRmsNormVectorKernel is the fast one.
template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    AddRmsNormKernel(AddRmsNormArgs a) {
  cuda::StartAfterPriorGrid();
  const NormRow<T> row(a);
  float squares = 0.f;
  for (int i = threadIdx.x; i < a.width; i += kNormThreads) {
    const T sum = FromFloat<T>(__fadd_rn(ToFloat(row.h[i]), ToFloat(row.r[i])));
    row.h[i] = sum;
    const float s = ToFloat(sum);
    squares += s * s;
  }
  const float total = BlockSum(squares);
  const float scale = rsqrtf(total / static_cast<float>(a.width) + a.eps);
  for (int i = threadIdx.x; i < a.width; i += kNormThreads) {
    row.out[i] = FromFloat<T>(ToFloat(row.h[i]) * scale * ToFloat(row.w[i]));
  }
}

// The same for rows of up to kVectors x 8 x kNormThreads elements, 8 at a
// time in 16-byte loads, the row's sums held in registers between the two
// passes: every load of a pass issued before any waits (run 7: the scalar
// kernel took 13 µs a row at batch 1, its loads one after another).
template <typename T, int kVectors>
__global__ void __launch_bounds__(kNormThreads)
    AddRmsNormVectorKernel(AddRmsNormArgs a) {
  cuda::StartAfterPriorGrid();
  const NormRow<T> row(a);
  float sums[kVectors][8];
  float squares = 0.f;
#pragma unroll
  for (int v = 0; v < kVectors; ++v) {
    const int i = (v * kNormThreads + threadIdx.x) * 8;
    if (i >= a.width) break;
    float x[8], y[8];
    Load8(row.h + i, x);
    Load8(row.r + i, y);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      sums[v][e] = Round<T>(__fadd_rn(x[e], y[e]));
      squares += sums[v][e] * sums[v][e];
    }
    Store8(row.h + i, sums[v]);
  }
  const float total = BlockSum(squares);
  const float scale = rsqrtf(total / static_cast<float>(a.width) + a.eps);
#pragma unroll
  for (int v = 0; v < kVectors; ++v) {
    const int i = (v * kNormThreads + threadIdx.x) * 8;
    if (i >= a.width) break;
    float x[8];
    Load8(row.w + i, x);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = sums[v][e] * scale * x[e];
    Store8(row.out + i, x);
  }
}

// x's pair (j, j + half) rotated at `position`: x * cos + rotate_half(x) *
// sin, each product and the sum rounded to T as the ATen chain's ops.
template <typename T>
__device__ inline void RotatePair(const T* x, int64_t position,
                                  const RopeTables& tables, int j, int half,
                                  T* lo, T* hi) {
  if (position < 0 || position >= tables.positions) {  // never: validated
    *lo = *hi = FromFloat<T>(NAN);
    return;
  }
  const T* cos = static_cast<const T*>(tables.cos) + position * 2 * half;
  const T* sin = static_cast<const T*>(tables.sin) + position * 2 * half;
  const float x1 = ToFloat(x[j]), x2 = ToFloat(x[j + half]);
  *lo = FromFloat<T>(__fadd_rn(Round<T>(__fmul_rn(x1, ToFloat(cos[j]))),
                               Round<T>(__fmul_rn(-x2, ToFloat(sin[j])))));
  *hi =
      FromFloat<T>(__fadd_rn(Round<T>(__fmul_rn(x2, ToFloat(cos[j + half]))),
                             Round<T>(__fmul_rn(x1, ToFloat(sin[j + half])))));
}

// This thread's (token, head, pair) of tokens x heads vectors of `half`
// pairs each (a thread per pair); false past the last.
struct Pair {
  int64_t vector;  // token * heads + head
  int64_t token, head;
  int j;
};
__device__ inline bool ThreadPair(int64_t block, int tokens, int heads,
                                  int half, Pair* p) {
  const int64_t i = block * kElementThreads + threadIdx.x;
  if (i >= int64_t{tokens} * heads * half) return false;
  p->j = static_cast<int>(i % half);
  p->vector = i / half;
  p->token = p->vector / heads;
  p->head = p->vector % heads;
  return true;
}

// Thread block `block`'s pairs of the rotation, a thread each.
template <typename T>
__device__ inline void RopeBlock(const RopeArgs& a, int64_t block) {
  const int half = a.head_dim / 2;
  Pair p;
  if (!ThreadPair(block, a.tokens, a.heads, half, &p)) return;
  const T* x = static_cast<const T*>(a.x) + p.token * a.token_stride +
               p.head * a.head_stride;
  T* out = static_cast<T*>(a.out) + p.vector * a.head_dim;
  RotatePair(x, a.positions[p.token], a.tables, p.j, half, out + p.j,
             out + p.j + half);
}

template <typename T>
__global__ void RopeKernel(RopeArgs a) {
  cuda::StartAfterPriorGrid();
  RopeBlock<T>(a, blockIdx.x);
}

// Thread block `block`'s (token, head, pair)s, a thread each: the key's pair
// rotated and the value's copied into the token's place in the caches.
template <typename T>
__device__ inline void RopeStoreKvBlock(const RopeStoreKvArgs& a,
                                        int64_t block) {
  const int half = a.head_dim / 2;
  Pair p;
  if (!ThreadPair(block, a.tokens, a.heads, half, &p)) return;
  const int64_t t = p.token, j = p.j;
  const int64_t from = t * a.token_stride + p.head * a.head_dim;
  const int64_t to = a.block[t] * a.stride_block +
                     a.offset[t] * a.stride_position + p.head * a.stride_head;
  T* key = static_cast<T*>(a.key_cache) + to;
  RotatePair(static_cast<const T*>(a.keys) + from, a.positions[t], a.tables,
             p.j, half, key + j, key + j + half);
  const T* value = static_cast<const T*>(a.values) + from;
  T* stored = static_cast<T*>(a.value_cache) + to;
  stored[j] = value[j];
  stored[j + half] = value[j + half];
}

template <typename T>
__global__ void RopeStoreKvKernel(RopeStoreKvArgs a) {
  cuda::StartAfterPriorGrid();
  RopeStoreKvBlock<T>(a, blockIdx.x);
}

// silu_(gate) rounded, then times up rounded (ATen's two ops; its silu is
// x / (1 + exp(-x)) in float).
template <typename T>
__device__ inline float SiluTimes(float g, float up) {
  const float silu = Round<T>(__fdiv_rn(g, __fadd_rn(1.f, expf(-g))));
  return __fmul_rn(silu, up);
}

// A thread per element: any width and alignment.
template <typename T>
__global__ void SiluMulKernel(SiluMulArgs a) {
  cuda::StartAfterPriorGrid();
  const int64_t i = int64_t{blockIdx.x} * kElementThreads + threadIdx.x;
  if (i >= a.rows * a.inter) return;
  const int64_t row = i / a.inter, c = i % a.inter;
  const T* both = static_cast<const T*>(a.both) + row * 2 * a.inter;
  static_cast<T*>(a.out)[i] =
      FromFloat<T>(SiluTimes<T>(ToFloat(both[c]), ToFloat(both[a.inter + c])));
}

// A thread per 8 columns (16-byte loads), blockIdx.y's rows gridDim.y
// apart: no 64-bit division per element (run 7: the kernel above took 11 ms
// a layer of a 64 x 2k prefill).
template <typename T>
__global__ void SiluMulVectorKernel(SiluMulArgs a) {
  cuda::StartAfterPriorGrid();
  const int64_t c = (int64_t{blockIdx.x} * kElementThreads + threadIdx.x) * 8;
  if (c >= a.inter) return;
  for (int64_t row = blockIdx.y; row < a.rows; row += gridDim.y) {
    const T* both = static_cast<const T*>(a.both) + row * 2 * a.inter + c;
    float g[8], up[8];
    Load8(both, g);
    Load8(both + a.inter, up);
#pragma unroll
    for (int e = 0; e < 8; ++e) g[e] = SiluTimes<T>(g[e], up[e]);
    Store8(static_cast<T*>(a.out) + row * a.inter + c, g);
  }
}

// Whether routed head j's gate ranks before head r's: the larger first,
// NaN above every number, equal gates the lower head first.
__device__ inline bool RanksBefore(float gate_j, int j, float gate_r, int r) {
  if (isnan(gate_j)) return !isnan(gate_r) || j < r;
  if (isnan(gate_r)) return false;
  return gate_j > gate_r || (gate_j == gate_r && j < r);
}

// Token t's gates, by a thread block of kThreads. The routed heads' query
// norms (a warp each), then on one thread their std, quotients and
// softmax, all in float32 as MohRouter::QueryNormGates (whatever T: bf16
// rounding would tie heads); then each head's rank among the gates: kept
// when below the token's K.
// kChunks: head_dim / 8 adjacent threads per head read 16 bytes each (a
// head_dim of 8 to 256, a power of two, rows aligned), every head's loads of
// a round in flight together; else a warp per head, an element a load.
template <typename T, bool kChunks, int kThreads>
__device__ inline void QueryNormGatesBlock(const QueryNormGatesArgs& a,
                                           int64_t t) {
  __shared__ float gate[kQueryNormMaxRouted];
  const T* q = static_cast<const T*>(a.queries) + t * a.token_stride;
  if constexpr (kChunks) {
    const int lanes = a.head_dim / 8, per_round = kThreads / lanes;
    const int group = threadIdx.x / lanes, d0 = threadIdx.x % lanes * 8;
#pragma unroll 4
    for (int r0 = 0; r0 < a.routed; r0 += per_round) {  // every lane each round
      const int r = r0 + group;
      float squares = 0.f;
      if (r < a.routed) {
        float x[8];
        Load8(q + int64_t{a.shared + r} * a.head_stride + d0, x);
#pragma unroll
        for (int e = 0; e < 8; ++e) squares += x[e] * x[e];
      }
      for (int o = lanes / 2; o > 0; o >>= 1) {
        squares += __shfl_xor_sync(~0u, squares, o);
      }
      if (r < a.routed && d0 == 0) gate[r] = sqrtf(squares);
    }
  } else {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = warp; r < a.routed; r += kThreads / 32) {
      const T* head = q + int64_t{a.shared + r} * a.head_stride;
      float squares = 0.f;
      for (int d = lane; d < a.head_dim; d += 32) {
        const float v = ToFloat(head[d]);
        squares += v * v;
      }
      squares = WarpSum(squares);
      if (lane == 0) gate[r] = sqrtf(squares);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const int n = a.routed;
    float mean = 0.f;
    for (int r = 0; r < n; ++r) mean += gate[r];
    mean /= static_cast<float>(n);
    float deviations = 0.f;
    for (int r = 0; r < n; ++r) {
      const float d = gate[r] - mean;
      deviations += d * d;
    }
    // Unbiased: one routed head gives 0 / 0, NaN, as at::std.
    const float std = sqrtf(deviations / static_cast<float>(n - 1));
    float most = -INFINITY;
    for (int r = 0; r < n; ++r) {
      gate[r] = __fdiv_rn(gate[r], std);
      most = fmaxf(most, gate[r]);
    }
    float sum = 0.f;
    for (int r = 0; r < n; ++r) {
      gate[r] = expf(gate[r] - most);
      sum += gate[r];
    }
    for (int r = 0; r < n; ++r) gate[r] = __fdiv_rn(gate[r], sum);
  }
  __syncthreads();
  const int64_t k = a.top_k[t];
  const int width = a.shared + a.routed;
  T* out = static_cast<T*>(a.gates) + t * width;
  for (int h = threadIdx.x; h < width; h += kThreads) {
    if (h < a.shared) {
      out[h] = FromFloat<T>(1.f);
      continue;
    }
    const int r = h - a.shared;
    int rank = 0;
    for (int j = 0; j < a.routed; ++j)
      rank += RanksBefore(gate[j], j, gate[r], r);
    out[h] = FromFloat<T>(rank < k ? 1.f : 0.f);
  }
}

template <typename T, bool kChunks>
__global__ void __launch_bounds__(kRouterThreads)
    QueryNormGatesKernel(QueryNormGatesArgs a) {
  cuda::StartAfterPriorGrid();
  QueryNormGatesBlock<T, kChunks, kRouterThreads>(a, blockIdx.x);
}

// The three above in one launch (cuda_layer_ops.h): block-uniform
// branches, so each part's barriers and shuffles see whole blocks.
template <typename T, bool kChunks>
__global__ void __launch_bounds__(kElementThreads)
    AttentionPrologueKernel(AttentionPrologueArgs a, int query_blocks,
                            int key_blocks) {
  cuda::StartAfterPriorGrid();
  const int64_t b = blockIdx.x;
  if (b < query_blocks) {
    RopeBlock<T>(a.queries, b);
  } else if (b < query_blocks + key_blocks) {
    RopeStoreKvBlock<T>(a.keys_values, b - query_blocks);
  } else {
    QueryNormGatesBlock<T, kChunks, kElementThreads>(
        a.router, b - query_blocks - key_blocks);
  }
}

const char* Result(cudaError_t error) {
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

cudaStream_t Stream(void* stream) { return static_cast<cudaStream_t>(stream); }

// Why the router kernel does not take `args`, or nullptr.
const char* RouterRefuses(const QueryNormGatesArgs& args) {
  return args.routed <= 0 || args.routed > kQueryNormMaxRouted
             ? "query-norm gates: routed heads out of [1, 256]"
             : nullptr;
}

// Whether its queries go head_dim / 8 threads a head, 16 bytes each: an
// aligned power-of-two head_dim in [8, 256].
bool RouterChunks(const QueryNormGatesArgs& args) {
  return ChunkedHeadDim(args.head_dim) &&
         Aligned8(args.type, args.queries, args.token_stride) &&
         Aligned8(args.type, args.queries, args.head_stride);
}

}  // namespace

const char* LaunchAddRmsNorm(const AddRmsNormArgs& args) {
  if (args.rows <= 0 || args.width <= 0) return nullptr;
  const CudaElement type = args.type;
  const bool aligned =
      args.width % 8 == 0 &&
      Aligned8(type, args.hidden.data, args.hidden.row_stride) &&
      Aligned8(type, args.residual.data, args.residual.row_stride) &&
      Aligned8(type, args.weight) &&
      Aligned8(type, args.out.data, args.out.row_stride);
  const int vectors = (args.width / 8 + kNormThreads - 1) / kNormThreads;
  return Result(ByElement(type, [&](auto element) {
    using T = decltype(element);
    const cudaStream_t stream = Stream(args.stream);
    if (aligned && vectors <= 4) {  // 1, 2 or 4 loads a thread
      void (*kernel)(AddRmsNormArgs) =
          vectors <= 1   ? AddRmsNormVectorKernel<T, 1>
          : vectors <= 2 ? AddRmsNormVectorKernel<T, 2>
                         : AddRmsNormVectorKernel<T, 4>;
      return MOH_CUDA_LAUNCH(kernel, args.rows, kNormThreads, stream, args);
    }
    return MOH_CUDA_LAUNCH(AddRmsNormKernel<T>, args.rows, kNormThreads, stream,
                           args);
  }));
}

const char* LaunchRope(const RopeArgs& args) {
  if (args.head_dim % 2 != 0) return "rope: odd head_dim";
  const int64_t items = int64_t{args.tokens} * args.heads * (args.head_dim / 2);
  if (items == 0) return nullptr;
  return Result(ByElement(args.type, [&](auto element) {
    using T = decltype(element);
    return MOH_CUDA_LAUNCH(RopeKernel<T>, Blocks(items), kElementThreads,
                           Stream(args.stream), args);
  }));
}

const char* LaunchRopeStoreKv(const RopeStoreKvArgs& args) {
  if (args.head_dim % 2 != 0) return "rope store: odd head_dim";
  const int64_t items = int64_t{args.tokens} * args.heads * (args.head_dim / 2);
  if (items == 0) return nullptr;
  return Result(ByElement(args.type, [&](auto element) {
    using T = decltype(element);
    return MOH_CUDA_LAUNCH(RopeStoreKvKernel<T>, Blocks(items), kElementThreads,
                           Stream(args.stream), args);
  }));
}

const char* LaunchSiluMul(const SiluMulArgs& args) {
  const int64_t items = args.rows * args.inter;
  if (items == 0) return nullptr;
  const bool aligned = args.inter % 8 == 0 && Aligned8(args.type, args.both) &&
                       Aligned8(args.type, args.out);
  return Result(ByElement(args.type, [&](auto element) {
    using T = decltype(element);
    if (aligned) {
      const dim3 grid(
          Blocks(args.inter / 8),
          static_cast<unsigned>(std::min<int64_t>(args.rows, 65535)));
      return MOH_CUDA_LAUNCH(SiluMulVectorKernel<T>, grid, kElementThreads,
                             Stream(args.stream), args);
    }
    return MOH_CUDA_LAUNCH(SiluMulKernel<T>, Blocks(items), kElementThreads,
                           Stream(args.stream), args);
  }));
}

const char* LaunchQueryNormGates(const QueryNormGatesArgs& args) {
  if (const char* error = RouterRefuses(args)) return error;
  if (args.tokens == 0) return nullptr;
  return Result(ByElement(args.type, [&](auto element) {
    using T = decltype(element);
    if (RouterChunks(args)) {
      return MOH_CUDA_LAUNCH((QueryNormGatesKernel<T, true>), args.tokens,
                             kRouterThreads, Stream(args.stream), args);
    }
    return MOH_CUDA_LAUNCH((QueryNormGatesKernel<T, false>), args.tokens,
                           kRouterThreads, Stream(args.stream), args);
  }));
}

const char* LaunchAttentionPrologue(const AttentionPrologueArgs& args) {
  const RopeArgs& q = args.queries;
  const RopeStoreKvArgs& kv = args.keys_values;
  const bool route = args.router.gates != nullptr;
  if (q.head_dim % 2 != 0 || kv.head_dim % 2 != 0) {
    return "attention prologue: odd head_dim";
  }
  if (kv.type != q.type || kv.tokens != q.tokens ||
      (route &&
       (args.router.type != q.type || args.router.tokens != q.tokens))) {
    return "attention prologue: parts of different types or tokens";
  }
  if (const char* error = route ? RouterRefuses(args.router) : nullptr) {
    return error;
  }
  const int64_t query_blocks =
      Blocks(int64_t{q.tokens} * q.heads * (q.head_dim / 2));
  const int64_t key_blocks =
      Blocks(int64_t{kv.tokens} * kv.heads * (kv.head_dim / 2));
  const int64_t blocks = query_blocks + key_blocks + (route ? q.tokens : 0);
  if (blocks == 0) return nullptr;
  if (blocks > INT32_MAX) return "attention prologue: too many tokens";
  const bool chunks = route && RouterChunks(args.router);
  return Result(ByElement(q.type, [&](auto element) {
    using T = decltype(element);
    const int grid = static_cast<int>(blocks);
    const cudaStream_t stream = Stream(q.stream);
    const int qb = static_cast<int>(query_blocks);
    const int kb = static_cast<int>(key_blocks);
    if (chunks) {
      return MOH_CUDA_LAUNCH((AttentionPrologueKernel<T, true>), grid,
                             kElementThreads, stream, args, qb, kb);
    }
    return MOH_CUDA_LAUNCH((AttentionPrologueKernel<T, false>), grid,
                           kElementThreads, stream, args, qb, kb);
  }));
}

}  // namespace moh
