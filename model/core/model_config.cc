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
  if (!r.Has("labels") || !r.raw()["labels"].is_array() ||
      r.raw()["labels"].empty()) {
    return r.Error("labels", "must be a non-empty list of class names");
  }
  for (const json& l : r.raw()["labels"]) {
    if (!l.is_string()) return r.Error("labels", "must contain strings");
    c.labels.push_back(l.get<std::string>());
  }
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

}  // namespace

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
  } else if (model_type == "llama" || llama_arch) {
    config.family = ModelFamily::kLlama;
    MOH_ASSIGN_OR_RETURN(config.llama, ParseLlama(r));
  } else {
    return r.Error(
        "model_type",
        absl::StrCat("must be \"llama\" (or architectures "
                     "[\"LlamaForCausalLM\"]) or \"moh_vit\", got \"",
                     model_type, "\""));
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
