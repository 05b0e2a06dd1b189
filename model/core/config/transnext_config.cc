#include "absl/strings/str_join.h"
#include "model/core/config/config_reader.h"

// MoH-ViT TransNeXt config.json: the released variants by name, or every field.
namespace moh {
namespace config_json {

namespace {

// The released MoH-ViT variants (MoH-ViT/transnext.py): patch 4, window 3,
// qkv bias, LayerNorm eps 1e-6, sr_ratios [8, 4, 2, 1].
struct TransNextVariant {
  const char* name;
  int32_t dims[4], heads[4], depths[4];
  double mlp[4];
  int32_t shared[4], top_k[4];
};
constexpr TransNextVariant kTransNextVariants[] = {
    {"moh_transnext_base_75",
     {96, 192, 384, 768},
     {4, 8, 16, 32},
     {5, 5, 23, 5},
     {8, 8, 4, 4},
     {4, 8, 4, 5},
     {0, 0, 8, 16}},
    {"moh_transnext_base_50",
     {96, 192, 384, 768},
     {4, 8, 16, 32},
     {5, 5, 23, 5},
     {8, 8, 4, 4},
     {2, 2, 2, 4},
     {2, 4, 6, 8}},
    {"moh_transnext_small_80",
     {72, 144, 288, 576},
     {3, 6, 12, 24},
     {5, 5, 22, 5},
     {8, 8, 4, 4},
     {3, 6, 3, 8},
     {0, 0, 6, 12}},
    {"moh_transnext_small_75",
     {72, 144, 288, 576},
     {3, 6, 12, 24},
     {5, 5, 22, 5},
     {8, 8, 4, 4},
     {3, 6, 3, 4},
     {0, 0, 6, 12}},
};
constexpr int kStages = 4;

// A list of four ints (one per stage), each in [lo, hi], or `fallback` when
// absent (no fallback: required).
absl::StatusOr<std::vector<int32_t>> StageInts(
    const ConfigReader& r, const char* field, int64_t lo, int64_t hi,
    const std::optional<std::vector<int32_t>>& fallback) {
  if (!r.Has(field)) {
    if (fallback) return *fallback;
    return r.Error(field, "is required (a list of 4 ints, one per stage)");
  }
  const json& v = r.raw()[field];
  if (!v.is_array() || v.size() != kStages) {
    return r.Error(field, "must be a list of 4 ints, one per stage");
  }
  std::vector<int32_t> out;
  for (size_t i = 0; i < v.size(); ++i) {
    MOH_ASSIGN_OR_RETURN(
        int32_t x, r.IntValue(v[i], absl::StrCat(field, "[", i, "]"), lo, hi));
    out.push_back(x);
  }
  return out;
}

// The variant named by "variant" (null when none is).
absl::StatusOr<const TransNextVariant*> FindVariant(const ConfigReader& r,
                                                    TransNextConfig& c) {
  MOH_ASSIGN_OR_RETURN(c.variant, r.String("variant", ""));
  const TransNextVariant* variant = nullptr;
  if (!c.variant.empty()) {
    for (const TransNextVariant& v : kTransNextVariants) {
      if (c.variant == v.name) variant = &v;
    }
    if (variant == nullptr) {
      return r.Error("variant",
                     absl::StrCat("must be one of ",
                                  absl::StrJoin(TransNextVariantNames(), ", "),
                                  ", got \"", c.variant, "\""));
    }
  }
  return variant;
}

// The image, the patch embedding and the fields shared by every stage.
absl::Status ParseImage(const ConfigReader& r, TransNextConfig& c) {
  // Every stage's grid must halve exactly (the official model's resolutions
  // are image_size // 2^(s + 2)) and the last must be at least 2x2 (its CPB
  // divides by side - 1).
  MOH_ASSIGN_OR_RETURN(c.image_size, r.Int("image_size", 64, 4096, 224));
  if (c.image_size % 32 != 0) {
    return r.Error("image_size", absl::StrCat("must be a multiple of 32, got ",
                                              c.image_size));
  }
  MOH_ASSIGN_OR_RETURN(c.pretrain_size,
                       r.Int("pretrain_size", 64, 4096, c.image_size));
  MOH_ASSIGN_OR_RETURN(c.resize_size, r.Int("resize_size", c.image_size, 8192,
                                            c.image_size * 8 / 7));
  MOH_ASSIGN_OR_RETURN(c.num_channels, r.Int("num_channels", 1, 16, 3));
  MOH_ASSIGN_OR_RETURN(c.patch_size, r.Int("patch_size", 4, 4, 4));
  MOH_ASSIGN_OR_RETURN(c.window_size, r.Int("window_size", 1, 15, 3));
  if (c.window_size % 2 == 0) {
    return r.Error("window_size",
                   absl::StrCat("must be odd, got ", c.window_size));
  }
  MOH_ASSIGN_OR_RETURN(c.qkv_bias, r.Bool("qkv_bias", true));
  MOH_ASSIGN_OR_RETURN(c.layer_norm_eps,
                       r.Double("layer_norm_eps", 0, 1, 1e-6));
  return absl::OkStatus();
}

// The per-stage lists, each a variant's (or the default) when absent.
struct StageLists {
  std::vector<int32_t> dims, heads, depths, sr, shared, top_k;
  std::vector<double> mlp;
};

absl::StatusOr<StageLists> ReadStageLists(const ConfigReader& r,
                                          const TransNextVariant* variant) {
  // A variant's value of `field`; nothing (so required) without a variant.
  auto from_variant = [&](auto field) -> std::optional<std::vector<int32_t>> {
    if (variant == nullptr) return std::nullopt;
    return std::vector<int32_t>(variant->*field, variant->*field + kStages);
  };
  StageLists l;
  MOH_ASSIGN_OR_RETURN(l.dims,
                       StageInts(r, "embed_dims", 1, 1 << 14,
                                 from_variant(&TransNextVariant::dims)));
  MOH_ASSIGN_OR_RETURN(l.heads,
                       StageInts(r, "num_heads", 1, 1024,
                                 from_variant(&TransNextVariant::heads)));
  MOH_ASSIGN_OR_RETURN(
      l.depths,
      StageInts(r, "depths", 1, 256, from_variant(&TransNextVariant::depths)));
  MOH_ASSIGN_OR_RETURN(
      l.sr, StageInts(r, "sr_ratios", 1, 64, std::vector<int32_t>{8, 4, 2, 1}));
  l.mlp.assign(4, 4.0);
  if (variant != nullptr) l.mlp.assign(variant->mlp, variant->mlp + 4);
  if (r.Has("mlp_ratios")) {
    MOH_ASSIGN_OR_RETURN(std::vector<float> m,
                         FloatList(r, "mlp_ratios", kStages, 4.0f));
    l.mlp.assign(m.begin(), m.end());
  }
  std::vector<int32_t> shared_default = l.heads, top_k_default(4, 0);
  if (variant != nullptr) {
    shared_default.assign(variant->shared, variant->shared + 4);
    top_k_default.assign(variant->top_k, variant->top_k + 4);
  }
  MOH_ASSIGN_OR_RETURN(
      l.shared, StageInts(r, "moh_shared_heads", 0, 1024, shared_default));
  MOH_ASSIGN_OR_RETURN(
      l.top_k, StageInts(r, "moh_routed_top_k", 0, 1024, top_k_default));
  return l;
}

// Stage `s`'s shape: heads dividing the width, the MLP ratio, the reduction.
absl::Status CheckStageShape(const ConfigReader& r, const StageLists& l,
                             const TransNextStage& stage, int s,
                             const TransNextConfig& c) {
  const std::string at = absl::StrCat("[", s, "]");
  if (l.dims[s] % l.heads[s] != 0) {
    return r.Error("num_heads" + at,
                   absl::StrCat("must divide embed_dims", at, " (", l.dims[s],
                                "), got ", l.heads[s]));
  }
  if (!(l.mlp[s] > 0 && l.mlp[s] <= 64)) {
    return r.Error("mlp_ratios" + at,
                   absl::StrCat("must be in (0, 64], got ", l.mlp[s]));
  }
  if (stage.glu_hidden() < 1) {
    return r.Error("mlp_ratios" + at,
                   "gives no hidden units (int(2 * int(dim * ratio) / 3))");
  }
  const bool last = s == kStages - 1;
  if (last != (l.sr[s] == 1)) {
    return r.Error("sr_ratios" + at,
                   last ? "must be 1 (the last stage uses full attention)"
                        : "must be > 1 (stages 1-3 use aggregated "
                          "attention)");
  }
  if (!last && c.resolution(s) < l.sr[s]) {
    return r.Error("sr_ratios" + at,
                   absl::StrCat("must be at most the stage's resolution (",
                                c.resolution(s), "), got ", l.sr[s]));
  }
  return absl::OkStatus();
}

// Stage `s`'s shared heads and routed top-K.
absl::Status CheckStageMoh(const ConfigReader& r, const StageLists& l, int s) {
  const std::string at = absl::StrCat("[", s, "]");
  if (l.shared[s] > l.heads[s]) {
    return r.Error(
        "moh_shared_heads" + at,
        absl::StrCat("must be in [0, ", l.heads[s], "], got ", l.shared[s]));
  }
  const int32_t routed = l.heads[s] - l.shared[s];
  if (l.top_k[s] > routed || (l.top_k[s] == 0) != (routed == 0)) {
    return r.Error(
        "moh_routed_top_k" + at,
        routed == 0
            ? absl::StrCat("must be 0 when every head is shared, got ",
                           l.top_k[s])
            : absl::StrCat("must be in [1, ", routed, "] (heads ", l.heads[s],
                           " - shared ", l.shared[s], "), got ", l.top_k[s]));
  }
  if (routed == 0 && l.shared[s] == 1) {
    // The official attention re-weights with wg_1, which needs S > 1.
    return r.Error("moh_shared_heads" + at,
                   "must be > 1 when the stage routes no heads");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TransNextConfig> ParseTransNext(const ConfigReader& r) {
  TransNextConfig c;
  MOH_ASSIGN_OR_RETURN(const TransNextVariant* variant, FindVariant(r, c));
  MOH_RETURN_IF_ERROR(ParseImage(r, c));
  MOH_ASSIGN_OR_RETURN(const StageLists l, ReadStageLists(r, variant));
  c.moh.router = RouterKind::kLearned;
  for (int s = 0; s < kStages; ++s) {
    TransNextStage stage;
    stage.embed_dim = l.dims[s];
    stage.num_heads = l.heads[s];
    stage.depth = l.depths[s];
    stage.sr_ratio = l.sr[s];
    stage.mlp_ratio = l.mlp[s];
    stage.shared_heads = l.shared[s];
    stage.top_k = l.top_k[s];
    MOH_RETURN_IF_ERROR(CheckStageShape(r, l, stage, s, c));
    MOH_RETURN_IF_ERROR(CheckStageMoh(r, l, s));
    for (int32_t b = 0; b < l.depths[s]; ++b) {
      c.moh.layers.push_back({l.heads[s], l.shared[s], l.top_k[s], s, b});
    }
    c.stages.push_back(stage);
  }
  if (c.pretrain_size / 32 < 2) {
    return r.Error("pretrain_size", "must be at least 64");
  }
  MOH_RETURN_IF_ERROR(ReadClassifierInput(r, c.num_channels, &c.labels,
                                          &c.image_mean, &c.image_std));
  return c;
}

}  // namespace config_json

const std::vector<std::string>& TransNextVariantNames() {
  static const auto* names = [] {
    auto* v = new std::vector<std::string>;
    for (const config_json::TransNextVariant& t :
         config_json::kTransNextVariants) {
      v->push_back(t.name);
    }
    return v;
  }();
  return *names;
}

int32_t TransNextStage::glu_hidden() const {
  return static_cast<int32_t>(2 * static_cast<int64_t>(embed_dim * mlp_ratio) /
                              3);
}

std::vector<int32_t> TransNextConfig::LayerStages() const {
  std::vector<int32_t> out;
  for (size_t s = 0; s < stages.size(); ++s) {
    out.insert(out.end(), stages[s].depth, static_cast<int32_t>(s));
  }
  return out;
}

namespace config_json {}  // namespace config_json
}  // namespace moh
