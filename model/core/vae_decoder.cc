#include "model/core/vae_decoder.h"

#include <c10/core/InferenceMode.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/checkpoint/safetensors_reader.h"
#include "model/checkpoint/torch_bin_reader.h"
#include "model/core/runtime.h"
#include "nlohmann/json.hpp"

namespace moh {
namespace {

using nlohmann::json;

constexpr double kEps = 1e-6;

bool IsRegularFile(const std::string& path) {
  std::ifstream in(path);
  return in.good();
}

}  // namespace

absl::StatusOr<VaeConfig> ParseVaeConfig(const std::string& json_text,
                                         const std::string& source) {
  json j = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": not a JSON object"));
  }
  auto error = [&](const char* field, const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": field '", field, "' ", what));
  };
  auto int_field = [&](const char* field, int64_t lo, int64_t hi,
                       int32_t* out) -> absl::Status {
    if (!j.contains(field)) return absl::OkStatus();
    if (!j[field].is_number_integer() || j[field].get<int64_t>() < lo ||
        j[field].get<int64_t>() > hi) {
      return error(field,
                   absl::StrCat("must be an integer in [", lo, ", ", hi, "]"));
    }
    *out = j[field].get<int32_t>();
    return absl::OkStatus();
  };
  VaeConfig c;
  MOH_RETURN_IF_ERROR(int_field("latent_channels", 1, 64, &c.latent_channels));
  MOH_RETURN_IF_ERROR(int_field("out_channels", 1, 4, &c.out_channels));
  MOH_RETURN_IF_ERROR(int_field("layers_per_block", 1, 8, &c.layers_per_block));
  MOH_RETURN_IF_ERROR(
      int_field("norm_num_groups", 1, 1024, &c.norm_num_groups));
  if (j.contains("block_out_channels")) {
    const json& v = j["block_out_channels"];
    if (!v.is_array() || v.empty() || v.size() > 8) {
      return error("block_out_channels", "must be a list of 1 to 8 ints");
    }
    c.block_out_channels.clear();
    for (const json& x : v) {
      if (!x.is_number_integer() || x.get<int64_t>() < 1 ||
          x.get<int64_t>() > 4096 ||
          x.get<int64_t>() % c.norm_num_groups != 0) {
        return error("block_out_channels",
                     absl::StrCat("must hold ints in [1, 4096] divisible by "
                                  "norm_num_groups (",
                                  c.norm_num_groups, ")"));
      }
      c.block_out_channels.push_back(x.get<int32_t>());
    }
  }
  if (j.contains("mid_block_add_attention")) {
    if (!j["mid_block_add_attention"].is_boolean()) {
      return error("mid_block_add_attention", "must be true or false");
    }
    c.mid_block_add_attention = j["mid_block_add_attention"].get<bool>();
  }
  if (j.contains("act_fn") && j["act_fn"] != "silu") {
    return error("act_fn", "must be \"silu\"");
  }
  return c;
}

absl::StatusOr<std::unique_ptr<VaeDecoder>> VaeDecoder::Load(
    const std::string& dir, const at::TensorOptions& options) {
  const std::string config_path = dir + "/config.json";
  std::ifstream in(config_path);
  if (!in) return absl::NotFoundError(config_path + ": cannot open");
  std::stringstream text;
  text << in.rdbuf();
  MOH_ASSIGN_OR_RETURN(VaeConfig config,
                       ParseVaeConfig(text.str(), config_path));
  absl::StatusOr<TensorStore> store;
  if (IsRegularFile(dir + "/diffusion_pytorch_model.safetensors")) {
    store = ReadSafetensorsFile(dir + "/diffusion_pytorch_model.safetensors");
  } else if (IsRegularFile(dir + "/diffusion_pytorch_model.bin")) {
    store = ReadTorchBinFile(dir + "/diffusion_pytorch_model.bin");
  } else {
    store = LoadCheckpoint(dir);
  }
  if (!store.ok()) return store.status();
  return FromStore(*store, config, options);
}

absl::StatusOr<VaeDecoder::Resnet> VaeDecoder::LoadResnet(TensorStore& store,
                                                          const std::string& p,
                                                          int64_t in,
                                                          int64_t out) {
  auto take = [&](const std::string& name, std::vector<int64_t> shape) {
    return store.Take(p + name, shape, options_);
  };
  Resnet r;
  MOH_ASSIGN_OR_RETURN(r.norm1_w, take("norm1.weight", {in}));
  MOH_ASSIGN_OR_RETURN(r.norm1_b, take("norm1.bias", {in}));
  MOH_ASSIGN_OR_RETURN(r.conv1_w, take("conv1.weight", {out, in, 3, 3}));
  MOH_ASSIGN_OR_RETURN(r.conv1_b, take("conv1.bias", {out}));
  MOH_ASSIGN_OR_RETURN(r.norm2_w, take("norm2.weight", {out}));
  MOH_ASSIGN_OR_RETURN(r.norm2_b, take("norm2.bias", {out}));
  MOH_ASSIGN_OR_RETURN(r.conv2_w, take("conv2.weight", {out, out, 3, 3}));
  MOH_ASSIGN_OR_RETURN(r.conv2_b, take("conv2.bias", {out}));
  if (in != out) {
    MOH_ASSIGN_OR_RETURN(r.shortcut_w,
                         take("conv_shortcut.weight", {out, in, 1, 1}));
    MOH_ASSIGN_OR_RETURN(r.shortcut_b, take("conv_shortcut.bias", {out}));
  }
  return r;
}

