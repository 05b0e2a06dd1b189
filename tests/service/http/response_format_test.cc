#include "service/http/response_format.h"

#include <string>

#include "base/field_error.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "service/http/openai_api.h"

namespace moh {
namespace openai {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

absl::StatusOr<ResponseFormat> Read(const json& body) {
  GenerateCall call;
  absl::Status status = ReadResponseFormat(body, body.dump(), &call);
  if (!status.ok()) return status;
  return call.response_format;
}

TEST(ResponseFormatTest, TextNullAndAbsentAreFreeText) {
  for (const json& body : {json::object(), json{{"response_format", nullptr}},
                           json{{"response_format", {{"type", "text"}}}}}) {
    auto format = Read(body);
    ASSERT_TRUE(format.ok()) << format.status();
    EXPECT_EQ(format->type, ResponseFormat::Type::kText);
  }
}

TEST(ResponseFormatTest, JsonObjectAndJsonSchema) {
  auto object = Read({{"response_format", {{"type", "json_object"}}}});
  ASSERT_TRUE(object.ok());
  EXPECT_EQ(object->type, ResponseFormat::Type::kJsonObject);
  const json schema = {{"type", "object"},
                       {"properties", {{"a", {{"type", "integer"}}}}}};
  auto with_schema =
      Read({{"response_format",
             {{"type", "json_schema"},
              {"json_schema",
               {{"name", "thing"}, {"schema", schema}, {"strict", true}}}}}});
  ASSERT_TRUE(with_schema.ok()) << with_schema.status();
  EXPECT_EQ(with_schema->type, ResponseFormat::Type::kJsonSchema);
  EXPECT_EQ(json::parse(with_schema->schema), schema);
}

TEST(ResponseFormatTest, TheSchemaKeepsTheClientsOrder) {
  const std::string raw =
      R"({"response_format": {"type": "json_schema", "json_schema": )"
      R"({"schema": {"type": "object", "properties": )"
      R"({"zeta": {"type": "integer"}, "alpha": {"type": "string"}}}}}})";
  GenerateCall call;
  ASSERT_TRUE(ReadResponseFormat(json::parse(raw), raw, &call).ok());
  const std::string& schema = call.response_format.schema;
  EXPECT_LT(schema.find("zeta"), schema.find("alpha")) << schema;
  EXPECT_LT(schema.find("\"type\""), schema.find("properties")) << schema;
}

TEST(ResponseFormatTest, MalformedFormsNameTheirField) {
  const struct {
    json format;
    const char* field;
  } cases[] = {
      {"json", "response_format"},
      {json{{"type", "yaml"}}, "response_format.type"},
      {json::object(), "response_format.type"},
      {json{{"type", "json_schema"}}, "response_format.json_schema"},
      {json{{"type", "json_schema"}, {"json_schema", {{"name", "x"}}}},
       "response_format.json_schema.schema"},
      {json{{"type", "json_schema"}, {"json_schema", {{"schema", "{}"}}}},
       "response_format.json_schema.schema"},
      {json{{"type", "json_schema"},
            {"json_schema", {{"schema", json::object()}, {"strict", 1}}}},
       "response_format.json_schema.strict"},
      {json{{"type", "json_schema"},
            {"json_schema", {{"schema", json::object()}, {"extra", 1}}}},
       "response_format.json_schema"},
  };
  for (const auto& c : cases) {
    auto format = Read({{"response_format", c.format}});
    ASSERT_FALSE(format.ok()) << c.format;
    EXPECT_EQ(format.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(ErrorField(format.status()), c.field) << c.format;
  }
}

TEST(ResponseFormatTest, BothEndpointsTakeIt) {
  for (Endpoint endpoint :
       {Endpoint::kCompletions, Endpoint::kChatCompletions}) {
    json body = {{"response_format", {{"type", "json_object"}}}};
    if (endpoint == Endpoint::kCompletions) {
      body["prompt"] = "hi";
    } else {
      body["messages"] = {{{"role", "user"}, {"content", "hi"}}};
    }
    auto request = ParseGenerationRequest(endpoint, body.dump());
    ASSERT_TRUE(request.ok()) << request.status();
    EXPECT_EQ(request->call.response_format.type,
              ResponseFormat::Type::kJsonObject);
  }
  auto bad = ParseGenerationRequest(
      Endpoint::kCompletions,
      R"({"prompt": "hi", "response_format": {"type": "xml"}})");
  EXPECT_THAT(bad.status().message(), HasSubstr("response_format.type"));
}

}  // namespace
}  // namespace openai
}  // namespace moh
