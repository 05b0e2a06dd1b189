#include "model/tokenizer_pipeline.h"

#include <algorithm>
#include <cctype>
#include <functional>
#include <queue>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace moh {
namespace tokenizer_internal {

// ---------------------------------------------------------------- UTF-8 --

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

char32_t DecodeUtf8(std::string_view s, int* len) {
  *len = NextUtf8(s);
  const auto b = static_cast<unsigned char>(s[0]);
  if (*len <= 0) {
    *len = std::max(1, -*len);
    return 0xFFFD;
  }
  if (*len == 1) return b;
  char32_t cp = b & (0x7F >> *len);
  for (int i = 1; i < *len; ++i) cp = (cp << 6) | (s[i] & 0x3F);
  return cp;
}

namespace {

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

}  // namespace

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

// ---------------------------------------------------------------- Regex --

absl::StatusOr<std::unique_ptr<Regex>> Regex::Compile(
    absl::string_view pattern) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()),
                                   pattern.size(), PCRE2_UTF | PCRE2_UCP,
                                   &error, &offset, nullptr);
  if (code == nullptr) {
    std::array<PCRE2_UCHAR, 256> msg{};
    pcre2_get_error_message(error, msg.data(), msg.size());
    return absl::InvalidArgumentError(
        absl::StrCat("bad regex \"", pattern, "\" at offset ", offset, ": ",
                     reinterpret_cast<const char*>(msg.data())));
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // Optional speed-up.
  return std::unique_ptr<Regex>(new Regex(code));
}

Regex::~Regex() { pcre2_code_free(code_); }

std::vector<std::pair<size_t, size_t>> Regex::FindAll(
    std::string_view text) const {
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

namespace {

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

}  // namespace

// ----------------------------------------------------------------- Encode --

void AddedTokenMatcher::Add(std::string pattern, int token_index) {
  if (pattern.empty()) return;
  auto& bucket = buckets_[static_cast<unsigned char>(pattern[0])];
  bucket.emplace_back(std::move(pattern), token_index);
  std::stable_sort(bucket.begin(), bucket.end(), [](auto& a, auto& b) {
    return a.first.size() > b.first.size();
  });
}

std::optional<std::tuple<size_t, size_t, int>> AddedTokenMatcher::Find(
    std::string_view text, size_t from) const {
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

std::vector<int32_t> TokenizerPipeline::Encode(std::string_view text,
                                               bool add_special_tokens) const {
  std::vector<int32_t> ids;
  if (add_special_tokens) ids = prefix_ids;
  std::vector<Segment> raw;
  SplitOnAdded(text, /*at_start=*/true, raw_matcher, &raw);
  for (const Segment& segment : raw) {
    if (segment.id >= 0) {
      ids.push_back(segment.id);
      continue;
    }
    const std::string normalized = Normalize(segment.text);
    std::vector<Segment> parts;
    SplitOnAdded(normalized, segment.at_start, normalized_matcher, &parts);
    for (const Segment& part : parts) {
      if (part.id >= 0) {
        ids.push_back(part.id);
        continue;
      }
      for (const Piece& piece : PreTokenize(part)) {
        EncodeWord(piece.text, &ids);
      }
    }
  }
  if (add_special_tokens) {
    ids.insert(ids.end(), suffix_ids.begin(), suffix_ids.end());
  }
  return ids;
}

std::string TokenizerPipeline::Normalize(std::string_view text) const {
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

void TokenizerPipeline::SplitOnAdded(std::string_view text, bool at_start,
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
      const bool word_after =
          stop < text.size() && IsWordChar(DecodeUtf8(text.substr(stop), &len));
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

std::vector<Piece> TokenizerPipeline::PreTokenize(
    const Segment& segment) const {
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

void TokenizerPipeline::EncodeWord(const std::string& word,
                                   std::vector<int32_t>* ids) const {
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

}  // namespace tokenizer_internal
}  // namespace moh
