// Fuzzes the HTTP API's request path (service/http/openai_api.h) as a client
// reaches it: the first byte picks the endpoint (/v1/completions or
// /v1/chat/completions), the rest is the body. The body is parsed and
// checked; a chat request's messages are rendered by demo-lm's chat template
// (the server's next step); the error answer is rendered as the HTTP door
// renders it. Contracts: nothing throws or crashes; a refused body is
// INVALID_ARGUMENT (or a template's refusal, INVALID_ARGUMENT too); the
// error JSON stays small whatever the body quotes (the echo rule: client
// text is abbreviated); a rendered prompt stays within its bound.
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "fuzz/fuzz_check.h"
#include "model/tokenizer/chat_template.h"
#include "nlohmann/json.hpp"
#include "service/http/openai_api.h"

namespace {

// demo-lm's template, read once (MOH_SOURCE_DIR is compiled in).
const moh::ChatTemplate& DemoTemplate() {
  static const moh::ChatTemplate* parsed = [] {
    std::ifstream in(std::string(MOH_SOURCE_DIR) +
                     "/models/demo-lm/tokenizer_config.json");
    std::stringstream text;
    text << in.rdbuf();
    const nlohmann::json config = nlohmann::json::parse(text.str());
    auto result = moh::ChatTemplate::Parse(
        config.at("chat_template").get<std::string>());
    MOH_FUZZ_CHECK(result.ok(), std::string(result.status().message()));
    return new moh::ChatTemplate(std::move(*result));
  }();
  return *parsed;
}

void CheckError(const absl::Status& status) {
  moh::fuzz::CheckInvalidArgument(status);
  const std::string json = moh::openai::ErrorJson(status);
  // The longest fixed text (the list of an endpoint's fields) plus a few
  // abbreviated quotes of the client's text.
  MOH_FUZZ_CHECK(json.size() <= 4096,
                 absl::StrCat("an error answer of ", json.size(), " bytes"));
  MOH_FUZZ_CHECK(nlohmann::json::accept(json), "the error answer is not JSON");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  using moh::openai::Endpoint;
  const Endpoint endpoint =
      data[0] % 2 == 0 ? Endpoint::kCompletions : Endpoint::kChatCompletions;
  const std::string_view body = moh::fuzz::AsText(data + 1, size - 1);
  absl::StatusOr<moh::openai::GenerationRequest> request =
      moh::openai::ParseGenerationRequest(
          endpoint, absl::string_view(body.data(), body.size()));
  if (!request.ok()) {
    CheckError(request.status());
    return 0;
  }
  if (endpoint == Endpoint::kChatCompletions) {
    MOH_FUZZ_CHECK(!request->messages.empty(), "a chat without messages");
    const std::map<std::string, std::string> variables = {
        {"bos_token", "<s>"}, {"eos_token", "</s>"}};
    absl::StatusOr<std::string> prompt = DemoTemplate().Render(
        request->messages, request->add_generation_prompt, variables);
    if (!prompt.ok()) {
      CheckError(prompt.status());
      return 0;
    }
    // A template adds a bounded amount of text to what the messages hold.
    size_t content = 0;
    for (const moh::ChatMessage& m : request->messages) {
      content += m.content.size() + m.role.size();
    }
    MOH_FUZZ_CHECK(prompt->size() <= content + 64 * (request->messages.size() + 1),
                   absl::StrCat("a prompt of ", prompt->size(),
                                " bytes from ", content, " of messages"));
  } else {
    MOH_FUZZ_CHECK(request->call.prompt.has_value() ||
                       request->call.token_ids.has_value(),
                   "a completion without a prompt");
  }
  MOH_FUZZ_CHECK(request->call.n >= 1, "n < 1");
  return 0;
}
