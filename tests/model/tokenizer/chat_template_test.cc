// Tests for moh::ChatTemplate and LoadChatTemplate. Renderings are compared
// byte for byte with jinja2's: tests/testdata/chat_template_golden.json,
// written by tests/reference/make_chat_template_golden.py from the published
// templates of tests/testdata/chat_templates.json and from feature templates
// that exercise each supported construct.
#include "model/tokenizer/chat_template.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "tests/base/test_paths.h"

namespace moh {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using json = nlohmann::json;
using Variables = std::map<std::string, std::string>;

json ReadTestdata(const std::string& name) {
  std::ifstream in(test_paths::TestdataDir() + "/" + name);
  EXPECT_TRUE(in) << name;
  return json::parse(in);
}

std::vector<ChatMessage> ToMessages(const json& conversation) {
  std::vector<ChatMessage> messages;
  for (const json& m : conversation) {
    messages.push_back(
        {m.at("role").get<std::string>(), m.at("content").get<std::string>()});
  }
  return messages;
}

// Parses `source`, failing the test when it does not parse.
ChatTemplate MustParse(const std::string& source) {
  absl::StatusOr<ChatTemplate> parsed = ChatTemplate::Parse(source);
  EXPECT_TRUE(parsed.ok()) << parsed.status();
  if (!parsed.ok()) return *ChatTemplate::Parse("");
  return *std::move(parsed);
}

absl::StatusOr<std::string> RenderSource(const std::string& source,
                                         const Variables& variables = {}) {
  absl::StatusOr<ChatTemplate> parsed = ChatTemplate::Parse(source);
  if (!parsed.ok()) return parsed.status();
  return parsed->Render({{"user", "Hello"}}, true, variables);
}

std::string Msg(const absl::Status& status) {
  return std::string(status.message());
}

absl::Status ParseError(const std::string& source) {
  return ChatTemplate::Parse(source).status();
}

// A golden entry's expectation: "output", or "error" (exact when "raised").
void ExpectMatches(const json& golden,
                   const absl::StatusOr<std::string>& rendered) {
  if (golden.contains("output")) {
    ASSERT_TRUE(rendered.ok()) << rendered.status();
    EXPECT_EQ(*rendered, golden["output"].get<std::string>());
    return;
  }
  ASSERT_FALSE(rendered.ok())
      << "rendered " << *rendered << " where jinja2 failed with "
      << golden["error"];
  EXPECT_EQ(rendered.status().code(), absl::StatusCode::kInvalidArgument);
  if (golden["raised"].get<bool>()) {
    EXPECT_EQ(rendered.status().message(), golden["error"].get<std::string>());
  } else {
    EXPECT_THAT(Msg(rendered.status()), StartsWith("chat template line "));
  }
}

// ------------------------------------------------------------- golden --

TEST(ChatTemplateGoldenTest, PublishedTemplatesRenderAsJinja2) {
  const json templates = ReadTestdata("chat_templates.json")["templates"];
  const json golden = ReadTestdata("chat_template_golden.json");
  std::map<std::string, std::pair<ChatTemplate, Variables>> parsed;
  for (const json& t : templates) {
    const std::string name = t["name"];
    SCOPED_TRACE(name);
    parsed.emplace(name,
                   std::make_pair(MustParse(t["template"]),
                                  Variables{{"bos_token", t["bos_token"]},
                                            {"eos_token", t["eos_token"]}}));
  }
  for (const char* name : {"llama3", "qwen2", "mistral-v0.1", "mistral-v0.2",
                           "llama2", "zephyr", "gemma", "deepseek-coder"}) {
    EXPECT_EQ(parsed.count(name), 1) << name;
  }
  int rendered = 0, raised = 0;
  for (const json& r : golden["renders"]) {
    const std::string name = r["template"], conversation = r["conversation"];
    const bool add_generation_prompt = r["add_generation_prompt"];
    SCOPED_TRACE(name + " on " + conversation +
                 (add_generation_prompt ? " with" : " without") +
                 " generation prompt");
    const auto& [chat_template, variables] = parsed.at(name);
    ExpectMatches(r, chat_template.Render(
                         ToMessages(golden["conversations"][conversation]),
                         add_generation_prompt, variables));
    ++rendered;
    raised += r.contains("error") ? 1 : 0;
  }
  EXPECT_EQ(rendered, 8 * 9 * 2);
  EXPECT_GT(raised, 0);  // Mistral, LLaMA-2 and Gemma refuse some turns.
}

TEST(ChatTemplateGoldenTest, FeaturesRenderAsJinja2) {
  const json golden = ReadTestdata("chat_template_golden.json");
  const std::vector<ChatMessage> messages =
      ToMessages(golden["conversations"]["multi_turn"]);
  ASSERT_GT(golden["features"].size(), 30u);
  for (const json& f : golden["features"]) {
    SCOPED_TRACE(f["name"].get<std::string>() + ": " +
                 f["template"].get<std::string>());
    absl::StatusOr<ChatTemplate> chat_template =
        ChatTemplate::Parse(f["template"]);
    if (!chat_template.ok()) {  // jinja2 must have refused it too.
      EXPECT_TRUE(f.contains("error") && !f["raised"].get<bool>())
          << chat_template.status();
      EXPECT_THAT(Msg(chat_template.status()),
                  StartsWith("chat template line "));
      continue;
    }
    ExpectMatches(f, chat_template->Render(messages, true,
                                           f["variables"].get<Variables>()));
  }
}

// ------------------------------------------------------------- errors --

TEST(ChatTemplateTest, SyntaxErrorsGiveLineAndColumn) {
  absl::Status status = ParseError("line one\n{% if x %}\n  {{ x + }}\n");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(status), StartsWith("chat template line 3 col 10: "));
  EXPECT_THAT(Msg(status), HasSubstr("'}}'"));

