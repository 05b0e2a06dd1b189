// Anthropic's Messages API JSON (service/http/anthropic_api.h): request
// bodies into the chat call, with errors that name Anthropic's fields; results
// into the message, stream events and error objects.
#include "service/http/anthropic_api.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/field_error.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moh {
namespace anthropic {
namespace {

using nlohmann::json;
using openai::GenerationRequest;
using ::testing::HasSubstr;

GenerationRequest ParseOk(const std::string& body) {
  auto parsed = ParseMessagesRequest(body);
  EXPECT_TRUE(parsed.ok()) << body << ": " << parsed.status();
  return parsed.ok() ? *parsed : GenerationRequest{};
}

// The error as a client reads it (its field named as this API names it).
std::string ErrorOf(const std::string& body) {
  auto parsed = ParseMessagesRequest(body);
  EXPECT_FALSE(parsed.ok()) << body;
  if (parsed.ok()) return "";
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  return json::parse(ErrorJson(parsed.status()))["error"]["message"];
}

TEST(AnthropicApiTest, FieldsBecomeTheChatCall) {
  const GenerationRequest r = ParseOk(R"({
    "model": "lm", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
    "top_k": 3, "stop_sequences": ["\n", "END"], "stream": true,
    "metadata": {"user_id": "u"}, "activation_ratio": 0.5,
    "min_activation_ratio": 0.25, "system": "Be brief.",
    "messages": [{"role": "user", "content": "Hi"},
                 {"role": "assistant", "content": [{"type": "text",
                   "text": "Hel"}, {"type": "text", "text": "lo"}]},
                 {"role": "user", "content": "Again"}]})");
  EXPECT_EQ(r.endpoint, openai::Endpoint::kMessages);
  EXPECT_EQ(r.model, "lm");
  EXPECT_EQ(r.call.max_new_tokens, 7);
  EXPECT_EQ(r.call.sampling.temperature, 0.5f);
  EXPECT_TRUE(r.call.sampling_set.temperature);
  EXPECT_FLOAT_EQ(r.call.sampling.top_p, 0.9f);
  EXPECT_EQ(r.call.sampling.top_k, 3);
  EXPECT_EQ(r.call.sampling.stop, (std::vector<std::string>{"\n", "END"}));
  EXPECT_TRUE(r.stream);
  EXPECT_EQ(r.call.ratio, 0.5f);
  EXPECT_EQ(r.call.min_ratio, 0.25f);
  EXPECT_EQ(r.call.n, 1);
  EXPECT_FALSE(r.call.prompt.has_value());
  EXPECT_TRUE(r.add_generation_prompt);
  ASSERT_EQ(r.messages.size(), 4u);  // system first
  EXPECT_EQ(r.messages[0].role, "system");
  EXPECT_EQ(r.messages[0].content, "Be brief.");
  EXPECT_EQ(r.messages[2].role, "assistant");
  EXPECT_EQ(r.messages[2].content, "Hello");
  EXPECT_EQ(r.messages[3].content, "Again");
}

TEST(AnthropicApiTest, DefaultsAndSystemBlocks) {
  const GenerationRequest r = ParseOk(R"({"max_tokens": 1,
    "system": [{"type": "text", "text": "A"},
               {"type": "text", "text": "B", "cache_control": {}}],
    "messages": [{"role": "user", "content": "x"}], "metadata": {}})");
  EXPECT_EQ(r.model, "");
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.call.sampling_set.temperature);
  EXPECT_EQ(r.call.sampling.temperature, 1.0f);
  EXPECT_FALSE(r.call.sampling_set.top_p);
  EXPECT_EQ(r.call.sampling.top_k, 0);
  ASSERT_EQ(r.messages.size(), 2u);
  EXPECT_EQ(r.messages[0].content, "AB");
  // No system message for an empty system prompt.
  EXPECT_EQ(ParseOk(R"({"max_tokens": 1, "system": "",
    "messages": [{"role": "user", "content": "x"}]})")
                .messages.size(),
            1u);
}

