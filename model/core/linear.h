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
// registers (a prefill on an AVX512_BF16 CPU rounds x to bfloat16 instead);
// an int8 weight (`weights: "int8"`, or a pre-quantized checkpoint:
// LinearWeight's values and a scale per row) to Int8Linear (likewise, on
// AVX512_VNNI products past 8 rows quantize x per 32 values); elsewhere
// (kPortable, CUDA) W is widened per call to x's type.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "model/kernels/cpu_linear.h"
#include "model/kernels/cpu_lowp_linear.h"

namespace moh {

// Whether `t` is a float32 CPU tensor: what the plain loops of the CPU paths
// (norms, RoPE, cache writes, the pair kernel) read by pointer, with the
// strides they check themselves.
inline bool CpuFloat(const at::Tensor& t) {
  return t.is_cpu() && t.scalar_type() == at::kFloat;
}

// A linear layer's weight W [out, in] as a model holds it: a floating
// tensor (float32, bfloat16, float16), or weight-only int8: int8 `values`
// and a float32 `scale` per output row, W[j, :] = values[j, :] * scale[j]
// (QuantizedLinearWeight). A plain tensor converts implicitly.
struct LinearWeight {
  LinearWeight() = default;
  LinearWeight(at::Tensor w) : values(std::move(w)) {}  // NOLINT: a plain W

  at::Tensor values;  // [out, in]
  at::Tensor scale;   // [out] float32 when values are int8, else undefined

  bool defined() const { return values.defined(); }
  bool quantized() const { return scale.defined(); }
  int64_t size(int64_t dim) const { return values.size(dim); }
  // Rows [start, start + count) of W (output channels), with their scales.
  LinearWeight Rows(int64_t start, int64_t count) const {
    LinearWeight rows(values.narrow(0, start, count));
    if (quantized()) rows.scale = scale.narrow(0, start, count);
    return rows;
  }
  // Columns [start, start + count) of W (input features); scales stay.
  LinearWeight Columns(int64_t start, int64_t count) const {
    LinearWeight columns(values.narrow(1, start, count));
    columns.scale = scale;
    return columns;
  }
  // W of `dtype`: itself when it already is, else a widened copy.
  at::Tensor Dense(at::ScalarType dtype) const {
    if (!quantized()) {
      return values.scalar_type() == dtype ? values : values.to(dtype);
    }
    return (values.to(at::kFloat) * scale.unsqueeze(1)).to(dtype);
  }
};

// Weights of one input stacked by rows into one W, so that one product
// (one pass over x, one parallel region, one launch) yields what they
// yielded one by one; each part becomes a view of its rows of it (no memory
// beyond the stack). Undefined, parts untouched, when their formats differ
// (one stored pre-quantized, the other not) and they cannot stack.
inline LinearWeight StackRows(std::initializer_list<LinearWeight*> parts) {
  const LinearWeight& first = **parts.begin();
  std::vector<at::Tensor> values, scales;
  for (const LinearWeight* part : parts) {
    if (!part->defined() || part->quantized() != first.quantized() ||
        part->values.scalar_type() != first.values.scalar_type() ||
        part->values.device() != first.values.device() ||
        part->values.dim() != 2 || part->size(1) != first.size(1)) {
      return {};
    }
    values.push_back(part->values);
    if (part->quantized()) scales.push_back(part->scale);
  }
  LinearWeight stacked(at::cat(values, 0));
  if (first.quantized()) stacked.scale = at::cat(scales, 0);
  int64_t row = 0;
  for (LinearWeight* part : parts) {
    const int64_t rows = part->size(0);
    *part = stacked.Rows(row, rows);
    row += rows;
  }
  return stacked;
}

// Rows `ids` of an embedding table held as a LinearWeight (tied to the
// lm_head's weight), widened to `dtype`: a looked-up row of an int8 table
// times its scale.
inline at::Tensor EmbeddingRows(const LinearWeight& table,
                                const at::Tensor& ids, at::ScalarType dtype) {
  if (!table.quantized()) return at::embedding(table.values, ids).to(dtype);
  return (table.values.index_select(0, ids).to(at::kFloat) *
          table.scale.index_select(0, ids).unsqueeze(1))
      .to(dtype);
}

// A float W [out, in] quantized per row (QuantizeInt8Rows): int8 values
// and a float32 scale per row, on the CPU.
inline LinearWeight QuantizedLinearWeight(const at::Tensor& weight) {
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  LinearWeight q;
  q.values = at::empty(w.sizes(), w.options().dtype(at::kChar));
  q.scale = at::empty({w.size(0)}, w.options());
  QuantizeInt8Rows(w.data_ptr<float>(), w.size(1), w.size(0), w.size(1),
                   q.values.data_ptr<int8_t>(), q.scale.data_ptr<float>());
  return q;
}

// Whether W is a bfloat16 or an int8 (with scales) CPU tensor whose rows
// are contiguous: what WidenWeightRows takes.
inline bool WidenableWeight(const LinearWeight& w) {
  const at::Tensor& v = w.values;
  return v.is_cpu() && v.dim() == 2 && v.stride(1) == 1 &&
         (w.quantized() ? v.scalar_type() == at::kChar
                        : v.scalar_type() == at::kBFloat16);
}

// Rows [row0, row0 + rows) of a WidenableWeight widened to float32 into
// out [rows, in] (contiguous); false, doing nothing, for another weight.
inline bool WidenWeightRows(const LinearWeight& w, int64_t row0, int64_t rows,
                            float* out) {
  if (!WidenableWeight(w)) return false;
  const at::Tensor& v = w.values;
  if (w.quantized()) {
    WidenInt8Rows(v.data_ptr<int8_t>() + row0 * v.stride(0), v.stride(0), rows,
                  v.size(1), w.scale.data_ptr<float>() + row0, out);
  } else {
    WidenBf16Rows(reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>() +
                                                    row0 * v.stride(0)),
                  v.stride(0), rows, v.size(1), out);
  }
  return true;
}

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