  EXPECT_THAT(Msg(ParseError("ab\n  {{ x")),
              StartsWith("chat template line 2 col 3: tag is not closed"));
  EXPECT_THAT(Msg(ParseError("{% if x %}a")),
              HasSubstr("expected 'elif' or 'else' or 'endif'"));
  EXPECT_THAT(Msg(ParseError("{% for x in y %}{% endif %}")),
              HasSubstr("line 1 col 20: unexpected 'endif', expected 'else' or "
                        "'endfor'"));
  EXPECT_THAT(Msg(ParseError("é{% frobnicate %}")),
              StartsWith("chat template line 1 col 5: unexpected tag "
                         "'frobnicate'"));
  EXPECT_THAT(Msg(ParseError("{{ 'abc }}")),
              HasSubstr("col 4: string is not closed"));
  EXPECT_THAT(Msg(ParseError("{# note")),
              HasSubstr("col 1: comment is not closed"));
  EXPECT_THAT(Msg(ParseError("{{ a ] }}")), HasSubstr("unexpected ']'"));
  EXPECT_THAT(Msg(ParseError("{{ a $ b }}")),
              HasSubstr("unexpected character '$'"));
  EXPECT_THAT(Msg(ParseError("{% break %}")),
              HasSubstr("'break' outside a for loop"));
  EXPECT_THAT(Msg(ParseError("{{ f(a=1, 2) }}")),
              HasSubstr("positional argument after a keyword argument"));
}

TEST(ChatTemplateTest, UnsupportedConstructsAreNamed) {
  for (const char* tag : {"macro", "call", "include", "extends", "block",
                          "import", "raw", "filter", "with"}) {
    EXPECT_THAT(Msg(ParseError(std::string("{% ") + tag + " x %}")),
                HasSubstr(std::string("'") + tag + "' tags are not supported"))
        << tag;
  }
  EXPECT_THAT(Msg(ParseError("{% for x in y recursive %}{% endfor %}")),
              HasSubstr("recursive loops are not supported"));
  EXPECT_THAT(Msg(ParseError("{{ f(*args) }}")),
              HasSubstr("*args and **kwargs are not supported"));
}

TEST(ChatTemplateTest, DeepNestingIsASyntaxErrorNotACrash) {
  const std::string parens =
      std::string(5000, '(') + "1" + std::string(5000, ')');
  EXPECT_THAT(Msg(ParseError("{{ " + parens + " }}")),
              HasSubstr("nested more than 100 levels deep"));
  std::string ifs;
  for (int i = 0; i < 2000; ++i) ifs += "{% if true %}";
  EXPECT_THAT(Msg(ParseError(ifs)),
              HasSubstr("nested more than 100 levels deep"));
  EXPECT_THAT(Msg(ParseError("{{ " + std::string(5000, '-') + "1 }}")),
              HasSubstr("nested more than 100 levels deep"));
}

