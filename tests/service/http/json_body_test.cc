#include "service/http/json_body.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/field_error.h"

namespace moh {
namespace json_body {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

std::string Message(const absl::Status& status) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  return std::string(status.message());
}

TEST(JsonBodyTest, ReadObjectTakesKnownFieldsOnly) {
  EXPECT_TRUE(ReadObject(R"({"a": 1, "b": null})", {"a", "b"}).ok());
  EXPECT_THAT(Message(ReadObject("{", {"a"}).status()),
              HasSubstr("the body must be JSON"));
  EXPECT_THAT(Message(ReadObject("[1]", {"a"}).status()),
              HasSubstr("the body must be a JSON object"));
  const absl::Status unknown = ReadObject(R"({"c": 1})", {"a", "b"}).status();
  EXPECT_THAT(
      Message(unknown),
      HasSubstr("\"c\" is not a field of this endpoint (fields: a, b)"));
  EXPECT_FALSE(ErrorField(unknown).has_value());  // about no one field
}

TEST(JsonBodyTest, FieldsAreReadByTypeAndRange) {
  const json body = json::parse(
      R"({"x": 0.5, "n": 3, "big": 18446744073709551615, "b": true,
          "s": "hi", "nil": null, "str": "1"})");
  const Fields f(body);
  EXPECT_EQ(f.Get("nil"), nullptr);
  EXPECT_EQ(*f.Number("x", 0, 1).value(), 0.5);
  EXPECT_FALSE(f.Number("nil", 0, 1).value().has_value());
  EXPECT_THAT(Message(f.Number("x", 0.5, 1, /*lo_open=*/true).status()),
              HasSubstr("x must be in (0.5, 1], got 0.5"));
  EXPECT_THAT(Message(f.Number("str", 0, 1).status()),
              HasSubstr("str must be a number, got string"));
  EXPECT_EQ(*f.Integer("n", 1, 3).value(), 3);
  EXPECT_THAT(Message(f.Integer("n", 4, 5).status()),
              HasSubstr("n must be in [4, 5], got 3"));
  EXPECT_THAT(Message(f.Integer("big", 0, 10).status()),
              HasSubstr("big must be in [0, 10], got 18446744073709551615"));
  EXPECT_THAT(Message(f.Integer("x", 0, 10).status()),
              HasSubstr("x must be an integer, got number"));
  EXPECT_TRUE(f.Bool("b", false).value());
  EXPECT_TRUE(f.Bool("nil", true).value());
  EXPECT_THAT(Message(f.Bool("s", false).status()),
              HasSubstr("s must be true or false, got string"));
  EXPECT_EQ(f.String("s").value(), "hi");
  EXPECT_EQ(f.String("nil").value(), "");
  EXPECT_THAT(Message(f.String("n").status()),
              HasSubstr("n must be a string, got number"));
  EXPECT_EQ(ErrorField(f.String("n").status()), "n");
}

}  // namespace
}  // namespace json_body
}  // namespace moh
