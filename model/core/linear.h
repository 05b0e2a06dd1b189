// x W^T (+ bias), as at::linear, with one exception that matters for decode:
// one float32 row on the CPU goes through a matrix-vector product. OpenBLAS
// 0.3.21 (Debian 12) runs a one-row sgemm by first packing the whole weight
// matrix, which was 58% of a batch-1 decode step of the bench model (perf);
// sgemv reads the weights once (2.4x faster for one row, equal at 4 rows,
// slower at 16: more rows stay on sgemm).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace moh {

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
  return bias.defined() ? at::linear(x, weight, bias) : at::linear(x, weight);
}

}  // namespace moh
