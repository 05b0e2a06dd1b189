#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "base/abbreviate.h"
#include "base/field_error.h"
#include "base/status_macros.h"
#include "model/generation/sampler.h"
#include "nlohmann/json.hpp"
#include "service/http/json_body.h"
#include "service/http/openai_api.h"
#include "service/http/response_format.h"
#include "service/metrics/request_log.h"

// The request bodies, parsed and checked (the answers are
// openai_response.cc's).
namespace moh {
namespace openai {
namespace {

using nlohmann::json;

using json_body::Fields;

// An error about `field` (already this API's name: HttpFieldName keeps it).
absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return FieldError(field, what);
}

// Fields OpenAI defines that this server accepts only at their defaults
// (the value that means "off"), so that a client relying on one hears so.
absl::Status CheckUnsupported(Endpoint endpoint, const Fields& f) {
  struct Off {
    const char* name;
    const char* off;  // what the client may send instead
  };
  for (const Off& o :
       {Off{endpoint == Endpoint::kChatCompletions ? "echo" : "", "false"},
        Off{"best_of", "null or 1"}, Off{"suffix", "null or \"\""},
        Off{"tools", "null or []"}, Off{"tool_choice", "null or \"none\""}}) {
    const json* v = *o.name != '\0' ? f.Get(o.name) : nullptr;
    if (v == nullptr) continue;
    const bool off =
        (v->is_boolean() && !v->get<bool>()) ||
        (v->is_number() && v->get<double>() == 0.0) ||
        (v->is_number() && std::string(o.name) == "best_of" &&
         v->get<double>() == 1.0) ||
        (v->is_string() &&
         (v->get<std::string>().empty() || v->get<std::string>() == "none")) ||
        (v->is_object() &&
         (v->empty() ||
          (v->size() == 1 && v->contains("type") && (*v)["type"] == "text"))) ||
        (v->is_array() && v->empty());
    if (!off) {
      return Invalid(o.name,
                     absl::StrCat("is not supported by this server yet: "
                                  "send ",
                                  o.off, " or leave it out"));
    }
  }
  return absl::OkStatus();
}

// `list`'s token ids; else INVALID_ARGUMENT "<field> must be <what>".
absl::StatusOr<std::vector<int32_t>> TokenIds(const json& list,
                                              const std::string& field,
                                              const char* what) {
  std::vector<int32_t> ids;
  for (const json& t : list) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 ||
        t.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return Invalid(field,
                     absl::StrCat("must be ", what,
                                  " (token ids: non-negative integers)"));
    }
    ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  return ids;
}

// The most max_tokens a request may ask (the model's max_seq_len bounds it
// further, in the servable).
constexpr int64_t kMaxTokens = 1 << 20;

constexpr char kPromptShape[] =
    "a string, a list of token ids, or a list of those";

// One prompt of a list: a string or a non-empty list of token ids.
absl::StatusOr<Prompt> OnePrompt(const json& p, const std::string& field) {
  Prompt prompt;
  if (p.is_string()) {
    prompt.text = p.get<std::string>();
  } else if (p.is_array() && !p.empty()) {
    MOH_ASSIGN_OR_RETURN(prompt.token_ids, TokenIds(p, field, kPromptShape));
  } else {
    return Invalid(field, "must be a string or a non-empty list of token ids");
  }
  return prompt;
}

// prompt: a string, a list of token ids, or a list of those (OpenAI's batch
// form: one request's choices per prompt), at most kMaxPrompts. The call
// takes the first.
absl::Status ReadPrompts(const Fields& f, GenerationRequest* request) {
  const json* p = f.Get("prompt");
  if (p == nullptr) return Invalid("prompt", "is required");
  if (!p->is_string() && (!p->is_array() || p->empty())) {
    return Invalid("prompt", absl::StrCat("must be ", kPromptShape));
  }
  std::vector<Prompt>& prompts = request->prompts;
  if (p->is_string() || (*p)[0].is_number_integer()) {
    MOH_ASSIGN_OR_RETURN(Prompt one, OnePrompt(*p, "prompt"));
    prompts.push_back(std::move(one));
  } else {
    if (p->size() > static_cast<size_t>(kMaxPrompts)) {
      return Invalid("prompt", absl::StrCat("must hold at most ", kMaxPrompts,
                                            " prompts, got ", p->size()));
    }
    for (size_t i = 0; i < p->size(); ++i) {
      MOH_ASSIGN_OR_RETURN(Prompt one,
                           OnePrompt((*p)[i], absl::StrCat("prompt[", i, "]")));
      prompts.push_back(std::move(one));
    }
  }
  request->call.prompt = prompts.front().text;
  request->call.token_ids = prompts.front().token_ids;
  return absl::OkStatus();
}

// messages: [{"role": "system"|"user"|"assistant"|..., "content": text or
// [{"type": "text", "text": ...}, ...]}, ...]
absl::StatusOr<std::vector<ChatMessage>> ReadMessages(const Fields& f) {
  const json* m = f.Get("messages");
  if (m == nullptr) return Invalid("messages", "is required");
  if (!m->is_array() || m->empty()) {
    return Invalid("messages", "must be a non-empty list of messages");
  }
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < m->size(); ++i) {
    const json& entry = (*m)[i];
    const std::string at = absl::StrCat("messages[", i, "]");
    if (!entry.is_object()) return Invalid(at, "must be an object");
    ChatMessage message;
    auto role = entry.find("role");
    if (role == entry.end() || !role->is_string() ||
        role->get<std::string>().empty()) {
      return Invalid(at + ".role", "must be a non-empty string");
    }
    message.role = role->get<std::string>();
    auto content = entry.find("content");
    if (content == entry.end() || content->is_null()) {
      // An assistant turn may have no content (it called tools).
    } else if (content->is_string()) {
      message.content = content->get<std::string>();
    } else if (content->is_array()) {
      for (size_t k = 0; k < content->size(); ++k) {
        const json& part = (*content)[k];
        const std::string part_at = absl::StrCat(at, ".content[", k, "]");
        if (!part.is_object()) {
          return Invalid(part_at, absl::StrCat("must be an object, got ",
                                               part.type_name()));
        }
        // Every value read by its type first: a number where a string
        // belongs is the client's error, never an exception.
        const auto type = part.find("type");
        if (type == part.end() || !type->is_string() ||
            type->get_ref<const std::string&>() != "text") {
          return Invalid(part_at + ".type",
                         "must be \"text\" (this server takes text only)");
        }
        const auto text = part.find("text");
        if (text == part.end() || !text->is_string()) {
          return Invalid(part_at + ".text", "must be a string");
        }
        message.content += text->get_ref<const std::string&>();
      }
    } else {
      return Invalid(at + ".content",
                     "must be a string or a list of text parts");
    }
    messages.push_back(std::move(message));
  }
  return messages;
}

