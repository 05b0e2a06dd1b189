// moh-generate-image: in-process image generation with a MoH-DiT model
// directory, for trying a model and as the in-process side of the benchmark
// suite's section 9. Without --time_steps it samples one image as
// GenerateImage does (the same generator and draws, so the same image for the
// same class, seed and settings), decodes it with the VAE the config names
// (pixel-space models need none) and writes it as PNG. With --time_steps=K it
// starts --batch requests, runs one untimed sampler step over all of them and
// then times K steps, printing the seconds per step and the effective ratio.
//
//   moh-generate-image --model_dir=DIR --class=207 --seed=0 --steps=50 \
//       --out=dog.png
//   moh-generate-image --model_dir=DIR --batch=8 --time_steps=2 --ratio=0.5
#include <chrono>
#include <fstream>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "model/core/activation.h"
#include "model/core/dit_model.h"
#include "model/core/runtime.h"
#include "model/generation/diffusion.h"
#include "model/generation/dit_sampler.h"
#include "service/diffusion/image_encoder.h"

ABSL_FLAG(std::string, model_dir, "",
          "Model directory (config.json, weights; the VAE its config names)");
ABSL_FLAG(std::string, class, "0", "Class: its index or its label");
ABSL_FLAG(uint64_t, seed, 0, "Noise seed (timing: request i gets seed + i)");
ABSL_FLAG(int32_t, steps, 0,
          "Sampler steps in [2, 1000]; 0 = the model's default_steps");
ABSL_FLAG(float, guidance, 0.0f,
          "Classifier-free guidance scale in [1, 100] (1 = none, one row per "
          "request; else two); 0 = the model's default_guidance");
ABSL_FLAG(float, ratio, 0.0f,
          "Activation ratio in (0, 1]; 0 = the model's default");
ABSL_FLAG(std::string, out, "", "PNG file to write (sampling)");
ABSL_FLAG(int32_t, batch, 1, "Requests sampled together (timing)");
ABSL_FLAG(int32_t, time_steps, 0,
          "Time this many sampler steps after one untimed step, instead of "
          "sampling an image; needs --steps > it");
ABSL_FLAG(std::string, attention, "auto",
          "auto (head-sparse where a block routes) or dense (every head, as "
          "the official code computes it)");
ABSL_FLAG(std::string, device, "auto", "auto, cpu, cuda or cuda:N");
ABSL_FLAG(std::string, dtype, "auto", "auto, float32, bfloat16 or float16");
ABSL_FLAG(std::string, weights, "",
          "Linear weights' precision under float32 activations on the CPU: "
          "empty (as --dtype), bfloat16 or int8, converted as they load");
ABSL_FLAG(
    int32_t, threads, 0,
    "LibTorch intra-op threads; 0 = the default (see model/core/runtime.h)");

namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// --class as an index, or else as one of the model's labels.
absl::StatusOr<int64_t> ResolveClass(const moh::DitConfig& c,
                                     const std::string& text) {
  int64_t index = 0;
  if (absl::SimpleAtoi(text, &index)) return index;
  for (size_t i = 0; i < c.labels.size(); ++i) {
    if (c.labels[i] == text) return static_cast<int64_t>(i);
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "--class=%s is neither an index nor one of the model's labels", text));
}

absl::Status TimeSteps(const moh::DitModel& model,
                       const moh::Diffusion& diffusion,
                       const moh::ImageRequest& base, int32_t batch,
                       int32_t time_steps) {
  std::vector<std::unique_ptr<moh::ImageSample>> samples;
  std::vector<moh::ImageSample*> running;
  int32_t rows = 0;
  for (int32_t i = 0; i < batch; ++i) {
    moh::ImageRequest request = base;
    request.seed = base.seed + i;
    MOH_ASSIGN_OR_RETURN(std::unique_ptr<moh::ImageSample> sample,
                         moh::ImageSample::Start(model, &diffusion, request));
    rows += sample->rows();
    running.push_back(sample.get());
    samples.push_back(std::move(sample));
  }
  MOH_RETURN_IF_ERROR(moh::SampleStep(model, running));  // warm-up
  const Clock::time_point start = Clock::now();
  for (int32_t i = 0; i < time_steps; ++i) {
    MOH_RETURN_IF_ERROR(moh::SampleStep(model, running));
  }
  const double seconds = SecondsSince(start);
  std::cout << absl::StrFormat(
      "step seconds: %.4f (batch %d, rows %d, %d timed steps, %.3f s)\n"
      "effective ratio: %.4f\n",
      seconds / time_steps, batch, rows, time_steps, seconds,
      samples[0]->effective_ratio());
  return absl::OkStatus();
}