// Whether x [..., k] W^T (+ bias) is a float32 x against an int8 W with its
// scales on the CPU that Int8Linear can read in place.
inline bool Int8KernelTakes(const at::Tensor& x, const LinearWeight& weight,
                            const at::Tensor& bias) {
  const at::Tensor& w = weight.values;
  return weight.quantized() && x.is_cpu() && x.scalar_type() == at::kFloat &&
         x.dim() >= 1 && w.is_cpu() && w.scalar_type() == at::kChar &&
         w.dim() == 2 && w.stride(1) == 1 && w.stride(0) >= w.size(1) &&
         x.size(-1) == w.size(1) && x.size(-1) > 0 && x.numel() > 0 &&
         weight.scale.scalar_type() == at::kFloat &&
         weight.scale.is_contiguous() &&
         (!bias.defined() ||
          (bias.scalar_type() == at::kFloat && bias.is_contiguous()));
}

// x W^T (+ bias) into y for Int8KernelTakes' operands; false under kPortable.
inline bool RunInt8Kernel(const at::Tensor& x, const LinearWeight& weight,
                          const at::Tensor& bias, float* y) {
  const at::Tensor in = x.contiguous();
  const at::Tensor& w = weight.values;
  return Int8Linear(in.data_ptr<float>(), in.numel() / in.size(-1), in.size(-1),
                    w.data_ptr<int8_t>(), w.stride(0), w.size(0),
                    weight.scale.data_ptr<float>(),
                    bias.defined() ? bias.data_ptr<float>() : nullptr, y);
}

// x W^T (+ bias) into y on the kernel of a bfloat16 or int8 W under float32
// x; false where none takes them.
inline bool RunLowPrecisionKernel(const at::Tensor& x,
                                  const LinearWeight& weight,
                                  const at::Tensor& bias, float* y) {
  if (weight.quantized()) {
    return Int8KernelTakes(x, weight, bias) &&
           RunInt8Kernel(x, weight, bias, y);
  }
  return Bf16KernelTakes(x, weight.values, bias) &&
         RunBf16Kernel(x, weight.values, bias, y);
}

// x [rows, k] (contiguous) W^T (+ bias) into y [rows, n] for a float32 W
// [n, k] (row stride ldw) on the kernel the row count picks; false when
// this CPU has none for it.
inline bool OwnKernelRows(const float* x, int64_t rows, int64_t k,
                          const float* w, int64_t ldw, int64_t n,
                          const float* bias, float* y) {
  if (rows == 1) return RowLinear(x, k, w, ldw, n, bias, y);
  if (rows < kMinStreamedRows) {
    return SkinnyLinear(x, rows, k, w, ldw, n, bias, y);
  }
  if (rows <= kMaxStreamedRows) {
    return StreamedLinear(x, rows, k, w, ldw, n, bias, y) ||
           (rows <= kMaxSkinnyRows &&
            SkinnyLinear(x, rows, k, w, ldw, n, bias, y));
  }
  return BlockedLinear(x, rows, k, w, ldw, n, bias, y);
}

