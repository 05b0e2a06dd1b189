#include "model/core/model_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/enum_names.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"

namespace moh {
namespace {

using nlohmann::json;

// Field readers: every error names the file, the field and what is allowed.
class ConfigReader {
 public:
  ConfigReader(const json& j, const std::string& source)
      : j_(j), source_(source) {}

  bool Has(const char* field) const {
    return j_.contains(field) && !j_[field].is_null();
  }

  absl::Status Error(const std::string& field, const std::string& what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(source_, ": field '", field, "' ", what));
  }

  absl::StatusOr<int32_t> Int(const char* field, int64_t lo, int64_t hi,
                              std::optional<int32_t> fallback) const {
    if (!Has(field)) {
      if (fallback) return *fallback;
      return Error(field, "is required");
    }
    return IntValue(j_[field], field, lo, hi);
  }

  absl::StatusOr<int32_t> IntValue(const json& v, const std::string& field,
                                   int64_t lo, int64_t hi) const {
    if (!v.is_number_integer()) return Error(field, "must be an integer");
    int64_t x = v.get<int64_t>();
    if (x < lo || x > hi) {
      return Error(field,
                   absl::StrCat("must be in [", lo, ", ", hi, "], got ", x));
    }
    return static_cast<int32_t>(x);
  }

  absl::StatusOr<double> Double(const char* field, double lo, double hi,
                                double fallback) const {
    if (!Has(field)) return fallback;
    if (!j_[field].is_number()) return Error(field, "must be a number");
    double x = j_[field].get<double>();
    if (!(x >= lo && x <= hi)) {
      return Error(field,
                   absl::StrCat("must be in [", lo, ", ", hi, "], got ", x));
    }
    return x;
  }

  absl::StatusOr<bool> Bool(const char* field, bool fallback) const {
    if (!Has(field)) return fallback;
    if (!j_[field].is_boolean()) return Error(field, "must be true or false");
    return j_[field].get<bool>();
  }

  absl::StatusOr<std::string> String(const char* field,
                                     const std::string& fallback) const {
    if (!Has(field)) return fallback;
    if (!j_[field].is_string()) return Error(field, "must be a string");
    return j_[field].get<std::string>();
  }

  // An int, or a list with one int per layer; each value in [lo, hi(layer)].
  absl::StatusOr<std::vector<int32_t>> PerLayerInt(const char* field,
                                                   int32_t num_layers,
                                                   int64_t lo,
                                                   int64_t hi) const {
    const json& v = j_[field];
    std::vector<int32_t> out;
    if (v.is_array()) {
      if (static_cast<int32_t>(v.size()) != num_layers) {
        return Error(field, absl::StrCat("has ", v.size(),
                                         " entries, expected one per layer (",
                                         num_layers, ")"));
      }
      for (size_t i = 0; i < v.size(); ++i) {
        MOH_ASSIGN_OR_RETURN(
            int32_t x,
            IntValue(v[i], absl::StrCat(field, "[", i, "]"), lo, hi));
        out.push_back(x);
      }
      return out;
    }
    MOH_ASSIGN_OR_RETURN(int32_t x, IntValue(v, field, lo, hi));
    out.assign(num_layers, x);
    return out;
  }

  const json& raw() const { return j_; }
  const std::string& source() const { return source_; }

