// Parses a Hugging Face tokenizer.json into a TokenizerPipeline.
#include <algorithm>
#include <functional>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/tokenizer/tokenizer_json.h"
#include "model/tokenizer/tokenizer_pipeline.h"

namespace moh {
namespace tokenizer_internal {
namespace {

// ByteLevel's default split pattern (GPT-2).
constexpr absl::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

absl::Status LoadModel(const json& root, TokenizerPipeline* impl) {
  const json* model = Get(root, "model");
  if (model == nullptr || !model->is_object()) {
    return Invalid("model", "missing or not an object");
  }
  const json* type = Get(*model, "type");
  if (type != nullptr && (!type->is_string() || *type != "BPE")) {
    return Unsupported("model.type", type->is_string()
                                         ? type->get<std::string>()
                                         : Describe(*type));
  }
  const json* vocab = Get(*model, "vocab");
  if (vocab == nullptr || !vocab->is_object()) {
    return Invalid("model.vocab", "missing or not an object");
  }
  for (const auto& [token, id] : vocab->items()) {
    const std::string field = absl::StrCat("model.vocab[\"", token, "\"]");
    if (!id.is_number_integer()) return Invalid(field, "must be an integer");
    MOH_ASSIGN_OR_RETURN(impl->vocab[token], CheckId(id.get<int64_t>(), field));
  }
  const json* merges = Get(*model, "merges");
  if (merges != nullptr && !merges->is_array()) {
    return Invalid("model.merges", "must be an array");
  }
  for (size_t rank = 0; merges != nullptr && rank < merges->size(); ++rank) {
    const json& m = (*merges)[rank];
    const std::string field = absl::StrCat("model.merges[", rank, "]");
    std::string a, b;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != s.npos) {
        return Invalid(field, absl::StrCat("\"", s, "\" is not \"a b\""));
      }
      a = s.substr(0, space);
      b = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() &&
               m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      return Invalid(field, "must be \"a b\" or [\"a\", \"b\"]");
    }
    auto ia = impl->vocab.find(a), ib = impl->vocab.find(b),
         ic = impl->vocab.find(a + b);
    if (ia == impl->vocab.end() || ib == impl->vocab.end() ||
        ic == impl->vocab.end()) {
      return Invalid(field, absl::StrCat("\"", a, "\", \"", b, "\" or \"", a, b,
                                         "\" is not in model.vocab"));
    }
    // Like HF, a repeated pair keeps its last rank.
    impl->merges[TokenizerPipeline::PairKey(ia->second, ib->second)] = {
        static_cast<int32_t>(rank), ic->second};
  }
  if (const json* unk = Get(*model, "unk_token")) {
    auto it = unk->is_string() ? impl->vocab.find(unk->get<std::string>())
                               : impl->vocab.end();
    if (it == impl->vocab.end()) {
      return Invalid("model.unk_token", "must be a token of model.vocab");
    }
    impl->unk_id = it->second;
  }
  MOH_ASSIGN_OR_RETURN(impl->fuse_unk,
                       GetBool(*model, "fuse_unk", false, "model"));
  MOH_ASSIGN_OR_RETURN(impl->byte_fallback,
                       GetBool(*model, "byte_fallback", false, "model"));
  MOH_ASSIGN_OR_RETURN(impl->ignore_merges,
                       GetBool(*model, "ignore_merges", false, "model"));
  if (const json* d = Get(*model, "dropout");
      d != nullptr && (!d->is_number() || d->get<double>() != 0.0)) {
    return Unsupported("model.dropout", Describe(*d));
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (const json* v = Get(*model, key);
        v != nullptr && (!v->is_string() || !v->get<std::string>().empty())) {
      return Unsupported(Field("model", key), Describe(*v));
    }
  }
  for (int b = 0; b < 256; ++b) {
    static constexpr char kHex[] = "0123456789ABCDEF";
    auto it = impl->vocab.find(
        absl::StrCat("<0x", std::string{kHex[b >> 4], kHex[b & 15]}, ">"));
    impl->byte_ids[b] = it == impl->vocab.end() ? -1 : it->second;
  }
  return absl::OkStatus();
}

absl::Status LoadAddedTokens(const json& root, TokenizerPipeline* impl) {
  const json* list = Get(root, "added_tokens");
  if (list == nullptr) return absl::OkStatus();
  if (!list->is_array()) return Invalid("added_tokens", "must be an array");
  for (size_t i = 0; i < list->size(); ++i) {
    const json& t = (*list)[i];
    const std::string where = absl::StrCat("added_tokens[", i, "]");
    AddedToken token;
    MOH_ASSIGN_OR_RETURN(const int64_t id, GetInt(t, "id", where));
    MOH_ASSIGN_OR_RETURN(token.id, CheckId(id, Field(where, "id")));
    MOH_ASSIGN_OR_RETURN(token.content, GetString(t, "content", where));
    if (token.content.empty()) {
      return Invalid(Field(where, "content"), "must not be empty");
    }
    MOH_ASSIGN_OR_RETURN(token.special, GetBool(t, "special", false, where));
    MOH_ASSIGN_OR_RETURN(token.lstrip, GetBool(t, "lstrip", false, where));
    MOH_ASSIGN_OR_RETURN(token.rstrip, GetBool(t, "rstrip", false, where));
    MOH_ASSIGN_OR_RETURN(token.single_word,
                         GetBool(t, "single_word", false, where));
    MOH_ASSIGN_OR_RETURN(token.normalized,
                         GetBool(t, "normalized", !token.special, where));
    impl->added_ids[token.content] = token.id;
    impl->added.push_back(std::move(token));
  }
  return absl::OkStatus();
}

// Sequence steps may hold Sequences: at most kMaxNesting deep (real files
// nest one or two), so that a hostile file cannot exhaust the loader's stack.
// Each level adds one "[i]" to the path `where`.
constexpr int kMaxNesting = 16;

absl::Status CheckNesting(const std::string& where) {
  if (std::count(where.begin(), where.end(), '[') < kMaxNesting) {
    return absl::OkStatus();
  }
  return Invalid(
      where, absl::StrCat("Sequences may nest at most ", kMaxNesting, " deep"));
}

absl::Status LoadNormalizer(const json& n, const std::string& where,
                            TokenizerPipeline* impl) {
  MOH_ASSIGN_OR_RETURN(const std::string type, GetString(n, "type", where));
  NormalizerStep step;
  if (type == "Sequence") {
    MOH_RETURN_IF_ERROR(CheckNesting(where));
    return ForEach(n, "normalizers", where,
                   [impl](const json& e, const std::string& w) {
                     return LoadNormalizer(e, w, impl);
                   });
  } else if (type == "Prepend") {
    step.prepend = true;
    MOH_ASSIGN_OR_RETURN(step.to, GetString(n, "prepend", where));
  } else if (type == "Replace") {
    MOH_RETURN_IF_ERROR(GetPattern(n, where, &step.from, nullptr));
    MOH_ASSIGN_OR_RETURN(step.to, GetString(n, "content", where));
  } else {
    return Unsupported(Field(where, "type"), type);
  }
  impl->normalizer.push_back(std::move(step));
  return absl::OkStatus();
}

// Metaspace's "prepend_scheme", or the legacy "add_prefix_space".
absl::StatusOr<PreTokenizerStep::Prepend> GetPrependScheme(
    const json& obj, absl::string_view where) {
  using Prepend = PreTokenizerStep::Prepend;
  if (Get(obj, "prepend_scheme") != nullptr) {
    MOH_ASSIGN_OR_RETURN(const std::string s,
                         GetString(obj, "prepend_scheme", where));
    if (s == "always") return Prepend::kAlways;
    if (s == "first") return Prepend::kFirst;
    if (s == "never") return Prepend::kNever;
    return Unsupported(Field(where, "prepend_scheme"), s);
  }
  MOH_ASSIGN_OR_RETURN(const bool add,
                       GetBool(obj, "add_prefix_space", true, where));
  return add ? Prepend::kAlways : Prepend::kNever;
}

absl::Status LoadPreTokenizer(const json& p, const std::string& where,
                              TokenizerPipeline* impl) {
  MOH_ASSIGN_OR_RETURN(const std::string type, GetString(p, "type", where));
  PreTokenizerStep step;
  if (type == "Sequence") {
    MOH_RETURN_IF_ERROR(CheckNesting(where));
    return ForEach(p, "pretokenizers", where,
                   [impl](const json& e, const std::string& w) {
                     return LoadPreTokenizer(e, w, impl);
                   });
  } else if (type == "ByteLevel") {
    step.kind = PreTokenizerStep::Kind::kByteLevel;
    MOH_ASSIGN_OR_RETURN(step.add_prefix_space,
                         GetBool(p, "add_prefix_space", true, where));
    MOH_ASSIGN_OR_RETURN(const bool use_regex,
                         GetBool(p, "use_regex", true, where));
    if (use_regex) {
      MOH_ASSIGN_OR_RETURN(step.regex, CompileAt(kGpt2Pattern, where));
    }
  } else if (type == "Split") {
    step.kind = PreTokenizerStep::Kind::kSplit;
    std::string regex;
    MOH_RETURN_IF_ERROR(GetPattern(p, where, &step.literal, &regex));
    if (step.literal.empty()) {
      MOH_ASSIGN_OR_RETURN(step.regex,
                           CompileAt(regex, Field(where, "pattern.Regex")));
    }
    MOH_ASSIGN_OR_RETURN(const std::string behavior,
                         GetString(p, "behavior", where));
    static const auto* kBehaviors =
        new std::unordered_map<std::string, SplitBehavior>{
            {"Removed", SplitBehavior::kRemoved},
            {"Isolated", SplitBehavior::kIsolated},
            {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
            {"MergedWithNext", SplitBehavior::kMergedWithNext},
            {"Contiguous", SplitBehavior::kContiguous}};
    auto it = kBehaviors->find(behavior);
    if (it == kBehaviors->end()) {
      return Unsupported(Field(where, "behavior"), behavior);
    }
    step.behavior = it->second;
    MOH_ASSIGN_OR_RETURN(step.invert, GetBool(p, "invert", false, where));
  } else if (type == "Metaspace") {
    step.kind = PreTokenizerStep::Kind::kMetaspace;
    MOH_ASSIGN_OR_RETURN(step.literal, GetChar(p, "replacement", where));
    MOH_ASSIGN_OR_RETURN(step.prepend, GetPrependScheme(p, where));
    MOH_ASSIGN_OR_RETURN(step.split, GetBool(p, "split", true, where));
  } else {
    return Unsupported(Field(where, "type"), type);
  }
  impl->pre_tokenizer.push_back(std::move(step));
  return absl::OkStatus();
}

absl::Status LoadTemplate(const json& p, const std::string& where,
                          TokenizerPipeline* impl) {
  const json* specials = Get(p, "special_tokens");
  bool seen_sequence = false;
  return ForEach(p, "single", where, [&](const json& e, const std::string& w) {
    if (const json* seq = Get(e, "Sequence")) {
      MOH_ASSIGN_OR_RETURN(const std::string id, GetString(*seq, "id", w));
      if (id != "A" || seen_sequence) {
        return Invalid(w, "single template must hold Sequence A once");
      }
      seen_sequence = true;
      return absl::OkStatus();
    }
    const json* special = Get(e, "SpecialToken");
    if (special == nullptr) {
      return Invalid(w, "must be a Sequence or a SpecialToken");
    }
    MOH_ASSIGN_OR_RETURN(const std::string name, GetString(*special, "id", w));
    const json* entry = specials ? Get(*specials, name.c_str()) : nullptr;
    const json* ids = entry ? Get(*entry, "ids") : nullptr;
    if (ids == nullptr || !ids->is_array()) {
      return Invalid(Field(where, "special_tokens"),
                     absl::StrCat("no ids for \"", name, "\""));
    }
    for (const json& id : *ids) {
      if (!id.is_number_integer()) return Invalid(w, "ids must be integers");
      MOH_ASSIGN_OR_RETURN(const int32_t checked,
                           CheckId(id.get<int64_t>(), w));
      (seen_sequence ? impl->suffix_ids : impl->prefix_ids).push_back(checked);
    }
    return absl::OkStatus();
  });
}

absl::Status LoadPostProcessor(const json& p, const std::string& where,
                               TokenizerPipeline* impl) {
  MOH_ASSIGN_OR_RETURN(const std::string type, GetString(p, "type", where));
  if (type == "Sequence") {
    MOH_RETURN_IF_ERROR(CheckNesting(where));
    return ForEach(p, "processors", where,
                   [impl](const json& e, const std::string& w) {
                     return LoadPostProcessor(e, w, impl);
                   });
  }
  if (type == "ByteLevel") return absl::OkStatus();  // Offsets only.
  if (type == "TemplateProcessing") return LoadTemplate(p, where, impl);
  return Unsupported(Field(where, "type"), type);
}

// `phase`: 0 while per-token steps may come, 1 after ByteFallback, 2 once
// the tokens are fused (Fuse or ByteLevel).
absl::Status LoadDecoder(const json& d, const std::string& where, int* phase,
                         DecoderSpec* spec) {
  MOH_ASSIGN_OR_RETURN(const std::string type, GetString(d, "type", where));
  if (type == "Sequence") {
    MOH_RETURN_IF_ERROR(CheckNesting(where));
    return ForEach(d, "decoders", where,
                   [&](const json& e, const std::string& w) {
                     return LoadDecoder(e, w, phase, spec);
                   });
  }
  if (type == "Replace" || type == "Metaspace") {
    if (*phase != 0) {
      return Invalid(where, absl::StrCat(type,
                                         " after ByteFallback, Fuse or "
                                         "ByteLevel is not supported"));
    }
    DecoderSpec::TokenStep step;
    if (type == "Replace") {
      MOH_RETURN_IF_ERROR(GetPattern(d, where, &step.from, nullptr));
      MOH_ASSIGN_OR_RETURN(step.to, GetString(d, "content", where));
    } else {
      step.metaspace = true;
      MOH_ASSIGN_OR_RETURN(step.from, GetChar(d, "replacement", where));
      MOH_ASSIGN_OR_RETURN(const auto scheme, GetPrependScheme(d, where));
      step.strip_first = scheme != PreTokenizerStep::Prepend::kNever;
    }
    spec->token_steps.push_back(std::move(step));
  } else if (type == "ByteFallback" || type == "ByteLevel") {
    if (spec->bytes != DecoderSpec::Bytes::kNone || *phase == 2) {
      return Invalid(where, absl::StrCat(type, " must come once, before Fuse"));
    }
    const bool level = type == "ByteLevel";
    spec->bytes = level ? DecoderSpec::Bytes::kByteLevel
                        : DecoderSpec::Bytes::kByteFallback;
    *phase = level ? 2 : 1;
  } else if (type == "Fuse") {
    *phase = 2;
  } else if (type == "Strip") {
    if (*phase != 2 || !spec->strip_content.empty()) {
      return Invalid(where, "Strip is supported once, after Fuse or ByteLevel");
    }
    MOH_ASSIGN_OR_RETURN(spec->strip_content, GetChar(d, "content", where));
    MOH_ASSIGN_OR_RETURN(const int64_t start, GetInt(d, "start", where));
    MOH_ASSIGN_OR_RETURN(const int64_t stop, GetInt(d, "stop", where));
    if (start < 0 || stop < 0) return Invalid(where, "negative start/stop");
    spec->strip_start = start;
    spec->strip_stop = stop;
  } else {
    return Unsupported(Field(where, "type"), type);
  }
  return absl::OkStatus();
}

std::optional<int32_t> FirstSpecial(const TokenizerPipeline& impl,
                                    std::initializer_list<const char*> names) {
  for (const char* name : names) {
    auto it = impl.added_ids.find(name);
    if (it != impl.added_ids.end() &&
        impl.id_kind[it->second] == TokenizerPipeline::kSpecial)
      return it->second;
  }
  return std::nullopt;
}

absl::Status Load(const json& root, TokenizerPipeline* impl) {
  if (!root.is_object()) return Invalid("(root)", "must be a JSON object");
  MOH_RETURN_IF_ERROR(LoadModel(root, impl));
  MOH_RETURN_IF_ERROR(LoadAddedTokens(root, impl));
  if (const json* n = Get(root, "normalizer")) {
    MOH_RETURN_IF_ERROR(LoadNormalizer(*n, "normalizer", impl));
  }
  if (const json* p = Get(root, "pre_tokenizer")) {
    MOH_RETURN_IF_ERROR(LoadPreTokenizer(*p, "pre_tokenizer", impl));
  }
  if (const json* p = Get(root, "post_processor")) {
    MOH_RETURN_IF_ERROR(LoadPostProcessor(*p, "post_processor", impl));
  }
  if (const json* d = Get(root, "decoder")) {
    int phase = 0;
    MOH_RETURN_IF_ERROR(LoadDecoder(*d, "decoder", &phase, &impl->decoder));
  } else {
    impl->decoder.join_with_space = true;
  }

  int32_t size = 0;
  for (const auto& [token, id] : impl->vocab) size = std::max(size, id + 1);
  for (const AddedToken& t : impl->added) size = std::max(size, t.id + 1);
  const int64_t named = static_cast<int64_t>(impl->vocab.size()) +
                        static_cast<int64_t>(impl->added.size());
  if (size - named > kMaxUnusedTokenIds) {
    return Invalid("(token ids)",
                   absl::StrCat("the largest id, ", size - 1, ", leaves ",
                                size - named, " ids below it unnamed; at most ",
                                kMaxUnusedTokenIds, " may be"));
  }
  impl->id_to_token.resize(size);
  impl->id_kind.assign(size, TokenizerPipeline::kMissing);
  for (const auto& [token, id] : impl->vocab) {
    impl->id_to_token[id] = token;
    impl->id_kind[id] = TokenizerPipeline::kModel;
  }
  for (size_t i = 0; i < impl->added.size(); ++i) {
    const AddedToken& t = impl->added[i];
    impl->id_to_token[t.id] = t.content;
    impl->id_kind[t.id] =
        t.special ? TokenizerPipeline::kSpecial : TokenizerPipeline::kAdded;
    if (t.normalized) {
      impl->normalized_matcher.Add(impl->Normalize(t.content), i);
    } else {
      impl->raw_matcher.Add(t.content, i);
    }
  }
  // Template ids are emitted as they are: each must name a token (the
  // suffix's too, and no gap in the ids), or Encode would return ids that
  // Decode refuses.
  for (const std::vector<int32_t>* ids :
       {&impl->prefix_ids, &impl->suffix_ids}) {
    for (int32_t id : *ids) {
      if (id >= size || impl->id_kind[id] == TokenizerPipeline::kMissing) {
        return Invalid("post_processor",
                       absl::StrCat("id ", id, " outside vocabulary"));
      }
    }
  }
  impl->bos_id = !impl->prefix_ids.empty()
                     ? std::optional<int32_t>(impl->prefix_ids.front())
                     : FirstSpecial(*impl, {"<|begin_of_text|>", "<s>", "<bos>",
                                            "<|startoftext|>"});
  impl->eos_id = FirstSpecial(*impl, {"<|end_of_text|>", "<|eot_id|>", "</s>",
                                      "<eos>", "<|endoftext|>", "<|im_end|>"});
  return absl::OkStatus();
}

}  // namespace

absl::Status LoadTokenizerJson(std::string_view json_text,
                               TokenizerPipeline* pipeline) {
  try {
    return Load(json::parse(json_text.begin(), json_text.end()), pipeline);
  } catch (const json::exception& e) {  // Malformed JSON (or a bug here).
    return absl::InvalidArgumentError(
        absl::StrCat("malformed tokenizer.json: ", e.what()));
  }
}

}  // namespace tokenizer_internal
}  // namespace moh
