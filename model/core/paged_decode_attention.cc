#include "model/core/paged_decode_attention.h"

#include <stdexcept>
#include <string>

#ifdef MOH_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>

#include "model/core/cuda_element_of.h"
#include "model/core/cuda_kernel_args.h"
#include "model/kernels/cuda_paged_decode.h"
#endif

namespace moh {

#ifdef MOH_CUDA_KERNELS

namespace {

// PagedDecodeServes' conditions but the device.
bool ArgumentsServed(const PagedDecodeInputs& in) {
  CudaElement type;
  const at::Tensor& k = in.key_cache;
  const at::Tensor& v = in.value_cache;
  return in.queries.dim() == 3 &&
         CudaElementOf(in.queries.scalar_type(), &type) &&
         k.scalar_type() == in.queries.scalar_type() &&
         v.scalar_type() == k.scalar_type() && k.dim() == 4 &&
         k.sizes() == v.sizes() && k.strides() == v.strides() &&
         k.stride(3) == 1 && k.size(3) == in.queries.size(2) &&
         in.block_table.scalar_type() == at::kLong &&
         in.positions.scalar_type() == at::kLong &&
         in.row_len.scalar_type() == at::kLong && in.kv_len > 0 &&
         in.split_keys >= 0 && in.split_keys <= kPagedDecodeSplit &&
         (!in.gates.defined() ||
          (in.gates.scalar_type() == in.queries.scalar_type() &&
           in.gates.device() == in.queries.device() && in.gates.dim() == 2 &&
           in.gates.size(0) == in.queries.size(0) &&
           in.gates.size(1) == in.queries.size(1) &&
           in.gates.stride(1) == 1)) &&
         PagedDecodeShapeSupported(static_cast<int>(in.queries.size(1)),
                                   static_cast<int>(k.size(2)),
                                   static_cast<int>(k.size(3)));
}

}  // namespace

bool PagedDecodeServes(const PagedDecodeInputs& in) {
  return in.queries.is_cuda() && ArgumentsServed(in);
}

bool PagedDecodeArgsFor(const PagedDecodeInputs& in,
                        PagedDecodeLaunch* launch) {
  if (!ArgumentsServed(in)) return false;
  PagedDecodeArgs& a = launch->args;
  CudaElementOf(in.queries.scalar_type(), &a.type);
  // The kernel reads queries 16 bytes at a time.
  at::Tensor queries = in.queries.contiguous();
  if (!Aligned8(a.type, queries.data_ptr())) queries = queries.clone();
  const at::Tensor table = in.block_table.contiguous();
  const at::Tensor positions = in.positions.reshape({-1}).contiguous();
  const at::Tensor row_len = in.row_len.contiguous();
  const int64_t rows = queries.size(0), heads = queries.size(1);
  const int64_t d = queries.size(2);
  a.queries = queries.data_ptr();
  a.key_cache = in.key_cache.data_ptr();
  a.value_cache = in.value_cache.data_ptr();
  a.stride_block = in.key_cache.stride(0);
  a.stride_position = in.key_cache.stride(1);
  a.stride_head = in.key_cache.stride(2);
  a.block_size = static_cast<int>(in.key_cache.size(1));
  a.block_table = table.data_ptr<int64_t>();
  a.table_stride = table.size(1);
  a.positions = positions.data_ptr<int64_t>();
  a.row_len = row_len.data_ptr<int64_t>();
  a.rows = static_cast<int>(rows);
  a.heads = static_cast<int>(heads);
  a.kv_heads = static_cast<int>(in.key_cache.size(2));
  a.head_dim = static_cast<int>(d);
  a.split_keys = in.split_keys != 0
                     ? in.split_keys
                     : PagedDecodeSplitKeys(rows, a.kv_heads, in.kv_len);
  a.splits = static_cast<int>((in.kv_len + a.split_keys - 1) / a.split_keys);
  a.scale = static_cast<float>(in.scale);
  if (in.gates.defined()) {
    a.gates = in.gates.data_ptr();
    a.gate_stride = in.gates.stride(0);
  }
  const at::TensorOptions f32 = queries.options().dtype(at::kFloat);
  const at::Tensor partial_out = at::empty({rows, heads, a.splits, d}, f32);
  const at::Tensor partial_max_sum = at::empty({rows, heads, a.splits, 2}, f32);
  a.partial_out = partial_out.data_ptr<float>();
  a.partial_max_sum = partial_max_sum.data_ptr<float>();
  launch->out = at::empty_like(queries);
  a.out = launch->out.data_ptr();
  launch->held = {queries, table,       positions,
                  row_len, partial_out, partial_max_sum};
  return true;
}

at::Tensor PagedDecode(const PagedDecodeInputs& in) {
  PagedDecodeLaunch launch;
  TORCH_CHECK(
      in.queries.is_cuda() && PagedDecodeArgsFor(in, &launch),
      "PagedDecode: inputs the kernel does not take (PagedDecodeServes)");
  launch.args.stream = at::cuda::getCurrentCUDAStream().stream();
  if (const char* error = LaunchPagedDecode(launch.args)) {
    throw std::runtime_error(std::string("PagedDecode: ") + error);
  }
  return launch.out;
}

#else  // a CPU LibTorch: no kernel

bool PagedDecodeServes(const PagedDecodeInputs&) { return false; }

at::Tensor PagedDecode(const PagedDecodeInputs&) {
  throw std::logic_error("PagedDecode: this build has no CUDA kernels");
}

#endif

}  // namespace moh
