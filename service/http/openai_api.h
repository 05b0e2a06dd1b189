// The JSON of the OpenAI-compatible HTTP API (openai_http.h): request bodies
// checked and turned into the servables' calls, results turned into OpenAI's
// response, stream chunk, model list and error objects. No HTTP here, so all
// of it is unit-tested on strings (tests/service/http/openai_api_test.cc). The
// requests are openai_request.cc's, the answers openai_response.cc's.
//
// Field names are OpenAI's (`max_tokens`, `stop`, ...); moh-serve's own idea,
// the activation ratio, enters as `activation_ratio` and
// `min_activation_ratio` and leaves as the `moh` object beside `usage`:
//   "moh": {"activation_ratio": 0.5, "effective_activation_ratio": 0.58}
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/tokenizer/chat_template.h"
#include "moh/v1/inference.pb.h"
#include "service/servable/servable.h"

namespace moh {
namespace openai {

// What the endpoint is: the object names of its responses differ.
// kMessages is Anthropic's POST /v1/messages (anthropic_api.h), served by the
// same generation path with its own request and response JSON.
enum class Endpoint { kCompletions, kChatCompletions, kMessages };

// A completions prompt as sent: its text, or its token ids.
struct Prompt {
  std::optional<std::string> text;
  std::optional<std::vector<int32_t>> token_ids;
};
// The most prompts one completions request may hold (OpenAI's batch form).
inline constexpr int32_t kMaxPrompts = 64;

// Completions' `echo`: the prompt comes back before the completion (OpenAI's
// legacy API); with `logprobs`, so do its tokens and their log-probabilities,
// the first token's null (lm-evaluation-harness scores log-likelihoods so).
struct Echo {
  bool on = false;
  // max_tokens 0: the prompt alone (one token is computed, then dropped).
  bool prompt_only = false;
  // Alternatives per position (`logprobs`); unset: no log-probabilities.
  std::optional<int32_t> top_n;
  // The prompts as sent; choice i is of prompts[i / samples].
  std::vector<Prompt> prompts;
  int32_t samples = 1;  // `n`
  // prompt_logprobs is set for the echo only: the client did not ask it.
  bool prompt_logprobs_unasked = false;
};

// A POST /v1/completions or /v1/chat/completions body, checked. Sampling
// fields left out take the model's generation_config.json defaults when it
// has them, else OpenAI's (temperature 1, top_p 1); max_tokens the model's
// configured default.
struct GenerationRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;  // empty: the server's only (or first) language model
  GenerateCall call;  // completions: the first prompt; chat: no prompt yet
  // Completions: every prompt, each run as a request of `call`'s fields with
  // `n` choices of its own: prompt p's sample i is choice p * n + i, as
  // OpenAI and vLLM answer a batch.
  std::vector<Prompt> prompts;
  std::vector<ChatMessage> messages;  // chat only
  bool add_generation_prompt = true;  // chat only
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  Echo echo;                   // completions only
};

// Parses and checks a body. INVALID_ARGUMENT naming the field (OpenAI's
// name) and its allowed values; unknown fields are refused by name.
absl::StatusOr<GenerationRequest> ParseGenerationRequest(
    Endpoint endpoint, absl::string_view body);

// A field as this API names it, from its gRPC name (base/field_error.h):
// "sampling.top_p" is "top_p", "activation.ratio" "activation_ratio".
std::string HttpFieldName(absl::string_view field);

// The HTTP status of an error (400, 401, 403, 404, 429, 499, 500, 503, 504).
int HttpStatus(absl::StatusCode code);
// {"error": {"message", "type", "param", "code": "INVALID_ARGUMENT"}}: the
// message and `param` (null for an error about no one field) name the
// field as this API does.
std::string ErrorJson(const absl::Status& status);

// A new response id: "cmpl-" or "chatcmpl-" and 24 random hex digits.
std::string NewId(Endpoint endpoint);

// "stop" (EOS or a stop string) or "length".
const char* FinishReasonString(FinishReason reason);

// A token's text for log-probabilities (Servable::TokenText).
using TokenTextFn = std::function<std::string(int32_t)>;

// What one choice (sample `index` of n) produced: all of it (ResponseJson),
// or what is new since its previous chunk (ChunkJson).
struct ChoiceOutput {
  int32_t index = 0;
  std::string text;
  std::vector<LogprobEntry> logprobs;          // one per token, when asked
  std::vector<LogprobEntry> prompt_logprobs;   // when asked (choice 0)
  const GenerationSummary* summary = nullptr;  // set once it has finished
  std::vector<int32_t> prompt_token_ids;       // with prompt_logprobs
  // Echo: a token shown before `logprobs` with a null log-probability (the
  // prompt's first).
  std::optional<int32_t> leading_token;

