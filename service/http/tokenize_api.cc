#include "service/http/tokenize_api.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/abbreviate.h"
#include "base/field_error.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"
#include "service/http/json_body.h"
#include "service/http/openai_api.h"

namespace moh {
namespace tokenize_api {
namespace {

using json_body::Fields;
using nlohmann::json;

// `messages` as /v1/chat/completions reads them (the same checks and
// errors).
absl::StatusOr<std::vector<ChatMessage>> ReadMessages(const json& messages) {
  MOH_ASSIGN_OR_RETURN(
      openai::GenerationRequest chat,
      openai::ParseGenerationRequest(openai::Endpoint::kChatCompletions,
                                     json{{"messages", messages}}.dump()));
  return std::move(chat.messages);
}

// A special token's text, or null.
json Token(const std::optional<std::string>& token) {
  return token.has_value() ? json(*token) : json(nullptr);
}

std::string Dump(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace

absl::StatusOr<TokenizeRequest> ParseTokenizeRequest(absl::string_view body) {
  MOH_ASSIGN_OR_RETURN(
      const json object,
      json_body::ReadObject(
          body, {"model", "prompt", "messages", "add_special_tokens",
                 "add_generation_prompt", "return_token_strs"}));
  const Fields f(object);
  TokenizeRequest request;
  MOH_ASSIGN_OR_RETURN(request.model, f.String("model"));
  const json* messages = f.Get("messages");
  const bool chat = messages != nullptr;
  if (chat == (f.Get("prompt") != nullptr)) {
    return FieldError("prompt", chat
                                    ? "and messages: send one of them, not both"
                                    : "is required (a string; or messages)");
  }
  TokenizeCall& call = request.call;
  if (chat) {
    ChatConversation conversation;
    MOH_ASSIGN_OR_RETURN(conversation.messages, ReadMessages(*messages));
    MOH_ASSIGN_OR_RETURN(conversation.add_generation_prompt,
                         f.Bool("add_generation_prompt", true));
    request.chat = std::move(conversation);
  } else {
    if (f.Get("add_generation_prompt") != nullptr) {
      return FieldError("add_generation_prompt", "is for messages only");
    }
    MOH_ASSIGN_OR_RETURN(call.prompt, f.String("prompt"));
  }
  MOH_ASSIGN_OR_RETURN(call.add_special_tokens,
                       f.Bool("add_special_tokens", !chat));
  MOH_ASSIGN_OR_RETURN(call.token_strs, f.Bool("return_token_strs", false));
  return request;
}

absl::StatusOr<DetokenizeRequest> ParseDetokenizeRequest(
    absl::string_view body) {
  MOH_ASSIGN_OR_RETURN(const json object,
                       json_body::ReadObject(body, {"model", "tokens"}));
  const Fields f(object);
  DetokenizeRequest request;
  MOH_ASSIGN_OR_RETURN(request.model, f.String("model"));
  const json* tokens = f.Get("tokens");
  if (tokens == nullptr) {
    return FieldError("tokens", "is required (a list of token ids)");
  }
  if (!tokens->is_array()) {
    return FieldError(
        "tokens",
        absl::StrCat("must be a list of token ids, got ", tokens->type_name()));
  }
  constexpr int64_t kMaxId = std::numeric_limits<int32_t>::max();
  for (size_t i = 0; i < tokens->size(); ++i) {
    const json& t = (*tokens)[i];
    const std::string field = absl::StrCat("tokens[", i, "]");
    if (!t.is_number_integer()) {
      return FieldError(field, absl::StrCat("must be an integer token id, got ",
                                            t.type_name()));
    }
    const bool big =
        t.is_number_unsigned() && t.get<uint64_t>() > uint64_t{kMaxId};
    if (big || t.get<int64_t>() < 0) {
      return FieldError(
          field, absl::StrCat("must be in [0, ", kMaxId, "], got ", t.dump()));
    }
    request.tokens.push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  return request;
}

std::string TokenizeJson(const TokenizeResult& result) {
  json out = {{"count", result.tokens.size()},
              {"max_model_len", result.max_model_len},
              {"tokens", result.tokens}};
  if (result.token_strs.has_value()) out["token_strs"] = *result.token_strs;
  return Dump(out);
}

std::string DetokenizeJson(const std::string& prompt) {
  return Dump(json{{"prompt", prompt}});
}

std::string TokenizerInfoJson(const TokenizerInfo& info) {
  json out = {{"tokenizer_class", info.tokenizer_class},
              {"bos_token", Token(info.bos_token)},
              {"eos_token", Token(info.eos_token)},
              {"pad_token", Token(info.pad_token)},
              {"unk_token", Token(info.unk_token)},
              {"model_max_length", info.model_max_length},
              {"vocab_size", info.vocab_size}};
  if (info.chat_template.has_value()) {
    out["chat_template"] = *info.chat_template;
  }
  return Dump(out);
}

}  // namespace tokenize_api
}  // namespace moh
