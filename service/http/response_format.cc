#include "service/http/response_format.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "base/abbreviate.h"
#include "base/field_error.h"
#include "nlohmann/json.hpp"

namespace moh {
namespace openai {
namespace {

using nlohmann::json;

absl::Status ReadJsonSchema(const json& format, absl::string_view raw_body,
                            ResponseFormat* out) {
  const auto it = format.find("json_schema");
  if (it == format.end() || !it->is_object()) {
    return FieldError("response_format.json_schema",
                      "must be an object with the schema under \"schema\"");
  }
  const json& spec = *it;
  for (const auto& [key, value] : spec.items()) {
    if (key == "name" || key == "description") {
      if (!value.is_string() && !value.is_null()) {
        return FieldError(
            absl::StrCat("response_format.json_schema.", key),
            absl::StrCat("must be a string, got ", value.type_name()));
      }
    } else if (key == "strict") {
      if (!value.is_boolean() && !value.is_null()) {
        return FieldError(
            "response_format.json_schema.strict",
            absl::StrCat("must be a boolean, got ", value.type_name()));
      }
    } else if (key != "schema") {
      return FieldError(
          "response_format.json_schema",
          absl::StrCat("has no field \"", Abbreviate(key),
                       "\" (fields: name, description, schema, strict)"));
    }
  }
  const auto schema = spec.find("schema");
  if (schema == spec.end() || !schema->is_object()) {
    return FieldError(
        ResponseFormat::kSchemaField,
        absl::StrCat("must be a JSON schema object, got ",
                     schema == spec.end() ? "nothing" : schema->type_name()));
  }
  out->type = ResponseFormat::Type::kJsonSchema;
  // `json` sorts keys; the schema's text keeps the client's order.
  const nlohmann::ordered_json ordered =
      nlohmann::ordered_json::parse(raw_body, nullptr, false);
  out->schema = ordered.is_object()
                    ? ordered["response_format"]["json_schema"]["schema"].dump()
                    : schema->dump();
  return absl::OkStatus();
}

}  // namespace

absl::Status ReadResponseFormat(const json& body, absl::string_view raw_body,
                                GenerateCall* call) {
  const auto it = body.find("response_format");
  if (it == body.end() || it->is_null()) return absl::OkStatus();
  const json& format = *it;
  if (!format.is_object()) {
    return FieldError("response_format",
                      absl::StrCat("must be an object such as "
                                   "{\"type\": \"json_object\"}, got ",
                                   format.type_name()));
  }
  const auto type = format.find("type");
  if (type == format.end() || !type->is_string()) {
    return FieldError("response_format.type",
                      "must be \"text\", \"json_object\" or \"json_schema\"");
  }
  const std::string name = type->get<std::string>();
  if (name == "text") return absl::OkStatus();
  if (name == "json_object") {
    call->response_format.type = ResponseFormat::Type::kJsonObject;
    return absl::OkStatus();
  }
  if (name == "json_schema") {
    return ReadJsonSchema(format, raw_body, &call->response_format);
  }
  return FieldError("response_format.type",
                    absl::StrCat("must be \"text\", \"json_object\" or "
                                 "\"json_schema\", got \"",
                                 Abbreviate(name), "\""));
}

}  // namespace openai
}  // namespace moh
