#include "model/generation/dit_sampler.h"

#include <ATen/CPUGeneratorImpl.h>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/core/runtime.h"

namespace moh {
namespace {

constexpr int64_t kGuidedChannels = 3;  // forward_with_cfg's

}  // namespace

absl::StatusOr<std::unique_ptr<ImageSample>> ImageSample::Start(
    const DitModel& model, const Diffusion* diffusion,
    const ImageRequest& request) {
  const DitConfig& c = model.config();
  if (!c.learn_sigma) {
    return absl::FailedPreconditionError(
        "the sampler needs a model that learns its variance (learn_sigma)");
  }
  if (request.class_id < 0 || request.class_id >= c.num_classes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "class must be in [0, ", c.num_classes, "), got ", request.class_id));
  }
  if (!(request.guidance >= kMinGuidance && request.guidance <= kMaxGuidance)) {
    return absl::InvalidArgumentError(
        absl::StrCat("guidance_scale must be in [", kMinGuidance, ", ",
                     kMaxGuidance, "], got ", request.guidance));
  }
  MOH_RETURN_IF_ERROR(ValidateTopK(c.moh, {request.top_k}, 1, "top_k"));
  std::unique_ptr<ImageSample> sample(new ImageSample(diffusion, request));
  sample->generator_ = at::make_generator<at::CPUGeneratorImpl>(request.seed);
  // sample.py: torch.manual_seed(seed); z = torch.randn(n, C, S, S).
  sample->x_ =
      at::randn({1, c.in_channels, c.input_size, c.input_size},
                sample->generator_, at::TensorOptions().dtype(at::kFloat))
          .squeeze(0);
  sample->next_ = diffusion->steps() - 1;
  int64_t max_heads = 0;
  for (const MohLayerConfig& l : c.moh.layers) {
    max_heads = std::max<int64_t>(max_heads, l.num_heads);
    sample->pairs_per_row_ += int64_t{c.tokens()} * l.num_heads;
  }
  sample->head_tokens_ = at::zeros(
      {static_cast<int64_t>(c.moh.layers.size()), max_heads}, at::kLong);
  return sample;
}

double ImageSample::effective_ratio() const {
  const int64_t pairs = int64_t{steps_done()} * rows() * pairs_per_row_;
  if (pairs == 0) return 1.0;
  return static_cast<double>(head_tokens_.sum().item<int64_t>()) / pairs;
}

absl::Status SampleStep(const DitModel& model,
                        const std::vector<ImageSample*>& samples) {
  const DitConfig& c = model.config();
  std::vector<at::Tensor> inputs;
  std::vector<int64_t> timesteps, classes;
  std::vector<LayerTopK> top_k;
  for (ImageSample* s : samples) {
    if (s->done()) return absl::InternalError("SampleStep: a sample is done");
    const int64_t t = s->diffusion_->timestep(s->next_);
    for (int32_t r = 0; r < s->rows(); ++r) {
      inputs.push_back(s->x_);
      timesteps.push_back(t);
      // The guided pair: the class, then the null class.
      classes.push_back(r == 0 ? s->request_.class_id : c.num_classes);
      top_k.push_back(s->request_.top_k);
    }
  }
  MOH_ASSIGN_OR_RETURN(
      DitOutput out,
      model.Forward(at::stack(inputs), at::tensor(timesteps, at::kLong),
                    at::tensor(classes, at::kLong), top_k));
  at::Tensor output = out.out.cpu();
  // Each generator's state, put back if the step fails after drawing noise.
  // (Not Generator::clone(): LibTorch 1.13 leaks every clone's state.)
  std::vector<at::Tensor> states;
  for (ImageSample* s : samples) states.push_back(s->generator_.get_state());
  const absl::Status status =
      CatchTorchErrors("SampleStep", [&]() -> absl::Status {
        // Each sample's next state, made before any sample takes it: a
        // failure leaves every one as it was.
        std::vector<at::Tensor> x, head_tokens;
        const int64_t channels = c.in_channels;
        const int64_t guided =
            std::min<int64_t>(kGuidedChannels, output.size(1));
        int64_t row = 0;
        for (ImageSample* s : samples) {
          at::Tensor result = output[row];
          if (s->guided()) {
            at::Tensor cond = output[row].narrow(0, 0, guided);
            at::Tensor uncond = output[row + 1].narrow(0, 0, guided);
            result = at::cat(
                {uncond + s->request_.guidance * (cond - uncond),
                 output[row].narrow(0, guided, output.size(1) - guided)});
          }
          at::Tensor counts = s->head_tokens_;
          for (int32_t r = 0; r < s->rows(); ++r) {
            counts = counts + out.head_token_counts[row + r];
          }
          head_tokens.push_back(counts);
          row += s->rows();
          // randn_like of the request's rows ([z, z] when guided), in one
          // draw of that shape; row 0's is the request's.
          at::Tensor noise = at::randn(
              {s->rows(), channels, c.input_size, c.input_size}, s->generator_,
              at::TensorOptions().dtype(at::kFloat))[0];
          x.push_back(s->diffusion_->Step(
              s->next_, s->x_, result.narrow(0, 0, channels),
              result.narrow(0, channels, channels), noise));
        }
        for (size_t i = 0; i < samples.size(); ++i) {
          ImageSample& s = *samples[i];
          s.x_ = std::move(x[i]);
          s.head_tokens_ = std::move(head_tokens[i]);
          --s.next_;
        }
        return absl::OkStatus();
      });
  if (!status.ok()) {
    for (size_t i = 0; i < samples.size(); ++i) {
      samples[i]->generator_.set_state(states[i]);
    }
  }
  return status;
}

absl::StatusOr<at::Tensor> SampleImage(const ImageSample& sample,
                                       const VaeDecoder* vae,
                                       double latent_scale) {
  if (!sample.done()) {
    return absl::FailedPreconditionError("SampleImage: not done sampling");
  }
  if (vae == nullptr) return ImageToBytes(sample.x());
  MOH_ASSIGN_OR_RETURN(
      at::Tensor image,
      vae->Decode(sample.x().unsqueeze(0) / static_cast<float>(latent_scale)));
  return ImageToBytes(image[0]);
}

absl::StatusOr<std::unique_ptr<VaeDecoder>> LoadDitVae(
    const std::string& model_dir, const DitModel& model) {
  const std::string& vae_dir = model.config().vae;
  if (vae_dir.empty()) return nullptr;
  const std::string path =
      vae_dir.front() == '/' ? vae_dir : model_dir + "/" + vae_dir;
  MOH_ASSIGN_OR_RETURN(std::unique_ptr<VaeDecoder> vae,
                       VaeDecoder::Load(path, model.options()));
  if (vae->config().latent_channels != model.config().in_channels) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, "/config.json: latent_channels (", vae->config().latent_channels,
        ") must equal the DiT's in_channels (", model.config().in_channels,
        ")"));
  }
  return vae;
}

}  // namespace moh
