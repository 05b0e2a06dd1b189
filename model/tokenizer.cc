#include "model/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "model/status_macros.h"

namespace moh {
namespace {

using json = nlohmann::json;

constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD
// ByteLevel's default split pattern (GPT-2).
constexpr absl::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// Ids are stored in dense tables; this bounds them against corrupt files.
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

// ---------------------------------------------------------------- UTF-8 --

// Length of the valid UTF-8 character starting `s`; 0 when `s` holds only an
// incomplete but so far valid prefix; -k when its first k bytes form a
// maximal invalid subpart (Unicode 3.9, as Rust's from_utf8_lossy uses).
int NextUtf8(std::string_view s) {
  const auto b = static_cast<unsigned char>(s[0]);
  int n = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b < 0x80) return 1;
  if (b >= 0xC2 && b <= 0xDF) {
    n = 2;
  } else if (b >= 0xE0 && b <= 0xEF) {
    n = 3;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    n = 4;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    return -1;
  }
  for (int i = 1; i < n; ++i) {
    if (static_cast<size_t>(i) >= s.size()) return 0;
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < (i == 1 ? lo : 0x80) || c > (i == 1 ? hi : 0xBF)) return -i;
  }
  return n;
}

// Appends `s` with each maximal invalid subpart replaced by U+FFFD. An
// incomplete character at the end is left unconsumed unless `final`.
// Returns the number of bytes consumed.
size_t AppendLossyUtf8(std::string_view s, bool final, std::string* out) {
  size_t i = 0;
  while (i < s.size()) {
    const int n = NextUtf8(s.substr(i));
    if (n > 0) {
      out->append(s.substr(i, n));
      i += n;
    } else if (n < 0) {
      out->append(kReplacementChar);
      i += -n;
    } else if (final) {
      out->append(kReplacementChar);
      i = s.size();
    } else {
      break;
    }
  }
  return i;
}

bool IsValidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const int n = NextUtf8(s.substr(i));
    if (n <= 0) return false;
    i += n;
  }
  return true;
}

// Code point at the start of valid UTF-8 `s`; sets `*len` to its length.
char32_t DecodeUtf8(std::string_view s, int* len) {
  *len = NextUtf8(s);
  const auto b = static_cast<unsigned char>(s[0]);
  if (*len == 1) return b;
  char32_t cp = b & (0x7F >> *len);
  for (int i = 1; i < *len; ++i) cp = (cp << 6) | (s[i] & 0x3F);
  return cp;
}

// Code point ending at `pos` (> 0) of valid UTF-8 `s`; sets `*begin` to
// its first byte.
char32_t CharBefore(std::string_view s, size_t pos, size_t* begin) {
  size_t b = pos - 1;
  while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
  *begin = b;
  int len = 0;
  return DecodeUtf8(s.substr(b), &len);
}

std::string EncodeUtf8(char32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

// Unicode White_Space, which is what `\s` means to HF's Rust regexes.
bool IsSpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
         c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the
// others to U+0100 upwards in byte order.
struct ByteLevelTables {
  std::array<std::string, 256> byte_to_char;
  std::array<int, 512> char_to_byte;  // -1 where unmapped
  ByteLevelTables() {
    char_to_byte.fill(-1);
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable =
          (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const int cp = printable ? b : next++;
      byte_to_char[b] = EncodeUtf8(cp);
      char_to_byte[cp] = b;
    }
  }
};
const ByteLevelTables& ByteLevel() {
  static const ByteLevelTables* tables = new ByteLevelTables();
  return *tables;
}

// ---------------------------------------------------------------- Regex --

// A PCRE2 pattern in UTF + UCP mode. Matching is thread-safe.
class Regex {
 public:
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(absl::string_view re) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code* code =
        pcre2_compile(reinterpret_cast<PCRE2_SPTR>(re.data()), re.size(),
                      PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
    if (code == nullptr) {
      std::array<PCRE2_UCHAR, 256> msg{};
      pcre2_get_error_message(error, msg.data(), msg.size());
      return absl::InvalidArgumentError(
          absl::StrCat("bad regex \"", re, "\" at offset ", offset, ": ",
                       reinterpret_cast<const char*>(msg.data())));
    }
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // Optional speed-up.
    return std::unique_ptr<Regex>(new Regex(code));
  }
  ~Regex() { pcre2_code_free(code_); }

  // Non-overlapping matches left to right as [begin, end) byte offsets.
  // `text` must be valid UTF-8. A match failing on a resource limit ends the
  // search (the rest of the text counts as unmatched).
  std::vector<std::pair<size_t, size_t>> FindAll(std::string_view text) const {
    std::vector<std::pair<size_t, size_t>> out;
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
        pcre2_match_data_create_from_pattern(code_, nullptr),
        &pcre2_match_data_free);
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t pos = 0;
    while (pos <= text.size()) {
      int rc = pcre2_match(code_, subject, text.size(), pos, PCRE2_NO_UTF_CHECK,
                           md.get(), nullptr);
      if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
        rc = pcre2_match(code_, subject, text.size(), pos,
                         PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md.get(), nullptr);
      }
      if (rc < 0) break;
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
      if (ov[1] < ov[0]) break;  // \K in a lookaround; give up safely.
      out.emplace_back(ov[0], ov[1]);
      if (ov[1] > ov[0]) {
        pos = ov[1];
      } else if (ov[1] < text.size()) {
        pos = ov[1] + std::max(1, NextUtf8(text.substr(ov[1])));
      } else {
        break;
      }
    }
    return out;
  }

 private:
  explicit Regex(pcre2_code* code) : code_(code) {}
  pcre2_code* code_;
};