absl::StatusOr<VaeDecoder::AttentionBlock> VaeDecoder::LoadAttention(
    TensorStore& store, const std::string& p, int64_t c) {
  // Current diffusers names, else the older ones.
  const bool current = store.Contains(p + "to_q.weight");
  const char* names[4][2] = {{"to_q", "query"},
                             {"to_k", "key"},
                             {"to_v", "value"},
                             {"to_out.0", "proj_attn"}};
  AttentionBlock a;
  at::Tensor* weights[4][2] = {{&a.q_w, &a.q_b},
                               {&a.k_w, &a.k_b},
                               {&a.v_w, &a.v_b},
                               {&a.out_w, &a.out_b}};
  for (int i = 0; i < 4; ++i) {
    const std::string name = p + names[i][current ? 0 : 1];
    MOH_ASSIGN_OR_RETURN(at::Tensor raw, store.Get(name + ".weight"));
    // Some conversions store these as 1x1 convolutions.
    const std::vector<int64_t> shape = raw.dim() == 4
                                           ? std::vector<int64_t>{c, c, 1, 1}
                                           : std::vector<int64_t>{c, c};
    MOH_ASSIGN_OR_RETURN(at::Tensor w,
                         store.Take(name + ".weight", shape, options_));
    *weights[i][0] = w.view({c, c});
    MOH_ASSIGN_OR_RETURN(*weights[i][1],
                         store.Take(name + ".bias", {c}, options_));
  }
  MOH_ASSIGN_OR_RETURN(a.norm_w,
                       store.Take(p + "group_norm.weight", {c}, options_));
  MOH_ASSIGN_OR_RETURN(a.norm_b,
                       store.Take(p + "group_norm.bias", {c}, options_));
  return a;
}

absl::StatusOr<std::unique_ptr<VaeDecoder>> VaeDecoder::FromStore(
    TensorStore& store, const VaeConfig& config,
    const at::TensorOptions& options) {
  std::unique_ptr<VaeDecoder> vae(new VaeDecoder(config, options));
  auto take = [&](const std::string& name, std::vector<int64_t> shape) {
    return store.Take(name, shape, options);
  };
  const int64_t latent = config.latent_channels;
  const std::vector<int32_t>& channels = config.block_out_channels;
  const int64_t top = channels.back();
  MOH_ASSIGN_OR_RETURN(vae->post_quant_w_,
                       take("post_quant_conv.weight", {latent, latent, 1, 1}));
  MOH_ASSIGN_OR_RETURN(vae->post_quant_b_,
                       take("post_quant_conv.bias", {latent}));
  MOH_ASSIGN_OR_RETURN(vae->conv_in_w_,
                       take("decoder.conv_in.weight", {top, latent, 3, 3}));
  MOH_ASSIGN_OR_RETURN(vae->conv_in_b_, take("decoder.conv_in.bias", {top}));
  MOH_ASSIGN_OR_RETURN(
      vae->mid_first_,
      vae->LoadResnet(store, "decoder.mid_block.resnets.0.", top, top));
  if (config.mid_block_add_attention) {
    MOH_ASSIGN_OR_RETURN(
        vae->mid_attention_,
        vae->LoadAttention(store, "decoder.mid_block.attentions.0.", top));
  }
  MOH_ASSIGN_OR_RETURN(
      vae->mid_second_,
      vae->LoadResnet(store, "decoder.mid_block.resnets.1.", top, top));
  int64_t output = top;
  const size_t blocks = channels.size();
  for (size_t i = 0; i < blocks; ++i) {
    const int64_t input = output;
    output = channels[blocks - 1 - i];
    UpBlock up;
    for (int32_t j = 0; j <= config.layers_per_block; ++j) {
      MOH_ASSIGN_OR_RETURN(
          Resnet r,
          vae->LoadResnet(
              store, absl::StrCat("decoder.up_blocks.", i, ".resnets.", j, "."),
              j == 0 ? input : output, output));
      up.resnets.push_back(std::move(r));
    }
    if (i + 1 < blocks) {
      const std::string p =
          absl::StrCat("decoder.up_blocks.", i, ".upsamplers.0.conv.");
      MOH_ASSIGN_OR_RETURN(up.upsample_w,
                           take(p + "weight", {output, output, 3, 3}));
      MOH_ASSIGN_OR_RETURN(up.upsample_b, take(p + "bias", {output}));
    }
    vae->up_blocks_.push_back(std::move(up));
  }
  const int64_t bottom = channels.front();
  MOH_ASSIGN_OR_RETURN(vae->norm_out_w_,
                       take("decoder.conv_norm_out.weight", {bottom}));
  MOH_ASSIGN_OR_RETURN(vae->norm_out_b_,
                       take("decoder.conv_norm_out.bias", {bottom}));
  MOH_ASSIGN_OR_RETURN(
      vae->conv_out_w_,
      take("decoder.conv_out.weight", {config.out_channels, bottom, 3, 3}));
  MOH_ASSIGN_OR_RETURN(vae->conv_out_b_,
                       take("decoder.conv_out.bias", {config.out_channels}));
  // Every decoder tensor is used; the encoder's are not needed.
  store.Discard("encoder.");
  store.Discard("quant_conv.");
  MOH_RETURN_IF_ERROR(store.CheckAllTaken());
  return vae;
}

