#include <algorithm>
#include <iterator>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/abbreviate.h"
#include "base/field_error.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"
#include "service/http/anthropic_api.h"
#include "service/http/json_body.h"

// A Messages request body, parsed and checked (the answers are
// anthropic_response.cc's).
namespace moh {
namespace anthropic {
namespace {

using json_body::Fields;
using nlohmann::json;

constexpr int64_t kMaxTokens = 1 << 20;

// Fields Anthropic defines that this server cannot honour: refused with the
// reason rather than as unknown.
constexpr const char* kNotServed[] = {"tools", "tool_choice", "thinking"};

// The fields of the body this endpoint takes, and those it refuses with the
// reason.
const std::set<std::string>& KnownFields() {
  static const std::set<std::string>* known = [] {
    auto* names = new std::set<std::string>{
        "model",       "messages", "system", "max_tokens", "stop_sequences",
        "temperature", "top_p",    "top_k",  "stream",     "metadata"};
    names->insert(std::begin(kNotServed), std::end(kNotServed));
    names->insert(std::begin(json_body::kActivationFields),
                  std::end(json_body::kActivationFields));
    return names;
  }();
  return *known;
}

// The body's object, every field known; a field this server cannot honour
// named with the reason (a null one counts as absent).
absl::StatusOr<json> ReadBody(absl::string_view body) {
  MOH_ASSIGN_OR_RETURN(json parsed, json_body::ReadObject(body, KnownFields()));
  for (const char* name : kNotServed) {
    if (Fields(parsed).Get(name) != nullptr) {
      return FieldError(name,
                        "is not supported by this server (it generates text "
                        "only): leave it out");
    }
  }
  return parsed;
}

// The value of `name`, or null when it is absent or null.
const json* Find(const json& body, const std::string& name) {
  return Fields(body).Get(name);
}

// The text of `content` at `at`: a string, or a list of text blocks
// ({"type": "text", "text", optional "cache_control"}) joined as the OpenAI
// chat endpoint joins its text parts.
absl::StatusOr<std::string> ReadText(const json& content,
                                     const std::string& at) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) {
    return FieldError(at, "must be a string or a list of text blocks");
  }
  std::string text;
  for (size_t k = 0; k < content.size(); ++k) {
    const json& block = content[k];
    const std::string block_at = absl::StrCat(at, "[", k, "]");
    if (!block.is_object()) return FieldError(block_at, "must be an object");
    const json* type = Find(block, "type");
    if (type == nullptr || !type->is_string()) {
      return FieldError(block_at + ".type", "must be a string (\"text\")");
    }
    if (*type != "text") {
      return FieldError(
          block_at + ".type",
          absl::StrCat("is \"", Abbreviate(type->get<std::string>()),
                       "\", which this server does not support: "
                       "it takes \"text\" blocks only"));
    }
    for (const auto& [key, value] : block.items()) {
      if (key != "type" && key != "text" && key != "cache_control") {
        return FieldError(absl::StrCat(block_at, ".", Abbreviate(key)),
                          "is not a field of a text block (type, text, "
                          "cache_control)");
      }
    }
    const json* part = Find(block, "text");
    if (part == nullptr || !part->is_string()) {
      return FieldError(block_at + ".text", "must be a string");
    }
    text += part->get_ref<const std::string&>();
  }
  return text;
}

// system, then messages: the conversation the chat template renders.
absl::StatusOr<std::vector<ChatMessage>> ReadConversation(const json& body) {
  std::vector<ChatMessage> conversation;
  if (const json* system = Find(body, "system")) {
    MOH_ASSIGN_OR_RETURN(std::string text, ReadText(*system, "system"));
    if (!text.empty()) conversation.push_back({"system", std::move(text)});
  }
  const json* messages = Find(body, "messages");
  if (messages == nullptr) return FieldError("messages", "is required");
  if (!messages->is_array() || messages->empty()) {
    return FieldError("messages", "must be a non-empty list of messages");
  }
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& entry = (*messages)[i];
    const std::string at = absl::StrCat("messages[", i, "]");
    if (!entry.is_object()) return FieldError(at, "must be an object");
    for (const auto& [key, value] : entry.items()) {
      if (key != "role" && key != "content") {
        return FieldError(absl::StrCat(at, ".", Abbreviate(key)),
                          "is not a field of a message (role, content)");
      }
    }
    const json* role = Find(entry, "role");
    if (role == nullptr || (*role != "user" && *role != "assistant")) {
      return FieldError(at + ".role", "must be \"user\" or \"assistant\"");
    }
    const json* content = Find(entry, "content");
    if (content == nullptr) return FieldError(at + ".content", "is required");
    MOH_ASSIGN_OR_RETURN(std::string text, ReadText(*content, at + ".content"));
    conversation.push_back({role->get<std::string>(), std::move(text)});
  }
  return conversation;
}

