#include "model/generation/grammar.h"

#include <dlpack/dlpack.h>
#include <xgrammar/compiler.h>
#include <xgrammar/matcher.h>
#include <xgrammar/tokenizer_info.h>

#include <algorithm>
#include <exception>
#include <list>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/abbreviate.h"
#include "base/field_error.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"

namespace moh {

class CompiledGrammar {
 public:
  explicit CompiledGrammar(xgrammar::CompiledGrammar grammar)
      : grammar_(std::move(grammar)) {}
  const xgrammar::CompiledGrammar& get() const { return grammar_; }

 private:
  xgrammar::CompiledGrammar grammar_;
};

namespace {

using GrammarPtr = std::shared_ptr<const CompiledGrammar>;

absl::Status SchemaError(absl::string_view what) {
  return FieldError(ResponseFormat::kSchemaField, what);
}

// The schema's checks before xgrammar sees it: size, JSON, an object, depth.
absl::Status CheckSchemaText(const std::string& schema,
                             const GrammarCompiler::Options& options) {
  if (schema.size() > options.max_schema_bytes) {
    return SchemaError(absl::StrCat("must be at most ",
                                    options.max_schema_bytes,
                                    " bytes of JSON, got ", schema.size()));
  }
  int deepest = 0;
  const nlohmann::json::parser_callback_t depth =
      [&deepest](int d, nlohmann::json::parse_event_t, nlohmann::json&) {
        deepest = std::max(deepest, d);
        return true;
      };
  const nlohmann::json parsed =
      nlohmann::json::parse(schema, depth, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return SchemaError("must be JSON");
  if (!parsed.is_object()) return SchemaError("must be a JSON object");
  if (deepest > options.max_schema_depth) {
    return SchemaError(absl::StrCat("must nest at most ",
                                    options.max_schema_depth,
                                    " levels deep, got ", deepest));
  }
  return absl::OkStatus();
}

// A DLTensor over `words` (int32, CPU), as xgrammar fills bitmasks.
DLTensor BitmaskTensor(std::vector<int32_t>* words, int64_t* shape) {
  *shape = static_cast<int64_t>(words->size());
  DLTensor t{};
  t.data = words->data();
  t.device = DLDevice{kDLCPU, 0};
  t.ndim = 1;
  t.dtype = DLDataType{kDLInt, 32, 1};
  t.shape = shape;
  return t;
}

}  // namespace

struct GrammarCompiler::State {
  State(xgrammar::TokenizerInfo info, int threads, std::vector<int32_t> eos)
      : compiler(info, threads, /*cache_enabled=*/false),
        vocab_size(info.GetVocabSize()),
        eos_ids(std::move(eos)) {}

  // One compile on the calling thread, with xgrammar's errors as statuses.
  absl::StatusOr<GrammarPtr> CompileNow(const ResponseFormat& format,
                                        int max_whitespace) const;
  // Whether a sequence under `grammar` can start: its first mask allows a
  // token that is not EOS (no JSON value is empty).
  bool CanStart(const GrammarPtr& grammar) const;

  GrammarPtr Find(const std::string& key) ABSL_LOCKS_EXCLUDED(mu);
  void Insert(const std::string& key, GrammarPtr grammar, size_t capacity)
      ABSL_LOCKS_EXCLUDED(mu);

  // A handle whose compiles are thread-safe (not const methods).
  mutable xgrammar::GrammarCompiler compiler;
  const int32_t vocab_size;
  const std::vector<int32_t> eos_ids;

