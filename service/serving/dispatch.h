// The one way a request reaches its model, whichever door it came through
// (gRPC: inference_service.cc; the OpenAI-compatible HTTP API:
// openai_http_generation.cc). A door converts its wire format into the
// domain's call (servable.h), then makes one call here, on a request
// worker: the model is found (by name, or the first READY one that serves
// the task), checked ready, a conversation rendered by its chat template
// (Generate), and the call submitted. TF Serving's shape: two transports,
// one entry. Recording the request's end stays with the door, which sees it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/tokenizer/chat_template.h"
#include "service/servable/servable.h"
#include "service/serving/model_manager.h"

namespace moh {

// How far a dispatch got, for the request's record even when it failed: the
// model's name (the name asked, until one is found: for the log line only,
// never a metric label), its servable once ready, and the alias asked for
// (ModelConfig.aliases; empty when none), which answers name.
struct Dispatched {
  std::string model;
  Servable* servable = nullptr;
  std::string alias;
};

// A conversation the model's chat template renders into the prompt.
struct ChatConversation {
  std::vector<ChatMessage> messages;
  bool add_generation_prompt = true;
};

// Generate: `call` (its prompt rendered from `chat` when there is one, with
// the template's own special tokens) to `model`; its id there.
absl::StatusOr<uint64_t> DispatchGenerate(
    const ModelManager& models, absl::string_view model, GenerateCall call,
    const std::optional<ChatConversation>& chat,
    std::shared_ptr<GenerationObserver> observer, Dispatched* dispatched);

// GenerateImage: `call` to `model`; its id there.
absl::StatusOr<uint64_t> DispatchGenerateImage(
    const ModelManager& models, absl::string_view model, GenerateImageCall call,
    std::shared_ptr<ImageObserver> observer, Dispatched* dispatched);

// Classify: `call` to `model`; `done` is called once, later, unless this
// returns an error.
absl::Status DispatchClassify(const ModelManager& models,
                              absl::string_view model, ClassifyCall call,
                              ClassifyDone done, Dispatched* dispatched);

// The tokenizer endpoints, on `model` (empty: the server's language
// model). Tokenize renders `chat` by the model's chat template first, when
// there is one, into `call`'s prompt.
absl::StatusOr<TokenizeResult> DispatchTokenize(
    const ModelManager& models, absl::string_view model, TokenizeCall call,
    const std::optional<ChatConversation>& chat, Dispatched* dispatched);
absl::StatusOr<std::string> DispatchDetokenize(
    const ModelManager& models, absl::string_view model,
    const std::vector<int32_t>& tokens, Dispatched* dispatched);
absl::StatusOr<TokenizerInfo> DispatchTokenizerInfo(const ModelManager& models,
                                                    absl::string_view model,
                                                    Dispatched* dispatched);

}  // namespace moh
