// Reading a model's config.json (model_config.h): the field readers every
// family's parser uses, and the parsers, one file each (llama_config.cc,
// vit_config.cc, transnext_config.cc, dit_config.cc). Internal to
// model_config.cc's ParseModelConfig.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/core/model_config.h"
#include "nlohmann/json.hpp"

namespace moh {
namespace config_json {

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

// The MoH fields of a model with `num_layers` layers of `num_heads` heads
// (router kind `released` when the file does not say).
absl::StatusOr<MohConfig> ParseMoh(const ConfigReader& r, int32_t num_layers,
                                   int32_t num_heads, RouterKind released);
// A list of `size` numbers, or `size` copies of `fallback` when absent.
absl::StatusOr<std::vector<float>> FloatList(const ConfigReader& r,
                                             const char* field, size_t size,
                                             float fallback);
// `labels`: a non-empty list of class names.
absl::StatusOr<std::vector<std::string>> Labels(const ConfigReader& r);
// What an image classifier shares: its labels and the normalization of its
// `channels` input channels (image_mean, image_std > 0; 0.5 when absent).
absl::Status ReadClassifierInput(const ConfigReader& r, int32_t channels,
                                 std::vector<std::string>* labels,
                                 std::vector<float>* mean,
                                 std::vector<float>* std);

// quantization_config: the layout of a pre-quantized int8 checkpoint, or
// kNone when the field is absent (quantization_config.cc).
absl::StatusOr<PrequantizedLayout> ParseQuantization(const ConfigReader& r);

// The families' parsers.
absl::StatusOr<LlamaConfig> ParseLlama(const ConfigReader& r);
absl::StatusOr<VitConfig> ParseVit(const ConfigReader& r);
absl::StatusOr<TransNextConfig> ParseTransNext(const ConfigReader& r);
absl::StatusOr<DitConfig> ParseDit(const ConfigReader& r);

}  // namespace config_json
}  // namespace moh
