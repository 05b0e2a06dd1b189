// The fused layer kernels (model/kernels/cuda_layer_ops.cu) run on the CPU
// through cuda_host_emulation.h, over the arguments fused_layer_ops.cc
// builds for a launch (fused_layer_ops_args.h), against the ATen chains
// they replace: layer_ops_reference.h's checks, which GpuFusedOpsTest makes
// on CUDA. Built with a CUDA LibTorch (CUDA's headers), run on any machine:
// the kernels' indexing, barriers, reductions and rounding are tested in CI,
// not only when a GPU is lent.
#include "tests/model/kernels/cuda_host_emulation.h"
// An emulated launch's error without the CUDA runtime.
#define cudaGetErrorString(error) "emulated launch failed"
#include "model/kernels/cuda_layer_ops.cu"
#undef cudaGetErrorString

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "model/core/fused_layer_ops_args.h"
#include "tests/model/core/layer_ops_reference.h"

namespace moh {
namespace {

using namespace layer_ops_reference;

// `out` once the launch ran, or undefined (a failure) where it did not.
at::Tensor Ran(const char* error, const at::Tensor& out) {
  EXPECT_EQ(error, nullptr) << error;
  return error == nullptr ? out : at::Tensor();
}

at::Tensor AddRmsNorm(at::Tensor& hidden, const at::Tensor& residual,
                      const at::Tensor& weight, double eps) {
  at::Tensor out;
  AddRmsNormArgs a;
  if (!AddRmsNormArgsFor(hidden, residual, weight, eps, &out, &a)) return {};
  return Ran(LaunchAddRmsNorm(a), out);
}

at::Tensor Rope(const at::Tensor& x, const at::Tensor& positions,
                const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor out;
  RopeArgs a;
  if (!RopeArgsFor(x, positions, cos, sin, &out, &a)) return {};
  return Ran(LaunchRope(a), out);
}

bool RopeStoreKv(const at::Tensor& keys, const at::Tensor& values,
                 const at::Tensor& positions, const at::Tensor& cos,
                 const at::Tensor& sin, const at::Tensor& block,
                 const at::Tensor& offset, const at::Tensor& key_cache,
                 const at::Tensor& value_cache) {
  RopeStoreKvArgs a;
  return RopeStoreKvArgsFor(keys, values, positions, cos, sin, block, offset,
                            key_cache, value_cache, &a) &&
         Ran(LaunchRopeStoreKv(a), keys).defined();
}

at::Tensor SiluMul(const at::Tensor& both) {
  at::Tensor out;
  SiluMulArgs a;
  if (!SiluMulArgsFor(both, &out, &a)) return {};
  return Ran(LaunchSiluMul(a), out);
}

at::Tensor QueryNormGates(const at::Tensor& queries, const at::Tensor& top_k,
                          int64_t shared, int64_t routed) {
  at::Tensor out;
  QueryNormGatesArgs a;
  if (!QueryNormGatesArgsFor(queries, top_k, shared, routed, &out, &a)) {
    return {};
  }
  return Ran(LaunchQueryNormGates(a), out);
}

const LayerKernels kEmulated = {AddRmsNorm, Rope, RopeStoreKv, SiluMul,
                                QueryNormGates};

class CudaLayerOpsEmulatedTest
    : public ::testing::TestWithParam<at::ScalarType> {
 protected:
  void SetUp() override { at::manual_seed(31); }
  at::TensorOptions Options() const {
    return at::TensorOptions().dtype(GetParam());
  }
};

TEST_P(CudaLayerOpsEmulatedTest, AddRmsNormIsAddThenRmsNorm) {
  CheckAddRmsNorm(kEmulated, Options());
}

TEST_P(CudaLayerOpsEmulatedTest, RopeIsTheChainsRotation) {
  CheckRope(kEmulated, Options());
}

TEST_P(CudaLayerOpsEmulatedTest, RopeStoreKvWritesTheRotatedKeysAndValuesOnly) {
  CheckRopeStoreKv(kEmulated, Options());
}

TEST_P(CudaLayerOpsEmulatedTest, SiluMulIsSiluThenMul) {
  CheckSiluMul(kEmulated, Options());
}

TEST_P(CudaLayerOpsEmulatedTest, QueryNormGatesKeepTheRoutersHeads) {
  CheckQueryNormGates(kEmulated, Options());
}

INSTANTIATE_TEST_SUITE_P(Types, CudaLayerOpsEmulatedTest,
                         ::testing::Values(at::kFloat, at::kBFloat16));

// The emulation itself: a launch that is not whole warps is refused (a
// block's warps exchange shuffles), and the kernels' own errors come back.
TEST(CudaHostEmulationTest, RefusesBlocksOfPartWarpsAndReportsKernelErrors) {
  AddRmsNormArgs none;
  EXPECT_EQ(emulation::Launch(AddRmsNormKernel<float>, dim3(1), dim3(48), none),
            cudaErrorInvalidConfiguration);
  QueryNormGatesArgs too_many;
  too_many.routed = kQueryNormMaxRouted + 1;
  EXPECT_NE(LaunchQueryNormGates(too_many), nullptr);
}

}  // namespace
}  // namespace moh
