// MoH-DiT (model/core/dit_model.h), its diffusion and sampler
// (model/generation/dit_sampler.h) and the VAE decoder against the
// independent Python transcription of the official code
// (tests/reference/moh_dit.py) on the tiny checkpoints of
// tests/reference/make_dit_fixtures.py: a release training container whose
// "ema" is served, a pixel-space model, a VAE in both key namings.
#include "model/core/dit_model.h"

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/core/vae_decoder.h"
#include "model/generation/diffusion.h"
#include "model/generation/dit_sampler.h"
#include "nlohmann/json.hpp"
#include "tests/base/test_paths.h"
#include "tests/model/core/golden_test_util.h"

namespace moh {
namespace {

using nlohmann::json;

const std::string kFixtures = test_paths::FixturesDir();
const DeviceOptions kCpu{"cpu", "float32"};

// A fixture's name, or a directory path (the shipped demo).
std::string ModelDir(const std::string& name) {
  return name.find('/') == std::string::npos ? kFixtures + "/" + name : name;
}

std::unique_ptr<DitModel> LoadOrDie(const std::string& dir) {
  auto model = DitModel::Load(ModelDir(dir), kCpu);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? std::move(*model) : nullptr;
}

LayerTopK TopK(const json& k) { return k.get<LayerTopK>(); }

class DitGoldenTest : public ::testing::TestWithParam<std::string> {};

// Single forwards (no guidance), rows at their own ratios, the null class.
TEST_P(DitGoldenTest, ForwardsMatchTheReference) {
  std::unique_ptr<DitModel> model = LoadOrDie(GetParam());
  ASSERT_NE(model, nullptr);
  const json golden = ReadJson(ModelDir(GetParam()) + "/golden.json");
  const json& in = golden.at("forward_inputs");
  const at::Tensor x = ToTensor(in.at("x"));
  const at::Tensor t = ToTensor(in.at("t"));
  const at::Tensor y = ToTensor(in.at("y"), at::kLong);
  for (const json& f : golden.at("forwards")) {
    std::vector<LayerTopK> rows(x.size(0));
    const json& per_block = f.at("top_k");
    for (size_t l = 0; l < per_block.size(); ++l) {
      for (size_t b = 0; b < rows.size(); ++b) {
        rows[b].push_back(per_block[l][b].get<int32_t>());
      }
    }
    // The ratios give these K too.
    std::vector<float> ratios = f.at("ratios").get<std::vector<float>>();
    EXPECT_EQ(rows, TopKForRatios(model->config().moh, ratios));
    for (AttentionMode mode : {AttentionMode::kAuto, AttentionMode::kDense}) {
      model->set_attention_mode(mode);
      auto out = model->Forward(x, t, y, rows);
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_LE(MaxAbs(out->out.to(at::kDouble) -
                       ToTensor(f.at("output"), at::kDouble)),
                3e-5)
          << GetParam() << " ratios " << ratios[0];
      const json& counts = f.at("head_token_counts");  // [L][B][H]
      for (size_t l = 0; l < counts.size(); ++l) {
        for (size_t b = 0; b < rows.size(); ++b) {
          for (size_t h = 0; h < counts[l][b].size(); ++h) {
            EXPECT_EQ(out->head_token_counts[b][l][h].item<int64_t>(),
                      counts[l][b][h].get<int64_t>());
          }
        }
      }
    }
  }
}

// Whole requests: the generator's draws, the final latent, the image bytes
// and the head loads; then all of them sampled together in one batch.
TEST_P(DitGoldenTest, SamplesMatchTheReferenceAloneAndBatched) {
  std::unique_ptr<DitModel> model = LoadOrDie(GetParam());
  ASSERT_NE(model, nullptr);
  const std::string dir = ModelDir(GetParam());
  const json golden = ReadJson(dir + "/golden.json");
  auto loaded = LoadDitVae(dir, *model);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  std::unique_ptr<VaeDecoder> vae = std::move(*loaded);
  EXPECT_EQ(vae == nullptr, model->config().vae.empty());
  std::map<int32_t, Diffusion> schedules;
  std::vector<std::unique_ptr<ImageSample>> alone, together;
  for (const json& s : golden.at("samples")) {
    const int32_t steps = s.at("steps").get<int32_t>();
    if (!schedules.count(steps)) {
      auto d = Diffusion::Respaced(steps);
      ASSERT_TRUE(d.ok());
      schedules.emplace(steps, *d);
    }
    ImageRequest request;
    request.class_id = s.at("class").get<int64_t>();
    request.seed = s.at("seed").get<uint64_t>();
    request.guidance = s.at("guidance").get<float>();
    request.top_k = TopK(s.at("top_k"));
    EXPECT_EQ(request.top_k, Activation::AtRatio(model->config().moh,
                                                 s.at("ratio").get<float>())
                                 .top_k());
    auto a = ImageSample::Start(*model, &schedules.at(steps), request);
    auto b = ImageSample::Start(*model, &schedules.at(steps), request);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status();
    // Draw 1, exactly.
    EXPECT_TRUE(at::equal((*a)->x(), ToTensor(s.at("z"))));
    EXPECT_EQ((*a)->rows(), s.at("model_rows").get<int32_t>());
    EXPECT_EQ((*a)->effective_ratio(), 1.0);  // no step yet
    alone.push_back(std::move(*a));
    together.push_back(std::move(*b));
  }
  // Alone: one request per step.
  for (auto& sample : alone) {
    while (!sample->done()) {
      ASSERT_TRUE(SampleStep(*model, {sample.get()}).ok());
    }
  }
  // Together: every unfinished request in each step's batch (they finish
  // at different steps).
  for (bool any = true; any;) {
    std::vector<ImageSample*> batch;
    for (auto& s : together) {
      if (!s->done()) batch.push_back(s.get());
    }
    any = !batch.empty();
    if (any) ASSERT_TRUE(SampleStep(*model, batch).ok());
  }
  for (size_t i = 0; i < alone.size(); ++i) {
    const json& s = golden.at("samples")[i];
    const std::string what = absl::StrCat(GetParam(), " sample ", i);
    const at::Tensor want = ToTensor(s.at("latent"), at::kDouble);
    const double bound = 1e-5 * MaxAbs(want);
    EXPECT_LE(MaxAbs(alone[i]->x().to(at::kDouble) - want), bound) << what;
    EXPECT_LE(MaxAbs(together[i]->x().to(at::kDouble) - want), bound)
        << what << " batched";
    const json& counts = s.at("head_token_counts");  // [L][H]
    int64_t used = 0, pairs = 0;
    for (size_t l = 0; l < counts.size(); ++l) {
      for (size_t h = 0; h < counts[l].size(); ++h) {
        EXPECT_EQ(alone[i]->head_token_counts()[l][h].item<int64_t>(),
                  counts[l][h].get<int64_t>())
            << what;
        used += counts[l][h].get<int64_t>();
      }
      pairs += int64_t{model->config().tokens()} *
               model->config().moh.layers[l].num_heads;
    }
    pairs *= int64_t{alone[i]->steps()} * alone[i]->rows();
    EXPECT_DOUBLE_EQ(alone[i]->effective_ratio(),
                     static_cast<double>(used) / pairs)
        << what;
    auto image =
        SampleImage(*alone[i], vae.get(), model->config().latent_scale);
    ASSERT_TRUE(image.ok()) << image.status();
    const at::Tensor want_image = ToTensor(s.at("image_u8"), at::kDouble);
    ASSERT_EQ(image->sizes(), want_image.sizes()) << what;
    EXPECT_LE(MaxAbs(image->to(at::kDouble) - want_image), 1.0) << what;
  }
}

// The tiny fixtures, and the shipped demo against the golden.json its
// training recipe wrote with the same reference.
INSTANTIATE_TEST_SUITE_P(Fixtures, DitGoldenTest,
                         ::testing::Values("dit_tiny", "dit_tiny_pixels",
                                           test_paths::ModelsDir() +
                                               "/demo-dit"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name =
                               info.param.substr(info.param.rfind('/') + 1);
                           for (char& c : name) {
                             if (!isalnum(static_cast<unsigned char>(c)))
                               c = '_';
                           }
                           return name;
                         });

TEST(DitTest, ScheduleEqualsTheReferenceTables) {
  const json golden = ReadJson(kFixtures + "/dit_tiny/golden.json");
  for (const auto& [steps, maps] : golden.at("timestep_maps").items()) {
    auto kept = SpaceTimesteps(1000, std::stoi(steps));
    ASSERT_TRUE(kept.ok());
    EXPECT_EQ(*kept, maps.get<std::vector<int64_t>>()) << steps << " steps";
  }
  EXPECT_FALSE(Diffusion::Respaced(1).ok());
  EXPECT_FALSE(Diffusion::Respaced(1001).ok());
}

TEST(DitTest, OldAndNewVaeNamesDecodeAlike) {
  auto current = VaeDecoder::Load(kFixtures + "/dit_tiny_vae",
                                  at::TensorOptions().dtype(at::kFloat));
  auto old = VaeDecoder::Load(kFixtures + "/dit_tiny_vae_old",
                              at::TensorOptions().dtype(at::kFloat));
  ASSERT_TRUE(current.ok()) << current.status();
  ASSERT_TRUE(old.ok()) << old.status();
  at::manual_seed(1);
  at::Tensor latents = at::randn({2, 4, 8, 8});
  auto a = (*current)->Decode(latents);
  auto b = (*old)->Decode(latents);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->sizes(), (std::vector<int64_t>{2, 3, 32, 32}));
  EXPECT_TRUE(at::allclose(*a, *b, 0, 1e-6));
}

TEST(DitTest, RejectsBadRequestsNamingTheField) {
  std::unique_ptr<DitModel> model = LoadOrDie("dit_tiny");
  ASSERT_NE(model, nullptr);
  auto d = Diffusion::Respaced(4);
  ASSERT_TRUE(d.ok());
  ImageRequest request;
  request.top_k = Activation::AtRatio(model->config().moh, 0).top_k();
  request.class_id = 10;
  EXPECT_THAT(
      std::string(ImageSample::Start(*model, &*d, request).status().message()),
      ::testing::HasSubstr("class must be in [0, 10)"));
  request.class_id = 1;
  request.guidance = 0.5f;
  EXPECT_THAT(
      std::string(ImageSample::Start(*model, &*d, request).status().message()),
      ::testing::HasSubstr("guidance_scale must be in [1, 100]"));
  auto bad = model->Forward(at::zeros({1, 4, 8, 8}), at::zeros({1}),
                            at::full({1}, 11, at::kLong), {request.top_k});
  EXPECT_THAT(std::string(bad.status().message()),
              ::testing::HasSubstr("classes must be in [0, 10]"));
}

// Every released configuration builds from exactly the official state
// dict's names and shapes (the reference computes them from models.py).
TEST(DitTest, VariantsTakeExactlyTheOfficialTensors) {
  const json manifest = ReadJson(kFixtures + "/dit_manifest.json");
  ASSERT_EQ(manifest.size(), 8u);
  for (const auto& [variant, entry] : manifest.items()) {
    json config = {{"model_type", "moh_dit"}, {"variant", variant}};
    auto parsed = ParseModelConfig(config.dump(), variant);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    TensorStore store(variant);
    for (const auto& [name, shape] : entry.at("tensors").items()) {
      ASSERT_TRUE(
          store
              .Insert(name,
                      at::zeros({1}).expand(shape.get<std::vector<int64_t>>()),
                      variant)
              .ok());
    }
    // bfloat16: the XL shape takes 1.4 GB, not 2.7.
    auto model = DitModel::FromStore(store, parsed->dit, at::kBFloat16);
    EXPECT_TRUE(model.ok()) << variant << ": " << model.status();
  }
}

}  // namespace
}  // namespace moh
