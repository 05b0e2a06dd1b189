// A decoder layer's small per-token operations as one CUDA kernel each
// (model/kernels/cuda_layer_ops.cu), for LlamaModel on CUDA: each replaces
// a chain of ATen ops and returns what that chain returns, rounded where it
// rounds. Each returns an undefined tensor (false) where it does not take
// its inputs: a CPU tensor, a type other than float32, bfloat16 or float16,
// mixed types, a last dimension that is not contiguous, an index tensor
// that is not contiguous, or a build against a CPU LibTorch (no kernels);
// the caller then runs the ATen chain. (cuda_kernel_args.h: the
// kernels' arguments for given tensors, for tests.)
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace moh {

// hidden.add_(residual) in place, and returns rms_norm(hidden) * weight
// (float32 inside, rounded once, as at::rms_norm). hidden and residual
// [N, C], weight [C]. Undefined, and hidden untouched, where not served.
at::Tensor FusedAddRmsNorm(at::Tensor& hidden, const at::Tensor& residual,
                           const at::Tensor& weight, double eps);

// Rotary embedding of x [N, H, D] at positions [N] (int64) with the tables
// cos and sin [P, D] in x's type: x * cos + rotate_half(x) * sin, [N, H, D]
// contiguous.
at::Tensor FusedRope(const at::Tensor& x, const at::Tensor& positions,
                     const at::Tensor& cos, const at::Tensor& sin);

// Keys [N, W, D] rotated (as FusedRope) and values [N, W, D] (rows of one
// product: the last dimension contiguous, heads D apart) stored at
// (block[t], offset[t]) of the caches [blocks, block positions, W (or
// more), D] (views of the layer's cache, keys' type). False where not
// served, and nothing written.
bool FusedRopeStoreKv(const at::Tensor& keys, const at::Tensor& values,
                      const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin, const at::Tensor& block,
                      const at::Tensor& offset, const at::Tensor& key_cache,
                      const at::Tensor& value_cache);

// SwiGLU over the [gate | up] product both [N, 2I]: silu(gate) * up, [N, I].
at::Tensor FusedSiluMul(const at::Tensor& both);

// Whether this project's CUDA kernels launch to overlap the kernel before
// them in the stream (programmatic dependent launch, Hopper and later:
// model/kernels/cuda_launch.h), process-wide, from now on; off by default.
// A no-op in a build against a CPU LibTorch.
void SetCudaProgrammaticLaunch(bool on);

// Outputs up to which the skinny kernel runs a product. cuBLAS splits the
// inner dimension of a product this narrow at batch 1 and reduces the
// splits in a second kernel; its wide products (the 8B layer's [gate | up],
// 28,672 outputs, and the LM head) ran at the copy bandwidth in run 7.
inline constexpr int64_t kSkinnyLinearMaxOutputs = 8192;
// x [N, K] W^T (+ bias [M]) for a weight W [M, K] in x's type, as
// at::linear, in one kernel without split-K (model/kernels/
// cuda_skinny_linear.h): where N <= kSkinnyMaxRows (a decode step's batch)
// and M <= max_outputs, K a multiple of 8 and the rows 16-byte aligned.
// Undefined elsewhere; cuBLAS then runs it.
at::Tensor FusedSkinnyLinear(const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& bias,
                             int64_t max_outputs = kSkinnyLinearMaxOutputs);
// FusedSiluMul(both) [N, K] times W^T: SwiGLU and the MLP's down projection
// in one kernel, where FusedSkinnyLinear would take the product.
at::Tensor FusedSiluMulLinear(const at::Tensor& both, const at::Tensor& weight,
                              int64_t max_outputs = kSkinnyLinearMaxOutputs);

// The query-norm router's gates [N, shared + routed] from the queries
// [N, H, D] (before RoPE) and each token's routed K (int64 [N]): 1 for the
// shared heads, 1 for the K routed heads of the largest
// softmax(norm / std(norms)), 0 for the rest (MohRouter::QueryNormGates).
at::Tensor FusedQueryNormGates(const at::Tensor& queries,
                               const at::Tensor& top_k, int64_t shared,
                               int64_t routed);

// What a layer does to its step's tokens before attending, one kernel:
// the queries rotated (FusedRope), the keys rotated and stored with the
// values (FusedRopeStoreKv) and, where top_k is defined, the query-norm
// router's gates of the queries before RoPE (FusedQueryNormGates).
struct AttentionPrologueInputs {
  at::Tensor queries;        // [N, H, D], before RoPE
  at::Tensor keys, values;   // [N, W, D], as FusedRopeStoreKv's
  at::Tensor positions;      // [N] int64: of queries and keys
  at::Tensor cos, sin;       // [P, D]
  at::Tensor block, offset;  // [N] int64: each token's place in the caches
  at::Tensor key_cache, value_cache;
  at::Tensor top_k;                // [N] int64, or undefined: no gates
  int64_t shared = 0, routed = 0;  // the router's heads (shared + routed = H)
};
struct AttentionPrologue {
  at::Tensor rotated;  // [N, H, D] contiguous; undefined: not served
  at::Tensor gates;    // [N, H], where routed
};
// Undefined outputs, and nothing written, where not served (any part's
// kernel would not take its tensors).
AttentionPrologue FusedAttentionPrologue(const AttentionPrologueInputs& in);

}  // namespace moh
