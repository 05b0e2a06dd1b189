// The OpenAI-compatible API's JSON (service/http/openai_api.h): request bodies
// into calls, with errors that name OpenAI's fields; results into responses,
// stream chunks, model lists and error objects.
#include "service/http/openai_api.h"

#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/field_error.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moh {
namespace openai {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

GenerationRequest ParseOk(Endpoint endpoint, const std::string& body) {
  auto parsed = ParseGenerationRequest(endpoint, body);
  EXPECT_TRUE(parsed.ok()) << body << ": " << parsed.status();
  return parsed.ok() ? *parsed : GenerationRequest{};
}

std::string ErrorOf(Endpoint endpoint, const std::string& body) {
  auto parsed = ParseGenerationRequest(endpoint, body);
  EXPECT_FALSE(parsed.ok()) << body;
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(parsed.status().message());
}

TEST(OpenAiApiTest, CompletionFieldsBecomeTheCall) {
  const GenerationRequest r = ParseOk(Endpoint::kCompletions, R"({
    "model": "lm", "prompt": "Once", "max_tokens": 7, "temperature": 0,
    "top_p": 0.5, "top_k": 3, "seed": 42, "stop": ["\n", "."],
    "repetition_penalty": 1.2, "stream": true,
    "stream_options": {"include_usage": true}, "user": "u",
    "activation_ratio": 0.5, "min_activation_ratio": 0.25,
    "stop_token_ids": [7, 9], "ignore_eos": true, "min_tokens": 3,
    "logprobs": 3, "prompt_logprobs": 1, "echo": false, "n": 2,
    "presence_penalty": 0.5, "frequency_penalty": -1, "min_p": 0.1,
    "priority": -5})");
  EXPECT_EQ(r.model, "lm");
  EXPECT_EQ(r.call.prompt, "Once");
  EXPECT_FALSE(r.call.token_ids.has_value());
  EXPECT_EQ(r.call.max_new_tokens, 7);
  EXPECT_EQ(r.call.sampling.temperature, 0.0f);
  EXPECT_EQ(r.call.sampling.top_p, 0.5f);
  EXPECT_EQ(r.call.sampling.top_k, 3);
  EXPECT_EQ(r.call.sampling.seed, 42u);
  EXPECT_EQ(r.call.sampling.stop, (std::vector<std::string>{"\n", "."}));
  EXPECT_FLOAT_EQ(r.call.sampling.repetition_penalty, 1.2f);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.call.ratio, 0.5f);
  EXPECT_EQ(r.call.min_ratio, 0.25f);
  EXPECT_EQ(r.call.sampling.stop_token_ids, (std::vector<int32_t>{7, 9}));
  EXPECT_TRUE(r.call.sampling.ignore_eos);
  EXPECT_EQ(r.call.sampling.min_tokens, 3);
  EXPECT_EQ(r.call.sampling.logprobs, 3);
  EXPECT_EQ(r.call.sampling.prompt_logprobs, 1);
  EXPECT_EQ(r.call.n, 2);
  EXPECT_EQ(r.call.priority, -5);
  EXPECT_EQ(r.call.sampling.presence_penalty, 0.5f);
  EXPECT_EQ(r.call.sampling.frequency_penalty, -1.0f);
  EXPECT_FLOAT_EQ(r.call.sampling.min_p, 0.1f);
}

TEST(OpenAiApiTest, ChatLogprobsAreABoolWithTopLogprobs) {
  const Endpoint chat = Endpoint::kChatCompletions;
  const std::string messages =
      R"("messages": [{"role": "user", "content": "x"}])";
  EXPECT_FALSE(ParseOk(chat, "{" + messages + "}").call.sampling.logprobs);
  EXPECT_EQ(ParseOk(chat, "{" + messages + R"(, "logprobs": true})")
                .call.sampling.logprobs,
            0);
  EXPECT_EQ(ParseOk(chat, "{" + messages +
                              R"(, "logprobs": true, "top_logprobs": 4})")
                .call.sampling.logprobs,
            4);
  EXPECT_FALSE(ParseOk(chat, "{" + messages + R"(, "logprobs": false})")
                   .call.sampling.logprobs);
  EXPECT_THAT(ErrorOf(chat, "{" + messages + R"(, "top_logprobs": 2})"),
              HasSubstr("top_logprobs needs \"logprobs\": true"));
  EXPECT_THAT(ErrorOf(chat, "{" + messages +
                                R"(, "logprobs": true, "top_logprobs": 21})"),
              HasSubstr("top_logprobs must be in [0, 20], got 21"));
  EXPECT_THAT(ErrorOf(chat, "{" + messages + R"(, "logprobs": 2})"),
              HasSubstr("logprobs must be true or false"));
}

