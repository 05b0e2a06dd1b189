// Chat templates: turns a conversation into a model's prompt with the Jinja
// template of its tokenizer_config.json, byte for byte as Hugging Face
// transformers' apply_chat_template(tokenize=False) renders it with jinja2
// (ImmutableSandboxedEnvironment, trim_blocks=True, lstrip_blocks=True,
// loopcontrols, transformers' tojson and raise_exception). No C++ Jinja
// engine is packaged for Debian 12, so this implements the subset real chat
// templates use; tests/model/tokenizer/chat_template_test.cc checks it against
// jinja2.
//
// Supported:
//   Tags:        text, {{ expr }}, {# comments #}; if/elif/else/endif;
//                for x in seq [if cond] / for a, b in pairs, with else,
//                loop.index/index0/revindex/revindex0/first/last/length/
//                previtem/nextitem, break, continue; set x = expr,
//                set a, b = expr, set ns.attr = expr, set x %}...{% endset;
//                transformers' {% generation %} (renders its body).
//   Whitespace:  "{%-", "-%}", "{{-", "-}}", "{#-", "-#}", "{%+", "+%}";
//                trim_blocks and lstrip_blocks exactly as jinja2 applies
//                them; "\r\n" read as "\n"; one trailing newline dropped.
//   Literals:    strings ('...' or "...", Python escapes), integers
//                (64-bit; 0x, 0o, 0b), floats, true/false/none (any case
//                jinja2 accepts), [lists], (tuples), {dicts with string
//                keys}.
//   Operators:   + - * / // % ** ~, == != < <= > >= (chained), in, not in,
//                and, or, not, a if c else b; x.attr, x[i], x[a:b:c].
//   Tests:       defined, undefined, none, string, number, integer, float,
//                boolean, true, false, mapping, iterable, sequence, callable,
//                lower, upper, odd, even, divisibleby, eq/equalto/==, ne/!=,
//                lt/le/gt/ge, in, sameas.
//   Filters:     trim, length/count, upper, lower, title, capitalize,
//                tojson(ensure_ascii, indent, separators, sort_keys: as
//                transformers' json.dumps), default/d, first, last, join,
//                replace, string, int, float, abs, list, items, select,
//                reject, selectattr, rejectattr, map (a filter or
//                attribute=), sort, dictsort (these give lists where jinja2
//                gives generators).
//   Methods:     str: strip, lstrip, rstrip, split, startswith, endswith,
//                upper, lower, title, capitalize, replace, join;
//                dict: items, keys, values, get.
//   Functions:   raise_exception(msg), range(...), namespace(...), dict(...).
//   Undefined:   jinja2's default Undefined: prints "", is falsy, iterates as
//                empty; its attributes, items, calls and arithmetic are
//                errors, as in jinja2.
// Not supported (a named INVALID_ARGUMENT at Parse): macros, call blocks,
// filter blocks, include/import/extends/block, raw, with, recursive loops,
// *args/**kwargs. At Render: custom filters or tests and any not listed
// above, string '%' formatting, strftime_now.
// Integers are 64-bit (overflow is an error, where Python grows them). Case
// mapping covers ASCII, Latin-1, Greek and Cyrillic. Loop objects and
// dict.items() print differently from jinja2 (nothing prints them).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace moh {

namespace jinja {
struct Node;
}

struct ChatMessage {
  std::string role;
  std::string content;
};

// A parsed chat template. Immutable and cheap to copy (the parsed form is
// shared); Render is thread-safe.
class ChatTemplate {
 public:
  // Parses once. INVALID_ARGUMENT "chat template line L col C: ..." on syntax
  // errors and unsupported constructs (named).
  static absl::StatusOr<ChatTemplate> Parse(const std::string& source);

  // Renders as transformers' apply_chat_template(tokenize=False): variables
  // `messages` (a list of {"role", "content"} dicts), `add_generation_prompt`
  // (bool), `tools` and `documents` (none, as transformers passes them), and
  // every entry of `variables` as a string (bos_token, eos_token, ...).
  // raise_exception(msg): INVALID_ARGUMENT carrying exactly msg. Runtime
  // errors (unknown filter or function, bad types, undefined values used,
  // limits): INVALID_ARGUMENT "chat template line L: ..." naming them.
  // Bounded: at most 1 MiB of output (and of any string built) and 1e6 loop
  // iterations and evaluation steps together, so that a hostile template can
  // neither hang nor exhaust memory.
  absl::StatusOr<std::string> Render(
      const std::vector<ChatMessage>& messages, bool add_generation_prompt,
      const std::map<std::string, std::string>& variables) const;

 private:
  using Body = std::vector<std::unique_ptr<jinja::Node>>;
  explicit ChatTemplate(std::shared_ptr<const Body> body)
      : body_(std::move(body)) {}

  std::shared_ptr<const Body> body_;
};

// A model directory's tokenizer_config.json: "chat_template" (a string, or a
// list of {"name", "template"} where the one named "default" is taken) and
// "bos_token"/"eos_token" (a string, or an AddedToken dict {"content": ...};
// absent or null: ""). NOT_FOUND when the file or its chat_template is
// absent; INVALID_ARGUMENT naming the file on bad JSON or a template that
// does not parse.
struct LoadedChatTemplate {
  ChatTemplate chat_template;
  std::string bos_token, eos_token;
};
absl::StatusOr<LoadedChatTemplate> LoadChatTemplate(
    const std::string& model_dir);

// The fields of a model directory's tokenizer_config.json that a client's
// tokenizer needs (vLLM's GET /tokenizer_info shows them): the special
// tokens' text (a string or an AddedToken dict; absent or null: nullopt),
// the tokenizer's class name, model_max_length, and the chat template's
// source (as LoadChatTemplate takes it; not parsed here). NOT_FOUND when the
// file is absent; INVALID_ARGUMENT naming the file and field on bad JSON or
// a field of the wrong type.
struct TokenizerConfig {
  std::string tokenizer_class;  // "" when absent
  std::optional<std::string> bos_token, eos_token, pad_token, unk_token;
  std::optional<int64_t> model_max_length;  // absent, or not an integer
  std::optional<std::string> chat_template;
};
absl::StatusOr<TokenizerConfig> ReadTokenizerConfig(
    const std::string& model_dir);

}  // namespace moh