bool IsWordChar(char32_t c) {
  if (c < 0x80) return std::isalnum(static_cast<int>(c)) || c == '_';
  static const Regex* word = Regex::Compile(R"(^\w$)").value().release();
  return !word->FindAll(EncodeUtf8(c)).empty();
}

std::vector<std::pair<size_t, size_t>> FindLiteral(std::string_view text,
                                                   std::string_view needle) {
  std::vector<std::pair<size_t, size_t>> out;
  for (size_t pos = text.find(needle); pos != std::string_view::npos;
       pos = text.find(needle, pos + needle.size())) {
    out.emplace_back(pos, pos + needle.size());
  }
  return out;
}

// ----------------------------------------------------------- Pipeline parts --

struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
  bool normalized = false;
};

// Leftmost-longest literal matching of added-token patterns.
class AddedTokenMatcher {
 public:
  void Add(std::string pattern, int token_index) {
    if (pattern.empty()) return;
    auto& bucket = buckets_[static_cast<unsigned char>(pattern[0])];
    bucket.emplace_back(std::move(pattern), token_index);
    std::stable_sort(bucket.begin(), bucket.end(), [](auto& a, auto& b) {
      return a.first.size() > b.first.size();
    });
  }
  // First match at or after `from`: {begin, end, token index}.
  std::optional<std::tuple<size_t, size_t, int>> Find(std::string_view text,
                                                      size_t from) const {
    for (size_t i = from; i < text.size(); ++i) {
      for (const auto& [pattern, index] :
           buckets_[static_cast<unsigned char>(text[i])]) {
        if (text.substr(i, pattern.size()) == pattern) {
          return std::make_tuple(i, i + pattern.size(), index);
        }
      }
    }
    return std::nullopt;
  }

 private:
  std::array<std::vector<std::pair<std::string, int>>, 256> buckets_;
};

// A piece of input text; `at_start` when it begins at offset 0 of the input
// (Metaspace's prepend_scheme "first" depends on it).
struct Segment {
  std::string_view text;
  int32_t id = -1;  // >= 0 for an added token.
  bool at_start = false;
};
struct Piece {
  std::string text;
  bool at_start = false;
};

struct NormalizerStep {
  bool prepend = false;  // Prepend `to`; else Replace `from` with `to`.
  std::string from, to;
};

enum class SplitBehavior {
  kRemoved,
  kIsolated,
  kMergedWithPrevious,
  kMergedWithNext,
  kContiguous
};

struct PreTokenizerStep {
  enum class Kind { kByteLevel, kSplit, kMetaspace } kind;
  std::unique_ptr<Regex> regex;   // ByteLevel with use_regex, Split Regex.
  std::string literal;            // Split String pattern; Metaspace char.
  bool add_prefix_space = false;  // ByteLevel.
  SplitBehavior behavior = SplitBehavior::kIsolated;  // Split.
  bool invert = false;                                // Split.
  enum class Prepend { kAlways, kFirst, kNever } prepend = Prepend::kAlways;
  bool split = true;  // Metaspace.
};