TEST(ChatTemplateTest, UnknownFilterIsARuntimeErrorNamingIt) {
  absl::StatusOr<std::string> rendered =
      RenderSource("text\n{{ messages|frobnicate }}");
  EXPECT_EQ(rendered.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(rendered.status().message(),
            "chat template line 2: no filter named 'frobnicate'");
  EXPECT_THAT(Msg(RenderSource("{{ 1 is frobnicated }}").status()),
              HasSubstr("no test named 'frobnicated'"));
  EXPECT_THAT(Msg(RenderSource("{{ frobnicate() }}").status()),
              HasSubstr("'frobnicate' is undefined"));
  EXPECT_THAT(Msg(RenderSource("{{ 'x'.frobnicate() }}").status()),
              HasSubstr("'frobnicate'"));
  EXPECT_THAT(Msg(RenderSource("{{ 'x'|trim(1, 2) }}").status()),
              HasSubstr("trim() takes at most 1 argument(s)"));
}

TEST(ChatTemplateTest, RaiseExceptionCarriesTheMessageAlone) {
  absl::StatusOr<std::string> rendered =
      RenderSource("{{ raise_exception('Roles must alternate ' ~ bos_token) }}",
                   {{"bos_token", "<s>"}});
  EXPECT_EQ(rendered.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(rendered.status().message(), "Roles must alternate <s>");
}

TEST(ChatTemplateTest, LongLoopsStopAtTheStepLimit) {
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::string> rendered = RenderSource(
      "{% for i in range(100000) %}{% for j in range(100000) %}"
      "{% endfor %}{% endfor %}");
  EXPECT_THAT(Msg(rendered.status()),
              HasSubstr("more than 1000000 evaluation steps"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  // Output without a loop body does not count as progress either.
  EXPECT_THAT(Msg(RenderSource("{% for i in range(100000) %}{% for j in "
                               "range(100000) %}{% continue %}{% endfor %}"
                               "{% endfor %}")
                      .status()),
              HasSubstr("evaluation steps"));
}

TEST(ChatTemplateTest, OutputAndValuesAreBounded) {
  EXPECT_THAT(Msg(RenderSource("{% for i in range(100000) %}{{ 'x' * 100 }}"
                               "{% endfor %}")
                      .status()),
              HasSubstr("output longer than 1048576 bytes"));
  EXPECT_THAT(Msg(RenderSource("{{ 'x' * 100000000 }}").status()),
              HasSubstr("string longer than 1048576 bytes"));
  EXPECT_THAT(
      Msg(RenderSource("{% set s = 'x' * 1000000 %}{{ s ~ s }}").status()),
      HasSubstr("output longer than"));
  EXPECT_THAT(
      Msg(RenderSource("{% set s = 'x' * 1000000 %}{{ s + s }}").status()),
      HasSubstr("string longer than"));
  EXPECT_THAT(Msg(RenderSource("{{ [1] * 10000000 }}").status()),
              HasSubstr("list longer than 100000 items"));
  // Shared lists that would print as gigabytes stop at the output limit.
  EXPECT_THAT(Msg(RenderSource("{% set a = range(1000)|list %}"
                               "{% set b = [a, a, a, a, a, a, a, a, a, a] %}"
                               "{% set c = [b, b, b, b, b, b, b, b, b, b] %}"
                               "{% set d = [c, c, c, c, c, c, c, c, c, c] %}"
                               "{{ [d, d, d, d, d, d, d, d, d, d]|tojson }}"
                               "{{ [d, d, d, d, d, d, d, d, d, d] }}")
                      .status()),
              HasSubstr("longer than 1048576 bytes"));
  EXPECT_THAT(
      Msg(RenderSource("{% set ns = namespace(x=[]) %}"
                       "{% for i in range(1000) %}{% set ns.x = [ns.x] %}"
                       "{% endfor %}{{ ns.x }}")
              .status()),
      HasSubstr("nested more than 64 levels deep"));
  EXPECT_THAT(
      Msg(RenderSource("{% set ns = namespace() %}{% set ns.me = [ns] %}")
              .status()),
      HasSubstr("a namespace cannot hold a namespace"));
  // An indent of more spaces than the output may hold (found by the
  // fuzzer: it allocated the spaces first): refused once a line break
  // needs it, harmless where none does, as json.dumps.
  EXPECT_THAT(
      Msg(RenderSource("{{ [1, [2]]|tojson(indent=555555555552) }}").status()),
      HasSubstr("longer than 1048576 bytes"));
  EXPECT_EQ(*RenderSource("{{ 7|tojson(indent=555555555552) }}"), "7");
  EXPECT_THAT(Msg(RenderSource("{% set s = ' ' * 1000000 %}"
                               "{{ [[[[[[[[1]]]]]]]]|tojson(indent=s) }}")
                      .status()),
              HasSubstr("longer than 1048576 bytes"));
  EXPECT_THAT(Msg(RenderSource("{{ 9223372036854775807 + 1 }}").status()),
              HasSubstr("does not fit in 64 bits"));
}

TEST(ChatTemplateTest, GenerationBlocksRenderTheirBody) {
  // transformers' {% generation %} marks assistant text for masks only.
  EXPECT_EQ(*RenderSource("[{% generation %}{{ messages[0].content }}"
                          "{% endgeneration %}]"),
            "[Hello]");
}

TEST(ChatTemplateTest, CopiesShareTheTemplateAndRenderConcurrently) {
  const ChatTemplate original = MustParse(
      "{% set ns = namespace(n=0) %}{% for m in messages %}"
      "{% set ns.n = ns.n + 1 %}{{ m.role }}:{{ m.content }};{% endfor %}"
      "{{ ns.n }}");
  const ChatTemplate copy = original;
  std::vector<std::thread> threads;
  std::vector<std::string> outputs(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        outputs[t] =
            *(t % 2 ? copy : original)
                 .Render({{"user", "a"}, {"assistant", "b"}}, false, {});
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const std::string& output : outputs)
    EXPECT_EQ(output, "user:a;assistant:b;2");
}

// ---------------------------------------------------- LoadChatTemplate --

class LoadChatTemplateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ =
        std::filesystem::path(::testing::TempDir()) /
        ("chat_template_" +
         std::string(
             ::testing::UnitTest::GetInstance()->current_test_info()->name()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  void WriteConfig(const std::string& text) {
    std::ofstream(dir_ / "tokenizer_config.json") << text;
  }
  std::string Render(const LoadedChatTemplate& loaded) {
    absl::StatusOr<std::string> text = loaded.chat_template.Render(
        {{"user", "hi"}}, true,
        {{"bos_token", loaded.bos_token}, {"eos_token", loaded.eos_token}});
    EXPECT_TRUE(text.ok()) << text.status();
    return text.value_or("");
  }

  std::filesystem::path dir_;
};

TEST_F(LoadChatTemplateTest, StringTemplateAndStringTokens) {
  WriteConfig(
      R"({"chat_template": "{{ bos_token }}{% for m in messages %})"
      R"({{ m.content }}{% endfor %}{{ eos_token }}",)"
      R"( "bos_token": "<s>", "eos_token": "</s>", "model_max_length": 8})");
  absl::StatusOr<LoadedChatTemplate> loaded = LoadChatTemplate(dir_.string());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->bos_token, "<s>");
  EXPECT_EQ(loaded->eos_token, "</s>");
  EXPECT_EQ(Render(*loaded), "<s>hi</s>");
}

// The demo model's own tokenizer_config.json (models/demo-lm, written by
// training/train_demo_lm.py); expected text as jinja2 renders it.
TEST(LoadChatTemplateDemoTest, DemoLmTemplateRenders) {
  absl::StatusOr<LoadedChatTemplate> loaded =
      LoadChatTemplate(test_paths::ModelsDir() + "/demo-lm");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->bos_token, "<|begin_of_text|>");
  EXPECT_EQ(loaded->eos_token, "<|end_of_text|>");
  const Variables variables = {{"bos_token", loaded->bos_token},
                               {"eos_token", loaded->eos_token}};
  absl::StatusOr<std::string> text =
      loaded->chat_template.Render({{"system", " Be brief. "},
                                    {"user", "Hi"},
                                    {"assistant", "Hello"},
                                    {"user", "Bye"}},
                                   true, variables);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, "<|begin_of_text|>Be brief.\nQ: Hi\nA: Hello\nQ: Bye\nA:");
  EXPECT_EQ(loaded->chat_template.Render({{"tool", "x"}}, false, variables)
                .status()
                .message(),
            "roles are system, user and assistant");
}

