#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "base/abbreviate.h"
#include "base/field_error.h"
#include "nlohmann/json.hpp"
#include "service/http/openai_api.h"
#include "service/metrics/request_log.h"

// The answers: errors, responses, stream chunks and the model list (the
// request bodies are openai_request.cc's).
namespace moh {
namespace openai {

using nlohmann::json;

std::string HttpFieldName(absl::string_view field) {
  if (field == "sampling.max_new_tokens") return "max_tokens";
  if (absl::ConsumePrefix(&field, "sampling.")) return std::string(field);
  if (field == "activation.ratio") return "activation_ratio";
  if (field == "activation.min_ratio") return "min_activation_ratio";
  if (field == "prompt (or token_ids)") return "prompt";
  if (field == "token_ids") return "prompt token ids";
  return std::string(field);
}

int HttpStatus(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kCancelled:
      return 499;  // the client closed the request (nginx's code)
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kFailedPrecondition:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

std::string ErrorJson(const absl::Status& status) {
  const int http = HttpStatus(status.code());
  const char* type = http == 401   ? "authentication_error"
                     : http == 403 ? "permission_error"
                     : http == 404 ? "not_found_error"
                     : http == 429 ? "rate_limit_error"
                     : http < 500  ? "invalid_request_error"
                                   : "server_error";
  const std::optional<std::string> field = ErrorField(status);
  json error = {{"message", MessageNaming(status, HttpFieldName)},
                {"type", type},
                {"param", field.has_value() ? json(HttpFieldName(*field))
                                            : json(nullptr)},
                {"code", absl::StatusCodeToString(status.code())}};
  return json{{"error", error}}.dump(-1, ' ', false,
                                     json::error_handler_t::replace);
}

std::string NewId(Endpoint endpoint) {
  return absl::StrCat(
      endpoint == Endpoint::kCompletions ? "cmpl-" : "chatcmpl-",
      RandomHex(24));
}

const char* FinishReasonString(FinishReason reason) {
  return reason == FinishReason::kLength ? "length" : "stop";
}

namespace {

json Usage(const GenerationSummary& s) {
  return {{"prompt_tokens", s.prompt_tokens},
          {"completion_tokens", s.completion_tokens},
          {"total_tokens", s.prompt_tokens + s.completion_tokens}};
}

json MohObject(const GenerationSummary& s) {
  return {{"activation_ratio", s.applied_ratio},
          {"effective_activation_ratio", s.effective_ratio}};
}

json Head(Endpoint endpoint, const std::string& id, int64_t created,
          const std::string& model, bool chunk) {
  const char* object =
      endpoint == Endpoint::kCompletions
          ? "text_completion"
          : (chunk ? "chat.completion.chunk" : "chat.completion");
  return {
      {"id", id}, {"object", object}, {"created", created}, {"model", model}};
}

// A log-probability as JSON: -inf has no JSON number; OpenAI's clients
// expect a number, so it is the most negative float.
double JsonLogprob(float logprob) {
  return std::isfinite(logprob) ? logprob : -std::numeric_limits<float>::max();
}

json Utf8Bytes(const std::string& text) {
  json bytes = json::array();
  for (unsigned char c : text) bytes.push_back(static_cast<int>(c));
  return bytes;
}

// The choice's logprobs object. Completions (OpenAI's legacy form):
// {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
// "text_offset"}, offsets counted from `offset` in the choice's text. Chat:
// {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}.
json LogprobsJson(Endpoint endpoint, const ChoiceOutput& c,
                  const TokenTextFn& token_text, int64_t offset) {
  const std::vector<LogprobEntry>& entries = c.logprobs;
  if (endpoint == Endpoint::kChatCompletions) {
    json content = json::array();
    for (const LogprobEntry& e : entries) {
      const std::string token = token_text(e.token.id);
      json top = json::array();
      for (const TokenLogprob& t : e.top) {
        const std::string alternative = token_text(t.id);
        top.push_back({{"token", alternative},
                       {"logprob", JsonLogprob(t.logprob)},
                       {"bytes", Utf8Bytes(alternative)}});
      }
      content.push_back({{"token", token},
                         {"logprob", JsonLogprob(e.token.logprob)},
                         {"bytes", Utf8Bytes(token)},
                         {"top_logprobs", top}});
    }
    return {{"content", content}};
  }
  json tokens = json::array(), token_logprobs = json::array(),
       top_logprobs = json::array(), text_offset = json::array();
  if (c.leading_token) {  // echo's first prompt token: nothing predicts it
    const std::string token = token_text(*c.leading_token);
    tokens.push_back(token);
    token_logprobs.push_back(nullptr);
    top_logprobs.push_back(nullptr);
    text_offset.push_back(offset);
    offset += static_cast<int64_t>(token.size());
  }
  for (const LogprobEntry& e : entries) {
    const std::string token = token_text(e.token.id);
    tokens.push_back(token);
    token_logprobs.push_back(JsonLogprob(e.token.logprob));
    json top = json::object();
    for (const TokenLogprob& t : e.top) {
      top[token_text(t.id)] = JsonLogprob(t.logprob);
    }
    top_logprobs.push_back(top);
    text_offset.push_back(offset);
    offset += static_cast<int64_t>(token.size());
  }
  return {{"tokens", tokens},
          {"token_logprobs", token_logprobs},
          {"top_logprobs", top_logprobs},
          {"text_offset", text_offset}};
}

// vLLM's prompt_logprobs: null for the first prompt token, then for each
// token {"<id>": {"logprob", "rank", "decoded_token"}} for it and its top
// alternatives.
json PromptLogprobsJson(const std::vector<LogprobEntry>& entries,
                        const TokenTextFn& token_text) {
  json out = json::array({nullptr});
  for (const LogprobEntry& e : entries) {
    json position = json::object();
    for (size_t i = 0; i < e.top.size(); ++i) {
      position[std::to_string(e.top[i].id)] = {
          {"logprob", JsonLogprob(e.top[i].logprob)},
          {"rank", static_cast<int>(i) + 1},
          {"decoded_token", token_text(e.top[i].id)}};
    }
    position[std::to_string(e.token.id)] = {
        {"logprob", JsonLogprob(e.token.logprob)},
        {"rank", e.rank},
        {"decoded_token", token_text(e.token.id)}};
    out.push_back(position);
  }
  return out;
}

// The fields a choice has in both forms: index, finish_reason, logprobs
// and prompt_logprobs.
json ChoiceHead(Endpoint endpoint, const ChoiceOutput& c,
                const LogprobsAsked& asked, const TokenTextFn& token_text,
                int64_t offset) {
  json choice = {{"index", c.index}};
  choice["finish_reason"] =
      c.summary ? json(FinishReasonString(c.summary->finish_reason)) : json();
  choice["logprobs"] =
      asked.tokens ? LogprobsJson(endpoint, c, token_text, offset) : json();
  if (asked.prompt && !c.prompt_logprobs.empty()) {
    choice["prompt_logprobs"] =
        PromptLogprobsJson(c.prompt_logprobs, token_text);
  }
  return choice;
}

std::string Dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace

void ApplyEcho(const Echo& echo, bool prompt_asked, const DecodeFn& decode,
               bool first, ChoiceOutput* out) {
  if (!echo.on) return;
  if (echo.prompt_only) {
    out->text.clear();
    out->logprobs.clear();
  }
  if (!first) return;
  const size_t p = static_cast<size_t>(out->index / echo.samples);
  if (p < echo.prompts.size()) {
    const Prompt& prompt = echo.prompts[p];
    out->text.insert(
        0, prompt.text
               ? *prompt.text
               : decode(prompt.token_ids.value_or(std::vector<int32_t>())));
  }
  if (echo.top_n && !out->prompt_token_ids.empty()) {
    std::vector<LogprobEntry> entries = out->prompt_logprobs;
    for (LogprobEntry& e : entries) {
      if (e.top.size() > static_cast<size_t>(*echo.top_n)) {
        e.top.resize(*echo.top_n);
      }
    }
    out->leading_token = out->prompt_token_ids.front();
    out->logprobs.insert(out->logprobs.begin(), entries.begin(), entries.end());
  }
  if (!prompt_asked) out->prompt_logprobs.clear();
}

void ApplyEcho(const Echo& echo, GenerationSummary* summary) {
  if (!echo.prompt_only) return;
  summary->completion_tokens = 0;
  summary->finish_reason = FinishReason::kLength;
}

GenerationSummary CombineSummaries(
    const std::vector<GenerationSummary>& samples, int32_t n) {
  if (samples.empty()) return GenerationSummary();
  GenerationSummary all = samples.front();
  all.prompt_tokens = 0;
  all.completion_tokens = 0;
  all.routed_tokens = 0;
  double used = 0.0;  // (token, head) pairs, as fractions of each's tokens
  for (const GenerationSummary& s : samples) {
    // Each prompt's first sample counts it.
    if (s.index % n == 0) all.prompt_tokens += s.prompt_tokens;
    all.completion_tokens += s.completion_tokens;
    all.routed_tokens += s.routed_tokens;
    used += s.effective_ratio * static_cast<double>(s.routed_tokens);
  }
  if (all.routed_tokens > 0) {
    all.effective_ratio = used / static_cast<double>(all.routed_tokens);
  }
  return all;
}

std::string ResponseJson(Endpoint endpoint, const Finished& f,
                         const TokenTextFn& token_text) {
  json out = Head(endpoint, f.id, f.created, f.model, /*chunk=*/false);
  json choices = json::array();
  for (const ChoiceOutput& c : f.choices) {
    json choice = ChoiceHead(endpoint, c, f.asked, token_text, 0);
    if (endpoint == Endpoint::kCompletions) {
      choice["text"] = c.text;
    } else {
      choice["message"] = {{"role", "assistant"}, {"content", c.text}};
    }
    choices.push_back(std::move(choice));
  }
  out["choices"] = std::move(choices);
  out["usage"] = Usage(f.summary);
  out["moh"] = MohObject(f.summary);
  return Dump(out);
}

std::string ChunkJson(Endpoint endpoint, const Chunk& c,
                      const TokenTextFn& token_text) {
  json out = Head(endpoint, c.id, c.created, c.model, /*chunk=*/true);
  json choice = ChoiceHead(endpoint, c.choice, c.asked, token_text, c.offset);
  if (endpoint == Endpoint::kCompletions) {
    choice["text"] = c.choice.text;
  } else {
    json delta = json::object();
    if (c.first) delta["role"] = "assistant";
    if (!c.choice.text.empty() || c.first) delta["content"] = c.choice.text;
    choice["delta"] = delta;
  }
  out["choices"] = json::array({choice});
  if (c.choice.summary) out["moh"] = MohObject(*c.choice.summary);
  return Dump(out);
}

std::string UsageChunkJson(Endpoint endpoint, const Chunk& c,
                           const GenerationSummary& summary) {
  json out = Head(endpoint, c.id, c.created, c.model, /*chunk=*/true);
  out["choices"] = json::array();
  out["usage"] = Usage(summary);
  out["moh"] = MohObject(summary);
  return Dump(out);
}

std::string ModelsJson(const std::vector<v1::ModelInfo>& models) {
  json data = json::array();
  for (const v1::ModelInfo& m : models) {
    // An alias's parent is its model (vLLM's field for a LoRA's base).
    const std::string root = m.alias_of().empty() ? m.name() : m.alias_of();
    data.push_back({{"id", m.name()},
                    {"object", "model"},
                    {"created", 0},
                    {"owned_by", "moh-serve"},
                    {"root", root},
                    {"parent", m.alias_of().empty() ? json() : json(root)},
                    {"max_model_len", m.max_seq_len()},
                    {"moh",
                     {{"family", m.family()},
                      {"state", v1::ModelInfo::State_Name(m.state())},
                      {"default_activation_ratio", m.default_ratio()},
                      {"min_activation_ratio", m.min_ratio()},
                      {"max_seq_len", m.max_seq_len()}}}});
    if (!m.alias_of().empty()) data.back()["moh"]["alias_of"] = root;
  }
  return Dump(json{{"object", "list"}, {"data", data}});
}

}  // namespace openai
}  // namespace moh