// Splits `piece` at `matches` as HF's NormalizedString::split does; empty
// parts are dropped.
void SplitPiece(const Piece& piece,
                const std::vector<std::pair<size_t, size_t>>& matches,
                SplitBehavior behavior, bool invert, std::vector<Piece>* out) {
  struct Part {
    size_t begin, end;
    bool is_match;
  };
  std::vector<Part> parts;
  size_t prev = 0;
  for (const auto& [b, e] : matches) {
    if (prev != b) parts.push_back({prev, b, invert});
    parts.push_back({b, e, !invert});
    prev = e;
  }
  if (prev != piece.text.size()) {
    parts.push_back({prev, piece.text.size(), invert});
  }
  std::vector<Part> kept;
  const bool next = behavior == SplitBehavior::kMergedWithNext;
  if (next) std::reverse(parts.begin(), parts.end());
  bool previous_match = false;
  for (const Part& p : parts) {
    const bool merge =
        !kept.empty() &&
        ((behavior == SplitBehavior::kContiguous &&
          p.is_match == previous_match) ||
         ((behavior == SplitBehavior::kMergedWithPrevious || next) &&
          p.is_match && !previous_match));
    if (merge) {
      (next ? kept.back().begin : kept.back().end) = next ? p.begin : p.end;
    } else if (!(behavior == SplitBehavior::kRemoved && p.is_match)) {
      kept.push_back({p.begin, p.end, false});
    }
    previous_match = p.is_match;
  }
  if (next) std::reverse(kept.begin(), kept.end());
  for (const Part& p : kept) {
    if (p.end == p.begin) continue;
    out->push_back({piece.text.substr(p.begin, p.end - p.begin),
                    piece.at_start && p.begin == 0});
  }
}

// The supported decoder chains, flattened: per-token text steps, then an
// optional byte stage, then fusion and an optional whole-text Strip.
struct DecoderSpec {
  struct TokenStep {
    bool metaspace = false;    // Else Replace.
    bool strip_first = false;  // Metaspace: drop replacement in token 0.
    std::string from, to;
  };
  std::vector<TokenStep> token_steps;
  enum class Bytes { kNone, kByteFallback, kByteLevel } bytes = Bytes::kNone;
  bool join_with_space = false;  // No decoder: HF joins tokens with " ".
  std::string strip_content;
  size_t strip_start = 0, strip_stop = 0;
};

// --------------------------------------------------------------- Pipeline --

// Everything a loaded tokenizer.json holds.
struct Pipeline {
  // BPE model.
  std::unordered_map<std::string, int32_t> vocab;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;
  std::optional<int32_t> unk_id;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  std::array<int32_t, 256> byte_ids{};  // <0xXX> ids, -1 when missing.
  // Id tables over [0, vocab_size).
  std::vector<std::string> id_to_token;
  enum Kind : uint8_t { kMissing, kModel, kAdded, kSpecial };
  std::vector<uint8_t> id_kind;
  // Added tokens.
  std::vector<AddedToken> added;
  std::unordered_map<std::string, int32_t> added_ids;
  AddedTokenMatcher raw_matcher, normalized_matcher;
  // Pipeline.
  std::vector<NormalizerStep> normalizer;
  std::vector<PreTokenizerStep> pre_tokenizer;
  std::vector<int32_t> prefix_ids, suffix_ids;
  DecoderSpec decoder;
  std::optional<int32_t> bos_id, eos_id;

  static uint64_t PairKey(int32_t a, int32_t b) {
    return (uint64_t{static_cast<uint32_t>(a)} << 32) |
           static_cast<uint32_t>(b);
  }

  std::string Normalize(std::string_view text) const {
    std::string s(text);
    for (const NormalizerStep& step : normalizer) {
      if (step.prepend) {
        if (!s.empty()) s.insert(0, step.to);
      } else {
        s = absl::StrReplaceAll(s, {{step.from, step.to}});
      }
    }
    return s;
  }

