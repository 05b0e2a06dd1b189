#include "model/core/fused_layer_ops.h"

#ifdef MOH_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>

#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>

#include "model/core/cuda_element_of.h"
#include "model/core/cuda_kernel_args.h"
#include "model/kernels/cuda_launch.h"
#include "model/kernels/cuda_layer_ops.h"
#include "model/kernels/cuda_skinny_linear.h"
#endif

namespace moh {

#ifdef MOH_CUDA_KERNELS

namespace {

// Whether the kernels take these tensors: on one device, in one type they
// take (*type), each with its last dimension contiguous.
bool Served(std::initializer_list<const at::Tensor*> tensors,
            CudaElement* type) {
  const at::Tensor& first = **tensors.begin();
  if (!first.defined() || !CudaElementOf(first.scalar_type(), type)) {
    return false;
  }
  for (const at::Tensor* t : tensors) {
    if (!t->defined() || t->device() != first.device() ||
        t->scalar_type() != first.scalar_type() || t->dim() == 0 ||
        t->stride(-1) != 1) {
      return false;
    }
  }
  return true;
}

// A contiguous int64 index vector of n on `like`'s device.
bool IndexServed(const at::Tensor& index, int64_t n, const at::Tensor& like) {
  return index.defined() && index.device() == like.device() &&
         index.scalar_type() == at::kLong && index.dim() == 1 &&
         index.size(0) == n && index.is_contiguous();
}

bool RopeTablesServed(const at::Tensor& x, const at::Tensor& cos,
                      const at::Tensor& sin) {
  return cos.dim() == 2 && cos.sizes() == sin.sizes() &&
         cos.size(1) == x.size(-1) && cos.is_contiguous() &&
         sin.is_contiguous() && x.size(-1) % 2 == 0;
}

RopeTables Tables(const at::Tensor& cos, const at::Tensor& sin) {
  return RopeTables{cos.data_ptr(), sin.data_ptr(), cos.size(0)};
}

void* CurrentStream() { return at::cuda::getCurrentCUDAStream().stream(); }

void Check(const char* error, const char* what) {
  if (error != nullptr) {
    throw std::runtime_error(std::string(what) + ": " + error);
  }
}

}  // namespace

bool AddRmsNormArgsFor(at::Tensor& hidden, const at::Tensor& residual,
                       const at::Tensor& weight, double eps, at::Tensor* out,
                       AddRmsNormArgs* a) {
  if (!Served({&hidden, &residual, &weight}, &a->type) || hidden.dim() != 2 ||
      residual.sizes() != hidden.sizes() || weight.dim() != 1 ||
      weight.size(0) != hidden.size(1)) {
    return false;
  }
  *out = at::empty(hidden.sizes(), hidden.options());
  a->hidden = CudaRows{hidden.data_ptr(), hidden.stride(0)};
  a->residual = CudaRows{residual.data_ptr(), residual.stride(0)};
  a->weight = weight.data_ptr();
  a->out = CudaRows{out->data_ptr(), out->stride(0)};
  a->rows = static_cast<int>(hidden.size(0));
  a->width = static_cast<int>(hidden.size(1));
  a->eps = static_cast<float>(eps);
  return true;
}

bool RopeArgsFor(const at::Tensor& x, const at::Tensor& positions,
                 const at::Tensor& cos, const at::Tensor& sin, at::Tensor* out,
                 RopeArgs* a) {
  if (!Served({&x, &cos, &sin}, &a->type) || x.dim() != 3 ||
      !RopeTablesServed(x, cos, sin) || !IndexServed(positions, x.size(0), x)) {
    return false;
  }
  *out = at::empty(x.sizes(), x.options());
  a->x = x.data_ptr();
  a->token_stride = x.stride(0);
  a->head_stride = x.stride(1);
  a->positions = positions.data_ptr<int64_t>();
  a->tables = Tables(cos, sin);
  a->out = out->data_ptr();
  a->tokens = static_cast<int>(x.size(0));
  a->heads = static_cast<int>(x.size(1));
  a->head_dim = static_cast<int>(x.size(2));
  return true;
}

bool RopeStoreKvArgsFor(const at::Tensor& keys, const at::Tensor& values,
                        const at::Tensor& positions, const at::Tensor& cos,
                        const at::Tensor& sin, const at::Tensor& block,
                        const at::Tensor& offset, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, RopeStoreKvArgs* a) {
  const int64_t n = keys.dim() == 3 ? keys.size(0) : -1;
  if (!Served({&keys, &values, &cos, &sin, &key_cache, &value_cache},
              &a->type) ||
      keys.dim() != 3 || values.sizes() != keys.sizes() ||
      values.strides() != keys.strides() || keys.stride(1) != keys.size(2) ||
      !RopeTablesServed(keys, cos, sin) || key_cache.dim() != 4 ||
      key_cache.sizes() != value_cache.sizes() ||
      key_cache.strides() != value_cache.strides() ||
      key_cache.size(2) < keys.size(1) || key_cache.size(3) != keys.size(2) ||
      !IndexServed(positions, n, keys) || !IndexServed(block, n, keys) ||
      !IndexServed(offset, n, keys)) {
    return false;
  }
  a->keys = keys.data_ptr();
  a->values = values.data_ptr();
  a->token_stride = keys.stride(0);
  a->positions = positions.data_ptr<int64_t>();
  a->tables = Tables(cos, sin);
  a->block = block.data_ptr<int64_t>();
  a->offset = offset.data_ptr<int64_t>();
  a->key_cache = key_cache.data_ptr();
  a->value_cache = value_cache.data_ptr();
  a->stride_block = key_cache.stride(0);
  a->stride_position = key_cache.stride(1);
  a->stride_head = key_cache.stride(2);
  a->tokens = static_cast<int>(n);
  a->heads = static_cast<int>(keys.size(1));
  a->head_dim = static_cast<int>(keys.size(2));
  return true;
}

bool SiluMulArgsFor(const at::Tensor& both, at::Tensor* out, SiluMulArgs* a) {
  if (!Served({&both}, &a->type) || both.dim() != 2 || !both.is_contiguous() ||
      both.size(1) % 2 != 0) {
    return false;
  }
  a->rows = both.size(0);
  a->inter = both.size(1) / 2;
  *out = at::empty({a->rows, a->inter}, both.options());
  a->both = both.data_ptr();
  a->out = out->data_ptr();
  return true;
}

bool SkinnyLinearArgsFor(const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& bias, bool silu_mul, at::Tensor* out,
                         SkinnyLinearArgs* a) {
  if (!Served({&x, &weight}, &a->type) || x.dim() != 2 || weight.dim() != 2 ||
      x.size(0) < 1 || x.size(0) > kSkinnyMaxRows ||
      x.size(1) != (silu_mul ? 2 : 1) * weight.size(1) ||
      weight.size(0) > std::numeric_limits<int>::max() ||
      weight.size(1) > std::numeric_limits<int>::max() / 2 ||
      (bias.defined() &&
       (!Served({&bias, &x}, &a->type) || bias.dim() != 1 ||
        bias.size(0) != weight.size(0) || !bias.is_contiguous()))) {
    return false;
  }
  a->x = CudaRows{x.data_ptr(), x.stride(0)};
  a->silu_mul = silu_mul;
  a->weight = CudaRows{weight.data_ptr(), weight.stride(0)};
  a->bias = bias.defined() ? bias.data_ptr() : nullptr;
  a->rows = static_cast<int>(x.size(0));
  a->n = static_cast<int>(weight.size(0));
  a->k = static_cast<int>(weight.size(1));
  if (!SkinnyLinearTakes(*a)) return false;
  *out = at::empty({x.size(0), weight.size(0)}, x.options());
  a->out = CudaRows{out->data_ptr(), out->stride(0)};
  return true;
}

bool QueryNormGatesArgsFor(const at::Tensor& queries, const at::Tensor& top_k,
                           int64_t shared, int64_t routed, at::Tensor* out,
                           QueryNormGatesArgs* a) {
  if (!Served({&queries}, &a->type) || queries.dim() != 3 || shared < 0 ||
      routed <= 0 || routed > kQueryNormMaxRouted ||
      queries.size(1) != shared + routed ||
      !IndexServed(top_k, queries.size(0), queries)) {
    return false;
  }
  *out = at::empty({queries.size(0), shared + routed}, queries.options());
  a->queries = queries.data_ptr();
  a->token_stride = queries.stride(0);
  a->head_stride = queries.stride(1);
  a->top_k = top_k.data_ptr<int64_t>();
  a->gates = out->data_ptr();
  a->tokens = static_cast<int>(queries.size(0));
  a->shared = static_cast<int>(shared);
  a->routed = static_cast<int>(routed);
  a->head_dim = static_cast<int>(queries.size(2));
  return true;
}

bool AttentionPrologueArgsFor(const AttentionPrologueInputs& in,
                              AttentionPrologue* out,
                              AttentionPrologueArgs* a) {
  const AttentionPrologueInputs& i = in;
  if (!RopeArgsFor(i.queries, i.positions, i.cos, i.sin, &out->rotated,
                   &a->queries) ||
      !RopeStoreKvArgsFor(i.keys, i.values, i.positions, i.cos, i.sin, i.block,
                          i.offset, i.key_cache, i.value_cache,
                          &a->keys_values) ||
      a->keys_values.type != a->queries.type ||
      (i.top_k.defined() &&
       !QueryNormGatesArgsFor(i.queries, i.top_k, i.shared, i.routed,
                              &out->gates, &a->router))) {
    *out = AttentionPrologue();
    return false;
  }
  return true;
}

at::Tensor FusedAddRmsNorm(at::Tensor& hidden, const at::Tensor& residual,
                           const at::Tensor& weight, double eps) {
  at::Tensor out;
  AddRmsNormArgs a;
  if (!hidden.is_cuda() ||
      !AddRmsNormArgsFor(hidden, residual, weight, eps, &out, &a)) {
    return at::Tensor();
  }
  a.stream = CurrentStream();
  Check(LaunchAddRmsNorm(a), "FusedAddRmsNorm");
  return out;
}

at::Tensor FusedRope(const at::Tensor& x, const at::Tensor& positions,
                     const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor out;
  RopeArgs a;
  if (!x.is_cuda() || !RopeArgsFor(x, positions, cos, sin, &out, &a)) {
    return at::Tensor();
  }
  a.stream = CurrentStream();
  Check(LaunchRope(a), "FusedRope");
  return out;
}

bool FusedRopeStoreKv(const at::Tensor& keys, const at::Tensor& values,
                      const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin, const at::Tensor& block,
                      const at::Tensor& offset, const at::Tensor& key_cache,
                      const at::Tensor& value_cache) {
  RopeStoreKvArgs a;
  if (!keys.is_cuda() ||
      !RopeStoreKvArgsFor(keys, values, positions, cos, sin, block, offset,
                          key_cache, value_cache, &a)) {
    return false;
  }
  a.stream = CurrentStream();
  Check(LaunchRopeStoreKv(a), "FusedRopeStoreKv");
  return true;
}

at::Tensor FusedSiluMul(const at::Tensor& both) {
  at::Tensor out;
  SiluMulArgs a;
  if (!both.is_cuda() || !SiluMulArgsFor(both, &out, &a)) return at::Tensor();
  a.stream = CurrentStream();
  Check(LaunchSiluMul(a), "FusedSiluMul");
  return out;
}

void SetCudaProgrammaticLaunch(bool on) { cuda::SetProgrammaticLaunch(on); }

namespace {

// The skinny kernel's product, where FusedSkinnyLinear takes it.
at::Tensor SkinnyProduct(const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& bias, bool silu_mul,
                         int64_t max_outputs) {
  at::Tensor out;
  SkinnyLinearArgs a;
  if (!x.is_cuda() || !weight.defined() || weight.size(0) > max_outputs ||
      !SkinnyLinearArgsFor(x, weight, bias, silu_mul, &out, &a)) {
    return at::Tensor();
  }
  a.stream = CurrentStream();
  Check(LaunchSkinnyLinear(a), "FusedSkinnyLinear");
  return out;
}

}  // namespace

at::Tensor FusedSkinnyLinear(const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& bias, int64_t max_outputs) {
  return SkinnyProduct(x, weight, bias, false, max_outputs);
}

at::Tensor FusedSiluMulLinear(const at::Tensor& both, const at::Tensor& weight,
                              int64_t max_outputs) {
  return SkinnyProduct(both, weight, at::Tensor(), true, max_outputs);
}

at::Tensor FusedQueryNormGates(const at::Tensor& queries,
                               const at::Tensor& top_k, int64_t shared,
                               int64_t routed) {
  at::Tensor out;
  QueryNormGatesArgs a;
  if (!queries.is_cuda() ||
      !QueryNormGatesArgsFor(queries, top_k, shared, routed, &out, &a)) {
    return at::Tensor();
  }
  a.stream = CurrentStream();
  Check(LaunchQueryNormGates(a), "FusedQueryNormGates");
  return out;
}

AttentionPrologue FusedAttentionPrologue(const AttentionPrologueInputs& in) {
  AttentionPrologue out;
  AttentionPrologueArgs a;
  if (!in.queries.is_cuda() || !AttentionPrologueArgsFor(in, &out, &a)) {
    return AttentionPrologue();
  }
  a.queries.stream = CurrentStream();
  Check(LaunchAttentionPrologue(a), "FusedAttentionPrologue");
  return out;
}

#else  // a CPU LibTorch: no kernels, the ATen chains run

at::Tensor FusedAddRmsNorm(at::Tensor&, const at::Tensor&, const at::Tensor&,
                           double) {
  return at::Tensor();
}

at::Tensor FusedRope(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&) {
  return at::Tensor();
}

bool FusedRopeStoreKv(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  return false;
}

at::Tensor FusedSiluMul(const at::Tensor&) { return at::Tensor(); }

void SetCudaProgrammaticLaunch(bool) {}

at::Tensor FusedSkinnyLinear(const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, int64_t) {
  return at::Tensor();
}

at::Tensor FusedSiluMulLinear(const at::Tensor&, const at::Tensor&, int64_t) {
  return at::Tensor();
}

at::Tensor FusedQueryNormGates(const at::Tensor&, const at::Tensor&, int64_t,
                               int64_t) {
  return at::Tensor();
}

AttentionPrologue FusedAttentionPrologue(const AttentionPrologueInputs&) {
  return AttentionPrologue();
}

#endif

}  // namespace moh