at::Tensor VaeDecoder::GroupNorm(const at::Tensor& x, const at::Tensor& w,
                                 const at::Tensor& b) const {
  return at::group_norm(x, config_.norm_num_groups, w, b, kEps);
}

at::Tensor VaeDecoder::ResnetForward(const Resnet& r,
                                     const at::Tensor& x) const {
  at::Tensor h = at::conv2d(at::silu(GroupNorm(x, r.norm1_w, r.norm1_b)),
                            r.conv1_w, r.conv1_b, {1, 1}, {1, 1});
  h = at::conv2d(at::silu(GroupNorm(h, r.norm2_w, r.norm2_b)), r.conv2_w,
                 r.conv2_b, {1, 1}, {1, 1});
  at::Tensor shortcut =
      r.shortcut_w.defined() ? at::conv2d(x, r.shortcut_w, r.shortcut_b) : x;
  return shortcut + h;
}

at::Tensor VaeDecoder::AttentionForward(const AttentionBlock& a,
                                        const at::Tensor& x) const {
  const int64_t b = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
  at::Tensor t =
      GroupNorm(x, a.norm_w, a.norm_b).view({b, c, h * w}).transpose(1, 2);
  at::Tensor q = at::linear(t, a.q_w, a.q_b);
  at::Tensor k = at::linear(t, a.k_w, a.k_b);
  at::Tensor v = at::linear(t, a.v_w, a.v_b);
  // One head of all c channels, scale c^-1/2, softmax in float32.
  at::Tensor scores = at::baddbmm(
      at::empty({b, h * w, h * w}, q.options()), q, k.transpose(1, 2),
      /*beta=*/0, /*alpha=*/1.0 / std::sqrt(static_cast<double>(c)));
  at::Tensor probs = at::softmax(scores.to(at::kFloat), -1).to(q.scalar_type());
  at::Tensor out = at::linear(at::bmm(probs, v), a.out_w, a.out_b);
  return out.transpose(1, 2).reshape({b, c, h, w}) + x;
}

absl::StatusOr<at::Tensor> VaeDecoder::Decode(const at::Tensor& latents) const {
  if (!latents.defined() || latents.dim() != 4 ||
      latents.size(1) != config_.latent_channels) {
    return absl::InvalidArgumentError(absl::StrCat(
        "latents must have shape [B, ", config_.latent_channels, ", h, w]"));
  }
  const c10::InferenceMode inference;
  return CatchTorchErrors(
      "VaeDecoder::Decode", [&]() -> absl::StatusOr<at::Tensor> {
        at::Tensor x =
            at::conv2d(latents.to(options_), post_quant_w_, post_quant_b_);
        x = at::conv2d(x, conv_in_w_, conv_in_b_, {1, 1}, {1, 1});
        x = ResnetForward(mid_first_, x);
        if (config_.mid_block_add_attention)
          x = AttentionForward(mid_attention_, x);
        x = ResnetForward(mid_second_, x);
        for (const UpBlock& up : up_blocks_) {
          for (const Resnet& r : up.resnets) x = ResnetForward(r, x);
          if (up.upsample_w.defined()) {
            x = at::upsample_nearest2d(x, {x.size(2) * 2, x.size(3) * 2});
            x = at::conv2d(x, up.upsample_w, up.upsample_b, {1, 1}, {1, 1});
          }
        }
        x = at::silu(GroupNorm(x, norm_out_w_, norm_out_b_));
        x = at::conv2d(x, conv_out_w_, conv_out_b_, {1, 1}, {1, 1});
        return x.to(at::kFloat);
      });
}

at::Tensor ImageToBytes(const at::Tensor& image) {
  at::Tensor x = image.to(at::kFloat).cpu().clamp(-1, 1);
  x = (x + 1) / 2;
  return (x * 255 + 0.5).clamp_(0, 255).to(at::kByte);
}

}  // namespace moh
