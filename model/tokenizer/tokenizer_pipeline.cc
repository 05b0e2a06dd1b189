#include "model/tokenizer/tokenizer_pipeline.h"

#include <algorithm>
#include <functional>
#include <queue>

#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"

namespace moh {
namespace tokenizer_internal {

namespace {

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
              mapped += ByteLevelChar(c);
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