 private:
  const json& j_;
  const std::string& source_;
};

// True for the released MoH-LLaMA3-8B config: it names its own modeling code.
bool NamesMohModelingCode(const json& j) {
  if (!j.contains("auto_map") || !j["auto_map"].is_object()) return false;
  for (const auto& [key, value] : j["auto_map"].items()) {
    if (value.is_string() &&
        value.get<std::string>().find("modeling_llama") != std::string::npos) {
      return true;
    }
  }
  return false;
}

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

absl::StatusOr<LlamaConfig> ParseLlama(const ConfigReader& r) {
  LlamaConfig c;
  constexpr int64_t kMaxDim = 1 << 20;
  MOH_ASSIGN_OR_RETURN(c.vocab_size, r.Int("vocab_size", 1, 1 << 24, {}));
  MOH_ASSIGN_OR_RETURN(c.hidden_size, r.Int("hidden_size", 1, kMaxDim, {}));
  MOH_ASSIGN_OR_RETURN(c.intermediate_size,
                       r.Int("intermediate_size", 1, kMaxDim, {}));
  MOH_ASSIGN_OR_RETURN(c.num_layers, r.Int("num_hidden_layers", 1, 1024, {}));
  MOH_ASSIGN_OR_RETURN(c.num_heads,
                       r.Int("num_attention_heads", 1, c.hidden_size, {}));
  MOH_ASSIGN_OR_RETURN(c.num_kv_heads, r.Int("num_key_value_heads", 1,
                                             c.num_heads, c.num_heads));
  if (c.num_heads % c.num_kv_heads != 0) {
    return r.Error("num_key_value_heads",
                   absl::StrCat("must divide num_attention_heads (",
                                c.num_heads, "), got ", c.num_kv_heads));
  }
  if (!r.Has("head_dim") && c.hidden_size % c.num_heads != 0) {
    return r.Error("num_attention_heads",
                   absl::StrCat("must divide hidden_size (", c.hidden_size,
                                "), got ", c.num_heads));
  }
  MOH_ASSIGN_OR_RETURN(
      c.head_dim, r.Int("head_dim", 2, kMaxDim, c.hidden_size / c.num_heads));
  if (c.head_dim % 2 != 0) {
    return r.Error("head_dim",
                   absl::StrCat("must be even for RoPE, got ", c.head_dim));
  }
  MOH_ASSIGN_OR_RETURN(c.rms_norm_eps, r.Double("rms_norm_eps", 0, 1, 1e-6));
  MOH_ASSIGN_OR_RETURN(c.rope_theta, r.Double("rope_theta", 1, 1e12, 10000.0));
  MOH_ASSIGN_OR_RETURN(c.max_position_embeddings,
                       r.Int("max_position_embeddings", 1, 1 << 24, 2048));
  // The RoPE tables (cos and sin, float32) are sized from these two fields
  // alone, with no weights to back them: bounded before anything allocates.
  constexpr int64_t kMaxRopeTableBytes = int64_t{1} << 31;
  const int64_t rope_bytes =
      int64_t{c.max_position_embeddings} * c.head_dim * 4 * 2;
  if (rope_bytes > kMaxRopeTableBytes) {
    return r.Error("max_position_embeddings",
                   absl::StrCat("x head_dim (", c.max_position_embeddings,
                                " x ", c.head_dim, ") needs ", rope_bytes >> 20,
                                " MiB of RoPE tables; at most ",
                                kMaxRopeTableBytes >> 20, " MiB"));
  }
  MOH_ASSIGN_OR_RETURN(c.tie_word_embeddings,
                       r.Bool("tie_word_embeddings", false));
  MOH_ASSIGN_OR_RETURN(c.attention_bias, r.Bool("attention_bias", false));
  MOH_ASSIGN_OR_RETURN(c.torch_dtype, r.String("torch_dtype", ""));
  MOH_ASSIGN_OR_RETURN(std::string act, r.String("hidden_act", "silu"));
  if (act != "silu") {
    return r.Error("hidden_act",
                   absl::StrCat("must be \"silu\", got \"", act, "\""));
  }
  if (r.Has("rope_scaling")) {
    return r.Error("rope_scaling", "is not supported yet (must be null)");
  }
  if (r.Has("bos_token_id")) {
    MOH_ASSIGN_OR_RETURN(c.bos_token_id,
                         r.Int("bos_token_id", 0, c.vocab_size - 1, {}));
  }
  if (r.Has("eos_token_id")) {
    const json& eos = r.raw()["eos_token_id"];
    if (eos.is_array()) {
      for (size_t i = 0; i < eos.size(); ++i) {
        MOH_ASSIGN_OR_RETURN(
            int32_t id,
            r.IntValue(eos[i], absl::StrCat("eos_token_id[", i, "]"), 0,
                       c.vocab_size - 1));
        c.eos_token_ids.push_back(id);
      }
    } else {
      MOH_ASSIGN_OR_RETURN(int32_t id,
                           r.Int("eos_token_id", 0, c.vocab_size - 1, {}));
      c.eos_token_ids.push_back(id);
    }
  }
  const RouterKind released = NamesMohModelingCode(r.raw())
                                  ? RouterKind::kQueryNorm
                                  : RouterKind::kDense;
  MOH_ASSIGN_OR_RETURN(c.moh, ParseMoh(r, c.num_layers, c.num_heads, released));
  return c;
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
  MOH_ASSIGN_OR_RETURN(c.labels, Labels(r));
  MOH_ASSIGN_OR_RETURN(c.image_mean,
                       FloatList(r, "image_mean", c.num_channels, 0.5f));
  MOH_ASSIGN_OR_RETURN(c.image_std,
                       FloatList(r, "image_std", c.num_channels, 0.5f));
  for (float s : c.image_std) {
    if (!(s > 0)) return r.Error("image_std", "values must be > 0");
  }
  MOH_ASSIGN_OR_RETURN(
      c.moh, ParseMoh(r, c.num_layers, c.num_heads, RouterKind::kDense));
  if (c.moh.router == RouterKind::kQueryNorm) {
    return r.Error("moh_router",
                   "must be \"learned\" or \"dense\" for moh_vit");
  }
  return c;
}

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

absl::StatusOr<TransNextConfig> ParseTransNext(const ConfigReader& r) {
  TransNextConfig c;
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
  // A variant's value of `field`; nothing (so required) without a variant.
  auto from_variant = [&](auto field) -> std::optional<std::vector<int32_t>> {
    if (variant == nullptr) return std::nullopt;
    return std::vector<int32_t>(variant->*field, variant->*field + kStages);
  };
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
  MOH_ASSIGN_OR_RETURN(std::vector<int32_t> dims,
                       StageInts(r, "embed_dims", 1, 1 << 14,
                                 from_variant(&TransNextVariant::dims)));
  MOH_ASSIGN_OR_RETURN(std::vector<int32_t> heads,
                       StageInts(r, "num_heads", 1, 1024,
                                 from_variant(&TransNextVariant::heads)));
  MOH_ASSIGN_OR_RETURN(
      std::vector<int32_t> depths,
      StageInts(r, "depths", 1, 256, from_variant(&TransNextVariant::depths)));
  MOH_ASSIGN_OR_RETURN(
      std::vector<int32_t> sr,
      StageInts(r, "sr_ratios", 1, 64, std::vector<int32_t>{8, 4, 2, 1}));
  std::vector<double> mlp(4, 4.0);
  if (variant != nullptr) mlp.assign(variant->mlp, variant->mlp + 4);
  if (r.Has("mlp_ratios")) {
    MOH_ASSIGN_OR_RETURN(std::vector<float> m,
                         FloatList(r, "mlp_ratios", kStages, 4.0f));
    mlp.assign(m.begin(), m.end());
  }
  std::vector<int32_t> shared_default = heads, top_k_default(4, 0);
  if (variant != nullptr) {
    shared_default.assign(variant->shared, variant->shared + 4);
    top_k_default.assign(variant->top_k, variant->top_k + 4);
  }
  MOH_ASSIGN_OR_RETURN(
      std::vector<int32_t> shared,
      StageInts(r, "moh_shared_heads", 0, 1024, shared_default));
  MOH_ASSIGN_OR_RETURN(
      std::vector<int32_t> top_k,
      StageInts(r, "moh_routed_top_k", 0, 1024, top_k_default));
  c.moh.router = RouterKind::kLearned;
  for (int s = 0; s < kStages; ++s) {
    TransNextStage stage;
    stage.embed_dim = dims[s];
    stage.num_heads = heads[s];
    stage.depth = depths[s];
    stage.sr_ratio = sr[s];
    stage.mlp_ratio = mlp[s];
    stage.shared_heads = shared[s];
    stage.top_k = top_k[s];
    const std::string at = absl::StrCat("[", s, "]");
    if (dims[s] % heads[s] != 0) {
      return r.Error("num_heads" + at,
                     absl::StrCat("must divide embed_dims", at, " (", dims[s],
                                  "), got ", heads[s]));
    }
    if (!(mlp[s] > 0 && mlp[s] <= 64)) {
      return r.Error("mlp_ratios" + at,
                     absl::StrCat("must be in (0, 64], got ", mlp[s]));
    }
    if (stage.glu_hidden() < 1) {
      return r.Error("mlp_ratios" + at,
                     "gives no hidden units (int(2 * int(dim * ratio) / 3))");
    }
    const bool last = s == kStages - 1;
    if (last != (sr[s] == 1)) {
      return r.Error("sr_ratios" + at,
                     last ? "must be 1 (the last stage uses full attention)"
                          : "must be > 1 (stages 1-3 use aggregated "
                            "attention)");
    }
    if (!last && c.resolution(s) < sr[s]) {
      return r.Error("sr_ratios" + at,
                     absl::StrCat("must be at most the stage's resolution (",
                                  c.resolution(s), "), got ", sr[s]));
    }
    if (shared[s] > heads[s]) {
      return r.Error(
          "moh_shared_heads" + at,
          absl::StrCat("must be in [0, ", heads[s], "], got ", shared[s]));
    }
    const int32_t routed = heads[s] - shared[s];
    if (top_k[s] > routed || (top_k[s] == 0) != (routed == 0)) {
      return r.Error(
          "moh_routed_top_k" + at,
          routed == 0
              ? absl::StrCat("must be 0 when every head is shared, got ",
                             top_k[s])
              : absl::StrCat("must be in [1, ", routed, "] (heads ", heads[s],
                             " - shared ", shared[s], "), got ", top_k[s]));
    }
    if (routed == 0 && shared[s] == 1) {
      // The official attention re-weights with wg_1, which needs S > 1.
      return r.Error("moh_shared_heads" + at,
                     "must be > 1 when the stage routes no heads");
    }
    for (int32_t b = 0; b < depths[s]; ++b) {
      c.moh.layers.push_back({heads[s], shared[s], top_k[s], s, b});
    }
    c.stages.push_back(stage);
  }
  if (c.pretrain_size / 32 < 2) {
    return r.Error("pretrain_size", "must be at least 64");
  }
  MOH_ASSIGN_OR_RETURN(c.labels, Labels(r));
  MOH_ASSIGN_OR_RETURN(c.image_mean,
                       FloatList(r, "image_mean", c.num_channels, 0.5f));
  MOH_ASSIGN_OR_RETURN(c.image_std,
                       FloatList(r, "image_std", c.num_channels, 0.5f));
  for (float s : c.image_std) {
    if (!(s > 0)) return r.Error("image_std", "values must be > 0");
  }
  return c;
}

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

absl::StatusOr<DitConfig> ParseDit(const ConfigReader& r) {
  DitConfig c;
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
  return c;
}

}  // namespace

