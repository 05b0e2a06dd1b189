// The tokenizer endpoints' JSON (service/http/tokenize_api.h): vLLM's request
// bodies into calls, with errors that name the field; results into vLLM's
// response shapes.
#include "service/http/tokenize_api.h"

#include <string>

#include "base/field_error.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moh {
namespace tokenize_api {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

TokenizeRequest TokenizeOk(const std::string& body) {
  auto parsed = ParseTokenizeRequest(body);
  EXPECT_TRUE(parsed.ok()) << body << ": " << parsed.status();
  return parsed.ok() ? *std::move(parsed) : TokenizeRequest{};
}

// The error's field (as ErrorField reads it) and message.
std::pair<std::string, std::string> TokenizeError(const std::string& body) {
  auto parsed = ParseTokenizeRequest(body);
  EXPECT_FALSE(parsed.ok()) << body;
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  return {ErrorField(parsed.status()).value_or(""),
          std::string(parsed.status().message())};
}

std::pair<std::string, std::string> DetokenizeError(const std::string& body) {
  auto parsed = ParseDetokenizeRequest(body);
  EXPECT_FALSE(parsed.ok()) << body;
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  return {ErrorField(parsed.status()).value_or(""),
          std::string(parsed.status().message())};
}

TEST(TokenizeApiTest, PromptAddsSpecialTokensByDefault) {
  const TokenizeRequest r = TokenizeOk(R"({"prompt": "héllo"})");
  EXPECT_EQ(r.model, "");
  EXPECT_EQ(r.call.prompt, "héllo");
  EXPECT_TRUE(r.call.add_special_tokens);
  EXPECT_FALSE(r.call.token_strs);
  EXPECT_FALSE(r.chat.has_value());
}

TEST(TokenizeApiTest, LmEvalsBodyAndVllmsOptions) {
  // What lm-eval's RemoteTokenizer.encode sends.
  TokenizeRequest r = TokenizeOk(
      R"({"prompt": "<|end_of_text|>", "add_special_tokens": false})");
  EXPECT_FALSE(r.call.add_special_tokens);
  r = TokenizeOk(R"({"model": "lm", "prompt": "x", "return_token_strs": true,)"
                 R"( "add_special_tokens": null})");
  EXPECT_EQ(r.model, "lm");
  EXPECT_TRUE(r.call.token_strs);
  EXPECT_TRUE(r.call.add_special_tokens);  // null: the default
}

TEST(TokenizeApiTest, MessagesAreAChatWithoutSpecialTokensByDefault) {
  const TokenizeRequest r =
      TokenizeOk(R"({"messages": [{"role": "user", "content": "Hi"}],)"
                 R"( "add_generation_prompt": false})");
  ASSERT_TRUE(r.chat.has_value());
  ASSERT_EQ(r.chat->messages.size(), 1u);
  EXPECT_EQ(r.chat->messages[0].role, "user");
  EXPECT_EQ(r.chat->messages[0].content, "Hi");
  EXPECT_FALSE(r.chat->add_generation_prompt);
  EXPECT_FALSE(r.call.add_special_tokens);
  EXPECT_TRUE(TokenizeOk(R"({"messages": [{"role": "user", "content": "x"}]})")
                  .chat->add_generation_prompt);
}

TEST(TokenizeApiTest, BadBodiesNameTheField) {
  EXPECT_EQ(TokenizeError("{}").first, "prompt");
  EXPECT_THAT(TokenizeError("{}").second, HasSubstr("prompt is required"));
  EXPECT_EQ(TokenizeError(R"({"prompt": 3})").first, "prompt");
  EXPECT_THAT(TokenizeError(R"({"prompt": [1, 2]})").second,
              HasSubstr("prompt must be a string, got array"));
  EXPECT_EQ(
      TokenizeError(R"({"prompt": "x", "messages": [{"role": "user"}]})").first,
      "prompt");
  EXPECT_EQ(TokenizeError(R"({"prompt": "x", "add_special_tokens": 1})").first,
            "add_special_tokens");
  EXPECT_EQ(
      TokenizeError(R"({"prompt": "x", "add_generation_prompt": true})").first,
      "add_generation_prompt");
  EXPECT_EQ(TokenizeError(R"({"messages": [{"content": "x"}]})").first,
            "messages[0].role");
  EXPECT_EQ(TokenizeError(R"({"prompt": "x", "model": 7})").first, "model");
  // Not a field: no field named, the known ones listed.
  const auto unknown = TokenizeError(R"({"prompt": "x", "text": "y"})");
  EXPECT_EQ(unknown.first, "");
  EXPECT_THAT(unknown.second, HasSubstr("\"text\" is not a field"));
  EXPECT_THAT(unknown.second, HasSubstr("add_special_tokens"));
  EXPECT_THAT(TokenizeError("[1]").second, HasSubstr("JSON object"));
  EXPECT_THAT(TokenizeError("{").second, HasSubstr("must be JSON"));
}

TEST(TokenizeApiTest, DetokenizeTakesTokenIds) {
  auto parsed = ParseDetokenizeRequest(R"({"tokens": [1, 0, 2147483647]})");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->tokens, (std::vector<int32_t>{1, 0, 2147483647}));
  EXPECT_EQ(parsed->model, "");
  parsed = ParseDetokenizeRequest(R"({"tokens": [], "model": "lm"})");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(parsed->tokens.empty());
  EXPECT_EQ(parsed->model, "lm");
}

