#include "model/core/config/config_reader.h"

// MoH-LLaMA3 (and LLaMA) config.json, as Hugging Face writes it.
namespace moh {
namespace config_json {

namespace {

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

}  // namespace

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
  MOH_ASSIGN_OR_RETURN(c.prequantized, ParseQuantization(r));
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

}  // namespace config_json
}  // namespace moh
