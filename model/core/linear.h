// x W^T (+ bias), as at::linear, with three exceptions, all for float32 on
// the CPU. OpenBLAS 0.3.21 (Debian 12) runs a few-row sgemm by first packing
// the whole weight matrix, which was 58% of a batch-1 decode step of the
// bench model (perf) and half of a batch-8 one. One row goes through a
// matrix-vector product (sgemv reads the weights once: 2.4x faster); 2 to
// kMaxSkinnyRows rows through SkinnyLinear (cpu_gemm.h), which streams the
// weights once for all of them; from kMinBlockedRows rows (prefill, large
// batches) through BlockedLinear, whose AVX-512 kernel does twice the
// multiply-adds per cycle of OpenBLAS's AVX2 one on CPUs that have it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "model/core/cpu_gemm.h"

namespace moh {

// Whether x [..., k] W^T (+ bias) can run on SkinnyLinear or BlockedLinear
// (float32 CPU tensors, W's rows contiguous, a row count they take).
inline bool OwnKernelTakes(const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& bias) {
  if (!x.is_cpu() || x.scalar_type() != at::kFloat || x.dim() < 1 ||
      !weight.is_cpu() || weight.scalar_type() != at::kFloat ||
      weight.dim() != 2 || weight.stride(1) != 1 ||
      weight.stride(0) < weight.size(1) || x.size(-1) != weight.size(1) ||
      x.size(-1) == 0 ||
      (bias.defined() &&
       (bias.scalar_type() != at::kFloat || !bias.is_contiguous()))) {
    return false;
  }
  const int64_t rows = x.numel() / x.size(-1);
  return rows >= 2 && (rows <= kMaxSkinnyRows || rows >= kMinBlockedRows);
}

// x W^T (+ bias) into y (x's rows by W's rows) on the kernel the row count
// picks, when OwnKernelTakes them; false when the CPU has not its
// instructions.
inline bool RunOwnKernel(const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& bias, float* y) {
  const at::Tensor in = x.contiguous();
  const int64_t rows = in.numel() / in.size(-1);
  auto* const product = rows <= kMaxSkinnyRows ? &SkinnyLinear : &BlockedLinear;
  return product(in.data_ptr<float>(), rows, in.size(-1),
                 weight.data_ptr<float>(), weight.stride(0), weight.size(0),
                 bias.defined() ? bias.data_ptr<float>() : nullptr, y);
}

// out = x W^T (+ bias) into `out` (contiguous, x's rows by W's rows): as
// Linear, without allocating the result.
inline void LinearInto(const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& bias, at::Tensor& out) {
  if (OwnKernelTakes(x, weight, bias) && out.is_contiguous() &&
      out.scalar_type() == at::kFloat) {
    if (RunOwnKernel(x, weight, bias, out.data_ptr<float>())) {
      return;
    }
  }
  if (bias.defined()) {
    at::addmm_out(out, bias, x, weight.t());
  } else {
    at::mm_out(out, x, weight.t());
  }
}

inline at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& bias = {}) {
  if (x.is_cpu() && x.scalar_type() == at::kFloat &&
      weight.scalar_type() == at::kFloat && x.dim() >= 1 &&
      x.numel() == x.size(-1)) {
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = weight.size(0);
    const at::Tensor row = x.reshape({-1});
    return (bias.defined() ? at::addmv(bias, weight, row) : at::mv(weight, row))
        .view(shape);
  }
  if (OwnKernelTakes(x, weight, bias)) {
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = weight.size(0);
    at::Tensor out = at::empty(shape, x.options());
    if (RunOwnKernel(x, weight, bias, out.data_ptr<float>())) {
      return out;
    }
  }
  return bias.defined() ? at::linear(x, weight, bias) : at::linear(x, weight);
}

}  // namespace moh