TEST_F(LoadChatTemplateTest, ListTakesTheDefaultTemplate) {
  WriteConfig(
      R"({"chat_template": [)"
      R"({"name": "tool_use", "template": "tools"},)"
      R"({"name": "default", "template": "default {{ messages|length }}"}]})");
  absl::StatusOr<LoadedChatTemplate> loaded = LoadChatTemplate(dir_.string());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->bos_token, "");  // Absent.
  EXPECT_EQ(Render(*loaded), "default 1");
}

TEST_F(LoadChatTemplateTest, AddedTokenDictsGiveTheirContent) {
  WriteConfig(
      R"({"chat_template": "{{ bos_token }}|{{ eos_token }}",)"
      R"( "bos_token": {"__type": "AddedToken", "content": "<|begin|>",)"
      R"( "lstrip": false, "normalized": false},)"
      R"( "eos_token": {"content": "<|end|>"}})");
  absl::StatusOr<LoadedChatTemplate> loaded = LoadChatTemplate(dir_.string());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->bos_token, "<|begin|>");
  EXPECT_EQ(loaded->eos_token, "<|end|>");
  EXPECT_EQ(Render(*loaded), "<|begin|>|<|end|>");
}

TEST_F(LoadChatTemplateTest, NullTokensAreEmpty) {
  WriteConfig(R"({"chat_template": "x", "bos_token": null})");
  absl::StatusOr<LoadedChatTemplate> loaded = LoadChatTemplate(dir_.string());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->bos_token, "");
}

