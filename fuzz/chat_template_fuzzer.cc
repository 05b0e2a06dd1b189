// Fuzzes chat templates (model/tokenizer/chat_template.h): the input is a
// template's source. Parse and Render may refuse it only with
// INVALID_ARGUMENT, and must stay within their bounds (1 MiB of output;
// libFuzzer's -timeout and -rss_limit_mb catch a hang or runaway memory).
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz/fuzz_check.h"
#include "model/tokenizer/chat_template.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::StatusOr<moh::ChatTemplate> chat_template =
      moh::ChatTemplate::Parse(std::string(moh::fuzz::AsText(data, size)));
  if (!chat_template.ok()) {
    moh::fuzz::CheckInvalidArgument(chat_template.status());
    return 0;
  }
  const std::vector<moh::ChatMessage> messages = {
      {"system", "You are a helpful assistant"},
      {"user", "Hello {{ x }} \xc3\xa9"},
      {"assistant", "  Hi  "},
      {"user", "Bye"}};
  const std::map<std::string, std::string> variables = {{"bos_token", "<s>"},
                                                        {"eos_token", "</s>"}};
  for (bool add_generation_prompt : {false, true}) {
    absl::StatusOr<std::string> text =
        chat_template->Render(messages, add_generation_prompt, variables);
    if (!text.ok()) {
      moh::fuzz::CheckInvalidArgument(text.status());
      continue;
    }
    MOH_FUZZ_CHECK(text->size() <= (1 << 20),
                   absl::StrCat("output of ", text->size(), " bytes"));
  }
  return 0;
}