TEST(OpenAiApiTest, DefaultsAreOpenAis) {
  const GenerationRequest r = ParseOk(
      Endpoint::kCompletions, R"({"prompt": "x", "temperature": null})");
  EXPECT_EQ(r.model, "");
  EXPECT_FALSE(r.call.max_new_tokens.has_value());  // the model's default
  EXPECT_EQ(r.call.sampling.temperature, 1.0f);
  EXPECT_EQ(r.call.sampling.top_p, 1.0f);
  EXPECT_EQ(r.call.sampling.top_k, 0);
  EXPECT_FALSE(r.call.sampling.seed.has_value());
  EXPECT_FALSE(r.stream);
  EXPECT_EQ(r.call.ratio, 0.0f);
}

TEST(OpenAiApiTest, PromptShapes) {
  EXPECT_EQ(ParseOk(Endpoint::kCompletions, R"({"prompt": [1, 2, 3]})")
                .call.token_ids,
            (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(
      ParseOk(Endpoint::kCompletions, R"({"prompt": [[4, 5]]})").call.token_ids,
      (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(
      ParseOk(Endpoint::kCompletions, R"({"prompt": ["hi"]})").call.prompt,
      "hi");
  EXPECT_THAT(ErrorOf(Endpoint::kCompletions, R"({"prompt": [1, -2]})"),
              HasSubstr("prompt must be a string, a list of token ids, or a "
                        "list of those"));
  EXPECT_THAT(ErrorOf(Endpoint::kCompletions, R"({"max_tokens": 3})"),
              HasSubstr("prompt is required"));
}

TEST(OpenAiApiTest, BadFieldsAreNamedWithTheirRange) {
  const Endpoint c = Endpoint::kCompletions;
  EXPECT_THAT(ErrorOf(c, "not json"), HasSubstr("the body must be JSON"));
  EXPECT_THAT(ErrorOf(c, "[1]"), HasSubstr("must be a JSON object"));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "temprature": 1})"),
              HasSubstr("\"temprature\" is not a field of this endpoint"));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "temperature": 3})"),
              HasSubstr("temperature must be in [0, 2], got 3"));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "temperature": "hot"})"),
              HasSubstr("temperature must be a number, got string"));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "top_p": 0})"),
              HasSubstr("top_p must be in (0, 1], got 0"));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "max_tokens": 0})"),
              HasSubstr("max_tokens must be in [1, 1048576], got 0"));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "max_tokens": 1.5})"),
              HasSubstr("max_tokens must be an integer"));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "seed": -1})"),
              HasSubstr("seed must be in [0, "));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "n": 17})"),
              HasSubstr("n must be in [1, 16], got 17"));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "priority": 1001})"),
              HasSubstr("priority must be in [-1000, 1000], got 1001"));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "presence_penalty": -3})"),
              HasSubstr("presence_penalty must be in [-2, 2], got -3"));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "min_p": 2})"),
              HasSubstr("min_p must be in [0, 1], got 2"));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "stop": [1]})"),
              HasSubstr("stop must be a string or a list of strings"));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "stop_token_ids": [1, -1]})"),
              HasSubstr("stop_token_ids must be a list of token ids"));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "min_tokens": -1})"),
              HasSubstr("min_tokens must be in [0, "));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "activation_ratio": 1.5})"),
              HasSubstr("activation_ratio must be in [0, 1], got 1.5"));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "logprobs": 21})"),
              HasSubstr("logprobs must be in [0, 20], got 21"));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "logprobs": true})"),
              HasSubstr("logprobs must be an integer"));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "max_tokens": 0})"),
              HasSubstr("max_tokens must be in [1, 1048576], got 0 (0 only "
                        "with \"echo\": true)"));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "echo": true, "logprobs": 1,
                             "n": 2})"),
              HasSubstr("echo with logprobs takes n 1 (one sample), got n 2"));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "echo": 1})"),
              HasSubstr("echo must be true or false"));
  EXPECT_THAT(ErrorOf(Endpoint::kChatCompletions,
                      R"({"messages": [{"role": "user", "content": "x"}],
                          "echo": true})"),
              HasSubstr("echo is not supported by this server yet"));
  EXPECT_THAT(ErrorOf(Endpoint::kChatCompletions,
                      R"({"messages": [{"role": "user", "content": "x"}],
                          "max_tokens": 0})"),
              HasSubstr("max_tokens must be in [1, 1048576], got 0"));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "stream_options": {}})"),
              HasSubstr("stream_options needs \"stream\": true"));
  EXPECT_THAT(
      ErrorOf(c,
              R"({"prompt": "x", "stream": true, "stream_options": {"x": 1}})"),
      HasSubstr("stream_options.x is not supported"));
  // Chat's fields are not completions'.
  EXPECT_THAT(ErrorOf(c, R"({"prompt": "x", "messages": []})"),
              HasSubstr("\"messages\" is not a field"));
}

