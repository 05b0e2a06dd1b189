// MoH-ViT TransNeXt (model/core/transnext_model.h) against the independent
// Python transcription of the official code (tests/reference/moh_transnext.py)
// on the tiny checkpoints tests/reference/make_fixtures.py writes, in the
// release container format and as safetensors; and the pair kernel against
// every head computed as the official code does.
#include "model/core/transnext_model.h"

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/base/test_paths.h"
#include "tests/model/core/golden_test_util.h"

namespace moh {
namespace {

using nlohmann::json;

const std::string kFixtures = test_paths::FixturesDir();
const DeviceOptions kCpu{"cpu", "float32"};

std::unique_ptr<TransNextModel> LoadOrDie(const std::string& dir) {
  auto model = TransNextModel::Load(kFixtures + "/" + dir, kCpu);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? std::move(*model) : nullptr;
}

class TransNextGoldenTest : public ::testing::TestWithParam<std::string> {};

// Logits are the reference's in float64 from the stored float32 weights; the
// float32 reference is within 3e-5 of them, so 3e-4 holds with margin.
constexpr double kLogitTolerance = 3e-4;

// The golden pixels (uint8, [B, C, S, S]) as the model's normalized input.
at::Tensor GoldenPixels(const TransNextModel& model, const json& golden) {
  return model.NormalizePixels(ToTensor(golden.at("pixels_u8")) / 255.0);
}

// Head token counts [L][B][H_l] equal the output's [B, L, H_max].
void ExpectCounts(const at::Tensor& got, const json& want,
                  const std::string& what) {
  ASSERT_EQ(static_cast<int64_t>(want.size()), got.size(1)) << what;
  for (size_t l = 0; l < want.size(); ++l) {
    for (size_t b = 0; b < want[l].size(); ++b) {
      const json& heads = want[l][b];
      for (size_t h = 0; h < heads.size(); ++h) {
        EXPECT_EQ(got[b][l][h].item<int64_t>(), heads[h].get<int64_t>())
            << what << " layer " << l << " image " << b << " head " << h;
      }
    }
  }
}

TEST_P(TransNextGoldenTest, LogitsAndRoutingMatchTheReference) {
  std::unique_ptr<TransNextModel> model = LoadOrDie(GetParam());
  ASSERT_NE(model, nullptr);
  const json golden = ReadJson(kFixtures + "/" + GetParam() + "/golden.json");
  const at::Tensor pixels = GoldenPixels(*model, golden);
  const int64_t rows = pixels.size(0);
  for (AttentionMode mode : {AttentionMode::kAuto, AttentionMode::kDense}) {
    model->set_attention_mode(mode);
    const std::string where =
        GetParam() + (mode == AttentionMode::kDense ? " dense" : " auto");
    for (const json& c : golden.at("cases")) {
      const float ratio = c.at("ratio").get<float>();
      const std::string what = absl::StrCat(where, " ratio ", ratio);
      auto out = model->Forward(pixels, std::vector<float>(rows, ratio));
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_LE(MaxAbs(out->logits - ToTensor(c.at("logits"))), kLogitTolerance)
          << what;
      ExpectCounts(out->head_token_counts, c.at("head_token_counts"), what);
    }
    // Rows at their own ratios in one batch.
    for (const json& mixed : golden.at("mixed")) {
      const std::vector<float> ratios =
          mixed.at("ratios").get<std::vector<float>>();
      const std::string what = absl::StrCat(where, " mixed ", ratios[0]);
      auto out = model->Forward(pixels, ratios);
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_LE(MaxAbs(out->logits - ToTensor(mixed.at("logits"))),
                kLogitTolerance)
          << what;
      ExpectCounts(out->head_token_counts, mixed.at("head_token_counts"), what);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TransNextGoldenTest,
                         ::testing::Values("transnext_tiny",
                                           "transnext_tiny_st",
                                           "transnext_tiny_b"));

TEST(TransNextTest, ReleaseContainerEqualsSafetensors) {
  std::unique_ptr<TransNextModel> release = LoadOrDie("transnext_tiny");
  std::unique_ptr<TransNextModel> converted = LoadOrDie("transnext_tiny_st");
  ASSERT_NE(release, nullptr);
  ASSERT_NE(converted, nullptr);
  at::manual_seed(3);
  at::Tensor pixels = at::randn({2, 3, 64, 64});
  auto a = release->Forward(pixels, {0.0f, 0.5f});
  auto b = converted->Forward(pixels, {0.0f, 0.5f});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(at::equal(a->logits, b->logits));
}

// The pair kernel (head-sparse where a stage routes) against every head
// computed as the official code does, at many ratios in one batch, and each
// row against itself alone.
TEST(TransNextTest, PairKernelMatchesEveryHeadAndRowsAreIndependent) {
  for (const char* dir : {"transnext_tiny_st", "transnext_tiny_b"}) {
    std::unique_ptr<TransNextModel> model = LoadOrDie(dir);
    ASSERT_NE(model, nullptr);
    const int64_t s = model->config().image_size;
    at::manual_seed(7);
    at::Tensor pixels = at::randn({5, 3, s, s});
    const std::vector<float> ratios = {0.1f, 0.5f, 0.0f, 1.0f, 0.75f};
    model->set_attention_mode(AttentionMode::kDense);
    auto dense = model->Forward(pixels, ratios, /*record_gates=*/true);
    ASSERT_TRUE(dense.ok()) << dense.status();
    model->set_attention_mode(AttentionMode::kAuto);
    auto sparse = model->Forward(pixels, ratios, /*record_gates=*/true);
    ASSERT_TRUE(sparse.ok()) << sparse.status();
    EXPECT_TRUE(at::equal(dense->head_token_counts, sparse->head_token_counts));
    EXPECT_LE(MaxAbs(dense->logits - sparse->logits), 1e-4) << dir;
    ASSERT_EQ(sparse->gates.size(), model->moh().layers.size());
    for (int64_t b = 0; b < 5; ++b) {
      auto alone = model->Forward(pixels.narrow(0, b, 1), {ratios[b]});
      ASSERT_TRUE(alone.ok());
      EXPECT_LE(MaxAbs(alone->logits[0] - sparse->logits[b]), 1e-4)
          << dir << " row " << b;
    }
  }
}

TEST(TransNextTest, FewerHeadsAtLowerRatios) {
  std::unique_ptr<TransNextModel> model = LoadOrDie("transnext_tiny_st");
  ASSERT_NE(model, nullptr);
  at::Tensor pixels = at::rand({1, 3, 64, 64});
  int64_t previous = -1;
  for (float ratio : {0.1f, 0.5f, 0.75f, 1.0f}) {
    auto out = model->Forward(pixels, {ratio});
    ASSERT_TRUE(out.ok());
    const int64_t pairs = out->head_token_counts.sum().item<int64_t>();
    EXPECT_GE(pairs, previous) << ratio;
    previous = pairs;
  }
  const int64_t all = RoutablePairs(model->moh(), model->LayerTokens());
  EXPECT_EQ(previous, all);  // ratio 1.0: every pair
}

TEST(TransNextTest, RejectsWrongPixelsAndTopK) {
  std::unique_ptr<TransNextModel> model = LoadOrDie("transnext_tiny_st");
  ASSERT_NE(model, nullptr);
  auto bad = model->Forward(at::zeros({1, 3, 32, 32}), {0.0f});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()),
              ::testing::HasSubstr("pixels must have shape [B, 3, 64, 64]"));
  LayerTopK too_many(model->moh().layers.size(), 99);
  auto k = model->ForwardWithTopK(at::zeros({1, 3, 64, 64}), {too_many});
  EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moh

namespace moh {
namespace {

// Every released variant, from its name alone, takes exactly the tensors of
// the official state dict (tests/reference/moh_transnext.py computes the
// manifest from the official module definitions): names and shapes, none
// missing, none left over.
TEST(TransNextManifestTest, VariantsTakeExactlyTheOfficialTensors) {
  const json manifest = ReadJson(kFixtures + "/transnext_manifest.json");
  ASSERT_EQ(manifest.size(), 4u);
  for (const auto& [variant, entry] : manifest.items()) {
    json config = {{"model_type", "moh_transnext"}, {"variant", variant}};
    config["labels"] =
        std::vector<std::string>(entry.at("num_classes").get<int>(), "class");
    auto parsed = ParseModelConfig(config.dump(), variant);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    // The architecture the variant name fills equals the reference's.
    const json& want = entry.at("config");
    const TransNextConfig& c = parsed->transnext;
    for (int s = 0; s < 4; ++s) {
      EXPECT_EQ(c.stages[s].embed_dim, want.at("embed_dims")[s]) << variant;
      EXPECT_EQ(c.stages[s].num_heads, want.at("num_heads")[s]) << variant;
      EXPECT_EQ(c.stages[s].depth, want.at("depths")[s]) << variant;
      EXPECT_EQ(c.stages[s].shared_heads, want.at("moh_shared_heads")[s]);
      EXPECT_EQ(c.stages[s].top_k, want.at("moh_routed_top_k")[s]);
    }
    // Tensors of the manifest's shapes (values irrelevant: one broadcast
    // zero each) build the model; one missing is named.
    TensorStore store(variant);
    for (const auto& [name, shape] : entry.at("tensors").items()) {
      const std::vector<int64_t> sizes = shape.get<std::vector<int64_t>>();
      ASSERT_TRUE(
          store.Insert(name, at::zeros({1}).expand(sizes), variant).ok());
    }
    auto model = TransNextModel::FromStore(store, c, at::kFloat);
    ASSERT_TRUE(model.ok()) << variant << ": " << model.status();
    EXPECT_EQ((*model)->moh().layers.size(),
              static_cast<size_t>(c.stages[0].depth + c.stages[1].depth +
                                  c.stages[2].depth + c.stages[3].depth));
  }
}

TEST(TransNextManifestTest, AMissingOrExtraTensorIsNamed) {
  const json manifest = ReadJson(kFixtures + "/transnext_manifest.json");
  const json& entry = manifest.at("moh_transnext_small_75");
  json config = {{"model_type", "moh_transnext"},
                 {"variant", "moh_transnext_small_75"},
                 {"labels", std::vector<std::string>(1000, "c")}};
  auto parsed = ParseModelConfig(config.dump(), "small");
  ASSERT_TRUE(parsed.ok());
  auto build = [&](const std::string& skip, bool extra) {
    TensorStore store("small");
    for (const auto& [name, shape] : entry.at("tensors").items()) {
      if (name == skip) continue;
      EXPECT_TRUE(
          store
              .Insert(name,
                      at::zeros({1}).expand(shape.get<std::vector<int64_t>>()),
                      "small.pth")
              .ok());
    }
    if (extra) {
      EXPECT_TRUE(
          store.Insert("block3.0.attn.extra", at::zeros({2}), "small.pth")
              .ok());
    }
    return TransNextModel::FromStore(store, parsed->transnext, at::kFloat)
        .status();
  };
  absl::Status missing = build("block3.4.attn.wg.weight", false);
  EXPECT_THAT(std::string(missing.message()),
              ::testing::HasSubstr("block3.4.attn.wg.weight"));
  absl::Status extra = build("", true);
  EXPECT_THAT(std::string(extra.message()),
              ::testing::HasSubstr("unexpected tensor 'block3.0.attn.extra'"));
}

}  // namespace
}  // namespace moh
