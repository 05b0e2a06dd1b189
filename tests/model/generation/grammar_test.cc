#include "model/generation/grammar.h"

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "base/field_error.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/generation/generator.h"
#include "nlohmann/json.hpp"
#include "tests/base/test_paths.h"

namespace moh {
namespace {

using ::testing::HasSubstr;

constexpr int32_t kEos = 767;  // the demo model's <|end_of_text|>

class GrammarTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto tokenizer = Tokenizer::FromFile(test_paths::ModelsDir() +
                                         "/demo-lm/tokenizer.json");
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = tokenizer->release();
  }
  static void TearDownTestSuite() { delete tokenizer_; }

  static std::unique_ptr<GrammarCompiler> Compiler(
      GrammarCompiler::Options options = {}) {
    auto compiler = GrammarCompiler::Create(*tokenizer_, {kEos}, options);
    EXPECT_TRUE(compiler.ok()) << compiler.status();
    return compiler.ok() ? std::move(*compiler) : nullptr;
  }
  static ResponseFormat Schema(std::string schema) {
    return {ResponseFormat::Type::kJsonSchema, std::move(schema)};
  }
  static bool Allowed(absl::Span<const uint32_t> mask, int32_t id) {
    return ((mask[id / 32] >> (id % 32)) & 1u) != 0;
  }
  // Feeds `text`'s tokens, then EOS; true when all are accepted and the
  // matcher ends.
  static bool Accepts(std::shared_ptr<const CompiledGrammar> grammar,
                      const std::string& text) {
    GrammarMatcher matcher(std::move(grammar));
    for (int32_t id : tokenizer_->Encode(text, false)) {
      if (!Allowed(matcher.AllowedTokens(), id)) return false;
      if (!matcher.Accept(id).ok()) return false;
    }
    if (!Allowed(matcher.AllowedTokens(), kEos)) return false;
    return matcher.Accept(kEos).ok() && matcher.terminated();
  }

  static Tokenizer* tokenizer_;
};
Tokenizer* GrammarTest::tokenizer_ = nullptr;

TEST_F(GrammarTest, TokenBytesAreTheDecodersBytes) {
  const std::vector<int32_t> ids = tokenizer_->Encode("{\"a\": 1}", false);
  std::string joined;
  for (int32_t id : ids) joined += *tokenizer_->TokenBytes(id);
  EXPECT_EQ(joined, "{\"a\": 1}");
  EXPECT_EQ(*tokenizer_->TokenBytes(kEos), "");  // special
  EXPECT_FALSE(tokenizer_->TokenBytes(100000).has_value());
}

TEST_F(GrammarTest, JsonObjectAcceptsObjectsOnly) {
  auto compiler = Compiler();
  auto grammar = compiler->Compile({ResponseFormat::Type::kJsonObject, ""});
  ASSERT_TRUE(grammar.ok()) << grammar.status();
  EXPECT_TRUE(Accepts(*grammar, "{\"a\": [1, true, null], \"b\": {}}"));
  EXPECT_TRUE(Accepts(*grammar, "{}"));
  EXPECT_FALSE(Accepts(*grammar, "[1]"));
  EXPECT_FALSE(Accepts(*grammar, "{\"a\": 1"));  // EOS before the end
  // Whitespace is bounded: two characters per place.
  EXPECT_TRUE(Accepts(*grammar, "{\"a\":  1}"));
  EXPECT_FALSE(Accepts(*grammar, "{\"a\":   1}"));
}

TEST_F(GrammarTest, SchemaIsEnforcedStrictly) {
  auto compiler = Compiler();
  auto grammar = compiler->Compile(Schema(R"({"type": "object",
      "properties": {"name": {"type": "string", "maxLength": 4},
                     "age": {"type": "integer"}},
      "required": ["name", "age"]})"));
  ASSERT_TRUE(grammar.ok()) << grammar.status();
  EXPECT_TRUE(Accepts(*grammar, "{\"name\": \"bo\", \"age\": 3}"));
  EXPECT_FALSE(Accepts(*grammar, "{\"name\": \"bobby\", \"age\": 3}"));
  EXPECT_FALSE(Accepts(*grammar, "{\"age\": 3}"));
  EXPECT_FALSE(Accepts(*grammar, "{\"name\": \"bo\", \"age\": 3, \"x\": 1}"));
}

TEST_F(GrammarTest, FirstMaskAllowsAnOpeningBraceNotEos) {
  auto compiler = Compiler();
  auto grammar = compiler->Compile({ResponseFormat::Type::kJsonObject, ""});
  ASSERT_TRUE(grammar.ok());
  GrammarMatcher matcher(*grammar);
  absl::Span<const uint32_t> mask = matcher.AllowedTokens();
  EXPECT_EQ(mask.size(),
            static_cast<size_t>((tokenizer_->vocab_size() + 31) / 32));
  EXPECT_FALSE(Allowed(mask, kEos));
  EXPECT_TRUE(Allowed(mask, tokenizer_->Encode("{", false)[0]));
  EXPECT_FALSE(Allowed(mask, tokenizer_->Encode("a", false)[0]));
  EXPECT_FALSE(matcher.Accept(tokenizer_->Encode("a", false)[0]).ok());
}