const std::vector<std::string>& DitVariantNames() {
  static const auto* names = [] {
    auto* v = new std::vector<std::string>;
    for (const DitVariant& d : DitVariants()) v->push_back(d.name);
    return v;
  }();
  return *names;
}

const std::vector<std::string>& TransNextVariantNames() {
  static const auto* names = [] {
    auto* v = new std::vector<std::string>;
    for (const TransNextVariant& t : kTransNextVariants) v->push_back(t.name);
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

const char* RouterKindName(RouterKind kind) {
  static constexpr const char* kNames[] = {"dense", "learned", "query_norm"};
  return EnumName(kind, kNames);
}

int32_t MohLayerConfig::TopKForRatio(float ratio) const {
  const int32_t routed = routed_heads();
  if (routed == 0) return 0;
  if (!(ratio > 0)) return top_k;
  const int64_t heads = static_cast<int64_t>(
      std::floor(static_cast<double>(ratio) * num_heads + 0.5));
  return static_cast<int32_t>(
      std::clamp<int64_t>(heads - shared_heads, 0, routed));
}

double MohConfig::DefaultRatio() const {
  int64_t used = 0, total = 0;
  for (const MohLayerConfig& l : layers) {
    used += l.shared_heads + l.top_k;
    total += l.num_heads;
  }
  return total == 0 ? 1.0 : static_cast<double>(used) / total;
}

double MohConfig::MinRatio() const {
  int64_t used = 0, total = 0;
  for (const MohLayerConfig& l : layers) {
    used += l.routed_heads() == 0 ? l.num_heads : l.shared_heads;
    total += l.num_heads;
  }
  return total == 0 ? 1.0 : static_cast<double>(used) / total;
}

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text,
                                             const std::string& source) {
  json j = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not valid JSON"));
  }
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": must be a JSON object"));
  }
  ConfigReader r(j, source);
  MOH_ASSIGN_OR_RETURN(std::string model_type, r.String("model_type", ""));
  bool llama_arch = false;
  if (j.contains("architectures") && j["architectures"].is_array()) {
    for (const json& a : j["architectures"]) {
      if (a.is_string() && a.get<std::string>() == "LlamaForCausalLM") {
        llama_arch = true;
      }
    }
  }
  ModelConfig config;
  if (model_type == "moh_vit") {
    config.family = ModelFamily::kVit;
    MOH_ASSIGN_OR_RETURN(config.vit, ParseVit(r));
  } else if (model_type == "moh_dit") {
    config.family = ModelFamily::kDit;
    MOH_ASSIGN_OR_RETURN(config.dit, ParseDit(r));
  } else if (model_type == "moh_transnext") {
    config.family = ModelFamily::kTransNext;
    MOH_ASSIGN_OR_RETURN(config.transnext, ParseTransNext(r));
  } else if (model_type == "llama" || llama_arch) {
    config.family = ModelFamily::kLlama;
    MOH_ASSIGN_OR_RETURN(config.llama, ParseLlama(r));
  } else {
    return r.Error("model_type",
                   absl::StrCat("must be \"llama\" (or architectures "
                                "[\"LlamaForCausalLM\"]), \"moh_vit\", "
                                "\"moh_transnext\" or \"moh_dit\", got \"",
                                model_type, "\""));
  }
  return config;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir,
                                            ModelFamily family) {
  MOH_ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));
  if (config.family != family) {
    static constexpr const char* kTypes[] = {"llama", "moh_vit",
                                             "moh_transnext", "moh_dit"};
    return absl::InvalidArgumentError(absl::StrCat(
        dir, "/config.json: not a ", EnumName(family, kTypes), " model"));
  }
  return config;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  return ParseModelConfig(buffer.str(), path);
}

}  // namespace moh