TEST_F(LoadChatTemplateTest, MissingFileOrTemplateIsNotFound) {
  EXPECT_EQ(LoadChatTemplate(dir_.string()).status().code(),
            absl::StatusCode::kNotFound);
  WriteConfig(R"({"bos_token": "<s>"})");
  EXPECT_EQ(LoadChatTemplate(dir_.string()).status().code(),
            absl::StatusCode::kNotFound);
  WriteConfig(R"({"chat_template": [{"name": "rag", "template": "x"}]})");
  EXPECT_EQ(LoadChatTemplate(dir_.string()).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(LoadChatTemplateTest, BadJsonOrTemplateIsInvalidArgumentNamingTheFile) {
  const std::string path = (dir_ / "tokenizer_config.json").string();
  WriteConfig(R"({"chat_template": "x",)");
  absl::Status status = LoadChatTemplate(dir_.string()).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(status), HasSubstr(path + ": malformed JSON"));

  WriteConfig(R"({"chat_template": "{% if %}"})");
  status = LoadChatTemplate(dir_.string()).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(status),
              HasSubstr(path + ": chat_template: chat template line 1 col 7"));

  WriteConfig(R"({"chat_template": 3})");
  EXPECT_EQ(LoadChatTemplate(dir_.string()).status().code(),
            absl::StatusCode::kInvalidArgument);
  WriteConfig(R"({"chat_template": "x", "eos_token": 5})");
  status = LoadChatTemplate(dir_.string()).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(status), HasSubstr("eos_token"));
}

// ------------------------------------------------- ReadTokenizerConfig --

TEST_F(LoadChatTemplateTest, TokenizerConfigGivesTheClientsFields) {
  WriteConfig(
      R"({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",)"
      R"( "eos_token": {"content": "</s>"}, "pad_token": null,)"
      R"( "model_max_length": 4096, "chat_template": "{{ messages }}"})");
  absl::StatusOr<TokenizerConfig> config = ReadTokenizerConfig(dir_.string());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->tokenizer_class, "PreTrainedTokenizerFast");
  EXPECT_EQ(config->bos_token, "<s>");
  EXPECT_EQ(config->eos_token, "</s>");
  EXPECT_EQ(config->pad_token, std::nullopt);  // null: absent
  EXPECT_EQ(config->unk_token, std::nullopt);
  EXPECT_EQ(config->model_max_length, 4096);
  EXPECT_EQ(config->chat_template, "{{ messages }}");
}

TEST_F(LoadChatTemplateTest, TokenizerConfigWithoutTemplateOrLimit) {
  // transformers writes 1e30 for "no limit": a float, left out.
  WriteConfig(R"({"eos_token": "</s>", "model_max_length": 1e30})");
  absl::StatusOr<TokenizerConfig> config = ReadTokenizerConfig(dir_.string());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->tokenizer_class, "");
  EXPECT_EQ(config->model_max_length, std::nullopt);
  EXPECT_EQ(config->chat_template, std::nullopt);
}

TEST_F(LoadChatTemplateTest, TokenizerConfigErrorsNameFileAndField) {
  EXPECT_EQ(ReadTokenizerConfig(dir_.string()).status().code(),
            absl::StatusCode::kNotFound);
  const std::string path = (dir_ / "tokenizer_config.json").string();
  WriteConfig(R"({"pad_token": 3})");
  absl::Status status = ReadTokenizerConfig(dir_.string()).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(status), HasSubstr(path + ": pad_token"));
  WriteConfig(R"({"tokenizer_class": 1})");
  EXPECT_THAT(Msg(ReadTokenizerConfig(dir_.string()).status()),
              HasSubstr("tokenizer_class"));
}

}  // namespace
}  // namespace moh
