#include "service/http/json_body.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/abbreviate.h"
#include "base/field_error.h"
#include "base/status_macros.h"

namespace moh {
namespace json_body {

using nlohmann::json;

absl::StatusOr<json> ReadObject(absl::string_view body,
                                const std::set<std::string>& known) {
  json parsed;
  try {
    parsed = json::parse(body.begin(), body.end());
  } catch (const json::exception& e) {
    // Where, and what the parser met there: "parse error at line 1, column
    // 9: syntax error while parsing value - invalid literal; last read:
    // '...'" without the client's bytes that it quotes, or "number overflow
    // parsing '1e309'"; not the library's "[json.exception...] " tag.
    std::string what = e.what();
    const size_t tag = what.find("] ");
    what = tag == std::string::npos ? "" : what.substr(tag + 2);
    what = what.substr(0, what.find("; last read"));
    return absl::InvalidArgumentError(
        absl::StrCat("the body must be JSON", what.empty() ? "" : " (",
                     Abbreviate(what, 160), what.empty() ? "" : ")"));
  }
  if (!parsed.is_object()) {
    return absl::InvalidArgumentError("the body must be a JSON object");
  }
  for (const auto& [key, value] : parsed.items()) {
    if (known.count(key) == 0) {
      // Not a field: no `param`.
      return absl::InvalidArgumentError(absl::StrCat(
          "\"", Abbreviate(key), "\" is not a field of this endpoint (fields: ",
          absl::StrJoin(known, ", "), ")"));
    }
  }
  return parsed;
}

const json* Fields::Get(const std::string& name) const {
  auto it = object_.find(name);
  if (it == object_.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::StatusOr<std::optional<double>> Fields::Number(const std::string& name,
                                                     double lo, double hi,
                                                     bool lo_open) const {
  const json* v = Get(name);
  if (v == nullptr) return std::optional<double>();
  if (!v->is_number()) {
    return FieldError(name,
                      absl::StrCat("must be a number, got ", v->type_name()));
  }
  const double x = v->get<double>();
  const bool above = lo_open ? x > lo : x >= lo;
  if (!(above && x <= hi)) {
    return FieldError(name, absl::StrCat("must be in ", lo_open ? "(" : "[", lo,
                                         ", ", hi, "], got ", x));
  }
  return std::optional<double>(x);
}

absl::StatusOr<std::optional<int64_t>> Fields::Integer(const std::string& name,
                                                       int64_t lo,
                                                       int64_t hi) const {
  const json* v = Get(name);
  if (v == nullptr) return std::optional<int64_t>();
  if (!v->is_number_integer()) {
    return FieldError(name,
                      absl::StrCat("must be an integer, got ", v->type_name()));
  }
  if (v->is_number_unsigned() &&
      v->get<uint64_t>() > static_cast<uint64_t>(hi)) {
    return FieldError(name, absl::StrCat("must be in [", lo, ", ", hi,
                                         "], got ", v->get<uint64_t>()));
  }
  const int64_t x = v->get<int64_t>();
  if (x < lo || x > hi) {
    return FieldError(name,
                      absl::StrCat("must be in [", lo, ", ", hi, "], got ", x));
  }
  return std::optional<int64_t>(x);
}

absl::StatusOr<bool> Fields::Bool(const std::string& name,
                                  bool fallback) const {
  const json* v = Get(name);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) {
    return FieldError(
        name, absl::StrCat("must be true or false, got ", v->type_name()));
  }
  return v->get<bool>();
}

absl::StatusOr<std::string> Fields::String(const std::string& name) const {
  const json* v = Get(name);
  if (v == nullptr) return std::string();
  if (!v->is_string()) {
    return FieldError(name,
                      absl::StrCat("must be a string, got ", v->type_name()));
  }
  return v->get<std::string>();
}

absl::Status ReadActivation(const Fields& f, float* ratio, float* min_ratio) {
  MOH_ASSIGN_OR_RETURN(std::optional<double> asked,
                       f.Number(kActivationFields[0], 0.0, 1.0));
  *ratio = static_cast<float>(asked.value_or(0.0));
  MOH_ASSIGN_OR_RETURN(std::optional<double> floor,
                       f.Number(kActivationFields[1], 0.0, 1.0));
  *min_ratio = static_cast<float>(floor.value_or(0.0));
  return absl::OkStatus();
}

absl::Status TypeError(const std::exception& e) {
  return absl::InvalidArgumentError(
      absl::StrCat("the body holds a value of a type this endpoint does not "
                   "take (",
                   Abbreviate(e.what(), 200), ")"));
}

}  // namespace json_body
}  // namespace moh