  // Appends more of the choice's output: its text and log-probabilities.
  void Append(const GenerationChunk& chunk) {
    AppendParts(chunk.text, chunk.logprobs, chunk.prompt_logprobs,
                chunk.prompt_token_ids);
  }
  void Append(const ChoiceOutput& more) {
    AppendParts(more.text, more.logprobs, more.prompt_logprobs,
                more.prompt_token_ids);
  }

 private:
  template <typename T>
  static void Extend(std::vector<T>& to, const std::vector<T>& from) {
    to.insert(to.end(), from.begin(), from.end());
  }
  void AppendParts(const std::string& more_text,
                   const std::vector<LogprobEntry>& more_logprobs,
                   const std::vector<LogprobEntry>& more_prompt_logprobs,
                   const std::vector<int32_t>& more_prompt_token_ids) {
    text += more_text;
    Extend(logprobs, more_logprobs);
    Extend(prompt_logprobs, more_prompt_logprobs);
    Extend(prompt_token_ids, more_prompt_token_ids);
  }
};

// The text of token ids decoded together (Servable::TokenText's, joined).
using DecodeFn = std::function<std::string(const std::vector<int32_t>&)>;

// Puts the echoed prompt before a choice's output: its text (as sent, or
// its ids decoded) and, with log-probabilities, its tokens' entries (from
// `out`'s prompt_logprobs, at most echo.top_n alternatives each). On a
// choice's first output (`first`); later outputs are only emptied when
// echo.prompt_only. The vLLM `prompt_logprobs` field stays only when asked.
void ApplyEcho(const Echo& echo, bool prompt_asked, const DecodeFn& decode,
               bool first, ChoiceOutput* out);
// The summary as echo.prompt_only reports it: no completion tokens, finished
// by "length".
void ApplyEcho(const Echo& echo, GenerationSummary* summary);

// The log-probabilities the request asked for (`logprobs` / `top_logprobs`,
// `prompt_logprobs`): choices without them show null.
struct LogprobsAsked {
  bool tokens = false;
  bool prompt = false;
};

// The summary of a request's choices together (`n` of each prompt): each
// prompt once, the completion tokens of all, the effective ratio over all
// tokens computed.
GenerationSummary CombineSummaries(
    const std::vector<GenerationSummary>& samples, int32_t n = 1);

// The whole response of a finished request (stream false): every choice,
// each with its summary, and `summary` (CombineSummaries) for usage and moh.
struct Finished {
  std::string id;
  int64_t created = 0;  // Unix seconds
  std::string model;
  std::vector<ChoiceOutput> choices;
  GenerationSummary summary;
  LogprobsAsked asked;
};
std::string ResponseJson(Endpoint endpoint, const Finished& finished,
                         const TokenTextFn& token_text);

// One stream chunk ("data: <this>\n\n") of one choice: its new text (and
// log-probabilities); a choice's last chunk has its finish reason and its
// `moh` object. With include_usage, the usage chunk (empty choices, `summary`
// of the request) follows the last choice's.
struct Chunk {
  std::string id;
  int64_t created = 0;
  std::string model;
  ChoiceOutput choice;
  bool first = false;  // chat: the choice's first delta carries the role
  LogprobsAsked asked;
  // Completions' text_offset of the chunk's first token: the length of the
  // tokens' text streamed before in this choice.
  int64_t offset = 0;
};
std::string ChunkJson(Endpoint endpoint, const Chunk& chunk,
                      const TokenTextFn& token_text);
std::string UsageChunkJson(Endpoint endpoint, const Chunk& chunk,
                           const GenerationSummary& summary);

// GET /v1/models: {"object": "list", "data": [...]}, every hosted model with
// a `moh` object (family, state, ratios, max_seq_len).
std::string ModelsJson(const std::vector<v1::ModelInfo>& models);

}  // namespace openai
}  // namespace moh
