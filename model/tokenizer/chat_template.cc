#include "model/tokenizer/chat_template.h"

#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/tokenizer/jinja/parser.h"
#include "model/tokenizer/jinja/renderer.h"
#include "model/tokenizer/tokenizer_json.h"

namespace moh {

absl::StatusOr<ChatTemplate> ChatTemplate::Parse(const std::string& source) {
  MOH_ASSIGN_OR_RETURN(jinja::Body body, jinja::ParseTemplate(source));
  return ChatTemplate(std::make_shared<const Body>(std::move(body)));
}

absl::StatusOr<std::string> ChatTemplate::Render(
    const std::vector<ChatMessage>& messages, bool add_generation_prompt,
    const std::map<std::string, std::string>& variables) const {
  using jinja::Value;
  jinja::List list;
  list.reserve(messages.size());
  for (const ChatMessage& m : messages) {
    list.push_back(Value::MakeDict({{"role", Value::String(m.role)},
                                    {"content", Value::String(m.content)}}));
  }
  jinja::Dict globals;
  for (const auto& [name, value] : variables) {
    globals.emplace_back(name, Value::String(value));
  }
  // Last, so that they win over `variables` of the same name.
  globals.emplace_back("messages", Value::MakeList(std::move(list)));
  globals.emplace_back("add_generation_prompt",
                       Value::Bool(add_generation_prompt));
  globals.emplace_back("tools", Value::None());
  globals.emplace_back("documents", Value::None());
  return jinja::Render(*body_, globals, jinja::RenderLimits());
}

namespace {

using tokenizer_internal::Describe;
using tokenizer_internal::Get;
using tokenizer_internal::Invalid;
using tokenizer_internal::json;

// bos_token/eos_token: a string, an AddedToken dict, or absent ("").
absl::StatusOr<std::string> GetToken(const json& root, const char* key) {
  const json* token = Get(root, key);
  if (token == nullptr) return std::string();
  if (token->is_string()) return token->get<std::string>();
  const json* content = Get(*token, "content");
  if (content != nullptr && content->is_string()) {
    return content->get<std::string>();
  }
  return Invalid(key, absl::StrCat("must be a string or {\"content\": ...}, "
                                   "not ",
                                   Describe(*token)));
}

// "chat_template": a string, or a list of {"name", "template"} of which the
// one named "default" is taken. NOT_FOUND when there is none.
absl::StatusOr<std::string> GetTemplateSource(const json& root) {
  const json* source = Get(root, "chat_template");
  if (source == nullptr) return absl::NotFoundError("no chat_template");
  if (source->is_string()) return source->get<std::string>();
  if (!source->is_array()) {
    return Invalid("chat_template",
                   "must be a string or a list of "
                   "{\"name\", \"template\"}");
  }
  for (size_t i = 0; i < source->size(); ++i) {
    const json& entry = (*source)[i];
    const json* name = Get(entry, "name");
    const json* text = Get(entry, "template");
    if (name == nullptr || !name->is_string() || text == nullptr ||
        !text->is_string()) {
      return Invalid(absl::StrCat("chat_template[", i, "]"),
                     "must be {\"name\": string, \"template\": string}");
    }
    if (*name == "default") return text->get<std::string>();
  }
  return absl::NotFoundError("no chat_template named \"default\"");
}

// `status` with the file's path before its message.
absl::Status InFile(const std::string& path, const absl::Status& status) {
  return absl::Status(status.code(),
                      absl::StrCat(path, ": ", status.message()));
}

// `model_dir`'s tokenizer_config.json, a JSON object (`path` its path).
absl::StatusOr<json> ReadConfigJson(const std::string& model_dir,
                                    std::string* path) {
  *path = model_dir + "/tokenizer_config.json";
  std::ifstream in(*path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", *path));
  std::stringstream text;
  text << in.rdbuf();
  json root;
  try {
    root = json::parse(text.str());
  } catch (const json::exception& e) {
    return InFile(*path, absl::InvalidArgumentError(
                             absl::StrCat("malformed JSON: ", e.what())));
  }
  if (!root.is_object()) {
    return InFile(*path, Invalid("(root)", "must be a JSON object"));
  }
  return root;
}

// A special token's text, nullopt when absent or null.
absl::StatusOr<std::optional<std::string>> GetOptionalToken(const json& root,
                                                            const char* key) {
  if (Get(root, key) == nullptr) return std::optional<std::string>();
  MOH_ASSIGN_OR_RETURN(std::string token, GetToken(root, key));
  return std::optional<std::string>(std::move(token));
}

}  // namespace

absl::StatusOr<LoadedChatTemplate> LoadChatTemplate(
    const std::string& model_dir) {
  std::string path;
  MOH_ASSIGN_OR_RETURN(const json root, ReadConfigJson(model_dir, &path));
  absl::StatusOr<std::string> source = GetTemplateSource(root);
  if (!source.ok()) return InFile(path, source.status());
  absl::StatusOr<ChatTemplate> chat_template = ChatTemplate::Parse(*source);
  if (!chat_template.ok()) {
    return InFile(path,
                  Invalid("chat_template", chat_template.status().message()));
  }
  absl::StatusOr<std::string> bos = GetToken(root, "bos_token");
  if (!bos.ok()) return InFile(path, bos.status());
  absl::StatusOr<std::string> eos = GetToken(root, "eos_token");
  if (!eos.ok()) return InFile(path, eos.status());
  return LoadedChatTemplate{*std::move(chat_template), *std::move(bos),
                            *std::move(eos)};
}

absl::StatusOr<TokenizerConfig> ReadTokenizerConfig(
    const std::string& model_dir) {
  std::string path;
  MOH_ASSIGN_OR_RETURN(const json root, ReadConfigJson(model_dir, &path));
  TokenizerConfig config;
  const auto read = [&]() -> absl::Status {
    const json* name = Get(root, "tokenizer_class");
    if (name != nullptr) {
      if (!name->is_string()) {
        return Invalid("tokenizer_class",
                       absl::StrCat("must be a string, not ", Describe(*name)));
      }
      config.tokenizer_class = name->get<std::string>();
    }
    MOH_ASSIGN_OR_RETURN(config.bos_token, GetOptionalToken(root, "bos_token"));
    MOH_ASSIGN_OR_RETURN(config.eos_token, GetOptionalToken(root, "eos_token"));
    MOH_ASSIGN_OR_RETURN(config.pad_token, GetOptionalToken(root, "pad_token"));
    MOH_ASSIGN_OR_RETURN(config.unk_token, GetOptionalToken(root, "unk_token"));
    // Often 1e30 ("no limit"), a float: then it is left out.
    const json* max_length = Get(root, "model_max_length");
    if (max_length != nullptr && max_length->is_number_integer() &&
        !(max_length->is_number_unsigned() &&
          max_length->get<uint64_t>() > uint64_t{INT64_MAX})) {
      config.model_max_length = max_length->get<int64_t>();
    }
    absl::StatusOr<std::string> source = GetTemplateSource(root);
    if (source.ok()) {
      config.chat_template = *std::move(source);
    } else if (!absl::IsNotFound(source.status())) {
      return source.status();
    }
    return absl::OkStatus();
  };
  const absl::Status status = read();
  if (!status.ok()) return InFile(path, status);
  return config;
}

}  // namespace moh
