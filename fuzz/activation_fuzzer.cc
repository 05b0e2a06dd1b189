// Fuzzes the request's activation (model/core/activation.h) against model
// configurations (model/core/model_config.h, ParseModelConfig): the first 8
// input bytes are activation.ratio and activation.min_ratio (two float32,
// any bit pattern: NaN, infinities, denormals), the rest is a config.json.
// Resolve must refuse every ratio outside 0 or (0, 1] and every min_ratio
// outside 0 or (0, ratio]; what it accepts must give one K per layer within
// the layer's routed heads (ValidateTopK agrees), and lowering to the floor
// never raises a K. This is the validation Generate and Classify run at
// admission (service/language/language_executor.cc, *_servable.cc) before
// anything touches a model.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "fuzz/fuzz_check.h"
#include "model/core/activation.h"
#include "model/core/model_config.h"

namespace {

void CheckResolved(const moh::MohConfig& moh, float ratio, float min_ratio) {
  absl::StatusOr<moh::Activation> activation =
      moh::Activation::Resolve(moh, ratio, min_ratio);
  const bool ratio_ok = ratio == 0.0f || (ratio > 0.0f && ratio <= 1.0f);
  if (!activation.ok()) {
    moh::fuzz::CheckInvalidArgument(activation.status());
    return;
  }
  MOH_FUZZ_CHECK(ratio_ok, absl::StrCat("accepted ratio ", ratio));
  MOH_FUZZ_CHECK(min_ratio == 0.0f || min_ratio > 0.0f,
                 absl::StrCat("accepted min_ratio ", min_ratio));
  MOH_FUZZ_CHECK(std::isfinite(activation->nominal_ratio()),
                 absl::StrCat("nominal ratio ", activation->nominal_ratio()));
  const absl::Status top_k_ok =
      moh::ValidateTopK(moh, {activation->top_k()}, 1, "top_k");
  MOH_FUZZ_CHECK(top_k_ok.ok(), top_k_ok.ToString());
  const moh::Activation lowered = activation->Lowered(moh);
  const absl::Status lowered_ok =
      moh::ValidateTopK(moh, {lowered.top_k()}, 1, "lowered top_k");
  MOH_FUZZ_CHECK(lowered_ok.ok(), lowered_ok.ToString());
  for (size_t l = 0; l < moh.layers.size(); ++l) {
    MOH_FUZZ_CHECK(
        lowered.top_k()[l] <= activation->top_k()[l],
        absl::StrCat("lowering raised layer ", l, "'s K from ",
                     activation->top_k()[l], " to ", lowered.top_k()[l]));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  float ratio, min_ratio;
  std::memcpy(&ratio, data, 4);
  std::memcpy(&min_ratio, data + 4, 4);
  absl::StatusOr<moh::ModelConfig> config = moh::ParseModelConfig(
      std::string(moh::fuzz::AsText(data + 8, size - 8)), "fuzz/config.json");
  if (!config.ok()) {
    moh::fuzz::CheckInvalidArgument(config.status());
    return 0;
  }
  const moh::MohConfig& moh = config->moh();
  const double default_ratio = moh.DefaultRatio();
  MOH_FUZZ_CHECK(default_ratio > 0.0 && default_ratio <= 1.0,
                 absl::StrCat("default ratio ", default_ratio));
  CheckResolved(moh, ratio, min_ratio);
  CheckResolved(moh, 0.0f, min_ratio);
  CheckResolved(moh, ratio, 0.0f);
  return 0;
}