TEST_F(GrammarTest, BadSchemasNameTheField) {
  GrammarCompiler::Options options;
  options.max_schema_bytes = 200;
  options.max_schema_depth = 4;
  auto compiler = Compiler(options);
  const std::string deep = R"({"a": {"b": {"c": {"d": {"e": 1}}}}})";
  for (const auto& [schema, what] :
       std::vector<std::pair<std::string, std::string>>{
           {std::string(300, ' ') + "{}", "at most 200 bytes"},
           {"{\"type\": ", "must be JSON"},
           {"[1]", "must be a JSON object"},
           {deep, "nest at most 4 levels"},
           {R"({"type": "nonsense"})", "can enforce"},
           {R"({"type": "integer", "minimum": 5, "maximum": 1})", ""},
           {R"({"enum": []})", ""},
       }) {
    auto grammar = compiler->Compile(Schema(schema));
    ASSERT_FALSE(grammar.ok()) << schema;
    EXPECT_EQ(grammar.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(ErrorField(grammar.status()), ResponseFormat::kSchemaField);
    EXPECT_THAT(grammar.status().message(), HasSubstr(what));
  }
}

TEST_F(GrammarTest, CompiledGrammarsAreCached) {
  auto compiler = Compiler();
  const std::string schema =
      R"({"type": "object", "properties": {"a": {"type": "boolean"}}})";
  auto first = compiler->Compile(Schema(schema));
  auto second = compiler->Compile(Schema(schema));
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(first->get(), second->get());
  EXPECT_EQ(compiler->compiles(), 1);
}

TEST_F(GrammarTest, ACompilePastItsTimeoutIsAnError) {
  GrammarCompiler::Options options;
  options.compile_timeout = absl::ZeroDuration();
  auto compiler = Compiler(options);
  std::string schema = R"({"type": "object", "properties": {)";
  for (int i = 0; i < 40; ++i) {
    schema += "\"p" + std::to_string(i) + "\": {\"type\": \"string\", " +
              "\"pattern\": \"[a-z]{1,9}\"},";
  }
  schema += R"("last": {"type": "integer"}}})";
  auto grammar = compiler->Compile(Schema(schema));
  ASSERT_FALSE(grammar.ok());
  EXPECT_EQ(ErrorField(grammar.status()), ResponseFormat::kSchemaField);
  EXPECT_THAT(grammar.status().message(), HasSubstr("longer than"));
}

TEST_F(GrammarTest, CreateNeedsAnEosToken) {
  auto compiler = GrammarCompiler::Create(*tokenizer_, {}, {});
  EXPECT_EQ(compiler.status().code(), absl::StatusCode::kFailedPrecondition);
}

// SequenceOutput under a grammar, on random logits: whatever they favour,
// the output is an object that ends with EOS.
TEST_F(GrammarTest, SequenceOutputOnRandomLogitsWritesValidJson) {
  auto compiler = Compiler();
  auto grammar = compiler->Compile(Schema(R"({"type": "object",
      "properties": {"ok": {"type": "boolean"},
                     "n": {"type": "integer", "minimum": 0, "maximum": 99}},
      "required": ["ok", "n"]})"));
  ASSERT_TRUE(grammar.ok()) << grammar.status();
  for (uint64_t seed = 0; seed < 8; ++seed) {
    SamplingParams sampling;
    sampling.temperature = 1.0f;
    sampling.seed = seed;
    sampling.max_new_tokens = 200;
    sampling.min_tokens = 5;  // the grammar decides where EOS may come
    SequenceOutput output(sampling, {1}, tokenizer_, {kEos}, *grammar);
    at::manual_seed(seed);
    std::string text;
    while (!output.finish_reason()) {
      auto chunk = output.Next(at::randn({tokenizer_->vocab_size()}) * 3);
      ASSERT_TRUE(chunk.ok()) << chunk.status();
      text += chunk->text;
    }
    EXPECT_EQ(*output.finish_reason(), FinishReason::kEos) << text;
    const nlohmann::json parsed = nlohmann::json::parse(text, nullptr, false);
    ASSERT_TRUE(parsed.is_object()) << text;
    EXPECT_TRUE(parsed["ok"].is_boolean()) << text;
    EXPECT_TRUE(parsed["n"].is_number_integer()) << text;
  }
}

TEST_F(GrammarTest, IgnoreEosEndsWithStopWhenComplete) {
  auto compiler = Compiler();
  auto grammar = compiler->Compile(Schema(R"({"enum": ["yes"]})"));
  ASSERT_TRUE(grammar.ok()) << grammar.status();
  SamplingParams sampling;
  sampling.ignore_eos = true;
  sampling.max_new_tokens = 50;
  SequenceOutput output(sampling, {1}, tokenizer_, {kEos}, *grammar);
  std::string text;
  while (!output.finish_reason()) {
    auto chunk = output.Next(at::zeros({tokenizer_->vocab_size()}));
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    text += chunk->text;
  }
  EXPECT_EQ(text, "\"yes\"");
  EXPECT_EQ(*output.finish_reason(), FinishReason::kStop);
}

}  // namespace
}  // namespace moh
