// GPU suite, in process (`ctest -L gpu`): the fixture models on a CUDA device
// against the same models on CPU in float32 (which model_golden_test holds to
// the Python reference's goldens), at several ratios mixed in one batch.
// Skipped when LibTorch sees no CUDA device.
//
// float32 on CUDA: every fixture, within 1e-3 of the logits' largest
// magnitude (the routers' top-k margins, 1e-3 relative and more, are far
// above float32 rounding, so both devices pick the same heads).
// bfloat16 on CUDA: bf16 keeps 8 mantissa bits (relative rounding 2^-9 per
// op), coarser than the learned fixtures' smallest top-k margins (1.2e-3 and
// 1.4e-3 relative): a near tie may pick another head there, which changes a
// logit by far more than rounding (seen on an H100: 1.75 and 4.5 against
// limits of 1.2 and 0.29). bf16 is checked on llama_qnorm, whose margins
// (3.3e-2) bf16 resolves, within 5% of the largest logit.
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "model/core/llama_model.h"
#include "model/core/vit_model.h"

namespace moh {
namespace {

const std::string kFixtures = MOH_FIXTURES_DIR;
constexpr double kBf16Tolerance = 0.05;
constexpr double kFp32Tolerance = 1e-3;

void ExpectClose(const at::Tensor& cuda, const at::Tensor& cpu,
                 double tolerance, const std::string& what) {
  const double scale = std::max(1.0, cpu.abs().max().item<double>());
  const at::Tensor got = cuda.to(at::kFloat).cpu();
  ASSERT_FALSE(at::isnan(got).any().item<bool>()) << what;
  EXPECT_LE((got - cpu).abs().max().item<double>(), tolerance * scale) << what;
}

// (fixture, CUDA dtype): bfloat16 only where bf16 resolves the routing.
using Case = std::tuple<std::string, std::string>;

class GpuModelTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  }
};

// cuDNN convolutions (the ViT's patch embedding) default to TF32, 10 mantissa
// bits: float32 is compared at float32's precision.
void FullFloat32() { at::globalContext().setAllowTF32CuDNN(false); }

TEST_P(GpuModelTest, CudaMatchesFp32OnCpuAtMixedRatios) {
  const auto& [fixture, dtype] = GetParam();
  auto cuda =
      LlamaModel::Load(kFixtures + "/" + fixture, DeviceOptions{"cuda", dtype});
  auto cpu = LlamaModel::Load(kFixtures + "/" + fixture,
                              DeviceOptions{"cpu", "float32"});
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const bool bf16 = dtype == "bfloat16";
  ASSERT_EQ((*cuda)->options().dtype(), bf16 ? at::kBFloat16 : at::kFloat);
  KvCache cuda_cache = (*cuda)->CreateKvCache(4, 32);
  KvCache cpu_cache = (*cpu)->CreateKvCache(4, 32);
  at::manual_seed(3);
  const at::Tensor prompt = at::randint(300, {4, 7}, at::kLong);
  std::vector<int32_t> start(4, 0);
  for (int step = 0; step < 4; ++step) {
    DecoderBatch batch;
    batch.token_ids = step == 0 ? prompt : at::randint(300, {4, 1}, at::kLong);
    batch.num_tokens = step == 0 ? std::vector<int32_t>{7, 3, 5, 1}
                                 : std::vector<int32_t>(4, 1);
    batch.slots = {3, 0, 2, 1};
    batch.start_positions = start;
    batch.ratios = {0.5f, 0.0f, 1.0f, 0.75f};
    auto a = (*cuda)->Forward(batch, cuda_cache);
    auto b = (*cpu)->Forward(batch, cpu_cache);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_TRUE(a->logits.is_cpu());  // one download per step
    ExpectClose(a->logits, b->logits, bf16 ? kBf16Tolerance : kFp32Tolerance,
                "step " + std::to_string(step));
    for (int r = 0; r < 4; ++r) start[r] += batch.num_tokens[r];
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GpuModelTest,
                         ::testing::Values(Case{"llama_qnorm", "bfloat16"},
                                           Case{"llama_qnorm", "float32"},
                                           Case{"llama_learned", "float32"}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::get<0>(info.param) + "_" +
                                  std::get<1>(info.param);
                         });

TEST(GpuVitTest, Fp32OnCudaMatchesFp32OnCpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  FullFloat32();
  auto cuda = VitModel::Load(kFixtures + "/vit_learned",
                             DeviceOptions{"cuda", "float32"});
  auto cpu = VitModel::Load(kFixtures + "/vit_learned",
                            DeviceOptions{"cpu", "float32"});
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  at::manual_seed(5);
  const at::Tensor pixels = at::randn({4, 3, 16, 16});
  const std::vector<float> ratios = {0.5f, 0.0f, 1.0f, 0.75f};
  auto a = (*cuda)->Forward(pixels, ratios);
  auto b = (*cpu)->Forward(pixels, ratios);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  ExpectClose(a->logits, b->logits, kFp32Tolerance, "vit");
}

}  // namespace
}  // namespace moh