TEST(OpenAiApiTest, ChatMessages) {
  const GenerationRequest r = ParseOk(Endpoint::kChatCompletions, R"({
    "messages": [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                              {"type": "text", "text": "there"}]}],
    "max_completion_tokens": 5, "max_tokens": 9,
    "add_generation_prompt": false})");
  ASSERT_EQ(r.messages.size(), 2u);
  EXPECT_EQ(r.messages[0].role, "system");
  EXPECT_EQ(r.messages[0].content, "Be brief.");
  EXPECT_EQ(r.messages[1].content, "Hi there");
  EXPECT_EQ(r.call.max_new_tokens, 5);  // max_completion_tokens wins
  EXPECT_FALSE(r.add_generation_prompt);
  EXPECT_FALSE(r.call.prompt.has_value());
  const Endpoint chat = Endpoint::kChatCompletions;
  EXPECT_THAT(ErrorOf(chat, R"({"messages": []})"),
              HasSubstr("messages must be a non-empty list"));
  EXPECT_THAT(ErrorOf(chat, R"({"messages": [{"content": "x"}]})"),
              HasSubstr("messages[0].role must be a non-empty string"));
  EXPECT_THAT(
      ErrorOf(chat, R"({"messages": [{"role": "user", "content": 3}]})"),
      HasSubstr("messages[0].content must be a string"));
  EXPECT_THAT(
      ErrorOf(
          chat,
          R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})"),
      HasSubstr("messages[0].content[0].type must be \"text\" (this server "
                "takes text only)"));
  // Every value read by its type: none makes the parser throw (a number as
  // a part's type aborted the server).
  for (const char* part :
       {R"({"type": 7})", R"({"type": null})", R"({"type": ["text"]})",
        R"({"type": {"x": 1}})", R"({"text": "x"})"}) {
    EXPECT_THAT(
        ErrorOf(chat,
                absl::StrCat(R"({"messages": [{"role": "user", "content": [)",
                             part, "]}]}")),
        HasSubstr("messages[0].content[0].type must be \"text\""))
        << part;
  }
  EXPECT_THAT(
      ErrorOf(
          chat,
          R"({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]})"),
      HasSubstr("messages[0].content[0].text must be a string"));
  EXPECT_THAT(
      ErrorOf(chat, R"({"messages": [{"role": "user", "content": [4]}]})"),
      HasSubstr("messages[0].content[0] must be an object, got number"));
  // Client text in an error is abbreviated: a 1 MB unknown field name.
  const std::string huge(1 << 20, 'f');
  const std::string error =
      ErrorOf(Endpoint::kCompletions,
              absl::StrCat(R"({"prompt": "x", ")", huge, R"(": 1})"));
  EXPECT_LT(error.size(), 1024u);
  EXPECT_THAT(error, HasSubstr("(1048576 bytes)"));
  EXPECT_THAT(ErrorOf(chat, R"({"messages": [{"role": "user", "content": "x"}],
                                "tools": [{"type": "function"}]})"),
              HasSubstr("tools is not supported"));
  EXPECT_THAT(ErrorOf(chat, R"({"prompt": "x"})"),
              HasSubstr("\"prompt\" is not a field"));
}