  // HF AddedVocabulary::find_matches.
  void SplitOnAdded(std::string_view text, bool at_start,
                    const AddedTokenMatcher& matcher,
                    std::vector<Segment>* out) const {
    size_t start_offset = 0;
    size_t search = 0;
    while (auto match = matcher.Find(text, search)) {
      auto [start, stop, index] = *match;
      const AddedToken& token = added[index];
      search = stop;
      size_t before = 0;
      if (token.single_word) {
        int len = 0;
        const bool word_before =
            start > 0 && IsWordChar(CharBefore(text, start, &before));
        const bool word_after = stop < text.size() &&
                                IsWordChar(DecodeUtf8(text.substr(stop), &len));
        if (word_before || word_after) continue;
      }
      if (token.lstrip) {
        while (start > start_offset &&
               IsSpace(CharBefore(text, start, &before))) {
          start = before;
        }
      }
      if (token.rstrip) {
        int len = 0;
        while (stop < text.size() &&
               IsSpace(DecodeUtf8(text.substr(stop), &len))) {
          stop += len;
        }
        search = stop;
      }
      if (start_offset < start) {
        out->push_back({text.substr(start_offset, start - start_offset), -1,
                        at_start && start_offset == 0});
      }
      out->push_back({text.substr(start, stop - start), token.id, false});
      start_offset = stop;
    }
    if (start_offset < text.size()) {
      out->push_back(
          {text.substr(start_offset), -1, at_start && start_offset == 0});
    }
  }

  std::vector<Piece> PreTokenize(const Segment& segment) const {
    std::vector<Piece> pieces = {{std::string(segment.text), segment.at_start}};
    for (const PreTokenizerStep& step : pre_tokenizer) {
      std::vector<Piece> next;
      for (Piece& piece : pieces) {
        switch (step.kind) {
          case PreTokenizerStep::Kind::kByteLevel: {
            if (step.add_prefix_space && piece.text[0] != ' ') {
              piece.text.insert(0, " ");
            }
            const size_t first = next.size();
            if (step.regex == nullptr) {
              next.push_back(std::move(piece));
            } else {
              SplitPiece(piece, step.regex->FindAll(piece.text),
                         SplitBehavior::kIsolated, false, &next);
            }
            for (size_t i = first; i < next.size(); ++i) {
              std::string mapped;
              for (unsigned char c : next[i].text) {
                mapped += ByteLevel().byte_to_char[c];
              }
              next[i].text = std::move(mapped);
            }
            break;
          }
          case PreTokenizerStep::Kind::kSplit:
            SplitPiece(piece,
                       step.regex ? step.regex->FindAll(piece.text)
                                  : FindLiteral(piece.text, step.literal),
                       step.behavior, step.invert, &next);
            break;
          case PreTokenizerStep::Kind::kMetaspace: {
            piece.text = absl::StrReplaceAll(piece.text, {{" ", step.literal}});
            const bool prepend =
                step.prepend == PreTokenizerStep::Prepend::kAlways ||
                (step.prepend == PreTokenizerStep::Prepend::kFirst &&
                 piece.at_start);
            if (prepend && !absl::StartsWith(piece.text, step.literal)) {
              piece.text.insert(0, step.literal);
            }
            if (step.split) {
              SplitPiece(piece, FindLiteral(piece.text, step.literal),
                         SplitBehavior::kMergedWithNext, false, &next);
            } else {
              next.push_back(std::move(piece));
            }
            break;
          }
        }
      }
      pieces.clear();
      for (Piece& p : next) {
        if (!p.text.empty()) pieces.push_back(std::move(p));
      }
    }
    return pieces;
  }

  const std::pair<int32_t, int32_t>* FindMerge(int32_t a, int32_t b) const {
    auto it = merges.find(PairKey(a, b));
    return it == merges.end() ? nullptr : &it->second;
  }