// stop_sequences: a list of non-empty strings.
absl::Status ReadStopSequences(const json& body, SamplingParams* sampling) {
  const json* stops = Find(body, "stop_sequences");
  if (stops == nullptr) return absl::OkStatus();
  if (!stops->is_array()) {
    return FieldError("stop_sequences", "must be a list of strings");
  }
  for (size_t i = 0; i < stops->size(); ++i) {
    const json& stop = (*stops)[i];
    if (!stop.is_string() || stop.get_ref<const std::string&>().empty()) {
      return FieldError(absl::StrCat("stop_sequences[", i, "]"),
                        "must be a non-empty string");
    }
    sampling->stop.push_back(stop.get<std::string>());
  }
  return absl::OkStatus();
}

// max_tokens (required), temperature, top_p, top_k, stop_sequences; the
// activation ratios.
absl::Status ReadSampling(const json& body, GenerateCall* call) {
  SamplingParams& s = call->sampling;
  MOH_ASSIGN_OR_RETURN(std::optional<int64_t> max_tokens,
                       Fields(body).Integer("max_tokens", 1, kMaxTokens));
  if (!max_tokens) return FieldError("max_tokens", "is required");
  call->max_new_tokens = static_cast<int32_t>(*max_tokens);
  MOH_ASSIGN_OR_RETURN(std::optional<double> temperature,
                       Fields(body).Number("temperature", 0.0, 1.0));
  s.temperature = static_cast<float>(temperature.value_or(1.0));
  call->sampling_set.temperature = temperature.has_value();
  MOH_ASSIGN_OR_RETURN(
      std::optional<double> top_p,
      Fields(body).Number("top_p", 0.0, 1.0, /*lo_open=*/true));
  s.top_p = static_cast<float>(top_p.value_or(1.0));
  call->sampling_set.top_p = top_p.has_value();
  MOH_ASSIGN_OR_RETURN(
      std::optional<int64_t> top_k,
      Fields(body).Integer("top_k", 0, std::numeric_limits<int32_t>::max()));
  s.top_k = static_cast<int32_t>(top_k.value_or(0));
  call->sampling_set.top_k = top_k.has_value();
  MOH_RETURN_IF_ERROR(ReadStopSequences(body, &s));
  return json_body::ReadActivation(Fields(body), &call->ratio,
                                   &call->min_ratio);
}

// model, stream, metadata ({"user_id": string}: accepted, not used).
absl::Status ReadOptions(const json& body, openai::GenerationRequest* request) {
  if (const json* model = Find(body, "model")) {
    if (!model->is_string()) return FieldError("model", "must be a string");
    request->model = model->get<std::string>();
  }
  if (const json* stream = Find(body, "stream")) {
    if (!stream->is_boolean()) {
      return FieldError("stream", "must be true or false");
    }
    request->stream = stream->get<bool>();
  }
  if (const json* metadata = Find(body, "metadata")) {
    if (!metadata->is_object()) {
      return FieldError("metadata", "must be an object");
    }
    for (const auto& [key, value] : metadata->items()) {
      if (key != "user_id") {
        return FieldError(absl::StrCat("metadata.", Abbreviate(key)),
                          "is not supported (metadata: user_id)");
      }
      if (!value.is_null() && !value.is_string()) {
        return FieldError("metadata.user_id", "must be a string");
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<openai::GenerationRequest> ParseChecked(absl::string_view body) {
  MOH_ASSIGN_OR_RETURN(const json parsed, ReadBody(body));
  openai::GenerationRequest request;
  request.endpoint = openai::Endpoint::kMessages;
  MOH_RETURN_IF_ERROR(ReadOptions(parsed, &request));
  MOH_ASSIGN_OR_RETURN(request.messages, ReadConversation(parsed));
  request.add_generation_prompt = true;
  MOH_RETURN_IF_ERROR(ReadSampling(parsed, &request.call));
  return request;
}

}  // namespace

absl::StatusOr<openai::GenerationRequest> ParseMessagesRequest(
    absl::string_view body) {
  // Every read above checks its value's type; should one not, the JSON
  // library's exception is still this request's error, not the server's.
  try {
    return ParseChecked(body);
  } catch (const json::exception& e) {
    return json_body::TypeError(e);
  }
}

}  // namespace anthropic
}  // namespace moh
