// Structured outputs: a request's response_format (a JSON object, or JSON
// that a JSON schema accepts) compiled into a grammar over one tokenizer's
// vocabulary, and the per-sequence matcher that says which tokens may come
// next. The grammar engine is xgrammar's C++ core (the one vLLM, SGLang and
// TensorRT-LLM use); no xgrammar type appears in this header.
//
// A GrammarCompiler belongs to one model (its tokenizer and EOS ids) and is
// called on request workers, never on the engine loop: a compile takes
// milliseconds to seconds, and a compile that runs past the timeout is
// answered INVALID_ARGUMENT while it finishes on its own thread. Compiled
// grammars are immutable, shared by every sequence that uses them, and kept
// in a bounded cache keyed by the schema text. A GrammarMatcher is one
// sequence's state: not thread-safe, used by the thread that samples it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "model/tokenizer/tokenizer.h"

namespace moh {

// What a request constrains its output to (OpenAI's response_format).
struct ResponseFormat {
  enum class Type { kText, kJsonObject, kJsonSchema };
  Type type = Type::kText;
  // kJsonSchema: the schema, as JSON text.
  std::string schema;
  // The field errors name (the front doors use OpenAI's path for it).
  static constexpr const char* kSchemaField =
      "response_format.json_schema.schema";
};

// A grammar compiled for one GrammarCompiler's vocabulary. Opaque, immutable.
class CompiledGrammar;

class GrammarCompiler {
 public:
  struct Options {
    // Bound on a schema's JSON text, in bytes, and on its nesting depth.
    size_t max_schema_bytes = size_t{32} << 10;
    int max_schema_depth = 32;
    // A compile still running after this is answered INVALID_ARGUMENT; it
    // finishes on its own thread (at most `max_overdue` at once: beyond,
    // cache misses get RESOURCE_EXHAUSTED until one ends).
    absl::Duration compile_timeout = absl::Seconds(10);
    int max_overdue = 2;
    // Compiled grammars kept, least recently used dropped first.
    size_t cache_entries = 64;
    // Whitespace allowed wherever JSON allows it, in characters per place
    // (xgrammar's max_whitespace_cnt): a small model under a grammar with
    // free whitespace can emit newlines until max_tokens.
    int max_whitespace = 2;
    // Threads one compile may use (xgrammar's token mask precomputation).
    int compile_threads = 2;
  };

  // `tokenizer` must outlive the compiler. `eos_ids`: the tokens that end a
  // sequence, which the grammar allows exactly where its JSON is complete;
  // FAILED_PRECONDITION when there are none (nothing could end the output).
  static absl::StatusOr<std::unique_ptr<GrammarCompiler>> Create(
      const Tokenizer& tokenizer, std::vector<int32_t> eos_ids,
      const Options& options);
  ~GrammarCompiler();

  // The grammar of `format` (not kText). Thread-safe. INVALID_ARGUMENT
  // naming ResponseFormat::kSchemaField for a schema that is too large or too
  // deep, is not a JSON object, that xgrammar refuses, that no value
  // satisfies, or whose compile times out.
  absl::StatusOr<std::shared_ptr<const CompiledGrammar>> Compile(
      const ResponseFormat& format);

  int32_t vocab_size() const;
  // Compiles that missed the cache since creation (for tests).
  int64_t compiles() const;

  struct State;

 private:
  GrammarCompiler(std::shared_ptr<State> state, const Options& options);
  const Options options_;
  std::shared_ptr<State> state_;  // shared with overdue compiles
};

// One sequence's position in its grammar. Not thread-safe.
class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar);
  GrammarMatcher(GrammarMatcher&&) noexcept;
  GrammarMatcher& operator=(GrammarMatcher&&) noexcept;
  ~GrammarMatcher();

  // The tokens that may come next: bit (id % 32) of word (id / 32) is set
  // for each allowed id in [0, vocab_size()). Valid until the next call.
  absl::Span<const uint32_t> AllowedTokens();
  // Advances past `token`. INTERNAL when the grammar does not allow it.
  absl::Status Accept(int32_t token);
  // True once an EOS token was accepted: the output is complete.
  bool terminated() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moh