TEST(AnthropicApiTest, ErrorsNameTheFieldAndItsRange) {
  const std::string ok_messages =
      R"("messages": [{"role": "user", "content": "x"}])";
  EXPECT_THAT(ErrorOf("{" + ok_messages + "}"),
              HasSubstr("max_tokens is required"));
  EXPECT_THAT(ErrorOf(R"({"max_tokens": 0, )" + ok_messages + "}"),
              HasSubstr("max_tokens must be in [1, "));
  EXPECT_THAT(
      ErrorOf(R"({"max_tokens": 5, "temperature": 1.5, )" + ok_messages + "}"),
      HasSubstr("temperature must be in [0, 1], got 1.5"));
  EXPECT_THAT(ErrorOf(R"({"max_tokens": 5, "top_p": 0, )" + ok_messages + "}"),
              HasSubstr("top_p must be in (0, 1]"));
  EXPECT_THAT(ErrorOf(R"({"max_tokens": 5, "top_k": -1, )" + ok_messages + "}"),
              HasSubstr("top_k must be in [0, "));
  EXPECT_THAT(ErrorOf(R"({"max_tokens": 5})"),
              HasSubstr("messages is required"));
  EXPECT_THAT(ErrorOf(R"({"max_tokens": 5, "messages": []})"),
              HasSubstr("messages must be a non-empty list"));
  EXPECT_THAT(ErrorOf(R"({"max_tokens": 5,
      "messages": [{"role": "system", "content": "x"}]})"),
              HasSubstr("messages[0].role must be \"user\" or \"assistant\""));
  EXPECT_THAT(ErrorOf(R"({"max_tokens": 5, "stop_sequences": [""], )" +
                      ok_messages + "}"),
              HasSubstr("stop_sequences[0] must be a non-empty string"));
  EXPECT_THAT(ErrorOf(R"({"max_tokens": 5, "stream": 1, )" + ok_messages + "}"),
              HasSubstr("stream must be true or false"));
  EXPECT_THAT(ErrorOf(R"({"max_tokens": 5, "metadata": {"x": 1}, )" +
                      ok_messages + "}"),
              HasSubstr("metadata.x is not supported"));
  EXPECT_THAT(ErrorOf("[1]"), HasSubstr("must be a JSON object"));
  EXPECT_THAT(ErrorOf("{"), HasSubstr("must be JSON"));
}

TEST(AnthropicApiTest, UnknownAndUnservedFieldsAreRefusedByName) {
  const std::string ok =
      R"("max_tokens": 5, "messages": [{"role": "user", "content": "x"}])";
  EXPECT_THAT(ErrorOf(R"({"bogus": 1, )" + ok + "}"),
              HasSubstr("\"bogus\" is not a field of this endpoint"));
  // OpenAI's names are not Anthropic's.
  EXPECT_THAT(ErrorOf(R"({"stop": "x", )" + ok + "}"),
              HasSubstr("\"stop\" is not a field"));
  for (const char* field : {"tools", "tool_choice", "thinking"}) {
    EXPECT_THAT(ErrorOf(absl::StrCat(R"({")", field, R"(": [{}], )", ok, "}")),
                HasSubstr(absl::StrCat(field,
                                       " is not supported by this "
                                       "server")));
  }
  EXPECT_THAT(ErrorOf(R"({"max_tokens": 5, "messages": [{"role": "user",
      "content": [{"type": "image", "source": {}}]}]})"),
              HasSubstr("messages[0].content[0].type is \"image\", which this "
                        "server does not support"));
  EXPECT_THAT(ErrorOf(R"({"max_tokens": 5, "messages": [{"role": "user",
      "content": [{"type": "text", "text": "x", "citations": []}]}]})"),
              HasSubstr("messages[0].content[0].citations is not a field"));
  EXPECT_THAT(ErrorOf(R"({"max_tokens": 5, "messages": [{"role": "user",
      "content": "x", "name": "n"}]})"),
              HasSubstr("messages[0].name is not a field of a message"));
}