// stop: a string or a list of at most kMaxStopStrings strings.
absl::Status ReadStop(const Fields& f, SamplingParams* sampling) {
  const json* s = f.Get("stop");
  if (s == nullptr) return absl::OkStatus();
  if (s->is_string()) {
    sampling->stop.push_back(s->get<std::string>());
    return absl::OkStatus();
  }
  if (!s->is_array()) {
    return Invalid("stop", "must be a string or a list of strings");
  }
  for (const json& one : *s) {
    if (!one.is_string()) {
      return Invalid("stop", "must be a string or a list of strings");
    }
    sampling->stop.push_back(one.get<std::string>());
  }
  return absl::OkStatus();
}

// logit_bias: an object from token ids (as strings, as JSON keys are) to
// the biases added to their logits. The count is checked before the entries
// are copied; the sampler checks the biases' range, the model the ids.
absl::Status ReadLogitBias(const Fields& f, SamplingParams* sampling) {
  const json* bias = f.Get("logit_bias");
  if (bias == nullptr) return absl::OkStatus();
  if (!bias->is_object()) {
    return Invalid("logit_bias",
                   "must be an object from token ids to biases in [-100, 100]");
  }
  if (bias->size() > static_cast<size_t>(kMaxLogitBias)) {
    return Invalid("logit_bias",
                   absl::StrCat("must have at most ", kMaxLogitBias,
                                " entries, got ", bias->size()));
  }
  for (const auto& [key, value] : bias->items()) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(key, &id) || id < 0) {
      return Invalid("logit_bias",
                     absl::StrCat("keys must be token ids (integers >= 0), "
                                  "got \"",
                                  Abbreviate(key, 32), "\""));
    }
    if (!value.is_number()) {
      return Invalid("logit_bias",
                     absl::StrCat("values must be numbers in [-100, 100], got ",
                                  value.type_name(), " for token ", id));
    }
    sampling->logit_bias.emplace_back(id, value.get<float>());
  }
  return absl::OkStatus();
}