  // HF BPE::merge_word + Word::merge_all: lowest rank first, leftmost on
  // ties.
  void EncodeWord(const std::string& word, std::vector<int32_t>* ids) const {
    if (ignore_merges) {
      if (auto it = vocab.find(word); it != vocab.end()) {
        ids->push_back(it->second);
        return;
      }
    }
    std::vector<int32_t> sym;
    std::optional<int32_t> unk;  // A pending (possibly fused) unknown.
    for (size_t i = 0; i < word.size();) {
      const int len = std::max(1, NextUtf8(std::string_view(word).substr(i)));
      const std::string ch = word.substr(i, len);
      i += len;
      if (auto it = vocab.find(ch); it != vocab.end()) {
        if (unk) sym.push_back(*std::exchange(unk, std::nullopt));
        sym.push_back(it->second);
        continue;
      }
      if (byte_fallback && std::all_of(ch.begin(), ch.end(), [&](char c) {
            return byte_ids[static_cast<unsigned char>(c)] >= 0;
          })) {
        if (unk) sym.push_back(*std::exchange(unk, std::nullopt));
        for (unsigned char c : ch) sym.push_back(byte_ids[c]);
        continue;
      }
      if (!unk_id) continue;  // HF drops unknown characters without unk.
      if (unk && !fuse_unk) sym.push_back(*unk);
      unk = unk_id;
    }
    if (unk) sym.push_back(*unk);

    const int n = static_cast<int>(sym.size());
    std::vector<int> prev(n), next(n);
    std::vector<bool> alive(n, true);
    using Entry = std::tuple<int32_t, int, int32_t>;  // rank, pos, new id.
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> queue;
    for (int i = 0; i < n; ++i) {
      prev[i] = i - 1;
      next[i] = i + 1 < n ? i + 1 : -1;
      if (i + 1 < n) {
        if (auto* m = FindMerge(sym[i], sym[i + 1])) {
          queue.emplace(m->first, i, m->second);
        }
      }
    }
    while (!queue.empty()) {
      const auto [rank, pos, new_id] = queue.top();
      queue.pop();
      if (!alive[pos] || next[pos] < 0) continue;
      const int right = next[pos];
      const auto* m = FindMerge(sym[pos], sym[right]);
      if (m == nullptr || m->second != new_id) continue;  // Stale entry.
      sym[pos] = new_id;
      alive[right] = false;
      next[pos] = next[right];
      if (next[pos] >= 0) prev[next[pos]] = pos;
      if (prev[pos] >= 0) {
        if (auto* l = FindMerge(sym[prev[pos]], sym[pos])) {
          queue.emplace(l->first, prev[pos], l->second);
        }
      }
      if (next[pos] >= 0) {
        if (auto* r = FindMerge(sym[pos], sym[next[pos]])) {
          queue.emplace(r->first, pos, r->second);
        }
      }
    }
    for (int i = 0; i < n; ++i) {
      if (alive[i]) ids->push_back(sym[i]);
    }
  }

  const std::string* TokenOf(int32_t id) const {
    if (id < 0 || static_cast<size_t>(id) >= id_kind.size() ||
        id_kind[id] == kMissing) {
      return nullptr;
    }
    return &id_to_token[id];
  }
};

// ----------------------------------------------------------------- Loading --

std::string Field(absl::string_view where, absl::string_view key) {
  return where.empty() ? std::string(key) : absl::StrCat(where, ".", key);
}

absl::Status Unsupported(absl::string_view field, absl::string_view value) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": unsupported value \"", value, "\""));
}

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

