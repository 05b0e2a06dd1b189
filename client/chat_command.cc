#include "client/chat_command.h"

#include <atomic>
#include <cstdio>

#include "absl/strings/str_format.h"
#include "client/interrupt_watcher.h"
#include "client/rpc_util.h"

namespace moh::client {
namespace {

using nlohmann::json;

// What the stream said besides the text.
struct Reply {
  std::string text;
  std::string finish_reason;
  json usage;
  json moh;
};

// Streams one reply to stdout, collecting it into `reply`.
absl::Status StreamReply(const OpenAiHttpClient& client, const json& request,
                         Reply* reply) {
  std::atomic<bool> cancel{false};
  CancelOnInterrupt on_interrupt(&cancel);
  return client.Stream(
      "/v1/chat/completions", request,
      [reply](const json& chunk) {
        if (chunk.contains("usage") && chunk["usage"].is_object()) {
          reply->usage = chunk["usage"];
        }
        if (chunk.contains("moh")) reply->moh = chunk["moh"];
        const json& choices = chunk.value("choices", json::array());
        if (!choices.is_array() || choices.empty()) return;
        const json& choice = choices[0];
        const json& finish = choice.value("finish_reason", json());
        if (finish.is_string()) reply->finish_reason = finish;
        const json& delta = choice.value("delta", json::object());
        const json& content = delta.value("content", json());
        if (!content.is_string()) return;
        const std::string text = content.get<std::string>();
        std::fwrite(text.data(), 1, text.size(), stdout);
        std::fflush(stdout);
        reply->text += text;
      },
      &cancel);
}

void PrintSummary(const Reply& reply) {
  absl::FPrintF(stderr, "finish_reason: %s\n", reply.finish_reason);
  if (reply.usage.is_object()) {
    absl::FPrintF(stderr, "usage: prompt_tokens %d, completion_tokens %d\n",
                  reply.usage.value("prompt_tokens", 0),
                  reply.usage.value("completion_tokens", 0));
  }
  if (reply.moh.is_object()) {
    PrintActivation(reply.moh.value("effective_activation_ratio", 0.0f),
                    reply.moh.value("activation_ratio", 0.0f));
  }
}

}  // namespace

int RunChat(const OpenAiHttpClient& client, const ChatOptions& options,
            std::istream& in) {
  json messages = json::array();
  if (!options.system.empty()) {
    messages.push_back({{"role", "system"}, {"content", options.system}});
  }
  std::string line;
  for (;;) {
    if (options.show_prompt) {
      std::fputs("> ", stderr);
      std::fflush(stderr);
    }
    if (!std::getline(in, line)) break;
    if (line.empty()) continue;
    messages.push_back({{"role", "user"}, {"content", line}});
    json request = options.fields;
    request["messages"] = messages;
    request["stream"] = true;
    request["stream_options"] = {{"include_usage", true}};
    Reply reply;
    const absl::Status status = StreamReply(client, request, &reply);
    if (status.ok() || !reply.text.empty()) {
      std::fputs("\n", stdout);  // each reply ends its line
      std::fflush(stdout);
    }
    if (status.code() == absl::StatusCode::kCancelled &&
        InterruptSignal() != 0) {
      ClearInterrupt();
      messages.erase(messages.size() - 1);
      std::fputs("(reply cancelled)\n", stderr);
      continue;
    }
    if (!status.ok()) return ReportError(status);
    messages.push_back({{"role", "assistant"}, {"content", reply.text}});
    PrintSummary(reply);
  }
  if (options.show_prompt) std::fputs("\n", stderr);
  return kExitOk;
}

}  // namespace moh::client