// Completions: logprobs, the number of alternatives (an integer). Chat:
// logprobs true, with top_logprobs alternatives. Both: prompt_logprobs
// (vLLM's).
absl::Status ReadLogprobs(Endpoint endpoint, const Fields& f,
                          SamplingParams* s) {
  if (endpoint == Endpoint::kCompletions) {
    MOH_ASSIGN_OR_RETURN(std::optional<int64_t> n,
                         f.Integer("logprobs", 0, kMaxLogprobs));
    if (n) s->logprobs = static_cast<int32_t>(*n);
  } else {
    MOH_ASSIGN_OR_RETURN(bool wanted, f.Bool("logprobs", false));
    MOH_ASSIGN_OR_RETURN(std::optional<int64_t> top,
                         f.Integer("top_logprobs", 0, kMaxLogprobs));
    if (top && !wanted) {
      return Invalid("top_logprobs", "needs \"logprobs\": true");
    }
    if (wanted) s->logprobs = static_cast<int32_t>(top.value_or(0));
  }
  MOH_ASSIGN_OR_RETURN(std::optional<int64_t> prompt,
                       f.Integer("prompt_logprobs", 0, kMaxLogprobs));
  if (prompt) s->prompt_logprobs = static_cast<int32_t>(*prompt);
  return absl::OkStatus();
}

std::set<std::string> KnownFields(Endpoint endpoint) {
  std::set<std::string> known = {
      "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
      "stop_token_ids", "ignore_eos", "min_tokens", "stream", "stream_options",
      "n", "repetition_penalty", "user", "logprobs", "prompt_logprobs", "min_p",
      "presence_penalty", "frequency_penalty", "priority", "response_format",
      "logit_bias",
      // Accepted only at their defaults (CheckUnsupported).
      "echo", "best_of", "suffix"};
  if (endpoint == Endpoint::kCompletions) {
    known.insert("prompt");
  } else {
    known.insert({"messages", "max_completion_tokens", "add_generation_prompt",
                  "top_logprobs", "tools", "tool_choice"});
  }
  known.insert(std::begin(json_body::kActivationFields),
               std::end(json_body::kActivationFields));
  return known;
}