TEST(AnthropicApiTest, ErrorObjects) {
  json e = json::parse(ErrorJson(FieldError("sampling.stop", "too many")));
  EXPECT_EQ(e["type"], "error");
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  EXPECT_EQ(e["error"]["message"], "stop_sequences too many");
  e = json::parse(ErrorJson(FieldError("sampling.max_new_tokens", "big")));
  EXPECT_EQ(e["error"]["message"], "max_tokens big");
  const std::vector<std::pair<absl::Status, const char*>> types = {
      {absl::UnauthenticatedError("x"), "authentication_error"},
      {absl::PermissionDeniedError("x"), "permission_error"},
      {absl::NotFoundError("x"), "not_found_error"},
      {absl::ResourceExhaustedError("x"), "rate_limit_error"},
      {absl::UnavailableError("x"), "overloaded_error"},
      {absl::DeadlineExceededError("x"), "timeout_error"},
      {absl::OutOfRangeError("x"), "invalid_request_error"},
      {absl::InternalError("x"), "api_error"}};
  for (const auto& [status, type] : types) {
    EXPECT_EQ(json::parse(ErrorJson(status))["error"]["type"], type) << status;
  }
}

TEST(AnthropicApiTest, StopReasonsAndIds) {
  EXPECT_STREQ(StopReason(FinishReason::kLength), "max_tokens");
  EXPECT_STREQ(StopReason(FinishReason::kStop), "stop_sequence");
  EXPECT_STREQ(StopReason(FinishReason::kEos), "end_turn");
  const std::string id = NewId();
  EXPECT_EQ(id.rfind("msg_", 0), 0u);
  EXPECT_EQ(id.size(), 4u + 24u);
  EXPECT_NE(NewId(), id);
}

TEST(AnthropicApiTest, MatchedStopSequenceIsTheFirstToComplete) {
  const std::vector<std::string> tokens = {"a", "b", "c", "d"};
  EXPECT_EQ(MatchedStopSequence(tokens, {"cd", "b"}), "b");
  // "abcd" starts first but completes after "bc".
  EXPECT_EQ(MatchedStopSequence(tokens, {"abcd", "bc"}), "bc");
  // Completed by one token: the earliest start, then the shortest.
  EXPECT_EQ(MatchedStopSequence({"xabcd"}, {"cd", "ab"}), "ab");
  EXPECT_EQ(MatchedStopSequence({"xabcd"}, {"abc", "ab"}), "ab");
  EXPECT_EQ(MatchedStopSequence(tokens, {"z"}), std::nullopt);
  EXPECT_EQ(MatchedStopSequence({}, {"a"}), std::nullopt);
}

TEST(AnthropicApiTest, MessageJson) {
  Message m;
  m.id = "msg_1";
  m.model = "lm";
  m.text = "Hello";
  m.summary.finish_reason = FinishReason::kStop;
  m.summary.prompt_tokens = 5;
  m.summary.completion_tokens = 3;
  m.summary.applied_ratio = 0.5f;
  m.summary.effective_ratio = 0.625;
  m.stop_sequence = "END";
  const json j = json::parse(MessageJson(m));
  EXPECT_EQ(j["id"], "msg_1");
  EXPECT_EQ(j["type"], "message");
  EXPECT_EQ(j["role"], "assistant");
  EXPECT_EQ(j["model"], "lm");
  EXPECT_EQ(j["content"],
            json::parse(R"([{"type": "text", "text": "Hello"}])"));
  EXPECT_EQ(j["stop_reason"], "stop_sequence");
  EXPECT_EQ(j["stop_sequence"], "END");
  EXPECT_EQ(j["usage"],
            json::parse(R"({"input_tokens": 5, "output_tokens": 3})"));
  EXPECT_EQ(j["moh"]["activation_ratio"], 0.5);
  EXPECT_EQ(j["moh"]["effective_activation_ratio"], 0.625);
  m.summary.finish_reason = FinishReason::kEos;
  m.stop_sequence.reset();
  const json eos = json::parse(MessageJson(m));
  EXPECT_EQ(eos["stop_reason"], "end_turn");
  EXPECT_TRUE(eos["stop_sequence"].is_null());
}

