// The JSON of Anthropic's Messages API (POST /v1/messages) on the HTTP door
// (openai_http.h): a request body checked and turned into the same
// GenerationRequest the OpenAI chat endpoint makes (so that the generation
// path, openai_http_generation.h, serves both), and results turned into
// Anthropic's message, stream events and error objects. No HTTP here, so all
// of it is unit-tested on strings (tests/service/http/anthropic_api_test.cc).
// The requests are anthropic_request.cc's, the answers anthropic_response.cc's.
//
// Field names are Anthropic's (`max_tokens`, `stop_sequences`, `system`);
// moh-serve's activation ratio enters as `activation_ratio` and
// `min_activation_ratio` and leaves as the `moh` object, as on the OpenAI
// endpoints. Text only: tools, thinking and non-text content blocks are
// refused by name.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "service/http/openai_api.h"
#include "service/servable/servable_types.h"

namespace moh {
namespace anthropic {

// Parses and checks a Messages body into a request of endpoint kMessages:
// `system` (a string or text blocks) becomes the conversation's first
// message, then `messages` (role "user" or "assistant", content a string or
// text blocks) as they are; n is 1. `max_tokens` is required; `temperature`
// is in [0, 1]. INVALID_ARGUMENT naming the field (Anthropic's name) and its
// allowed values; unknown fields are refused by name, and so are the fields
// and content blocks Anthropic defines that this server cannot honour.
absl::StatusOr<openai::GenerationRequest> ParseMessagesRequest(
    absl::string_view body);

// A field as this API names it, from its gRPC name (base/field_error.h):
// "sampling.stop" is "stop_sequences", the rest as openai::HttpFieldName.
std::string FieldName(absl::string_view field);

// {"type": "error", "error": {"type": "invalid_request_error", "message"}}:
// the error type follows the HTTP status openai::HttpStatus gives `status`
// (401 authentication_error, 403 permission_error, 404 not_found_error, 429
// rate_limit_error, 503 overloaded_error, 504 timeout_error, other 4xx
// invalid_request_error, else api_error); the message names the field as
// FieldName does.
std::string ErrorJson(const absl::Status& status);

// A new message id: "msg_" and 24 random hex digits.
std::string NewId();

// "max_tokens" (the token budget or the model's length ran out),
// "stop_sequence" (a stop string matched: Messages requests set no stop
// token ids), else "end_turn" (EOS).
const char* StopReason(FinishReason reason);

// Which of `stops` ended a generation whose tokens' texts are `token_texts`,
// in order (Servable::TokenText of each generated id): as the stop matcher
// of the sampler does, the first token after which some stop string is in
// the text, and of those found then, the one that starts first (the
// shortest, at one start). nullopt when none is found (a token's text that
// differs from its decoding in context).
std::optional<std::string> MatchedStopSequence(
    const std::vector<std::string>& token_texts,
    const std::vector<std::string>& stops);

// A finished message.
struct Message {
  std::string id;
  std::string model;
  std::string text;
  GenerationSummary summary;
  std::optional<std::string> stop_sequence;  // with reason "stop_sequence"
};

// The whole response (stream false): {"id", "type": "message", "role":
// "assistant", "model", "content": [{"type": "text", "text"}],
// "stop_reason", "stop_sequence", "usage": {"input_tokens",
// "output_tokens"}, "moh"}.
std::string MessageJson(const Message& message);

// A stream's events, each "event: <type>\ndata: <json>\n\n". The start:
// message_start (the message with empty content; usage 0, as the prompt's
// tokens are counted once it has run), content_block_start (index 0, an
// empty text block) and ping.
std::string StreamStartEvents(const std::string& id, const std::string& model);
// content_block_delta with a text_delta.
std::string TextDeltaEvent(const std::string& text);
// The end: content_block_stop, message_delta (stop_reason, stop_sequence,
// usage with input_tokens and output_tokens, moh) and message_stop.
std::string StreamEndEvents(const Message& message);
// An error once the stream has started: an `error` event.
std::string ErrorEvent(const absl::Status& status);

}  // namespace anthropic
}  // namespace moh
