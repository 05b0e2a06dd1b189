#include "model/core/config/config_reader.h"

// MoH-ViT (the plain ViT layout) config.json.
namespace moh {
namespace config_json {

absl::StatusOr<VitConfig> ParseVit(const ConfigReader& r) {
  VitConfig c;
  MOH_ASSIGN_OR_RETURN(c.image_size, r.Int("image_size", 1, 8192, {}));
  MOH_ASSIGN_OR_RETURN(c.patch_size, r.Int("patch_size", 1, c.image_size, {}));
  if (c.image_size % c.patch_size != 0) {
    return r.Error("patch_size",
                   absl::StrCat("must divide image_size (", c.image_size,
                                "), got ", c.patch_size));
  }
  MOH_ASSIGN_OR_RETURN(c.num_channels, r.Int("num_channels", 1, 16, 3));
  MOH_ASSIGN_OR_RETURN(c.hidden_size, r.Int("hidden_size", 1, 1 << 16, {}));
  MOH_ASSIGN_OR_RETURN(c.num_layers, r.Int("num_hidden_layers", 1, 1024, {}));
  MOH_ASSIGN_OR_RETURN(c.num_heads,
                       r.Int("num_attention_heads", 1, c.hidden_size, {}));
  if (c.hidden_size % c.num_heads != 0) {
    return r.Error("num_attention_heads",
                   absl::StrCat("must divide hidden_size (", c.hidden_size,
                                "), got ", c.num_heads));
  }
  MOH_ASSIGN_OR_RETURN(c.intermediate_size,
                       r.Int("intermediate_size", 1, 1 << 20, {}));
  MOH_ASSIGN_OR_RETURN(c.layer_norm_eps,
                       r.Double("layer_norm_eps", 0, 1, 1e-6));
  MOH_ASSIGN_OR_RETURN(c.qkv_bias, r.Bool("qkv_bias", true));
  MOH_RETURN_IF_ERROR(ReadClassifierInput(r, c.num_channels, &c.labels,
                                          &c.image_mean, &c.image_std));
  MOH_ASSIGN_OR_RETURN(
      c.moh, ParseMoh(r, c.num_layers, c.num_heads, RouterKind::kDense));
  if (c.moh.router == RouterKind::kQueryNorm) {
    return r.Error("moh_router",
                   "must be \"learned\" or \"dense\" for moh_vit");
  }
  return c;
}

}  // namespace config_json
}  // namespace moh