// Splits "event: t\ndata: j\n\n..." into (type, data) pairs, checking that
// each data's "type" is its event's.
std::vector<std::pair<std::string, json>> Events(const std::string& text) {
  std::vector<std::pair<std::string, json>> events;
  size_t at = 0;
  while (at < text.size()) {
    const size_t end = text.find("\n\n", at);
    EXPECT_NE(end, std::string::npos) << text;
    if (end == std::string::npos) break;
    const std::string event = text.substr(at, end - at);
    const size_t newline = event.find('\n');
    EXPECT_EQ(event.rfind("event: ", 0), 0u) << event;
    EXPECT_EQ(event.compare(newline + 1, 6, "data: "), 0) << event;
    events.emplace_back(event.substr(7, newline - 7),
                        json::parse(event.substr(newline + 7)));
    EXPECT_EQ(events.back().second["type"], events.back().first);
    at = end + 2;
  }
  return events;
}

TEST(AnthropicApiTest, StreamEventsInAnthropicsOrder) {
  auto start = Events(StreamStartEvents("msg_1", "lm"));
  ASSERT_EQ(start.size(), 3u);
  EXPECT_EQ(start[0].first, "message_start");
  const json& message = start[0].second["message"];
  EXPECT_EQ(message["id"], "msg_1");
  EXPECT_EQ(message["type"], "message");
  EXPECT_EQ(message["role"], "assistant");
  EXPECT_EQ(message["content"], json::array());
  EXPECT_TRUE(message["stop_reason"].is_null());
  EXPECT_EQ(message["usage"]["output_tokens"], 0);
  EXPECT_EQ(start[1].first, "content_block_start");
  EXPECT_EQ(start[1].second["index"], 0);
  EXPECT_EQ(start[1].second["content_block"],
            json::parse(R"({"type": "text", "text": ""})"));
  EXPECT_EQ(start[2].first, "ping");

  auto delta = Events(TextDeltaEvent("Hi \"x\"\n"));
  ASSERT_EQ(delta.size(), 1u);
  EXPECT_EQ(delta[0].first, "content_block_delta");
  EXPECT_EQ(delta[0].second["index"], 0);
  EXPECT_EQ(delta[0].second["delta"],
            json::parse(R"({"type": "text_delta", "text": "Hi \"x\"\n"})"));

  Message m;
  m.summary.finish_reason = FinishReason::kLength;
  m.summary.prompt_tokens = 4;
  m.summary.completion_tokens = 2;
  auto end = Events(StreamEndEvents(m));
  ASSERT_EQ(end.size(), 3u);
  EXPECT_EQ(end[0].first, "content_block_stop");
  EXPECT_EQ(end[0].second["index"], 0);
  EXPECT_EQ(end[1].first, "message_delta");
  EXPECT_EQ(end[1].second["delta"]["stop_reason"], "max_tokens");
  EXPECT_TRUE(end[1].second["delta"]["stop_sequence"].is_null());
  EXPECT_EQ(end[1].second["usage"],
            json::parse(R"({"input_tokens": 4, "output_tokens": 2})"));
  EXPECT_EQ(end[2].first, "message_stop");

  auto error = Events(ErrorEvent(absl::InternalError("boom")));
  ASSERT_EQ(error.size(), 1u);
  EXPECT_EQ(error[0].second["error"]["type"], "api_error");
  EXPECT_EQ(error[0].second["error"]["message"], "boom");
}

}  // namespace
}  // namespace anthropic
}  // namespace moh