// Sampling: the token budget, the sampler's fields, stops, samples,
// priority, log-probabilities. The server's own limits (max_seq_len) apply
// later, in the servable.
absl::Status ReadSampling(Endpoint endpoint, const Fields& f,
                          GenerateCall* out) {
  GenerateCall& call = *out;
  SamplingParams& s = call.sampling;
  // Completions' 0 is for `echo` (ReadEcho).
  MOH_ASSIGN_OR_RETURN(
      std::optional<int64_t> max_tokens,
      f.Integer("max_tokens", endpoint == Endpoint::kCompletions ? 0 : 1,
                kMaxTokens));
  if (endpoint == Endpoint::kChatCompletions) {
    // The newer name wins.
    MOH_ASSIGN_OR_RETURN(std::optional<int64_t> max_completion_tokens,
                         f.Integer("max_completion_tokens", 1, kMaxTokens));
    if (max_completion_tokens) max_tokens = max_completion_tokens;
  }
  if (max_tokens) call.max_new_tokens = static_cast<int32_t>(*max_tokens);
  MOH_ASSIGN_OR_RETURN(std::optional<double> temperature,
                       f.Number("temperature", 0.0, 2.0));
  s.temperature = static_cast<float>(temperature.value_or(1.0));
  call.sampling_set.temperature = temperature.has_value();
  MOH_ASSIGN_OR_RETURN(std::optional<double> top_p,
                       f.Number("top_p", 0.0, 1.0, /*lo_open=*/true));
  s.top_p = static_cast<float>(top_p.value_or(1.0));
  call.sampling_set.top_p = top_p.has_value();
  MOH_ASSIGN_OR_RETURN(
      std::optional<int64_t> top_k,
      f.Integer("top_k", -1, std::numeric_limits<int32_t>::max()));
  s.top_k = top_k && *top_k > 0 ? static_cast<int32_t>(*top_k) : 0;
  call.sampling_set.top_k = top_k.has_value();
  MOH_ASSIGN_OR_RETURN(
      std::optional<int64_t> seed,
      f.Integer("seed", 0, std::numeric_limits<int64_t>::max()));
  if (seed) s.seed = static_cast<uint64_t>(*seed);
  MOH_ASSIGN_OR_RETURN(
      std::optional<double> penalty,
      f.Number("repetition_penalty", 0.0, 1e6, /*lo_open=*/true));
  s.repetition_penalty = static_cast<float>(penalty.value_or(1.0));
  call.sampling_set.repetition_penalty = penalty.has_value();
  MOH_RETURN_IF_ERROR(ReadStop(f, &s));
  MOH_RETURN_IF_ERROR(ReadLogitBias(f, &s));
  if (const json* ids = f.Get("stop_token_ids")) {
    if (!ids->is_array()) {
      return Invalid("stop_token_ids", "must be a list of token ids");
    }
    MOH_ASSIGN_OR_RETURN(s.stop_token_ids, TokenIds(*ids, "stop_token_ids",
                                                    "a list of token ids"));
  }
  MOH_ASSIGN_OR_RETURN(s.ignore_eos, f.Bool("ignore_eos", false));
  MOH_ASSIGN_OR_RETURN(std::optional<int64_t> min_tokens,
                       f.Integer("min_tokens", 0, kMaxTokens));
  s.min_tokens = static_cast<int32_t>(min_tokens.value_or(0));
  MOH_ASSIGN_OR_RETURN(std::optional<int64_t> n,
                       f.Integer("n", 1, kMaxSamples));
  call.n = static_cast<int32_t>(n.value_or(1));
  MOH_ASSIGN_OR_RETURN(std::optional<int64_t> priority,
                       f.Integer("priority", -kMaxPriority, kMaxPriority));
  call.priority = static_cast<int32_t>(priority.value_or(0));
  for (auto [name, value] :
       {std::pair<const char*, float*>{"presence_penalty", &s.presence_penalty},
        {"frequency_penalty", &s.frequency_penalty}}) {
    MOH_ASSIGN_OR_RETURN(std::optional<double> x,
                         f.Number(name, -kMaxOutputPenalty, kMaxOutputPenalty));
    *value = static_cast<float>(x.value_or(0.0));
  }
  MOH_ASSIGN_OR_RETURN(std::optional<double> min_p, f.Number("min_p", 0, 1));
  s.min_p = static_cast<float>(min_p.value_or(0.0));
  call.sampling_set.min_p = min_p.has_value();
  MOH_RETURN_IF_ERROR(ReadLogprobs(endpoint, f, &s));
  return absl::OkStatus();
}