// Member `key` of `obj`; nullptr when absent or null.
const json* Get(const json& obj, const char* key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

absl::StatusOr<bool> GetBool(const json& obj, const char* key, bool dflt,
                             absl::string_view where) {
  const json* v = Get(obj, key);
  if (v == nullptr) return dflt;
  if (!v->is_boolean()) return Invalid(Field(where, key), "must be a boolean");
  return v->get<bool>();
}

absl::StatusOr<int64_t> GetInt(const json& obj, const char* key,
                               absl::string_view where) {
  const json* v = Get(obj, key);
  if (v == nullptr || !v->is_number_integer()) {
    return Invalid(Field(where, key), "must be an integer");
  }
  return v->get<int64_t>();
}

absl::StatusOr<std::string> GetString(const json& obj, const char* key,
                                      absl::string_view where) {
  const json* v = Get(obj, key);
  if (v == nullptr || !v->is_string()) {
    return Invalid(Field(where, key), "must be a string");
  }
  return v->get<std::string>();
}

// A Split/Replace "pattern": {"String": s} or {"Regex": r}.
absl::Status GetPattern(const json& obj, absl::string_view where,
                        std::string* literal, std::string* regex) {
  const json* p = Get(obj, "pattern");
  if (const json* s = p ? Get(*p, "String") : nullptr; s && s->is_string()) {
    *literal = s->get<std::string>();
    if (!literal->empty()) return absl::OkStatus();
  } else if (const json* r = p ? Get(*p, "Regex") : nullptr;
             r && r->is_string() && regex != nullptr) {
    *regex = r->get<std::string>();
    return absl::OkStatus();
  }
  return Invalid(Field(where, "pattern"),
                 regex ? "must be {\"String\": non-empty} or {\"Regex\": ...}"
                       : "must be {\"String\": non-empty} (Regex unsupported)");
}

absl::StatusOr<int32_t> CheckId(int64_t id, absl::string_view field) {
  if (id < 0 || id > kMaxTokenId) {
    return Invalid(field, absl::StrCat("token id ", id, " out of range"));
  }
  return static_cast<int32_t>(id);
}

absl::Status LoadModel(const json& root, Pipeline* impl) {
  const json* model = Get(root, "model");
  if (model == nullptr || !model->is_object()) {
    return Invalid("model", "missing or not an object");
  }
  const json* type = Get(*model, "type");
  if (type != nullptr && (!type->is_string() || *type != "BPE")) {
    return Unsupported("model.type", type->is_string()
                                         ? type->get<std::string>()
                                         : type->dump());
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
    impl->merges[Pipeline::PairKey(ia->second, ib->second)] = {
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
    return Unsupported("model.dropout", d->dump());
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (const json* v = Get(*model, key);
        v != nullptr && (!v->is_string() || !v->get<std::string>().empty())) {
      return Unsupported(Field("model", key), v->dump());
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

absl::Status LoadAddedTokens(const json& root, Pipeline* impl) {
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

// Calls `load(element, where)` for each element of the array `obj[key]`.
absl::Status ForEach(
    const json& obj, const char* key, const std::string& where,
    const std::function<absl::Status(const json&, const std::string&)>& load) {
  const json* list = Get(obj, key);
  if (list == nullptr || !list->is_array()) {
    return Invalid(Field(where, key), "must be an array");
  }
  for (size_t i = 0; i < list->size(); ++i) {
    MOH_RETURN_IF_ERROR(
        load((*list)[i], absl::StrCat(Field(where, key), "[", i, "]")));
  }
  return absl::OkStatus();
}

absl::Status LoadNormalizer(const json& n, const std::string& where,
                            Pipeline* impl) {
  MOH_ASSIGN_OR_RETURN(const std::string type, GetString(n, "type", where));
  NormalizerStep step;
  if (type == "Sequence") {
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

absl::StatusOr<std::string> GetChar(const json& obj, const char* key,
                                    absl::string_view where) {
  MOH_ASSIGN_OR_RETURN(std::string c, GetString(obj, key, where));
  if (c.empty() || NextUtf8(c) != static_cast<int>(c.size())) {
    return Invalid(Field(where, key), "must be a single character");
  }
  return c;
}

absl::StatusOr<std::unique_ptr<Regex>> CompileAt(absl::string_view pattern,
                                                 absl::string_view field) {
  auto regex = Regex::Compile(pattern);
  if (!regex.ok()) return Invalid(field, regex.status().message());
  return regex;
}

absl::Status LoadPreTokenizer(const json& p, const std::string& where,
                              Pipeline* impl) {
  MOH_ASSIGN_OR_RETURN(const std::string type, GetString(p, "type", where));
  PreTokenizerStep step;
  if (type == "Sequence") {
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
                          Pipeline* impl) {
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
                               Pipeline* impl) {
  MOH_ASSIGN_OR_RETURN(const std::string type, GetString(p, "type", where));
  if (type == "Sequence") {
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

std::optional<int32_t> FirstSpecial(const Pipeline& impl,
                                    std::initializer_list<const char*> names) {
  for (const char* name : names) {
    auto it = impl.added_ids.find(name);
    if (it != impl.added_ids.end() &&
        impl.id_kind[it->second] == Pipeline::kSpecial)
      return it->second;
  }
  return std::nullopt;
}

absl::Status Load(const json& root, Pipeline* impl) {
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
  impl->id_to_token.resize(size);
  impl->id_kind.assign(size, Pipeline::kMissing);
  for (const auto& [token, id] : impl->vocab) {
    impl->id_to_token[id] = token;
    impl->id_kind[id] = Pipeline::kModel;
  }
  for (size_t i = 0; i < impl->added.size(); ++i) {
    const AddedToken& t = impl->added[i];
    impl->id_to_token[t.id] = t.content;
    impl->id_kind[t.id] = t.special ? Pipeline::kSpecial : Pipeline::kAdded;
    if (t.normalized) {
      impl->normalized_matcher.Add(impl->Normalize(t.content), i);
    } else {
      impl->raw_matcher.Add(t.content, i);
    }
  }
  for (int32_t id : impl->prefix_ids) {
    if (id >= size) return Invalid("post_processor", "id outside vocabulary");
  }
  impl->bos_id = !impl->prefix_ids.empty()
                     ? std::optional<int32_t>(impl->prefix_ids.front())
                     : FirstSpecial(*impl, {"<|begin_of_text|>", "<s>", "<bos>",
                                            "<|startoftext|>"});
  impl->eos_id = FirstSpecial(*impl, {"<|end_of_text|>", "<|eot_id|>", "</s>",
                                      "<eos>", "<|endoftext|>", "<|im_end|>"});
  return absl::OkStatus();
}

// The bytes a ByteLevel decoder gives for `token`: its characters mapped
// back through bytes_to_unicode, or its UTF-8 itself if any is unmapped.
std::string ByteLevelBytes(std::string_view token) {
  std::string bytes;
  for (size_t i = 0; i < token.size();) {
    int len = 0;
    const char32_t cp = DecodeUtf8(token.substr(i), &len);
    if (len <= 0 || cp >= 512 || ByteLevel().char_to_byte[cp] < 0) {
      return std::string(token);
    }
    bytes += static_cast<char>(ByteLevel().char_to_byte[cp]);
    i += len;
  }
  return bytes;
}

// The byte of a "<0xXX>" token, as HF's ByteFallback decoder reads it.
std::optional<char> ParseByteToken(std::string_view t) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>' ||
      hex(t[3]) < 0 || hex(t[4]) < 0) {
    return std::nullopt;
  }
  return static_cast<char>(hex(t[3]) * 16 + hex(t[4]));
}

}  // namespace

struct Tokenizer::Impl : Pipeline {};

// --------------------------------------------------------------- Tokenizer --

Tokenizer::Tokenizer(std::unique_ptr<const Impl> impl)
    : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromFile(
    const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read tokenizer ", path));
  }
  std::stringstream contents;
  contents << in.rdbuf();
  return FromJson(contents.str(), path);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(
    std::string_view text, std::string_view source_name) {
  auto impl = std::make_unique<Impl>();
  absl::Status status;
  try {
    status = Load(json::parse(text.begin(), text.end()), impl.get());
  } catch (const json::exception& e) {  // Malformed JSON (or a bug here).
    status = absl::InvalidArgumentError(
        absl::StrCat("malformed tokenizer.json: ", e.what()));
  }
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(absl::string_view(source_name.data(), source_name.size()),
                     ": ", status.message()));
  }
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text,
                                       bool add_special_tokens) const {
  std::string valid;
  if (!IsValidUtf8(text)) {
    AppendLossyUtf8(text, /*final=*/true, &valid);
    text = valid;
  }
  std::vector<int32_t> ids;
  if (add_special_tokens) ids = impl_->prefix_ids;
  std::vector<Segment> raw;
  impl_->SplitOnAdded(text, /*at_start=*/true, impl_->raw_matcher, &raw);
  for (const Segment& segment : raw) {
    if (segment.id >= 0) {
      ids.push_back(segment.id);
      continue;
    }
    const std::string normalized = impl_->Normalize(segment.text);
    std::vector<Segment> parts;
    impl_->SplitOnAdded(normalized, segment.at_start, impl_->normalized_matcher,
                        &parts);
    for (const Segment& part : parts) {
      if (part.id >= 0) {
        ids.push_back(part.id);
        continue;
      }
      for (const Piece& piece : impl_->PreTokenize(part)) {
        impl_->EncodeWord(piece.text, &ids);
      }
    }
  }
  if (add_special_tokens) {
    ids.insert(ids.end(), impl_->suffix_ids.begin(), impl_->suffix_ids.end());
  }
  return ids;
}

absl::StatusOr<std::string> Tokenizer::Decode(absl::Span<const int32_t> ids,
                                              bool skip_special_tokens) const {
  IncrementalDecoder decoder(*this, skip_special_tokens);
  std::string text;
  for (int32_t id : ids) {
    MOH_ASSIGN_OR_RETURN(const std::string chunk, decoder.Push(id));
    text += chunk;
  }
  return text + decoder.Flush();
}

int32_t Tokenizer::vocab_size() const {
  return static_cast<int32_t>(impl_->id_kind.size());
}

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  const std::string key(token);
  if (auto it = impl_->added_ids.find(key); it != impl_->added_ids.end()) {
    return it->second;
  }
  if (auto it = impl_->vocab.find(key); it != impl_->vocab.end()) {
    return it->second;
  }
  return std::nullopt;
}

std::optional<std::string> Tokenizer::IdToToken(int32_t id) const {
  const std::string* token = impl_->TokenOf(id);
  return token ? std::optional<std::string>(*token) : std::nullopt;
}

bool Tokenizer::IsSpecial(int32_t id) const {
  return impl_->TokenOf(id) != nullptr &&
         impl_->id_kind[id] == Pipeline::kSpecial;
}

std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos_id; }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos_id; }

// ------------------------------------------------------ IncrementalDecoder --

struct IncrementalDecoder::State {
  int64_t tokens = 0;     // Tokens given to the decoder (after skipping).
  std::string pending;    // Bytes of an incomplete character / <0xXX> run.
  size_t strip_left = 0;  // Leading Strip content still to drop.
  std::string held;       // Trailing Strip content held back.

  // Ends a run of <0xXX> tokens: HF keeps it if it is valid UTF-8 and
  // otherwise emits one U+FFFD per byte.
  void EndByteRun(std::string* out) {
    if (IsValidUtf8(pending)) {
      out->append(pending);
    } else {
      for (size_t i = 0; i < pending.size(); ++i) out->append(kReplacementChar);
    }
    pending.clear();
  }

  // HF's Strip decoder applied to the fused text, as a stream.
  std::string Strip(const DecoderSpec& spec, std::string out, bool final) {
    const std::string& c = spec.strip_content;
    if (c.empty()) return out;
    while (strip_left > 0 && absl::StartsWith(out, c)) {
      out.erase(0, c.size());
      --strip_left;
    }
    if (!out.empty()) strip_left = 0;
    if (spec.strip_stop > 0) {
      out.insert(0, std::exchange(held, ""));
      size_t cut = 0;
      for (size_t n = 0; n < spec.strip_stop; ++n) {
        if (!absl::EndsWith(absl::string_view(out).substr(0, out.size() - cut),
                            c)) {
          break;
        }
        cut += c.size();
      }
      if (!final) held = out.substr(out.size() - cut);
      out.resize(out.size() - cut);
    }
    return out;
  }
};

IncrementalDecoder::IncrementalDecoder(const Tokenizer& tokenizer,
                                       bool skip_special_tokens)
    : tokenizer_(&tokenizer),
      skip_special_tokens_(skip_special_tokens),
      state_(std::make_unique<State>()) {
  state_->strip_left = tokenizer.impl_->decoder.strip_start;
}
IncrementalDecoder::IncrementalDecoder(IncrementalDecoder&&) noexcept = default;
IncrementalDecoder& IncrementalDecoder::operator=(
    IncrementalDecoder&&) noexcept = default;
IncrementalDecoder::~IncrementalDecoder() = default;

absl::StatusOr<std::string> IncrementalDecoder::Push(int32_t id) {
  const Pipeline& impl = *tokenizer_->impl_;
  const std::string* token = impl.TokenOf(id);
  if (token == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("token id ", id, " is not in the vocabulary (size ",
                     impl.id_kind.size(), ")"));
  }
  if (skip_special_tokens_ && impl.id_kind[id] == Pipeline::kSpecial) return "";
  const DecoderSpec& spec = impl.decoder;
  std::string text = *token;
  for (const DecoderSpec::TokenStep& step : spec.token_steps) {
    const bool drop = step.metaspace && step.strip_first && state_->tokens == 0;
    text = absl::StrReplaceAll(
        text, {{step.from, drop ? "" : (step.metaspace ? " " : step.to)}});
  }
  std::string out = spec.join_with_space && state_->tokens > 0 ? " " : "";
  ++state_->tokens;
  switch (spec.bytes) {
    case DecoderSpec::Bytes::kByteLevel:
      state_->pending += ByteLevelBytes(text);
      state_->pending.erase(0, AppendLossyUtf8(state_->pending, false, &out));
      break;
    case DecoderSpec::Bytes::kByteFallback:
      if (const std::optional<char> byte = ParseByteToken(text)) {
        state_->pending += *byte;
      } else {
        state_->EndByteRun(&out);
        out += text;
      }
      break;
    case DecoderSpec::Bytes::kNone:
      out += text;
      break;
  }
  return state_->Strip(spec, std::move(out), /*final=*/false);
}

std::string IncrementalDecoder::Flush() {
  const DecoderSpec& spec = tokenizer_->impl_->decoder;
  std::string out;
  if (spec.bytes == DecoderSpec::Bytes::kByteLevel) {
    AppendLossyUtf8(state_->pending, /*final=*/true, &out);
  } else {
    state_->EndByteRun(&out);
  }
  out = state_->Strip(spec, std::move(out), /*final=*/true);
  *state_ = State();
  state_->strip_left = spec.strip_start;
  return out;
}

}  // namespace moh
