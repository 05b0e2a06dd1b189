#include "model/core/config/config_reader.h"

#include <cmath>

// What the families share: the MoH fields, number lists, labels.
namespace moh {
namespace config_json {

absl::StatusOr<MohConfig> ParseMoh(const ConfigReader& r, int32_t num_layers,
                                   int32_t num_heads,
                                   RouterKind released_default) {
  MohConfig moh;
  const bool has_fields = r.Has("moh_router") || r.Has("moh_shared_heads") ||
                          r.Has("moh_routed_top_k");
  if (!has_fields) {
    moh.router = released_default;
  } else {
    MOH_ASSIGN_OR_RETURN(std::string router, r.String("moh_router", "learned"));
    if (router == "learned") {
      moh.router = RouterKind::kLearned;
    } else if (router == "query_norm") {
      moh.router = RouterKind::kQueryNorm;
    } else if (router == "dense" || router == "none") {
      moh.router = RouterKind::kDense;
    } else {
      return r.Error("moh_router",
                     absl::StrCat("must be \"learned\", \"query_norm\" or "
                                  "\"dense\", got \"",
                                  router, "\""));
    }
  }

  std::vector<int32_t> shared(num_layers, num_heads);
  std::vector<int32_t> top_k(num_layers, 0);
  if (moh.router == RouterKind::kQueryNorm) {
    shared.assign(num_layers, num_heads / 2);
    top_k.assign(num_layers, num_heads / 4);
  }
  if (moh.router != RouterKind::kDense) {
    if (r.Has("moh_shared_heads")) {
      MOH_ASSIGN_OR_RETURN(
          shared, r.PerLayerInt("moh_shared_heads", num_layers, 0, num_heads));
    } else if (moh.router == RouterKind::kLearned) {
      return r.Error("moh_shared_heads", "is required for moh_router learned");
    }
    if (r.Has("moh_routed_top_k")) {
      MOH_ASSIGN_OR_RETURN(
          top_k, r.PerLayerInt("moh_routed_top_k", num_layers, 0, num_heads));
    } else if (moh.router == RouterKind::kLearned) {
      return r.Error("moh_routed_top_k", "is required for moh_router learned");
    }
  }
  for (int32_t l = 0; l < num_layers; ++l) {
    MohLayerConfig layer{num_heads, shared[l], top_k[l]};
    const int32_t routed = layer.routed_heads();
    if (top_k[l] > routed) {
      return r.Error("moh_routed_top_k",
                     absl::StrCat("layer ", l, ": must be in [0, ", routed,
                                  "] (heads ", num_heads, " - shared ",
                                  shared[l], "), got ", top_k[l]));
    }
    if (top_k[l] == 0 && routed != 0) {
      return r.Error("moh_routed_top_k",
                     absl::StrCat("layer ", l,
                                  ": is 0, which requires "
                                  "moh_shared_heads == num_attention_heads (",
                                  num_heads, "), got ", shared[l]));
    }
    if (moh.router == RouterKind::kQueryNorm && routed > 0 && routed < 2) {
      return r.Error("moh_shared_heads",
                     absl::StrCat("layer ", l,
                                  ": the query-norm router needs at least 2 "
                                  "routed heads, got ",
                                  routed));
    }
    moh.layers.push_back(layer);
  }
  return moh;
}

absl::StatusOr<std::vector<float>> FloatList(const ConfigReader& r,
                                             const char* field, size_t size,
                                             float fallback) {
  if (!r.Has(field)) return std::vector<float>(size, fallback);
  const json& v = r.raw()[field];
  if (!v.is_array() || v.size() != size) {
    return r.Error(field, absl::StrCat("must be a list of ", size, " numbers"));
  }
  std::vector<float> out;
  for (const json& x : v) {
    if (!x.is_number()) {
      return r.Error(field,
                     absl::StrCat("must be a list of ", size, " numbers"));
    }
    out.push_back(x.get<float>());
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> Labels(const ConfigReader& r) {
  if (!r.Has("labels") || !r.raw()["labels"].is_array() ||
      r.raw()["labels"].empty()) {
    return r.Error("labels", "must be a non-empty list of class names");
  }
  std::vector<std::string> labels;
  for (const json& l : r.raw()["labels"]) {
    if (!l.is_string()) return r.Error("labels", "must contain strings");
    labels.push_back(l.get<std::string>());
  }
  return labels;
}

absl::Status ReadClassifierInput(const ConfigReader& r, int32_t channels,
                                 std::vector<std::string>* labels,
                                 std::vector<float>* mean,
                                 std::vector<float>* std) {
  MOH_ASSIGN_OR_RETURN(*labels, Labels(r));
  MOH_ASSIGN_OR_RETURN(*mean, FloatList(r, "image_mean", channels, 0.5f));
  MOH_ASSIGN_OR_RETURN(*std, FloatList(r, "image_std", channels, 0.5f));
  for (float s : *std) {
    if (!(s > 0)) return r.Error("image_std", "values must be > 0");
  }
  return absl::OkStatus();
}

}  // namespace config_json
}  // namespace moh
