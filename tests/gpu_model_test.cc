// GPU suite, in process (`ctest -L gpu`): the fixture models on a CUDA device
// in bfloat16 against the same models on CPU in float32 (which
// model_golden_test holds to the Python reference's goldens), at several
// ratios mixed in one batch. Skipped when LibTorch sees no CUDA device.
//
// Tolerance: bf16 keeps 8 mantissa bits (relative rounding 2^-9 per op); over
// the fixtures' few layers the logits agree within 5% of their largest
// magnitude (measured deviations are a fraction of that).
#include <gtest/gtest.h>

#include <string>

#include "model/core/llama_model.h"
#include "model/core/vit_model.h"

namespace moh {
namespace {

const std::string kFixtures = MOH_FIXTURES_DIR;
constexpr double kBf16Tolerance = 0.05;

void ExpectClose(const at::Tensor& cuda, const at::Tensor& cpu,
                 const std::string& what) {
  const double scale = std::max(1.0, cpu.abs().max().item<double>());
  EXPECT_LE((cuda.to(at::kFloat).cpu() - cpu).abs().max().item<double>(),
            kBf16Tolerance * scale)
      << what;
}

class GpuModelTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(GpuModelTest, Bf16OnCudaMatchesFp32OnCpuAtMixedRatios) {
  auto cuda = LlamaModel::Load(kFixtures + "/" + GetParam(),
                               DeviceOptions{"cuda", "auto"});
  auto cpu = LlamaModel::Load(kFixtures + "/" + GetParam(),
                              DeviceOptions{"cpu", "float32"});
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  ASSERT_EQ((*cuda)->options().dtype(), at::kBFloat16);
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
    ExpectClose(a->logits, b->logits, "step " + std::to_string(step));
    for (int r = 0; r < 4; ++r) start[r] += batch.num_tokens[r];
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GpuModelTest,
                         ::testing::Values("llama_qnorm", "llama_learned"));

TEST(GpuVitTest, Bf16OnCudaMatchesFp32OnCpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  auto cuda =
      VitModel::Load(kFixtures + "/vit_learned", DeviceOptions{"cuda", "auto"});
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
  ExpectClose(a->logits, b->logits, "vit");
}

}  // namespace
}  // namespace moh