// x W^T (+ bias) into y (x's rows by W's rows) on the kernel the row count
// picks, when OwnKernelTakes them; false when this CPU has none for it.
inline bool RunOwnKernel(const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& bias, float* y) {
  const at::Tensor in = x.contiguous();
  return OwnKernelRows(in.data_ptr<float>(), in.numel() / in.size(-1),
                       in.size(-1), weight.data_ptr<float>(), weight.stride(0),
                       weight.size(0),
                       bias.defined() ? bias.data_ptr<float>() : nullptr, y);
}

// x [m, k] (contiguous, float32) times a block of a CPU W: its rows
// [row0, row0 + n) and columns [col0, col0 + k), (+ bias [n]) into y [m, n]
// (contiguous), straight from pointers into W (float32, bfloat16 or int8
// with its scales): what Linear(x, W.Rows(..).Columns(..)) computes, with no
// ATen view, allocation or dispatch. False (nothing written) where no
// kernel here takes W (another type or device, kPortable).
inline bool LinearBlockInto(const float* x, int64_t m, int64_t k,
                            const LinearWeight& weight, int64_t row0, int64_t n,
                            int64_t col0, const float* bias, float* y) {
  const at::Tensor& w = weight.values;
  if (m < 1 || n < 1 || k < 1 || !w.is_cpu() || w.dim() != 2 ||
      w.stride(1) != 1 || row0 + n > w.size(0) || col0 + k > w.size(1)) {
    return false;
  }
  const int64_t ldw = w.stride(0), at = row0 * ldw + col0;
  if (weight.quantized()) {
    return w.scalar_type() == at::kChar &&
           weight.scale.scalar_type() == at::kFloat &&
           weight.scale.is_contiguous() &&
           Int8Linear(x, m, k, w.data_ptr<int8_t>() + at, ldw, n,
                      weight.scale.data_ptr<float>() + row0, bias, y);
  }
  if (w.scalar_type() == at::kBFloat16) {
    return Bf16Linear(
        x, m, k,
        reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()) + at, ldw,
        n, bias, y);
  }
  return w.scalar_type() == at::kFloat &&
         OwnKernelRows(x, m, k, w.data_ptr<float>() + at, ldw, n, bias, y);
}

// out = x W^T (+ bias) into `out` (contiguous, x's rows by W's rows): as
// Linear, without allocating the result.
inline void LinearInto(const at::Tensor& x, const LinearWeight& weight,
                       const at::Tensor& bias, at::Tensor& out) {
  const bool float_out = out.is_contiguous() && out.scalar_type() == at::kFloat;
  if (float_out && !weight.quantized() &&
      OwnKernelTakes(x, weight.values, bias) &&
      RunOwnKernel(x, weight.values, bias, out.data_ptr<float>())) {
    return;
  }
  if (float_out &&
      RunLowPrecisionKernel(x, weight, bias, out.data_ptr<float>())) {
    return;
  }
  const at::Tensor w = weight.Dense(x.scalar_type());
  if (bias.defined()) {
    at::addmm_out(out, bias, x, w.t());
  } else {
    at::mm_out(out, x, w.t());
  }
}

inline at::Tensor Linear(const at::Tensor& x, const LinearWeight& weight,
                         const at::Tensor& bias = {}) {
  const at::Tensor& w = weight.values;
  auto output = [&] {
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = w.size(0);
    return at::empty(shape, x.options());
  };
  if (!weight.quantized() && OwnKernelTakes(x, w, bias)) {
    at::Tensor out = output();
    if (RunOwnKernel(x, w, bias, out.data_ptr<float>())) return out;
  }
  if (Int8KernelTakes(x, weight, bias) ||
      (!weight.quantized() && Bf16KernelTakes(x, w, bias))) {
    at::Tensor out = output();
    if (RunLowPrecisionKernel(x, weight, bias, out.data_ptr<float>())) {
      return out;
    }
  }
  if (!weight.quantized() && x.is_cpu() && x.scalar_type() == at::kFloat &&
      w.scalar_type() == at::kFloat && x.dim() >= 1 &&
      x.numel() == x.size(-1)) {
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = w.size(0);
    const at::Tensor row = x.reshape({-1});
    return (bias.defined() ? at::addmv(bias, w, row) : at::mv(w, row))
        .view(shape);
  }
  const at::Tensor dense = weight.Dense(x.scalar_type());
  return bias.defined() ? at::linear(x, dense, bias) : at::linear(x, dense);
}

}  // namespace moh
