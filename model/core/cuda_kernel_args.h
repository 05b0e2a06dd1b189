// The CUDA kernels' arguments for given tensors (the ATen wrappers' side of
// each launch, before the stream: fused_layer_ops.cc,
// paged_decode_attention.cc) on any device, so that a test can run the kernels'
// host emulation (tests/model/kernels/cuda_host_emulation.h) over the same
// arguments as a CUDA launch. Only in builds with the kernels (a CUDA LibTorch:
// MOH_CUDA_KERNELS).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "model/core/fused_layer_ops.h"
#include "model/core/paged_decode_attention.h"
#include "model/kernels/cuda_layer_ops.h"
#include "model/kernels/cuda_paged_decode.h"
#include "model/kernels/cuda_skinny_linear.h"

namespace moh {

// Each fills *args (and allocates *out where the kernel writes a new
// tensor) and returns true, or returns false where the kernel does not take
// the tensors (fused_layer_ops.h says which; index tensors must be
// contiguous). args->stream is left null.
bool AddRmsNormArgsFor(at::Tensor& hidden, const at::Tensor& residual,
                       const at::Tensor& weight, double eps, at::Tensor* out,
                       AddRmsNormArgs* args);
bool RopeArgsFor(const at::Tensor& x, const at::Tensor& positions,
                 const at::Tensor& cos, const at::Tensor& sin, at::Tensor* out,
                 RopeArgs* args);
bool RopeStoreKvArgsFor(const at::Tensor& keys, const at::Tensor& values,
                        const at::Tensor& positions, const at::Tensor& cos,
                        const at::Tensor& sin, const at::Tensor& block,
                        const at::Tensor& offset, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, RopeStoreKvArgs* args);
bool SiluMulArgsFor(const at::Tensor& both, at::Tensor* out, SiluMulArgs* args);
// Any number of outputs (FusedSkinnyLinear's limit aside).
bool SkinnyLinearArgsFor(const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& bias, bool silu_mul, at::Tensor* out,
                         SkinnyLinearArgs* args);
bool QueryNormGatesArgsFor(const at::Tensor& queries, const at::Tensor& top_k,
                           int64_t shared, int64_t routed, at::Tensor* out,
                           QueryNormGatesArgs* args);
bool AttentionPrologueArgsFor(const AttentionPrologueInputs& in,
                              AttentionPrologue* out,
                              AttentionPrologueArgs* args);

// PagedDecode's launch: its arguments, the output and workspace they point
// into, and the contiguous copies of its inputs they read, held until the
// launch has run.
struct PagedDecodeLaunch {
  PagedDecodeArgs args;
  at::Tensor out;
  std::vector<at::Tensor> held;
};
// False where PagedDecodeServes is (the device aside).
bool PagedDecodeArgsFor(const PagedDecodeInputs& in, PagedDecodeLaunch* launch);

}  // namespace moh