  absl::Mutex mu;
  // Most recently used first; `index` points into it.
  std::list<std::pair<std::string, GrammarPtr>> lru ABSL_GUARDED_BY(mu);
  std::unordered_map<std::string,
                     std::list<std::pair<std::string, GrammarPtr>>::iterator>
      index ABSL_GUARDED_BY(mu);
  int overdue ABSL_GUARDED_BY(mu) = 0;
  int64_t compiles ABSL_GUARDED_BY(mu) = 0;
};

absl::StatusOr<GrammarPtr> GrammarCompiler::State::CompileNow(
    const ResponseFormat& format, int max_whitespace) const {
  std::optional<xgrammar::CompiledGrammar> compiled;
  try {
    // json_object: any object; a schema: strict (no properties or items the
    // schema does not name), as vLLM compiles them. Whitespace is bounded
    // in both; output is on one line.
    const bool object = format.type == ResponseFormat::Type::kJsonObject;
    compiled.emplace(compiler.CompileJSONSchema(
        object ? std::string(R"({"type": "object"})") : format.schema,
        /*any_whitespace=*/true, /*indent=*/std::nullopt,
        /*separators=*/std::nullopt, /*strict_mode=*/!object,
        /*max_whitespace_cnt=*/max_whitespace));
  } catch (const std::exception& e) {
    return SchemaError(absl::StrCat("is not a schema this server can enforce: ",
                                    Abbreviate(e.what(), 300)));
  }
  auto grammar = std::make_shared<const CompiledGrammar>(std::move(*compiled));
  if (!CanStart(grammar)) {
    return SchemaError("is unsatisfiable: no JSON value matches it");
  }
  return grammar;
}

bool GrammarCompiler::State::CanStart(const GrammarPtr& grammar) const {
  GrammarMatcher matcher(grammar);
  absl::Span<const uint32_t> allowed = matcher.AllowedTokens();
  for (size_t w = 0; w < allowed.size(); ++w) {
    uint32_t bits = allowed[w];
    for (int32_t id : eos_ids) {
      if (static_cast<size_t>(id / 32) == w) bits &= ~(1u << (id % 32));
    }
    if (bits != 0) return true;
  }
  return false;
}

GrammarPtr GrammarCompiler::State::Find(const std::string& key) {
  absl::MutexLock lock(&mu);
  auto it = index.find(key);
  if (it == index.end()) return nullptr;
  lru.splice(lru.begin(), lru, it->second);
  return it->second->second;
}

void GrammarCompiler::State::Insert(const std::string& key, GrammarPtr grammar,
                                    size_t capacity) {
  absl::MutexLock lock(&mu);
  if (index.count(key) > 0 || capacity == 0) return;
  lru.emplace_front(key, std::move(grammar));
  index[key] = lru.begin();
  while (lru.size() > capacity) {
    index.erase(lru.back().first);
    lru.pop_back();
  }
}

absl::StatusOr<std::unique_ptr<GrammarCompiler>> GrammarCompiler::Create(
    const Tokenizer& tokenizer, std::vector<int32_t> eos_ids,
    const Options& options) {
  const int32_t vocab = tokenizer.vocab_size();
  eos_ids.erase(
      std::remove_if(eos_ids.begin(), eos_ids.end(),
                     [vocab](int32_t id) { return id < 0 || id >= vocab; }),
      eos_ids.end());
  if (eos_ids.empty()) {
    return absl::FailedPreconditionError(
        "response_format needs a model with an end-of-sequence token in its "
        "tokenizer");
  }
  std::vector<std::string> vocabulary(vocab);
  for (int32_t id = 0; id < vocab; ++id) {
    vocabulary[id] = tokenizer.TokenBytes(id).value_or("");
  }
  try {
    xgrammar::TokenizerInfo info(vocabulary, xgrammar::VocabType::RAW, vocab,
                                 eos_ids);
    auto state = std::make_shared<State>(std::move(info),
                                         std::max(1, options.compile_threads),
                                         std::move(eos_ids));
    return std::unique_ptr<GrammarCompiler>(
        new GrammarCompiler(std::move(state), options));
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("grammar engine: the tokenizer's vocabulary: ", e.what()));
  }
}

GrammarCompiler::GrammarCompiler(std::shared_ptr<State> state,
                                 const Options& options)
    : options_(options), state_(std::move(state)) {}

GrammarCompiler::~GrammarCompiler() = default;

int32_t GrammarCompiler::vocab_size() const { return state_->vocab_size; }

int64_t GrammarCompiler::compiles() const {
  absl::MutexLock lock(&state_->mu);
  return state_->compiles;
}

absl::StatusOr<GrammarPtr> GrammarCompiler::Compile(
    const ResponseFormat& format) {
  if (format.type == ResponseFormat::Type::kText) {
    return absl::InvalidArgumentError("response_format text has no grammar");
  }
  const bool object = format.type == ResponseFormat::Type::kJsonObject;
  if (!object) MOH_RETURN_IF_ERROR(CheckSchemaText(format.schema, options_));
  const std::string key = object ? "object" : "schema:" + format.schema;
  if (GrammarPtr cached = state_->Find(key)) return cached;

  // The compile runs on its own thread so that this request gives up on it
  // after compile_timeout; the thread owns what it uses.
  struct Pending {
    absl::Mutex mu;
    bool done ABSL_GUARDED_BY(mu) = false;
    absl::StatusOr<GrammarPtr> result ABSL_GUARDED_BY(mu);
  };
  auto pending = std::make_shared<Pending>();
  {
    absl::MutexLock lock(&state_->mu);
    if (state_->overdue >= options_.max_overdue) {
      return absl::ResourceExhaustedError(
          "response_format: too many grammars are still compiling; retry "
          "later");
    }
    ++state_->compiles;
  }
  std::thread([state = state_, pending, format, key, options = options_] {
    absl::StatusOr<GrammarPtr> result =
        state->CompileNow(format, options.max_whitespace);
    if (result.ok()) state->Insert(key, *result, options.cache_entries);
    absl::MutexLock lock(&pending->mu);
    pending->done = true;
    pending->result = std::move(result);
  }).detach();

  absl::MutexLock lock(&pending->mu);
  const auto done = [&pending]() ABSL_SHARED_LOCKS_REQUIRED(pending->mu) {
    return pending->done;
  };
  if (pending->mu.AwaitWithTimeout(absl::Condition(&done),
                                   options_.compile_timeout)) {
    return std::move(pending->result);
  }
  // Overdue: counted until its thread ends.
  absl::MutexLock state_lock(&state_->mu);
  ++state_->overdue;
  return SchemaError(absl::StrCat(
      "took longer than ", absl::FormatDuration(options_.compile_timeout),
      " to compile; simplify the schema"));
}

// ------------------------------------------------------------ matcher --

struct GrammarMatcher::Impl {
  explicit Impl(std::shared_ptr<const CompiledGrammar> g)
      : grammar(std::move(g)),
        matcher(grammar->get()),
        words(xgrammar::GetBitmaskSize(
            grammar->get().GetTokenizerInfo().GetVocabSize())) {}
  std::shared_ptr<const CompiledGrammar> grammar;
  xgrammar::GrammarMatcher matcher;
  std::vector<int32_t> words;
};

GrammarMatcher::GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar)
    : impl_(std::make_unique<Impl>(std::move(grammar))) {}
GrammarMatcher::GrammarMatcher(GrammarMatcher&&) noexcept = default;
GrammarMatcher& GrammarMatcher::operator=(GrammarMatcher&&) noexcept = default;
GrammarMatcher::~GrammarMatcher() = default;

absl::Span<const uint32_t> GrammarMatcher::AllowedTokens() {
  int64_t shape = 0;
  DLTensor tensor = BitmaskTensor(&impl_->words, &shape);
  if (impl_->matcher.IsTerminated()) {
    std::fill(impl_->words.begin(), impl_->words.end(), 0);
  } else {
    impl_->matcher.FillNextTokenBitmask(&tensor);
  }
  return absl::Span<const uint32_t>(
      reinterpret_cast<const uint32_t*>(impl_->words.data()),
      impl_->words.size());
}

absl::Status GrammarMatcher::Accept(int32_t token) {
  if (!impl_->matcher.AcceptToken(token)) {
    return absl::InternalError(
        absl::StrCat("token ", token, " is not allowed by response_format"));
  }
  return absl::OkStatus();
}

bool GrammarMatcher::terminated() const {
  return impl_->matcher.IsTerminated();
}

}  // namespace moh