// echo (completions), after ReadSampling: the prompt comes back, and with
// `logprobs` its entries, computed as vLLM's prompt_logprobs (with at least
// as many alternatives). max_tokens 0, the prompt alone, only with it.
absl::Status ReadEcho(const Fields& f, GenerationRequest* request) {
  GenerateCall& call = request->call;
  Echo& echo = request->echo;
  MOH_ASSIGN_OR_RETURN(echo.on, f.Bool("echo", false));
  if (call.max_new_tokens == 0) {
    if (!echo.on) {
      return Invalid("max_tokens",
                     absl::StrCat("must be in [1, ", kMaxTokens,
                                  "], got 0 (0 only with \"echo\": true)"));
    }
    echo.prompt_only = true;
    call.max_new_tokens = 1;  // computed, then dropped
  }
  if (!echo.on) return absl::OkStatus();
  SamplingParams& s = call.sampling;
  if (s.logprobs) {
    if (call.n > 1) {
      return Invalid("echo", absl::StrCat("with logprobs takes n 1 (one "
                                          "sample), got n ",
                                          call.n));
    }
    echo.top_n = s.logprobs;
    echo.prompt_logprobs_unasked = !s.prompt_logprobs.has_value();
    s.prompt_logprobs = std::max(s.prompt_logprobs.value_or(0), *s.logprobs);
  }
  echo.prompts = request->prompts;
  echo.samples = call.n;
  return absl::OkStatus();
}

// stream, and stream_options (include_usage) with it.
absl::Status ReadStream(const Fields& f, GenerationRequest* request) {
  MOH_ASSIGN_OR_RETURN(request->stream, f.Bool("stream", false));
  if (const json* options = f.Get("stream_options")) {
    if (!request->stream) {
      return Invalid("stream_options", "needs \"stream\": true");
    }
    if (!options->is_object())
      return Invalid("stream_options", "must be an object");
    for (const auto& [key, value] : options->items()) {
      if (key != "include_usage") {
        return Invalid(absl::StrCat("stream_options.", key),
                       "is not supported (stream_options: include_usage)");
      }
    }
    MOH_ASSIGN_OR_RETURN(request->include_usage,
                         Fields(*options).Bool("include_usage", false));
  }
  return absl::OkStatus();
}

absl::StatusOr<GenerationRequest> ParseChecked(Endpoint endpoint,
                                               absl::string_view body) {
  MOH_ASSIGN_OR_RETURN(const json parsed,
                       json_body::ReadObject(body, KnownFields(endpoint)));
  const Fields f(parsed);
  MOH_RETURN_IF_ERROR(CheckUnsupported(endpoint, f));
  GenerationRequest request;
  request.endpoint = endpoint;
  MOH_ASSIGN_OR_RETURN(request.model, f.String("model"));
  if (endpoint == Endpoint::kCompletions) {
    MOH_RETURN_IF_ERROR(ReadPrompts(f, &request));
  } else {
    MOH_ASSIGN_OR_RETURN(request.messages, ReadMessages(f));
    MOH_ASSIGN_OR_RETURN(request.add_generation_prompt,
                         f.Bool("add_generation_prompt", true));
  }
  MOH_RETURN_IF_ERROR(ReadSampling(endpoint, f, &request.call));
  if (endpoint == Endpoint::kCompletions) {
    MOH_RETURN_IF_ERROR(ReadEcho(f, &request));
  }
  MOH_RETURN_IF_ERROR(json_body::ReadActivation(f, &request.call.ratio,
                                                &request.call.min_ratio));
  MOH_RETURN_IF_ERROR(ReadResponseFormat(parsed, body, &request.call));
  MOH_ASSIGN_OR_RETURN(std::string user, f.String("user"));
  (void)user;  // accepted, not used
  MOH_RETURN_IF_ERROR(ReadStream(f, &request));
  return request;
}

}  // namespace

absl::StatusOr<GenerationRequest> ParseGenerationRequest(
    Endpoint endpoint, absl::string_view body) {
  // Every read above checks its value's type; should one not, the JSON
  // library's exception is still this request's error, not the server's.
  try {
    return ParseChecked(endpoint, body);
  } catch (const json::exception& e) {
    return json_body::TypeError(e);
  }
}

}  // namespace openai
}  // namespace moh