absl::Status SampleOne(const moh::DitModel& model, const std::string& dir,
                       const moh::Diffusion& diffusion,
                       const moh::ImageRequest& request,
                       const std::string& out) {
  MOH_ASSIGN_OR_RETURN(std::unique_ptr<moh::VaeDecoder> vae,
                       moh::LoadDitVae(dir, model));
  MOH_ASSIGN_OR_RETURN(std::unique_ptr<moh::ImageSample> sample,
                       moh::ImageSample::Start(model, &diffusion, request));
  const Clock::time_point start = Clock::now();
  while (!sample->done()) {
    MOH_RETURN_IF_ERROR(moh::SampleStep(model, {sample.get()}));
  }
  const double sampling = SecondsSince(start);
  MOH_ASSIGN_OR_RETURN(
      at::Tensor image,
      moh::SampleImage(*sample, vae.get(), model.config().latent_scale));
  MOH_ASSIGN_OR_RETURN(std::string png, moh::EncodePng(image));
  std::ofstream file(out, std::ios::binary);
  file.write(png.data(), static_cast<std::streamsize>(png.size()));
  file.close();
  if (!file) return absl::UnavailableError("cannot write " + out);
  const moh::DitConfig& c = model.config();
  std::cout << absl::StrFormat(
      "%s: %dx%d, class %d (%s), seed %d, %d steps, guidance %g\n"
      "effective ratio: %.4f\nsampling seconds: %.3f (%.4f per step), "
      "decoding seconds: %.3f\n",
      out, image.size(2), image.size(1), request.class_id,
      c.labels.empty() ? "" : c.labels[request.class_id], request.seed,
      sample->steps(), request.guidance, sample->effective_ratio(), sampling,
      sampling / sample->steps(), SecondsSince(start) - sampling);
  return absl::OkStatus();
}

int Fail(const absl::Status& status) {
  std::cerr << "moh-generate-image: " << status.message() << "\n";
  return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Samples an image with a MoH-DiT model in process and writes it as "
      "PNG, or times sampler steps (--time_steps).");
  absl::ParseCommandLine(argc, argv);
  const std::string dir = absl::GetFlag(FLAGS_model_dir);
  const std::string out = absl::GetFlag(FLAGS_out);
  const int32_t batch = absl::GetFlag(FLAGS_batch);
  const int32_t time_steps = absl::GetFlag(FLAGS_time_steps);
  const std::string attention = absl::GetFlag(FLAGS_attention);
  if (dir.empty()) {
    return Fail(absl::InvalidArgumentError("--model_dir is required"));
  }
  if (time_steps < 0 || batch < 1 || batch > 1024) {
    return Fail(absl::InvalidArgumentError(
        "--time_steps must be >= 0 and --batch in [1, 1024]"));
  }
  if (time_steps == 0 && (out.empty() || batch != 1)) {
    return Fail(absl::InvalidArgumentError(
        "sampling writes one image: give --out=FILE.png (and no --batch), "
        "or time steps with --time_steps"));
  }
  if (attention != "auto" && attention != "dense") {
    return Fail(absl::InvalidArgumentError(
        "--attention must be auto or dense, got " + attention));
  }
  const float ratio = absl::GetFlag(FLAGS_ratio);
  if (absl::Status ok = moh::ValidateRatio(ratio, "--ratio"); !ok.ok()) {
    return Fail(ok);
  }
  moh::ConfigureCpuAllocator();
  moh::ConfigureCpuThreads(absl::GetFlag(FLAGS_threads));
  const Clock::time_point load_start = Clock::now();
  auto model = moh::DitModel::Load(
      dir, {absl::GetFlag(FLAGS_device), absl::GetFlag(FLAGS_dtype),
            absl::GetFlag(FLAGS_weights)});
  if (!model.ok()) return Fail(model.status());
  MOH_LOG(Info) << absl::StrFormat(
      "loaded %s in %.2fs: %d blocks, %d tokens, default ratio %.3f", dir,
      SecondsSince(load_start), (*model)->config().depth,
      (*model)->config().tokens(), (*model)->config().moh.DefaultRatio());
  (*model)->set_attention_mode(attention == "dense"
                                   ? moh::AttentionMode::kDense
                                   : moh::AttentionMode::kAuto);
  const moh::DitConfig& c = (*model)->config();
  const int32_t steps = absl::GetFlag(FLAGS_steps) == 0
                            ? c.default_steps
                            : absl::GetFlag(FLAGS_steps);
  if (time_steps > 0 && steps <= time_steps) {
    return Fail(absl::InvalidArgumentError(absl::StrFormat(
        "--steps (%d) must exceed --time_steps (%d): one untimed step comes "
        "first",
        steps, time_steps)));
  }
  auto diffusion = moh::Diffusion::Respaced(steps);
  if (!diffusion.ok()) return Fail(diffusion.status());
  auto class_id = ResolveClass(c, absl::GetFlag(FLAGS_class));
  if (!class_id.ok()) return Fail(class_id.status());
  moh::ImageRequest request;
  request.class_id = *class_id;
  request.seed = absl::GetFlag(FLAGS_seed);
  request.guidance = absl::GetFlag(FLAGS_guidance) == 0.0f
                         ? static_cast<float>(c.default_guidance)
                         : absl::GetFlag(FLAGS_guidance);
  request.top_k = moh::Activation::AtRatio(c.moh, ratio).top_k();
  const absl::Status done =
      time_steps > 0
          ? TimeSteps(**model, *diffusion, request, batch, time_steps)
          : SampleOne(**model, dir, *diffusion, request, out);
  return done.ok() ? 0 : Fail(done);
}