TEST(OpenAiApiTest, ServableErrorsNameTheirFieldAsThisApiDoes) {
  const auto message = [](absl::string_view field, absl::string_view what) {
    return json::parse(ErrorJson(FieldError(field, what)))["error"];
  };
  json e = message("sampling.max_new_tokens", "must be in [1, 5], got 9");
  EXPECT_EQ(e["message"], "max_tokens must be in [1, 5], got 9");
  EXPECT_EQ(e["param"], "max_tokens");
  e = message("activation.min_ratio", "must be 0 (off) or in (0, 0.5]");
  EXPECT_EQ(e["message"],
            "min_activation_ratio must be 0 (off) or in (0, 0.5]");
  EXPECT_EQ(e["param"], "min_activation_ratio");
  EXPECT_EQ(message("activation.ratio", "x")["param"], "activation_ratio");
  EXPECT_EQ(message("sampling.top_k", "must be >= 0")["message"],
            "top_k must be >= 0");
  EXPECT_EQ(message("token_ids", "must be in [0, 10), got 12")["message"],
            "prompt token ids must be in [0, 10), got 12");
  EXPECT_EQ(message("sampling.stop_token_ids", "must be in [0, 10)")["param"],
            "stop_token_ids");
  EXPECT_EQ(
      message("prompt (or token_ids)", "must have 1 to 9 tokens")["param"],
      "prompt");
  // Only the field is renamed: text in the rest of the message (a client's
  // own words) is left as it is.
  EXPECT_EQ(
      message("sampling.stop", "\"sampling.top_p\" is too long")["message"],
      "stop \"sampling.top_p\" is too long");
  // Without a field, the message as it is and a null param.
  e = json::parse(ErrorJson(absl::InvalidArgumentError("sampling.top_p x")));
  EXPECT_EQ(e["error"]["message"], "sampling.top_p x");
  EXPECT_TRUE(e["error"]["param"].is_null());
}

TEST(OpenAiApiTest, ErrorsHaveOpenAisShapeAndStatus) {
  const json e =
      json::parse(ErrorJson(FieldError("sampling.top_p", "must be ...")));
  EXPECT_EQ(e["error"]["message"], "top_p must be ...");
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  EXPECT_EQ(e["error"]["code"], "INVALID_ARGUMENT");
  EXPECT_EQ(e["error"]["param"], "top_p");
  EXPECT_EQ(HttpStatus(absl::StatusCode::kInvalidArgument), 400);
  EXPECT_EQ(HttpStatus(absl::StatusCode::kUnauthenticated), 401);
  EXPECT_EQ(HttpStatus(absl::StatusCode::kNotFound), 404);
  EXPECT_EQ(HttpStatus(absl::StatusCode::kResourceExhausted), 429);
  EXPECT_EQ(HttpStatus(absl::StatusCode::kUnavailable), 503);
  EXPECT_EQ(HttpStatus(absl::StatusCode::kDeadlineExceeded), 504);
  EXPECT_EQ(HttpStatus(absl::StatusCode::kInternal), 500);
  EXPECT_EQ(json::parse(ErrorJson(
                absl::ResourceExhaustedError("full")))["error"]["type"],
            "rate_limit_error");
}

GenerationSummary Summary() {
  GenerationSummary s;
  s.finish_reason = FinishReason::kLength;
  s.prompt_tokens = 3;
  s.completion_tokens = 4;
  s.applied_ratio = 0.5f;
  s.effective_ratio = 0.625;
  return s;
}

std::string FakeText(int32_t id) { return absl::StrCat("t", id); }

