// The CUDA kernels run on the CPU through cuda_host_emulation.h, over the
// arguments the ATen wrappers build for a launch (cuda_kernel_args.h),
// making the checks the GPU suite makes on CUDA: the fused layer kernels
// (model/kernels/cuda_layer_ops.cu) against the ATen chains they replace
// (layer_ops_reference.h, GpuFusedOpsTest's) and the paged decode kernel
// (model/kernels/cuda_paged_decode.cu) against DenseAttention
// (paged_decode_reference.h, GpuPagedDecodeTest's). Built with a CUDA
// LibTorch (CUDA's headers), run on any machine: the kernels' indexing,
// barriers, reductions and rounding are tested in CI, not only when a GPU
// is lent.
#include "tests/model/kernels/cuda_host_emulation.h"
// An emulated launch's error without the CUDA runtime.
#define cudaGetErrorString(error) "emulated launch failed"
#include "model/kernels/cuda_layer_ops.cu"
#include "model/kernels/cuda_paged_decode.cu"
#include "model/kernels/cuda_skinny_linear.cu"
#undef cudaGetErrorString

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "model/core/cuda_kernel_args.h"
#include "tests/model/core/layer_ops_reference.h"
#include "tests/model/core/paged_decode_reference.h"

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

AttentionPrologue Prologue(const AttentionPrologueInputs& in) {
  AttentionPrologue out;
  AttentionPrologueArgs a;
  if (!AttentionPrologueArgsFor(in, &out, &a)) return {};
  if (!Ran(LaunchAttentionPrologue(a), out.rotated).defined()) return {};
  return out;
}

at::Tensor SkinnyLinear(const at::Tensor& x, const at::Tensor& weight,
                        const at::Tensor& bias) {
  at::Tensor out;
  SkinnyLinearArgs a;
  if (!SkinnyLinearArgsFor(x, weight, bias, false, &out, &a)) return {};
  return Ran(LaunchSkinnyLinear(a), out);
}

at::Tensor SiluMulLinear(const at::Tensor& both, const at::Tensor& weight) {
  at::Tensor out;
  SkinnyLinearArgs a;
  if (!SkinnyLinearArgsFor(both, weight, {}, true, &out, &a)) return {};
  return Ran(LaunchSkinnyLinear(a), out);
}

const LayerKernels kEmulated = {AddRmsNorm,   Rope,           RopeStoreKv,
                                SiluMul,      QueryNormGates, Prologue,
                                SkinnyLinear, SiluMulLinear};

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

TEST_P(CudaLayerOpsEmulatedTest, AttentionPrologueIsRopeStoreAndGates) {
  CheckAttentionPrologue(kEmulated, Options());
}

TEST_P(CudaLayerOpsEmulatedTest, SkinnyLinearIsTheProduct) {
  CheckSkinnyLinear(kEmulated, Options());
}

INSTANTIATE_TEST_SUITE_P(Types, CudaLayerOpsEmulatedTest,
                         ::testing::Values(at::kFloat, at::kBFloat16));

// PagedDecode's launch, emulated.
at::Tensor EmulatedPagedDecode(const PagedDecodeInputs& in) {
  PagedDecodeLaunch launch;
  if (!PagedDecodeArgsFor(in, &launch)) {
    ADD_FAILURE() << "PagedDecodeArgsFor refused the inputs";
    return at::Tensor();
  }
  return Ran(LaunchPagedDecode(launch.args), launch.out);
}

class PagedDecodeEmulatedTest : public ::testing::TestWithParam<PagedCase> {};

TEST_P(PagedDecodeEmulatedTest, MatchesDenseAttention) {
  // Splits of 100 keys (not a power of two; a few times the blocks of
  // 256) and of 256.
  CheckPagedDecode(GetParam(), EmulatedPagedDecode, at::kCPU,
                   {100, kPagedDecodeSplit}, kPagedDecodeSplit);
}

// GpuPagedDecodeTest's shapes, fewer (an emulated launch runs its blocks'
// threads on two cores: seconds each): every type, one, two and four heads
// per KV group, head dims 8 to 128, a KV-head view of a wider cache.
INSTANTIATE_TEST_SUITE_P(
    Shapes, PagedDecodeEmulatedTest,
    ::testing::Values(PagedCase{8, 8, 64, 8, at::kFloat, 1e-5},
                      PagedCase{16, 4, 128, 8, at::kBFloat16, 1e-2},
                      PagedCase{4, 4, 32, 4, at::kHalf, 2e-3},
                      PagedCase{8, 2, 8, 2, at::kFloat, 1e-5}));

// Keys a thread block reads: 256 while a launch has 512 blocks or more,
// halved down to 32 for small batches.
TEST(PagedDecodeSplitKeysTest, KeepsLaunchesWideForSmallBatches) {
  EXPECT_EQ(PagedDecodeSplitKeys(1, 8, 4096), 64);  // 512 blocks
  EXPECT_EQ(PagedDecodeSplitKeys(64, 8, 2048), 256);
  EXPECT_EQ(PagedDecodeSplitKeys(4, 8, 4096), 256);
  EXPECT_EQ(PagedDecodeSplitKeys(2, 8, 4096), 128);
  EXPECT_EQ(PagedDecodeSplitKeys(1, 1, 10), 32);
  EXPECT_EQ(PagedDecodeSplitKeys(6, 8, 700), 64);
}

// The emulation itself: it takes 1-D blocks only, and the kernels' own
// errors come back.
TEST(CudaHostEmulationTest, RefusesBlocksItCannotRunAndReportsKernelErrors) {
  AddRmsNormArgs none;
  EXPECT_EQ(
      emulation::Launch(AddRmsNormKernel<float>, dim3(1), dim3(32, 2), 0, none),
      cudaErrorInvalidConfiguration);
  EXPECT_EQ(
      emulation::Launch(AddRmsNormKernel<float>, dim3(1), dim3(0), 0, none),
      cudaErrorInvalidConfiguration);
  QueryNormGatesArgs too_many;
  too_many.routed = kQueryNormMaxRouted + 1;
  EXPECT_NE(LaunchQueryNormGates(too_many), nullptr);
}

}  // namespace
}  // namespace moh
