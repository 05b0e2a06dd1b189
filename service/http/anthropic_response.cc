#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/field_error.h"
#include "nlohmann/json.hpp"
#include "service/http/anthropic_api.h"
#include "service/metrics/request_log.h"

// The answers of the Messages API: errors, the message, stream events (the
// request body is anthropic_request.cc's).
namespace moh {
namespace anthropic {
namespace {

using nlohmann::json;

std::string Dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string Event(const char* type, const json& data) {
  return absl::StrCat("event: ", type, "\ndata: ", Dump(data), "\n\n");
}

json MohObject(const GenerationSummary& s) {
  return {{"activation_ratio", s.applied_ratio},
          {"effective_activation_ratio", s.effective_ratio}};
}

json Usage(int32_t input_tokens, int32_t output_tokens) {
  return {{"input_tokens", input_tokens}, {"output_tokens", output_tokens}};
}

json StopSequence(const std::optional<std::string>& stop) {
  return stop.has_value() ? json(*stop) : json(nullptr);
}

}  // namespace

std::string FieldName(absl::string_view field) {
  if (field == "sampling.stop") return "stop_sequences";
  return openai::HttpFieldName(field);
}

std::string ErrorJson(const absl::Status& status) {
  const int http = openai::HttpStatus(status.code());
  const char* type = http == 401   ? "authentication_error"
                     : http == 403 ? "permission_error"
                     : http == 404 ? "not_found_error"
                     : http == 429 ? "rate_limit_error"
                     : http == 503 ? "overloaded_error"
                     : http == 504 ? "timeout_error"
                     : http < 500  ? "invalid_request_error"
                                   : "api_error";
  return Dump(
      {{"type", "error"},
       {"error",
        {{"type", type}, {"message", MessageNaming(status, FieldName)}}}});
}

std::string NewId() { return absl::StrCat("msg_", RandomHex(24)); }

const char* StopReason(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return "max_tokens";
    case FinishReason::kStop:
      return "stop_sequence";
    default:
      return "end_turn";
  }
}

std::optional<std::string> MatchedStopSequence(
    const std::vector<std::string>& token_texts,
    const std::vector<std::string>& stops) {
  std::string text;
  for (const std::string& token : token_texts) {
    text += token;
    const std::string* found = nullptr;
    size_t found_at = std::string::npos;
    for (const std::string& stop : stops) {
      const size_t at = text.find(stop);
      if (at == std::string::npos) continue;
      if (found == nullptr || at < found_at ||
          (at == found_at && stop.size() < found->size())) {
        found = &stop;
        found_at = at;
      }
    }
    if (found != nullptr) return *found;
  }
  return std::nullopt;
}

std::string MessageJson(const Message& m) {
  const GenerationSummary& s = m.summary;
  return Dump({{"id", m.id},
               {"type", "message"},
               {"role", "assistant"},
               {"model", m.model},
               {"content", json::array({{{"type", "text"}, {"text", m.text}}})},
               {"stop_reason", StopReason(s.finish_reason)},
               {"stop_sequence", StopSequence(m.stop_sequence)},
               {"usage", Usage(s.prompt_tokens, s.completion_tokens)},
               {"moh", MohObject(s)}});
}

std::string StreamStartEvents(const std::string& id, const std::string& model) {
  const json message = {{"id", id},
                        {"type", "message"},
                        {"role", "assistant"},
                        {"model", model},
                        {"content", json::array()},
                        {"stop_reason", nullptr},
                        {"stop_sequence", nullptr},
                        {"usage", Usage(0, 0)}};
  return absl::StrCat(
      Event("message_start", {{"type", "message_start"}, {"message", message}}),
      Event("content_block_start",
            {{"type", "content_block_start"},
             {"index", 0},
             {"content_block", {{"type", "text"}, {"text", ""}}}}),
      Event("ping", {{"type", "ping"}}));
}

std::string TextDeltaEvent(const std::string& text) {
  return Event("content_block_delta",
               {{"type", "content_block_delta"},
                {"index", 0},
                {"delta", {{"type", "text_delta"}, {"text", text}}}});
}

std::string StreamEndEvents(const Message& m) {
  const GenerationSummary& s = m.summary;
  return absl::StrCat(
      Event("content_block_stop",
            {{"type", "content_block_stop"}, {"index", 0}}),
      Event("message_delta",
            {{"type", "message_delta"},
             {"delta",
              {{"stop_reason", StopReason(s.finish_reason)},
               {"stop_sequence", StopSequence(m.stop_sequence)}}},
             {"usage", Usage(s.prompt_tokens, s.completion_tokens)},
             {"moh", MohObject(s)}}),
      Event("message_stop", {{"type", "message_stop"}}));
}

std::string ErrorEvent(const absl::Status& status) {
  return absl::StrCat("event: error\ndata: ", ErrorJson(status), "\n\n");
}

}  // namespace anthropic
}  // namespace moh