TEST(OpenAiApiTest, ResponsesCarryUsageAndTheRatio) {
  const GenerationSummary s = Summary();
  Finished f{"cmpl-1", 1700000000, "lm", {}, s};
  f.choices.push_back(ChoiceOutput{0, "abc", {}, {}, &s});
  const json c = json::parse(ResponseJson(Endpoint::kCompletions, f, FakeText));
  EXPECT_EQ(c["object"], "text_completion");
  EXPECT_EQ(c["choices"][0]["text"], "abc");
  EXPECT_EQ(c["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(c["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(c["usage"]["total_tokens"], 7);
  EXPECT_EQ(c["moh"]["activation_ratio"], 0.5);
  EXPECT_EQ(c["moh"]["effective_activation_ratio"], 0.625);
  const json chat =
      json::parse(ResponseJson(Endpoint::kChatCompletions, f, FakeText));
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(chat["choices"][0]["message"]["content"], "abc");
  // Invalid UTF-8 cannot break the JSON.
  f.choices[0].text = "\xff";
  EXPECT_NO_THROW(
      json::parse(ResponseJson(Endpoint::kCompletions, f, FakeText)));
}

// lm-evaluation-harness's log-likelihood request: the prompt as token ids,
// echoed with one alternative per position and max_tokens 1.
TEST(OpenAiApiTest, EchoParsesAsPromptLogprobs) {
  const GenerationRequest r = ParseOk(Endpoint::kCompletions, R"({
    "prompt": [[5, 6, 7]], "temperature": 0, "max_tokens": 1,
    "logprobs": 1, "seed": 1234, "echo": true})");
  EXPECT_TRUE(r.echo.on);
  EXPECT_FALSE(r.echo.prompt_only);
  EXPECT_EQ(r.echo.top_n, 1);
  ASSERT_EQ(r.echo.prompts.size(), 1u);
  EXPECT_EQ(r.echo.prompts[0].token_ids, std::vector<int32_t>({5, 6, 7}));
  // The prompt's entries are computed, for the echo only.
  EXPECT_EQ(r.call.sampling.prompt_logprobs, 1);
  EXPECT_TRUE(r.echo.prompt_logprobs_unasked);
  // max_tokens 0: one token computed, then dropped.
  const GenerationRequest zero = ParseOk(
      Endpoint::kCompletions,
      R"({"prompt": "ab", "max_tokens": 0, "echo": true, "prompt_logprobs": 3,
          "logprobs": 2})");
  EXPECT_TRUE(zero.echo.prompt_only);
  EXPECT_EQ(zero.call.max_new_tokens, 1);
  EXPECT_EQ(zero.echo.prompts[0].text, "ab");
  EXPECT_EQ(zero.call.sampling.prompt_logprobs, 3);
  EXPECT_FALSE(zero.echo.prompt_logprobs_unasked);
  // Echo without logprobs computes nothing more.
  const GenerationRequest text =
      ParseOk(Endpoint::kCompletions, R"({"prompt": "ab", "echo": true})");
  EXPECT_FALSE(text.call.sampling.prompt_logprobs.has_value());
  EXPECT_FALSE(text.echo.top_n.has_value());
}

// OpenAI's batch form (lm-eval's batch_size > 1): a request per prompt.
TEST(OpenAiApiTest, PromptListsAreOneRequestEach) {
  const GenerationRequest r =
      ParseOk(Endpoint::kCompletions,
              R"({"prompt": [[1, 2], "text", [3]], "n": 2, "echo": true})");
  ASSERT_EQ(r.prompts.size(), 3u);
  EXPECT_EQ(r.call.token_ids, std::vector<int32_t>({1, 2}));
  EXPECT_EQ(r.prompts[1].text, "text");
  EXPECT_EQ(r.prompts[2].token_ids, std::vector<int32_t>({3}));
  EXPECT_EQ(r.echo.prompts.size(), 3u);
  EXPECT_EQ(r.echo.samples, 2);
  const Endpoint c = Endpoint::kCompletions;
  EXPECT_THAT(ErrorOf(c, R"({"prompt": ["a", []]})"),
              HasSubstr("prompt[1] must be a string or a non-empty list of "
                        "token ids"));
  EXPECT_THAT(ErrorOf(c, R"({"prompt": [[1], [-1]]})"),
              HasSubstr("prompt[1] must be a string, a list of token ids, or "
                        "a list of those (token ids: non-negative integers)"));
  std::string many = "[";
  for (int i = 0; i <= kMaxPrompts; ++i) many += i ? ", \"x\"" : "\"x\"";
  EXPECT_THAT(ErrorOf(c, R"({"prompt": )" + many + "]}"),
              HasSubstr("prompt must hold at most 64 prompts, got 65"));
}

