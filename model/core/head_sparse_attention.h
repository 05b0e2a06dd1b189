// Attention computed only for the (token, head) pairs a MoH router selected.
//
// MoH's official code computes every head and multiplies unselected ones by
// zero. Here, for each head, only the tokens that selected it get a query
// projection, attention scores, softmax, weighted values and an output
// projection (the head's columns of o_proj); keys and values stay complete
// (SPEC §1: other tokens may select a head this token skipped). The result
// equals the dense computation up to float rounding.
//
// Tokens are flattened over a batch of rows; each token attends to the keys
// of its own row up to its position (causal) and below the row's length.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

#include "model/core/kv_cache.h"
#include "model/core/linear.h"
#include "model/core/moh_router.h"

namespace moh {

// How a model computes attention.
//   kDense:      every head, as the official code does (the reference that
//                tests and benchmarks compare against).
//   kHeadSparse: only the selected (token, head) pairs: on CPU in float32 the
//                pair kernel (head_sparse_attention_cpu.cc: one matrix product
//                per head and per block of queries, keys read in place from
//                the cache, causal key blocks skipped), elsewhere ATen ops.
//   kHeadSparseAten: the ATen-ops pair path everywhere (tests compare it).
//   kAuto:       the CPU pair kernel whenever it applies (it beats kDense even
//                with every head); on CUDA dense (no host-device sync: the
//                ATen pair path waits for the device several times a layer,
//                and a GPU pair kernel is future work); else (CPU, bf16)
//                head-sparse when some row of the batch uses fewer than all
//                heads of the layer, else dense.
enum class AttentionMode { kAuto, kDense, kHeadSparse, kHeadSparseAten };

// Whether a layer routed by `router` runs pair by pair (HeadSparseAttention)
// for a batch whose smallest routed K is `min_top_k`, with activations of
// `options`.
bool UseHeadSparse(AttentionMode mode, const MohRouter& router,
                   int64_t min_top_k, const at::TensorOptions& options);

struct HeadSparseAttentionInputs {
  at::Tensor x;         // [N, C] attention input of every token
  at::Tensor gates;     // [N, H]; 0 = the pair is skipped
  LinearWeight q_weight;  // [H * D, C]
  at::Tensor q_bias;    // [H * D] or undefined
  // [N, H, D] queries already projected (a router that needed them): used
  // instead of q_weight when defined. Not yet rotated.
  at::Tensor q_full;
  // Rotates queries [n, D] at positions [n] (RoPE); empty = none.
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> rotate;
  // `rotate`'s tables [P, D] (float32, contiguous) when the CPU kernel may
  // rotate the queries it projected in place instead (RotateInPlace, no
  // ATen op); undefined: it calls `rotate`.
  at::Tensor rope_cos, rope_sin;
  // [blocks, block_size, KV, D] keys and values (a KV cache, kv_cache.h,
  // or [B, L, KV, D] computed for this batch); the last dimension
  // contiguous. Row b reads its positions p from block
  // block_table[b][p / block_size]; head h reads KV head h / (H / KV). Their
  // type may be narrower than x's (a 16-bit cache): they are widened as they
  // are read.
  at::Tensor key_cache;
  at::Tensor value_cache;
  at::Tensor block_table;  // [B, n] int64
  // Rows stored narrow (kv_cache.h, the ratio ceiling): they read their
  // positions through narrow.key_cache / value_cache and select shared heads
  // only. Empty: every row wide.
  NarrowRows narrow;
  at::Tensor token_row;    // [N] int64: the row of each token
  at::Tensor token_pos;    // [N] int64: keys j <= token_pos are visible
  at::Tensor row_len;      // [B] int64: keys j < row_len are visible
  LinearWeight o_weight;   // [C, H * D]
  at::Tensor o_bias;       // [C] or undefined
  double scale = 1.0;      // applied to q·k
};

// Returns [N, C]: sum over selected heads h of gate * attention_h projected by
// o_proj's columns of h, plus o_bias. `aten_only` skips the CPU pair kernel.
at::Tensor HeadSparseAttention(const HeadSparseAttentionInputs& in,
                               bool aten_only = false);

// Whether the CPU pair kernel handles activations of `options` (float32 on
// CPU).
bool CpuPairKernelApplies(const at::TensorOptions& options);
// Whether it reads keys or values stored in `cache` (float32 or bfloat16 on
// CPU).
bool CpuPairKernelReads(const at::Tensor& cache);

// The CPU pair kernel (head_sparse_attention_cpu.cc): float32 activations,
// float32 or bfloat16 keys and values, on CPU.
at::Tensor HeadSparseAttentionCpu(const HeadSparseAttentionInputs& in);

}  // namespace moh
