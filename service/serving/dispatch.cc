#include "service/serving/dispatch.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/field_error.h"
#include "base/status_macros.h"

namespace moh {
namespace {

// The model that serves `task` under `name`, READY, and the ratios of a
// call (`*ratio`, `*min_ratio`) as the alias `name` may fix them: unset
// ones take the alias's, another ratio is refused.
absl::StatusOr<Servable*> FindReady(const ModelManager& models,
                                    absl::string_view name, Task task,
                                    float* ratio, float* min_ratio,
                                    Dispatched* dispatched) {
  dispatched->model = std::string(name);
  MOH_ASSIGN_OR_RETURN(HostedModel * found, models.Find(name, task));
  dispatched->model = found->name();
  if (const v1::ModelAlias* alias = models.FindAlias(name)) {
    dispatched->alias = alias->name();
    const float fixed = alias->activation_ratio();
    if (*ratio != 0.0f && *ratio != fixed) {
      return FieldError(
          "activation.ratio",
          absl::StrCat("is ", fixed, " for model \"", alias->name(), "\" (",
                       found->name(), " at a fixed ratio): send ", fixed,
                       " or leave it out, or ask model \"", found->name(),
                       "\"; got ", *ratio));
    }
    *ratio = fixed;
    if (*min_ratio == 0.0f) *min_ratio = alias->min_activation_ratio();
  }
  MOH_ASSIGN_OR_RETURN(dispatched->servable, found->Ready());
  return dispatched->servable;
}

// The same for a request without a ratio (an alias's is of no account).
absl::StatusOr<Servable*> FindReady(const ModelManager& models,
                                    absl::string_view name, Task task,
                                    Dispatched* dispatched) {
  float ratio = 0.0f, min_ratio = 0.0f;
  return FindReady(models, name, task, &ratio, &min_ratio, dispatched);
}

}  // namespace

absl::StatusOr<uint64_t> DispatchGenerate(
    const ModelManager& models, absl::string_view model, GenerateCall call,
    const std::optional<ChatConversation>& chat,
    std::shared_ptr<GenerationObserver> observer, Dispatched* dispatched) {
  MOH_ASSIGN_OR_RETURN(Servable * servable,
                       FindReady(models, model, Task::kGenerate, &call.ratio,
                                 &call.min_ratio, dispatched));
  if (chat.has_value()) {
    MOH_ASSIGN_OR_RETURN(
        call.prompt,
        servable->ChatPrompt(chat->messages, chat->add_generation_prompt));
    call.token_ids.reset();
    call.add_special_tokens = false;  // the template wrote them
  }
  return servable->Generate(std::move(call), std::move(observer));
}

absl::StatusOr<uint64_t> DispatchGenerateImage(
    const ModelManager& models, absl::string_view model, GenerateImageCall call,
    std::shared_ptr<ImageObserver> observer, Dispatched* dispatched) {
  MOH_ASSIGN_OR_RETURN(Servable * servable,
                       FindReady(models, model, Task::kGenerateImage,
                                 &call.ratio, &call.min_ratio, dispatched));
  return servable->GenerateImage(std::move(call), std::move(observer));
}

absl::Status DispatchClassify(const ModelManager& models,
                              absl::string_view model, ClassifyCall call,
                              ClassifyDone done, Dispatched* dispatched) {
  MOH_ASSIGN_OR_RETURN(Servable * servable,
                       FindReady(models, model, TaskOf(call), &call.ratio,
                                 &call.min_ratio, dispatched));
  return servable->Classify(std::move(call), std::move(done));
}

// A model's tokenizer is found as its generation is: a tokenizer request
// without a model name goes to the language model.
absl::StatusOr<TokenizeResult> DispatchTokenize(
    const ModelManager& models, absl::string_view model, TokenizeCall call,
    const std::optional<ChatConversation>& chat, Dispatched* dispatched) {
  MOH_ASSIGN_OR_RETURN(Servable * servable,
                       FindReady(models, model, Task::kGenerate, dispatched));
  if (chat.has_value()) {
    MOH_ASSIGN_OR_RETURN(
        call.prompt,
        servable->ChatPrompt(chat->messages, chat->add_generation_prompt));
  }
  return servable->Tokenize(call);
}

absl::StatusOr<std::string> DispatchDetokenize(
    const ModelManager& models, absl::string_view model,
    const std::vector<int32_t>& tokens, Dispatched* dispatched) {
  MOH_ASSIGN_OR_RETURN(Servable * servable,
                       FindReady(models, model, Task::kGenerate, dispatched));
  return servable->Detokenize(tokens);
}

absl::StatusOr<TokenizerInfo> DispatchTokenizerInfo(const ModelManager& models,
                                                    absl::string_view model,
                                                    Dispatched* dispatched) {
  MOH_ASSIGN_OR_RETURN(Servable * servable,
                       FindReady(models, model, Task::kGenerate, dispatched));
  return servable->DescribeTokenizer();
}

}  // namespace moh