TEST(TokenizeApiTest, BadTokensNameTheirIndexAndRange) {
  EXPECT_EQ(DetokenizeError("{}").first, "tokens");
  EXPECT_EQ(DetokenizeError(R"({"tokens": "1 2"})").first, "tokens");
  auto error = DetokenizeError(R"({"tokens": [1, "2"]})");
  EXPECT_EQ(error.first, "tokens[1]");
  EXPECT_THAT(error.second,
              HasSubstr("must be an integer token id, got string"));
  EXPECT_EQ(DetokenizeError(R"({"tokens": [1.5]})").first, "tokens[0]");
  error = DetokenizeError(R"({"tokens": [0, -1]})");
  EXPECT_EQ(error.first, "tokens[1]");
  EXPECT_THAT(error.second, HasSubstr("must be in [0, 2147483647], got -1"));
  EXPECT_EQ(DetokenizeError(R"({"tokens": [2147483648]})").first, "tokens[0]");
  EXPECT_EQ(DetokenizeError(R"({"tokens": [18446744073709551615]})").first,
            "tokens[0]");
  EXPECT_THAT(DetokenizeError(R"({"tokens": [1], "prompt": "x"})").second,
              HasSubstr("\"prompt\" is not a field"));
}

TEST(TokenizeApiTest, ResponsesHaveVllmsShapes) {
  TokenizeResult result;
  result.tokens = {766, 5, 9};
  result.max_model_len = 256;
  EXPECT_EQ(json::parse(TokenizeJson(result)),
            json::parse(R"({"count": 3, "max_model_len": 256,)"
                        R"( "tokens": [766, 5, 9]})"));
  result.token_strs = std::vector<std::string>{"<s>", "Ġa", "b"};
  EXPECT_EQ(json::parse(TokenizeJson(result))["token_strs"],
            json::parse(R"(["<s>", "Ġa", "b"])"));
  EXPECT_EQ(json::parse(DetokenizeJson("héllo\n")),
            json::parse(R"({"prompt": "héllo\n"})"));
}

TEST(TokenizeApiTest, TokenizerInfoNullsAbsentTokens) {
  TokenizerInfo info;
  info.tokenizer_class = "PreTrainedTokenizerFast";
  info.bos_token = "<s>";
  info.eos_token = "</s>";
  info.model_max_length = 2048;
  info.vocab_size = 768;
  json out = json::parse(TokenizerInfoJson(info));
  EXPECT_EQ(out,
            json::parse(R"({"tokenizer_class": "PreTrainedTokenizerFast",)"
                        R"( "bos_token": "<s>", "eos_token": "</s>",)"
                        R"( "pad_token": null, "unk_token": null,)"
                        R"( "model_max_length": 2048, "vocab_size": 768})"));
  info.chat_template = "{{ messages }}";
  EXPECT_EQ(json::parse(TokenizerInfoJson(info))["chat_template"],
            "{{ messages }}");
}

}  // namespace
}  // namespace tokenize_api
}  // namespace moh