TEST(OpenAiApiTest, EchoPutsThePromptFirst) {
  GenerationSummary s = Summary();
  // Prompt 4 5 6, completion 9: entries for 5 and 6 predicted, 9 sampled.
  LogprobEntry p5{{5, -1.0f}, 2, {{8, -0.5f}, {5, -1.0f}}};
  LogprobEntry p6{{6, -0.25f}, 1, {{6, -0.25f}, {2, -3.0f}}};
  LogprobEntry g9{{9, -0.125f}, 1, {{9, -0.125f}}};
  Echo echo;
  echo.on = true;
  echo.top_n = 1;
  echo.prompts = {Prompt{std::nullopt, std::vector<int32_t>{4, 5, 6}}};
  echo.prompt_logprobs_unasked = true;
  ChoiceOutput out{0, "t9", {g9}, {p5, p6}, &s};
  out.prompt_token_ids = {4, 5, 6};
  const DecodeFn decode = [](const std::vector<int32_t>& ids) {
    std::string text;
    for (int32_t id : ids) text += FakeText(id);
    return text;
  };
  ApplyEcho(echo, /*prompt_asked=*/false, decode, /*first=*/true, &out);
  Finished f{"cmpl-1", 0, "lm", {out}, s, LogprobsAsked{true, false}};
  const json c = json::parse(ResponseJson(Endpoint::kCompletions, f, FakeText));
  const json& choice = c["choices"][0];
  EXPECT_EQ(choice["text"], "t4t5t6t9");
  EXPECT_FALSE(choice.contains("prompt_logprobs"));
  const json& lp = choice["logprobs"];
  EXPECT_EQ(lp["tokens"], json({"t4", "t5", "t6", "t9"}));
  EXPECT_EQ(lp["token_logprobs"], json({nullptr, -1.0, -0.25, -0.125}));
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  // At most `logprobs` alternatives at every position.
  EXPECT_EQ(lp["top_logprobs"][1], json({{"t8", -0.5}}));
  EXPECT_EQ(lp["top_logprobs"][2], json({{"t6", -0.25}}));
  EXPECT_EQ(lp["text_offset"], json({0, 2, 4, 6}));
  // A later output of the same choice is left alone...
  ChoiceOutput later{0, "t3", {}, {}, nullptr};
  ApplyEcho(echo, false, decode, /*first=*/false, &later);
  EXPECT_EQ(later.text, "t3");
  // ...but for max_tokens 0, whose computed token is dropped.
  echo.prompt_only = true;
  ApplyEcho(echo, false, decode, /*first=*/false, &later);
  EXPECT_EQ(later.text, "");
  ApplyEcho(echo, &s);
  EXPECT_EQ(s.completion_tokens, 0);
  EXPECT_EQ(s.finish_reason, FinishReason::kLength);
}

