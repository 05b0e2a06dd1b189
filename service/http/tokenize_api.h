// The JSON of the tokenizer endpoints the HTTP door serves beside the OpenAI
// API, in vLLM's shapes, so that clients written for vLLM (lm-evaluation-
// harness's RemoteTokenizer: tokenizer_backend=remote) tokenize with the
// server's own tokenizer:
//   POST /tokenize    {"prompt": text} or {"messages": [...]}, optional
//                     "model", "add_special_tokens", "add_generation_prompt",
//                     "return_token_strs"
//                     -> {"count", "max_model_len", "tokens"[, "token_strs"]}
//   POST /detokenize  {"tokens": [ids], "model"?} -> {"prompt": text}
//   GET /tokenizer_info -> {"tokenizer_class", "bos_token", "eos_token",
//                     "pad_token", "unk_token", "model_max_length",
//                     "vocab_size"[, "chat_template"]}
// No HTTP here: unit-tested on strings
// (tests/service/http/tokenize_api_test.cc). Errors are openai_api.h's
// ErrorJson; fields are named as above.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "service/servable/servable_types.h"
#include "service/serving/dispatch.h"

namespace moh {
namespace tokenize_api {

// A POST /tokenize body, checked: exactly one of "prompt" (a string) and
// "messages" (a chat, as /v1/chat/completions takes it, rendered by the
// model's chat template). add_special_tokens defaults to true for a prompt
// and false for messages (the template writes them), as vLLM's.
struct TokenizeRequest {
  std::string model;  // empty: the server's language model
  TokenizeCall call;  // with messages: no prompt yet
  std::optional<ChatConversation> chat;
};
// INVALID_ARGUMENT naming the field and what it takes; unknown fields are
// refused by name.
absl::StatusOr<TokenizeRequest> ParseTokenizeRequest(absl::string_view body);

// A POST /detokenize body: "tokens", a list of non-negative integers (the
// model checks them against its vocabulary).
struct DetokenizeRequest {
  std::string model;
  std::vector<int32_t> tokens;
};
absl::StatusOr<DetokenizeRequest> ParseDetokenizeRequest(
    absl::string_view body);

std::string TokenizeJson(const TokenizeResult& result);
std::string DetokenizeJson(const std::string& prompt);
std::string TokenizerInfoJson(const TokenizerInfo& info);

}  // namespace tokenize_api
}  // namespace moh
