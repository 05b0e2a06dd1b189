#include "base/abbreviate.h"
#include "model/core/config/config_reader.h"

// config.json's quantization_config, as Hugging Face tools write it for a
// pre-quantized checkpoint: the int8 layouts LlamaModel reads (int8 values
// and a float scale per output row, model_config.h's PrequantizedLayout).
// Everything else (4-bit, float8, GPTQ/AWQ packing, zero points) is refused
// naming the field and what is supported.
namespace moh {
namespace config_json {

namespace {

constexpr char kField[] = "quantization_config";

// obj[key] as a string at `field`, or the error naming it.
absl::StatusOr<std::string> StringAt(const ConfigReader& r, const json& obj,
                                     const std::string& field,
                                     const char* key) {
  if (!obj.contains(key) || !obj[key].is_string()) {
    return r.Error(field, "must be a string");
  }
  return obj[key].get<std::string>();
}

// Whether obj[key] equals `want` (a missing key equals `missing`).
bool ValueIs(const json& obj, const char* key, const json& want,
             const json& missing) {
  if (!obj.contains(key) || obj[key].is_null()) return missing == want;
  return obj[key] == want;
}

// compressed-tensors' weights in every config group: 8-bit integers,
// symmetric, one scale per output channel (or one for the tensor).
absl::Status CheckCompressedTensors(const ConfigReader& r, const json& q) {
  const std::string prefix = absl::StrCat(kField, ".");
  MOH_ASSIGN_OR_RETURN(std::string format,
                       StringAt(r, q, prefix + "format", "format"));
  if (format != "int-quantized") {
    return r.Error(
        prefix + "format",
        absl::StrCat("must be \"int-quantized\" (int8 values; ",
                     "packed, float8 and sparse formats are not ",
                     "supported), got \"", Abbreviate(format), "\""));
  }
  const std::string groups_field = prefix + "config_groups";
  if (!q.contains("config_groups") || !q["config_groups"].is_object() ||
      q["config_groups"].empty()) {
    return r.Error(groups_field, "must be a non-empty object");
  }
  for (const auto& [name, group] : q["config_groups"].items()) {
    const std::string weights_field =
        absl::StrCat(groups_field, ".", name, ".weights");
    if (!group.is_object() || !group.contains("weights") ||
        !group["weights"].is_object()) {
      return r.Error(weights_field, "must be an object");
    }
    const json& w = group["weights"];
    if (!ValueIs(w, "num_bits", 8, nullptr)) {
      return r.Error(
          weights_field + ".num_bits",
          absl::StrCat("must be 8, got ",
                       Abbreviate(w.value("num_bits", json()).dump())));
    }
    if (!ValueIs(w, "type", "int", "int")) {
      return r.Error(
          weights_field + ".type",
          absl::StrCat("must be \"int\", got ", Abbreviate(w["type"].dump())));
    }
    if (!ValueIs(w, "symmetric", true, true)) {
      return r.Error(weights_field + ".symmetric",
                     "must be true (zero points are not supported)");
    }
    if (!ValueIs(w, "strategy", "channel", nullptr) &&
        !ValueIs(w, "strategy", "tensor", nullptr)) {
      return r.Error(
          weights_field + ".strategy",
          absl::StrCat("must be \"channel\" or \"tensor\" (a scale per ",
                       "output row or one per matrix), got ",
                       Abbreviate(w.value("strategy", json()).dump())));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PrequantizedLayout> ParseQuantization(const ConfigReader& r) {
  if (!r.Has(kField)) return PrequantizedLayout::kNone;
  const json& q = r.raw()[kField];
  if (!q.is_object()) return r.Error(kField, "must be an object");
  const std::string method_field = absl::StrCat(kField, ".quant_method");
  MOH_ASSIGN_OR_RETURN(std::string method,
                       StringAt(r, q, method_field, "quant_method"));
  if (method == "compressed-tensors") {
    MOH_RETURN_IF_ERROR(CheckCompressedTensors(r, q));
    return PrequantizedLayout::kCompressedTensors;
  }
  if (method == "bitsandbytes") {
    if (!ValueIs(q, "load_in_8bit", true, false) ||
        ValueIs(q, "load_in_4bit", true, false)) {
      return r.Error(absl::StrCat(kField, ".load_in_8bit"),
                     "must be true, and load_in_4bit false (only 8-bit "
                     "bitsandbytes checkpoints are supported)");
    }
    return PrequantizedLayout::kBitsandbytes;
  }
  return r.Error(method_field,
                 absl::StrCat("must be \"compressed-tensors\" (int8, a scale ",
                              "per output channel) or \"bitsandbytes\" ",
                              "(8-bit), got \"", Abbreviate(method), "\""));
}

}  // namespace config_json
}  // namespace moh
