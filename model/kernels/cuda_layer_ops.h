// A decoder layer's small per-token operations on CUDA, each one kernel in
// place of the chain of ATen ops it replaces (about 25 launches a layer at
// decode; in a replayed CUDA graph a small kernel still costs 2-3 µs of the
// device's time, which at batch 1 was as much as the attention):
// - AddRmsNorm: the residual stream takes a block's output and is
//   normalized (RMSNorm), 2 launches -> 1;
// - Rope: rotary embedding of queries, 5 -> 1;
// - RopeStoreKv: keys rotated and stored with the values into their
//   blocks of the paged cache, 7 -> 1;
// - SiluMul: SwiGLU's silu(gate) * up over the [gate | up] product, 2 -> 1;
// - QueryNormGates: the query-norm router's gates (every shared head, and
//   the top K routed heads by query norm), about 13 -> 1;
// - AttentionPrologue: Rope, RopeStoreKv and QueryNormGates of one layer's
//   tokens in one launch, 3 -> 1.
// Each rounds where the ATen chain rounds (every op's result to the
// tensor's type, no fused multiply-add across an op's boundary), so in
// float32 and in bfloat16 the results are the chain's, up to the order of
// a reduction's sums.
//
// AddRmsNorm and SiluMul move 8 elements a load where the widths are
// multiples of 8 and every row starts 16-byte aligned (as the model's
// tensors do), one element a load elsewhere.
//
// Plain pointers and strides: this header and its .cu see no ATen (the
// wrappers are model/core/layer_ops_cuda.cc). Every launch returns nullptr
// or the CUDA error's text.
#pragma once

#include <cstdint>

#include "model/kernels/cuda_element.h"

namespace moh {

// rows x width elements, row r at base + r * row_stride, the last dimension
// contiguous.
struct CudaRows {
  void* data = nullptr;
  int64_t row_stride = 0;
};

struct AddRmsNormArgs {
  CudaElement type = CudaElement::kFloat32;
  CudaRows hidden;               // [rows, width]: hidden += residual, in place
  CudaRows residual;             // [rows, width]
  const void* weight = nullptr;  // [width]
  CudaRows out;                  // [rows, width]: rms_norm(hidden) * weight
  int rows = 0, width = 0;
  float eps = 1e-6f;
  void* stream = nullptr;  // cudaStream_t
};
const char* LaunchAddRmsNorm(const AddRmsNormArgs& args);

// Rotary embedding of [tokens, heads, head_dim] vectors at positions
// [tokens] (int64), with the model's cos and sin tables [positions,
// head_dim] (its type): x * cos + rotate_half(x) * sin, rotate_half(x) =
// [-x2, x1] for x = [x1, x2].
struct RopeTables {
  const void* cos = nullptr;
  const void* sin = nullptr;
  int64_t positions = 0;  // rows of each table
};

struct RopeArgs {
  CudaElement type = CudaElement::kFloat32;
  const void* x = nullptr;
  int64_t token_stride = 0, head_stride = 0;  // of x, in elements
  const int64_t* positions = nullptr;
  RopeTables tables;
  void* out = nullptr;  // [tokens, heads, head_dim] contiguous
  int tokens = 0, heads = 0, head_dim = 0;
  void* stream = nullptr;
};
const char* LaunchRope(const RopeArgs& args);

// Keys [tokens, heads, head_dim] rotated and values copied into the caches
// ([blocks, block positions, heads (or more), head_dim], the last dimension
// contiguous, the same strides for both, the keys' type): token t's go to
// (block[t], offset[t]).
struct RopeStoreKvArgs {
  CudaElement type = CudaElement::kFloat32;
  const void* keys = nullptr;
  const void* values = nullptr;
  int64_t token_stride = 0;  // of keys and values, in elements; heads at D
  const int64_t* positions = nullptr;
  RopeTables tables;
  const int64_t* block = nullptr;
  const int64_t* offset = nullptr;
  void* key_cache = nullptr;
  void* value_cache = nullptr;
  int64_t stride_block = 0, stride_position = 0, stride_head = 0;
  int tokens = 0, heads = 0, head_dim = 0;
  void* stream = nullptr;
};
const char* LaunchRopeStoreKv(const RopeStoreKvArgs& args);

// out [rows, inter] = silu(both[:, :inter]) * both[:, inter:], both
// [rows, 2 * inter] contiguous, out contiguous.
struct SiluMulArgs {
  CudaElement type = CudaElement::kFloat32;
  const void* both = nullptr;
  void* out = nullptr;
  int64_t rows = 0, inter = 0;
  void* stream = nullptr;
};
const char* LaunchSiluMul(const SiluMulArgs& args);

// The query-norm router's gates [tokens, shared + routed] (contiguous, the
// queries' type): 1 for the shared heads [0, shared); for the routed ones,
// 1 on the top_k[t] (int64 [tokens]) largest of softmax(norm / std) over
// the routed heads' query norms (std unbiased; all in float32, as
// MohRouter::QueryNormGates), 0 elsewhere. Equal gates: the lower head
// first; NaN above every number (as ATen's topk).
struct QueryNormGatesArgs {
  CudaElement type = CudaElement::kFloat32;
  const void* queries = nullptr;  // [tokens, heads, head_dim]
  int64_t token_stride = 0, head_stride = 0;
  const int64_t* top_k = nullptr;
  void* gates = nullptr;
  int tokens = 0, shared = 0, routed = 0, head_dim = 0;
  void* stream = nullptr;
};
// Routed heads one launch takes (its shared memory).
inline constexpr int kQueryNormMaxRouted = 256;
const char* LaunchQueryNormGates(const QueryNormGatesArgs& args);

// What a layer does to its step's tokens before attending, in one launch:
// the queries rotated (as LaunchRope), the keys rotated and stored with the
// values (as LaunchRopeStoreKv) and, where router.gates is set, the
// query-norm router's gates of the same queries before RoPE (as
// LaunchQueryNormGates; the rotated queries go to queries.out). Thread
// blocks of the queries' pairs, then of the keys', then one a token
// routing: each launch in a replayed CUDA graph costs about 3 µs of the
// device between kernels (run 7). Every part in queries.type, over the same
// tokens; queries.stream.
struct AttentionPrologueArgs {
  RopeArgs queries;
  RopeStoreKvArgs keys_values;
  QueryNormGatesArgs router;  // gates null: no routing
};
const char* LaunchAttentionPrologue(const AttentionPrologueArgs& args);

}  // namespace moh