TEST(OpenAiApiTest, LogprobsInBothForms) {
  const GenerationSummary s = Summary();
  LogprobEntry a{{7, -0.5f}, 2, {{3, -0.25f}, {7, -0.5f}}};
  LogprobEntry b{{12, -std::numeric_limits<float>::infinity()}, 9, {}};
  Finished f{"cmpl-1", 0, "lm", {}, s, LogprobsAsked{true, true}};
  f.choices.push_back(ChoiceOutput{0, "t7t12", {a, b}, {a}, &s});
  const json c = json::parse(ResponseJson(Endpoint::kCompletions, f, FakeText));
  const json& lp = c["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], json({"t7", "t12"}));
  EXPECT_EQ(lp["token_logprobs"][0], -0.5);
  // -inf is no JSON number: the most negative float.
  EXPECT_EQ(lp["token_logprobs"][1], -std::numeric_limits<float>::max());
  EXPECT_EQ(lp["top_logprobs"][0]["t3"], -0.25);
  EXPECT_TRUE(lp["top_logprobs"][1].empty());
  EXPECT_EQ(lp["text_offset"], json({0, 2}));
  const json& prompt = c["choices"][0]["prompt_logprobs"];
  ASSERT_EQ(prompt.size(), 2u);
  EXPECT_TRUE(prompt[0].is_null());
  EXPECT_EQ(prompt[1]["7"]["rank"], 2);
  EXPECT_EQ(prompt[1]["3"]["rank"], 1);
  EXPECT_EQ(prompt[1]["3"]["decoded_token"], "t3");

  const json chat =
      json::parse(ResponseJson(Endpoint::kChatCompletions, f, FakeText));
  const json& content = chat["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 2u);
  EXPECT_EQ(content[0]["token"], "t7");
  EXPECT_EQ(content[0]["logprob"], -0.5);
  EXPECT_EQ(content[0]["bytes"], json({116, 55}));
  EXPECT_EQ(content[0]["top_logprobs"][0]["token"], "t3");
  EXPECT_EQ(content[1]["top_logprobs"].size(), 0u);
}

TEST(OpenAiApiTest, CombinedSummaryOfSamples) {
  GenerationSummary a = Summary(), b = Summary();
  a.routed_tokens = 7;
  a.effective_ratio = 0.5;
  b.index = 1;
  b.routed_tokens = 3;
  b.effective_ratio = 1.0;
  b.completion_tokens = 2;
  // Two samples of one prompt: the prompt counts once.
  const GenerationSummary all = CombineSummaries({a, b}, /*n=*/2);
  EXPECT_EQ(all.prompt_tokens, 3);
  EXPECT_EQ(all.completion_tokens, 6);
  EXPECT_EQ(all.routed_tokens, 10);
  EXPECT_DOUBLE_EQ(all.effective_ratio, 0.65);
  // Two prompts of one sample each: both count.
  EXPECT_EQ(CombineSummaries({a, b}, /*n=*/1).prompt_tokens, 6);
}

TEST(OpenAiApiTest, StreamChunks) {
  const GenerationSummary s = Summary();
  Chunk chunk{"chatcmpl-1", 5, "lm", ChoiceOutput{0, "He"}, true};
  json first =
      json::parse(ChunkJson(Endpoint::kChatCompletions, chunk, FakeText));
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(first["choices"][0]["delta"]["content"], "He");
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  EXPECT_FALSE(first.contains("moh"));
  chunk = Chunk{"chatcmpl-1", 5, "lm", ChoiceOutput{1, "", {}, {}, &s}, false};
  json last =
      json::parse(ChunkJson(Endpoint::kChatCompletions, chunk, FakeText));
  EXPECT_EQ(last["choices"][0]["index"], 1);
  EXPECT_EQ(last["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(last["choices"][0]["delta"].empty());
  EXPECT_EQ(last["moh"]["effective_activation_ratio"], 0.625);
  json usage =
      json::parse(UsageChunkJson(Endpoint::kChatCompletions, chunk, s));
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 4);
  Chunk text{"cmpl-1",    5,
             "lm",        ChoiceOutput{0, "x", {{{4, -1.0f}, 1, {}}}},
             true,        LogprobsAsked{true, false},
             /*offset=*/5};
  json completion =
      json::parse(ChunkJson(Endpoint::kCompletions, text, FakeText));
  EXPECT_EQ(completion["object"], "text_completion");
  EXPECT_EQ(completion["choices"][0]["text"], "x");
  EXPECT_EQ(completion["choices"][0]["logprobs"]["text_offset"], json({5}));
}

TEST(OpenAiApiTest, ModelsList) {
  v1::ModelInfo m;
  m.set_name("lm");
  m.set_family("llama");
  m.set_state(v1::ModelInfo::READY);
  m.set_default_ratio(0.75f);
  m.set_max_seq_len(256);
  const json list = json::parse(ModelsJson({m}));
  EXPECT_EQ(list["object"], "list");
  EXPECT_EQ(list["data"][0]["id"], "lm");
  EXPECT_EQ(list["data"][0]["object"], "model");
  EXPECT_EQ(list["data"][0]["moh"]["state"], "READY");
  EXPECT_EQ(list["data"][0]["moh"]["default_activation_ratio"], 0.75);
}

TEST(OpenAiApiTest, IdsAreFreshAndPrefixed) {
  const std::string a = NewId(Endpoint::kCompletions);
  const std::string b = NewId(Endpoint::kCompletions);
  EXPECT_NE(a, b);
  EXPECT_EQ(a.rfind("cmpl-", 0), 0u);
  EXPECT_EQ(a.size(), 5u + 24u);
  EXPECT_EQ(NewId(Endpoint::kChatCompletions).rfind("chatcmpl-", 0), 0u);
}

}  // namespace
}  // namespace openai
}  // namespace moh
