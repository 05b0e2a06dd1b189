#include "model/tokenizer/tokenizer_json.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace moh {
namespace tokenizer_internal {

std::string Field(absl::string_view where, absl::string_view key) {
  return where.empty() ? std::string(key) : absl::StrCat(where, ".", key);
}

absl::Status Unsupported(absl::string_view field, absl::string_view value) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": unsupported value \"", value, "\""));
}

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

std::string Describe(const json& value) {
  if (value.is_array()) return "(an array)";
  if (value.is_object()) return "(an object)";
  return value.dump();
}

const json* Get(const json& obj, const char* key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

absl::StatusOr<bool> GetBool(const json& obj, const char* key, bool dflt,
                             absl::string_view where) {
  const json* v = Get(obj, key);
  if (v == nullptr) return dflt;
  if (!v->is_boolean()) return Invalid(Field(where, key), "must be a boolean");
  return v->get<bool>();
}

absl::StatusOr<int64_t> GetInt(const json& obj, const char* key,
                               absl::string_view where) {
  const json* v = Get(obj, key);
  if (v == nullptr || !v->is_number_integer()) {
    return Invalid(Field(where, key), "must be an integer");
  }
  return v->get<int64_t>();
}

absl::StatusOr<std::string> GetString(const json& obj, const char* key,
                                      absl::string_view where) {
  const json* v = Get(obj, key);
  if (v == nullptr || !v->is_string()) {
    return Invalid(Field(where, key), "must be a string");
  }
  return v->get<std::string>();
}

absl::Status GetPattern(const json& obj, absl::string_view where,
                        std::string* literal, std::string* regex) {
  const json* p = Get(obj, "pattern");
  if (const json* s = p ? Get(*p, "String") : nullptr; s && s->is_string()) {
    *literal = s->get<std::string>();
    if (!literal->empty()) return absl::OkStatus();
  } else if (const json* r = p ? Get(*p, "Regex") : nullptr;
             r && r->is_string() && regex != nullptr) {
    *regex = r->get<std::string>();
    return absl::OkStatus();
  }
  return Invalid(Field(where, "pattern"),
                 regex ? "must be {\"String\": non-empty} or {\"Regex\": ...}"
                       : "must be {\"String\": non-empty} (Regex unsupported)");
}

absl::StatusOr<int32_t> CheckId(int64_t id, absl::string_view field) {
  if (id < 0 || id > kMaxTokenId) {
    return Invalid(field, absl::StrCat("token id ", id, " out of range"));
  }
  return static_cast<int32_t>(id);
}

absl::Status ForEach(
    const json& obj, const char* key, const std::string& where,
    const std::function<absl::Status(const json&, const std::string&)>& load) {
  const json* list = Get(obj, key);
  if (list == nullptr || !list->is_array()) {
    return Invalid(Field(where, key), "must be an array");
  }
  for (size_t i = 0; i < list->size(); ++i) {
    MOH_RETURN_IF_ERROR(
        load((*list)[i], absl::StrCat(Field(where, key), "[", i, "]")));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> GetChar(const json& obj, const char* key,
                                    absl::string_view where) {
  MOH_ASSIGN_OR_RETURN(std::string c, GetString(obj, key, where));
  if (c.empty() || NextUtf8(c) != static_cast<int>(c.size())) {
    return Invalid(Field(where, key), "must be a single character");
  }
  return c;
}

absl::StatusOr<std::unique_ptr<Regex>> CompileAt(absl::string_view pattern,
                                                 absl::string_view field) {
  auto regex = Regex::Compile(pattern);
  if (!regex.ok()) return Invalid(field, regex.status().message());
  return regex;
}

}  // namespace tokenizer_internal
}  // namespace moh
