#include "absl/strings/str_join.h"
#include "model/core/config/config_reader.h"

// MoH-DiT config.json: the released variants by name, or every field.
namespace moh {
namespace config_json {

namespace {

// The released MoH-DiT configurations (MoH-DiT/models.py): patch 2, 4 latent
// channels, 1000 classes, learned sigma.
struct DitVariant {
  std::string name;
  int32_t depth, hidden, head_dim;  // head_dim 0: hidden / heads
  std::vector<int32_t> heads, shared, top_k;
};

// `count` copies of `value`, then `rest`.
std::vector<int32_t> Repeat(
    std::initializer_list<std::pair<int32_t, int>> runs) {
  std::vector<int32_t> out;
  for (const auto& [value, count] : runs) out.insert(out.end(), count, value);
  return out;
}

const std::vector<DitVariant>& DitVariants() {
  static const auto* variants = new std::vector<DitVariant>{
      {"MoH-DiT-XL/2-90", 28, 1152, 72, Repeat({{8, 9}, {16, 10}, {24, 9}}),
       Repeat({{8, 9}, {16, 10}, {16, 9}}), Repeat({{0, 19}, {3, 9}})},
      {"MoH-DiT-XL/2-75", 28, 1152, 72, Repeat({{8, 9}, {16, 10}, {24, 9}}),
       Repeat({{8, 9}, {10, 10}, {14, 9}}), Repeat({{0, 9}, {2, 19}})},
      {"MoH-DiT-L/2-90", 24, 1024, 64, Repeat({{8, 8}, {16, 8}, {24, 8}}),
       Repeat({{8, 8}, {16, 8}, {16, 8}}), Repeat({{0, 16}, {3, 8}})},
      {"MoH-DiT-L/2-75", 24, 1024, 64, Repeat({{8, 8}, {16, 8}, {24, 8}}),
       Repeat({{8, 8}, {8, 8}, {12, 8}}), Repeat({{0, 8}, {4, 16}})},
      {"MoH-DiT-B/2-90", 12, 768, 0, Repeat({{12, 12}}),
       Repeat({{6, 5}, {7, 5}, {12, 2}}), Repeat({{4, 10}, {0, 2}})},
      {"MoH-DiT-B/2-75", 12, 768, 0, Repeat({{12, 12}}),
       Repeat({{4, 2}, {6, 8}, {12, 2}}), Repeat({{2, 2}, {3, 8}, {0, 2}})},
      {"MoH-DiT-S/2-90", 12, 384, 0, Repeat({{6, 12}}),
       Repeat({{3, 8}, {6, 4}}), Repeat({{2, 8}, {0, 4}})},
      {"MoH-DiT-S/2-75", 12, 384, 0, Repeat({{6, 12}}),
       Repeat({{2, 2}, {3, 8}, {6, 2}}), Repeat({{1, 6}, {2, 4}, {0, 2}})},
  };
  return *variants;
}

// A per-block list of ints (or one int for every block), each in [lo, hi];
// `fallback` when absent (empty: required).
absl::StatusOr<std::vector<int32_t>> BlockInts(
    const ConfigReader& r, const char* field, int32_t depth, int64_t lo,
    int64_t hi, const std::vector<int32_t>& fallback) {
  if (!r.Has(field)) {
    if (!fallback.empty()) return fallback;
    return r.Error(field, "is required (an int, or a list with one per block)");
  }
  return r.PerLayerInt(field, depth, lo, hi);
}

// The variant named by "variant" (null when none is).
absl::StatusOr<const DitVariant*> FindVariant(const ConfigReader& r,
                                              DitConfig& c) {
  MOH_ASSIGN_OR_RETURN(c.variant, r.String("variant", ""));
  const DitVariant* variant = nullptr;
  if (!c.variant.empty()) {
    for (const DitVariant& v : DitVariants()) {
      if (c.variant == v.name) variant = &v;
    }
    if (variant == nullptr) {
      return r.Error("variant",
                     absl::StrCat("must be one of ",
                                  absl::StrJoin(DitVariantNames(), ", "),
                                  ", got \"", c.variant, "\""));
    }
  }
  return variant;
}

// The image and the transformer's shape: input, patch and channels, width,
// depth and heads per block.
absl::Status ParseShape(const ConfigReader& r, const DitVariant* variant,
                        DitConfig& c) {
  MOH_ASSIGN_OR_RETURN(c.input_size, r.Int("input_size", 2, 1024, 32));
  MOH_ASSIGN_OR_RETURN(c.patch_size, r.Int("patch_size", 1, c.input_size, 2));
  if (c.input_size % c.patch_size != 0) {
    return r.Error("patch_size",
                   absl::StrCat("must divide input_size (", c.input_size,
                                "), got ", c.patch_size));
  }
  MOH_ASSIGN_OR_RETURN(c.in_channels, r.Int("in_channels", 1, 64, 4));
  MOH_ASSIGN_OR_RETURN(
      c.hidden_size, variant ? r.Int("hidden_size", 2, 1 << 14, variant->hidden)
                             : r.Int("hidden_size", 2, 1 << 14, {}));
  if (c.hidden_size % 2 != 0) {
    return r.Error("hidden_size",
                   absl::StrCat("must be even (sin-cos position embedding), "
                                "got ",
                                c.hidden_size));
  }
  MOH_ASSIGN_OR_RETURN(c.depth, variant ? r.Int("depth", 1, 256, variant->depth)
                                        : r.Int("depth", 1, 256, {}));
  MOH_ASSIGN_OR_RETURN(
      c.num_heads,
      BlockInts(r, "num_heads", c.depth, 1, 1024,
                variant && variant->depth == c.depth ? variant->heads
                                                     : std::vector<int32_t>{}));
  return absl::OkStatus();
}

// Each block's head_dim: the variant's, or hidden_size / heads, or given.
absl::Status ParseHeadDims(const ConfigReader& r, const DitVariant* variant,
                           DitConfig& c) {
  std::vector<int32_t> head_dim_default;
  if (variant != nullptr && variant->head_dim > 0) {
    head_dim_default.assign(c.depth, variant->head_dim);
  } else {
    for (int32_t h : c.num_heads) {
      if (c.hidden_size % h != 0 && !r.Has("head_dim")) {
        return r.Error("num_heads",
                       absl::StrCat("must divide hidden_size (", c.hidden_size,
                                    ") when head_dim is not given, got ", h));
      }
      head_dim_default.push_back(c.hidden_size / h);
    }
  }
  // An int for every block, or a list with one per block; null (there or
  // as an entry) is hidden_size / heads.
  c.head_dim = head_dim_default;
  if (r.Has("head_dim")) {
    const json& v = r.raw()["head_dim"];
    if (v.is_array() && static_cast<int32_t>(v.size()) != c.depth) {
      return r.Error("head_dim", absl::StrCat("has ", v.size(),
                                              " entries, expected one per "
                                              "block (",
                                              c.depth, ")"));
    }
    for (int32_t l = 0; l < c.depth; ++l) {
      const json& entry = v.is_array() ? v[l] : v;
      if (entry.is_null()) {
        if (c.hidden_size % c.num_heads[l] != 0) {
          return r.Error(
              "head_dim",
              absl::StrCat("[", l,
                           "] is null, which needs "
                           "num_heads to divide hidden_size (",
                           c.hidden_size, "), got ", c.num_heads[l]));
        }
        c.head_dim[l] = c.hidden_size / c.num_heads[l];
        continue;
      }
      MOH_ASSIGN_OR_RETURN(
          c.head_dim[l],
          r.IntValue(entry, absl::StrCat("head_dim[", l, "]"), 1, 4096));
    }
  }
  return absl::OkStatus();
}

// The MLP width, the classes and their labels, the VAE and the sampling
// defaults.
absl::Status ParseClassesAndSampling(const ConfigReader& r, DitConfig& c) {
  MOH_ASSIGN_OR_RETURN(c.mlp_ratio, r.Double("mlp_ratio", 0.01, 64, 4.0));
  if (c.mlp_hidden() < 1) {
    return r.Error("mlp_ratio", "gives no hidden units");
  }
  MOH_ASSIGN_OR_RETURN(c.num_classes, r.Int("num_classes", 1, 1 << 20, 1000));
  MOH_ASSIGN_OR_RETURN(c.learn_sigma, r.Bool("learn_sigma", true));
  if (r.Has("labels")) {
    MOH_ASSIGN_OR_RETURN(c.labels, Labels(r));
    if (static_cast<int32_t>(c.labels.size()) != c.num_classes) {
      return r.Error("labels",
                     absl::StrCat("must have num_classes (", c.num_classes,
                                  ") names, got ", c.labels.size()));
    }
  } else {
    for (int32_t i = 0; i < c.num_classes; ++i) {
      c.labels.push_back(std::to_string(i));
    }
  }
  MOH_ASSIGN_OR_RETURN(c.vae, r.String("vae", ""));
  MOH_ASSIGN_OR_RETURN(c.latent_scale,
                       r.Double("latent_scale", 1e-6, 1e6, 0.18215));
  MOH_ASSIGN_OR_RETURN(c.default_steps, r.Int("default_steps", 1, 1000, 250));
  MOH_ASSIGN_OR_RETURN(c.default_guidance,
                       r.Double("default_guidance", 1.0, 100.0, 4.0));
  return absl::OkStatus();
}

// Each block's shared heads and routed top-K (the variant's by default).
absl::Status ParseMoh(const ConfigReader& r, const DitVariant* variant,
                      DitConfig& c) {
  const bool same_depth = variant != nullptr && variant->depth == c.depth;
  std::vector<int32_t> shared_default = c.num_heads, top_k_default(c.depth, 0);
  if (same_depth) {
    shared_default = variant->shared;
    top_k_default = variant->top_k;
  }
  MOH_ASSIGN_OR_RETURN(
      std::vector<int32_t> shared,
      BlockInts(r, "moh_shared_heads", c.depth, 0, 1024, shared_default));
  MOH_ASSIGN_OR_RETURN(
      std::vector<int32_t> top_k,
      BlockInts(r, "moh_routed_top_k", c.depth, 0, 1024, top_k_default));
  c.moh.router = RouterKind::kLearned;
  for (int32_t l = 0; l < c.depth; ++l) {
    const std::string at = absl::StrCat("[", l, "]");
    const int32_t heads = c.num_heads[l];
    if (shared[l] > heads) {
      return r.Error(
          "moh_shared_heads" + at,
          absl::StrCat("must be in [0, ", heads, "], got ", shared[l]));
    }
    const int32_t routed = heads - shared[l];
    if (top_k[l] > routed || (top_k[l] == 0) != (routed == 0)) {
      return r.Error(
          "moh_routed_top_k" + at,
          routed == 0
              ? absl::StrCat("must be 0 when every head is shared, got ",
                             top_k[l])
              : absl::StrCat("must be in [1, ", routed, "] (heads ", heads,
                             " - shared ", shared[l], "), got ", top_k[l]));
    }
    c.moh.layers.push_back({heads, shared[l], top_k[l]});
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DitConfig> ParseDit(const ConfigReader& r) {
  DitConfig c;
  MOH_ASSIGN_OR_RETURN(const DitVariant* variant, FindVariant(r, c));
  MOH_RETURN_IF_ERROR(ParseShape(r, variant, c));
  MOH_RETURN_IF_ERROR(ParseHeadDims(r, variant, c));
  MOH_RETURN_IF_ERROR(ParseClassesAndSampling(r, c));
  MOH_RETURN_IF_ERROR(ParseMoh(r, variant, c));
  return c;
}

}  // namespace config_json

const std::vector<std::string>& DitVariantNames() {
  static const auto* names = [] {
    auto* v = new std::vector<std::string>;
    for (const config_json::DitVariant& d : config_json::DitVariants()) {
      v->push_back(d.name);
    }
    return v;
  }();
  return *names;
}

namespace config_json {}  // namespace config_json
}  // namespace moh
