// What the tests of DeviceOptions::weights (linear weights held in bfloat16
// or int8 under float32 activations) share across model families:
// lowp_weights_test (MoH-LLaMA) and vit_lowp_weights_test (MoH-ViT).
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>

#include "model/core/runtime.h"

namespace moh {

// The fixture model of `dir` on the CPU in float32 with `weights`; null
// (and a failure) where it does not load.
template <typename Model>
std::unique_ptr<Model> LoadWithWeights(const std::string& dir,
                                       const std::string& weights = "") {
  auto model = Model::Load(dir, DeviceOptions{"cpu", "float32", weights});
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? *std::move(model) : nullptr;
}

// A converted format and how close its logits must stay to float32's.
struct WeightsPrecision {
  std::string weights;  // DeviceOptions::weights
  WeightFormat format;
  // The largest |logit error| allowed, as a fraction of the largest logit.
  double bound;
  double agreement;  // of the argmax, the least share allowed
};

// Logits `got` [rows, classes] of the converted model against `want` of
// float32 under `p`: within the bound, not equal (the weights were
// converted), the argmax agreeing; prints the figures, labelled `what`.
inline void ExpectLogitsWithinBound(const at::Tensor& want,
                                    const at::Tensor& got,
                                    const WeightsPrecision& p,
                                    const std::string& what) {
  const double scale = want.abs().max().item<double>();
  const double error = (want - got).abs().max().item<double>();
  ASSERT_FALSE(std::isnan(error)) << what;
  EXPECT_LE(error, p.bound * scale) << what;
  EXPECT_GT(error, 0) << what << ": the weights were not converted";
  const double agree =
      (want.argmax(-1) == got.argmax(-1)).to(at::kFloat).mean().item<double>();
  EXPECT_GE(agree, p.agreement) << what;
  std::printf(
      "%s %s: max |logit error| %.3g of %.3g (%.2g), argmax agreement %.3f\n",
      p.weights.c_str(), what.c_str(), error, scale, error / scale, agree);
}

// Model::Load(dir, DeviceOptions) holds the weights as loaded for "" and
// "auto" (Model::linear_weights()), and answers INVALID_ARGUMENT naming the
// field for an unknown format, and naming float32 for a converted format
// under another dtype.
template <typename Model>
void ExpectWeightsRefusalsNameTheField(const std::string& dir) {
  for (const char* as_loaded : {"", "auto"}) {
    std::unique_ptr<Model> model = LoadWithWeights<Model>(dir, as_loaded);
    ASSERT_TRUE(model);
    EXPECT_EQ(model->linear_weights(), WeightFormat::kAsLoaded);
  }
  struct Refused {
    DeviceOptions options;
    const char* named;  // in the message
  };
  for (const Refused& refused : {
           Refused{{"cpu", "float32", "float8"}, "weights"},
           Refused{{"cpu", "float32", "fp16"}, "weights"},
           Refused{{"cpu", "float32", "int4"}, "weights"},
           Refused{{"cpu", "bfloat16", "bfloat16"}, "dtype float32"},
           Refused{{"cpu", "bfloat16", "int8"}, "dtype float32"},
       }) {
    auto model = Model::Load(dir, refused.options);
    const std::string what =
        refused.options.dtype + " / " + refused.options.weights;
    ASSERT_FALSE(model.ok()) << what;
    EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument)
        << what;
    EXPECT_NE(model.status().message().find(refused.named), std::string::npos)
        << model.status().message();
  }
}

}  // namespace moh
