// x W^T (+ bias), as at::linear, except for float32 on the CPU, where
// OpenBLAS 0.3.21 (Debian 12) runs a few-row sgemm by first packing the whole
// weight matrix (58% of a batch-1 decode step of the bench model, perf) and
// runs AVX2 kernels on AVX-512 CPUs. There products go to this project's
// kernels (model/kernels/cpu_linear.h) by row count: RowLinear for one row,
// SkinnyLinear up to kMinStreamedRows - 1, StreamedLinear up to
// kMaxStreamedRows (decode batches), BlockedLinear beyond (prefill). Each has
// an AVX-512 and an AVX2 + FMA path (model/kernels/cpu_isa.h picks one at run
// time); only on a CPU with neither, or under MOH_CPU_ISA=portable, one row
// goes through a matrix-vector product (sgemv reads the weights once: 2.4x
// faster than OpenBLAS's sgemm) and OpenBLAS takes the rest.
// A bfloat16 weight (LlamaModel's `weights: "bfloat16"`) with float32 x goes
// to Bf16Linear (model/kernels/cpu_lowp_linear.h), which widens W in
// registers; elsewhere (kPortable, CUDA) W is widened per call to x's type.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "model/kernels/cpu_linear.h"
#include "model/kernels/cpu_lowp_linear.h"

namespace moh {

// Whether x [..., k] W^T (+ bias) can run on this project's kernels: float32
// CPU tensors, W's rows contiguous, at least one row.
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
  return x.numel() / x.size(-1) >= 1;
}

// Whether x [..., k] W^T (+ bias) is a float32 x against a bfloat16 W on the
// CPU that Bf16Linear can read in place (W's rows contiguous).
inline bool Bf16KernelTakes(const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias) {
  return x.is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 &&
         weight.is_cpu() && weight.scalar_type() == at::kBFloat16 &&
         weight.dim() == 2 && weight.stride(1) == 1 &&
         weight.stride(0) >= weight.size(1) && x.size(-1) == weight.size(1) &&
         x.size(-1) > 0 && x.numel() > 0 &&
         (!bias.defined() ||
          (bias.scalar_type() == at::kFloat && bias.is_contiguous()));
}

// x W^T (+ bias) into y for Bf16KernelTakes' operands; false under kPortable.
inline bool RunBf16Kernel(const at::Tensor& x, const at::Tensor& weight,
                          const at::Tensor& bias, float* y) {
  const at::Tensor in = x.contiguous();
  return Bf16Linear(
      in.data_ptr<float>(), in.numel() / in.size(-1), in.size(-1),
      reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()),
      weight.stride(0), weight.size(0),
      bias.defined() ? bias.data_ptr<float>() : nullptr, y);
}

// A weight of another type than x's (a bfloat16 weight where no kernel of
// this project takes it) widened for at::linear: a copy per call.
inline at::Tensor AsTypeOf(const at::Tensor& weight, const at::Tensor& x) {
  return weight.scalar_type() == x.scalar_type() ? weight
                                                 : weight.to(x.scalar_type());
}

// x W^T (+ bias) into y (x's rows by W's rows) on the kernel the row count
// picks, when OwnKernelTakes them; false when this CPU has none for it.
inline bool RunOwnKernel(const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& bias, float* y) {
  const at::Tensor in = x.contiguous();
  const int64_t rows = in.numel() / in.size(-1);
  auto run = [&](auto* product) {
    return product(in.data_ptr<float>(), rows, in.size(-1),
                   weight.data_ptr<float>(), weight.stride(0), weight.size(0),
                   bias.defined() ? bias.data_ptr<float>() : nullptr, y);
  };
  if (rows == 1) {
    return RowLinear(in.data_ptr<float>(), in.size(-1),
                     weight.data_ptr<float>(), weight.stride(0), weight.size(0),
                     bias.defined() ? bias.data_ptr<float>() : nullptr, y);
  }
  if (rows < kMinStreamedRows) return run(&SkinnyLinear);
  if (rows <= kMaxStreamedRows) {
    return run(&StreamedLinear) ||
           (rows <= kMaxSkinnyRows && run(&SkinnyLinear));
  }
  return run(&BlockedLinear);
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
  if (Bf16KernelTakes(x, weight, bias) && out.is_contiguous() &&
      out.scalar_type() == at::kFloat &&
      RunBf16Kernel(x, weight, bias, out.data_ptr<float>())) {
    return;
  }
  if (bias.defined()) {
    at::addmm_out(out, bias, x, AsTypeOf(weight, x).t());
  } else {
    at::mm_out(out, x, AsTypeOf(weight, x).t());
  }
}

inline at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& bias = {}) {
  if (OwnKernelTakes(x, weight, bias)) {
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = weight.size(0);
    at::Tensor out = at::empty(shape, x.options());
    if (RunOwnKernel(x, weight, bias, out.data_ptr<float>())) return out;
  }
  if (Bf16KernelTakes(x, weight, bias)) {
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = weight.size(0);
    at::Tensor out = at::empty(shape, x.options());
    if (RunBf16Kernel(x, weight, bias, out.data_ptr<float>())) return out;
  }
  if (x.is_cpu() && x.scalar_type() == at::kFloat &&
      weight.scalar_type() == at::kFloat && x.dim() >= 1 &&
      x.numel() == x.size(-1)) {
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = weight.size(0);
    const at::Tensor row = x.reshape({-1});
    return (bias.defined() ? at::addmv(bias, weight, row) : at::mv(weight, row))
        .view(shape);
  }
  const at::Tensor w = AsTypeOf(weight, x);
  return bias.defined() ? at::linear(x, w, bias) : at::linear(x, w);
}

}  // namespace moh
