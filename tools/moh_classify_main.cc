// moh-classify: in-process image classification with a MoH image model
// directory (timm-layout MoH-ViT or the released MoH-ViT TransNeXt), for
// trying a model and as the in-process side of the benchmark suite: classifies
// random pixels (or --pixels_seed) in batches and prints images/s, the
// effective activation ratio and the top classes of the first image.
//
//   moh-classify --model_dir=DIR --batch=32 --repeat=3 --ratio=0.5
#include <chrono>
#include <cstdio>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "model/core/image_classifier.h"
#include "model/core/runtime.h"
#include "model/core/transnext_model.h"
#include "model/core/vit_model.h"

ABSL_FLAG(std::string, model_dir, "", "Model directory (config.json, weights)");
ABSL_FLAG(float, ratio, 0.0f,
          "Activation ratio in (0, 1]; 0 = the model's default");
ABSL_FLAG(int32_t, batch, 1, "Images per forward");
ABSL_FLAG(int32_t, repeat, 1, "Timed forwards");
ABSL_FLAG(int32_t, warmup, 1, "Untimed forwards before the timed ones");
ABSL_FLAG(std::string, attention, "auto",
          "auto (head-sparse where a layer routes) or dense (every head, as "
          "the official code computes it)");
ABSL_FLAG(int64_t, pixels_seed, 0, "Seed of the random pixels in [0, 1]");
ABSL_FLAG(std::string, device, "auto", "auto, cpu, cuda or cuda:N");
ABSL_FLAG(std::string, dtype, "auto", "auto, float32, bfloat16 or float16");
ABSL_FLAG(std::string, weights, "",
          "Linear weights' precision under float32 activations on the CPU: "
          "empty (as --dtype), bfloat16 or int8, converted as they load");
ABSL_FLAG(
    int32_t, threads, 0,
    "LibTorch intra-op threads; 0 = the default (see model/core/runtime.h)");
ABSL_FLAG(int32_t, top_n, 3, "Classes printed for the first image");

namespace {

absl::StatusOr<std::unique_ptr<moh::ImageClassifier>> Load(
    const std::string& dir, const moh::DeviceOptions& device) {
  MOH_ASSIGN_OR_RETURN(moh::ModelConfig config, moh::LoadModelConfig(dir));
  switch (config.family) {
    case moh::ModelFamily::kVit:
      return moh::VitModel::Load(dir, device);
    case moh::ModelFamily::kTransNext:
      return moh::TransNextModel::Load(dir, device);
    case moh::ModelFamily::kLlama:
    case moh::ModelFamily::kDit:
      break;
  }
  return absl::InvalidArgumentError(
      dir + "/config.json: not an image classifier (moh_vit or moh_transnext)");
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Classifies random images with a MoH image model, in process, and "
      "prints images/s.");
  absl::ParseCommandLine(argc, argv);
  const std::string dir = absl::GetFlag(FLAGS_model_dir);
  if (dir.empty()) {
    std::cerr << "moh-classify: --model_dir is required\n";
    return 2;
  }
  const int32_t batch = absl::GetFlag(FLAGS_batch);
  const int32_t repeat = absl::GetFlag(FLAGS_repeat);
  const int32_t warmup = absl::GetFlag(FLAGS_warmup);
  if (batch < 1 || batch > 4096 || repeat < 1 || warmup < 0) {
    std::cerr << "moh-classify: --batch must be in [1, 4096], --repeat >= 1, "
                 "--warmup >= 0\n";
    return 2;
  }
  const std::string attention = absl::GetFlag(FLAGS_attention);
  if (attention != "auto" && attention != "dense") {
    std::cerr << "moh-classify: --attention must be auto or dense, got "
              << attention << "\n";
    return 2;
  }
  const float ratio = absl::GetFlag(FLAGS_ratio);
  if (absl::Status ok = moh::ValidateRatio(ratio, "--ratio"); !ok.ok()) {
    std::cerr << "moh-classify: " << ok.message() << "\n";
    return 2;
  }
  moh::ConfigureCpuAllocator();
  moh::ConfigureCpuThreads(absl::GetFlag(FLAGS_threads));
  auto model =
      Load(dir, {absl::GetFlag(FLAGS_device), absl::GetFlag(FLAGS_dtype),
                 absl::GetFlag(FLAGS_weights)});
  if (!model.ok()) {
    std::cerr << "moh-classify: " << model.status() << "\n";
    return 1;
  }
  (*model)->set_attention_mode(attention == "dense"
                                   ? moh::AttentionMode::kDense
                                   : moh::AttentionMode::kAuto);
  const moh::ImagePreprocessing p = (*model)->preprocessing();
  at::manual_seed(absl::GetFlag(FLAGS_pixels_seed));
  at::Tensor pixels = (*model)->NormalizePixels(
      at::rand({batch, p.num_channels, p.image_size, p.image_size}));
  const std::vector<float> ratios(batch, ratio);
  absl::StatusOr<moh::ClassifierOutput> out;
  for (int32_t i = 0; i < warmup; ++i) out = (*model)->Forward(pixels, ratios);
  const auto start = std::chrono::steady_clock::now();
  for (int32_t i = 0; i < repeat; ++i) out = (*model)->Forward(pixels, ratios);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  if (!out.ok()) {
    std::cerr << "moh-classify: " << out.status() << "\n";
    return 1;
  }
  const int64_t pairs =
      moh::RoutablePairs((*model)->moh(), (*model)->LayerTokens());
  const double effective =
      static_cast<double>(out->head_token_counts[0].sum().item<int64_t>()) /
      pairs;
  at::Tensor probs = at::softmax(out->logits[0], -1);
  const int64_t top_n =
      std::min<int64_t>(absl::GetFlag(FLAGS_top_n), probs.size(0));
  auto [scores, indices] = at::topk(probs, top_n);
  for (int64_t i = 0; i < top_n; ++i) {
    const int64_t index = indices[i].item<int64_t>();
    std::cout << absl::StrFormat("%-24s %.4f\n", (*model)->labels()[index],
                                 scores[i].item<float>());
  }
  std::cout << absl::StrFormat(
      "images/s: %.3f (batch %d, %d forwards, %.3f s)\neffective ratio: "
      "%.4f\n",
      batch * repeat / seconds, batch, repeat, seconds, effective);
  return 0;
}
