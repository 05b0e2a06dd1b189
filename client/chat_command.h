// moh-client chat: a conversation with a language model over the server's
// OpenAI-compatible HTTP API (POST /v1/chat/completions, streamed).
#ifndef MOH_CLIENT_CHAT_COMMAND_H_
#define MOH_CLIENT_CHAT_COMMAND_H_

#include <istream>
#include <string>

#include "client/openai_http_client.h"
#include "nlohmann/json.hpp"

namespace moh::client {

struct ChatOptions {
  std::string system;  // the system message; empty: none
  // Fields sent with every request besides "messages" and the stream's
  // (model, max_tokens, sampling, activation_ratio, ...), OpenAI's names.
  nlohmann::json fields = nlohmann::json::object();
  bool show_prompt = false;  // "> " on stderr before each line (a terminal)
};

// Reads the user's lines from `in` until EOF, skipping empty ones. Each line
// is sent with the conversation so far; the reply streams to stdout as it
// arrives, followed by a newline, then its finish reason, usage and activation
// ratios go to stderr. Ctrl-C during a reply cancels it (the connection is
// closed; the turn is left out of the conversation) and the chat goes on;
// while waiting for a line it ends the program (exit 130).
// Returns kExitOk at EOF; a failed request ends the chat (ReportError's exit
// status: the server's error with its HTTP status on stderr).
int RunChat(const OpenAiHttpClient& client, const ChatOptions& options,
            std::istream& in);

}  // namespace moh::client

#endif  // MOH_CLIENT_CHAT_COMMAND_H_
