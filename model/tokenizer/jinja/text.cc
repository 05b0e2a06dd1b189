#include "model/tokenizer/jinja/text.h"

#include <algorithm>

namespace moh {
namespace jinja {
namespace {

// Length of the UTF-8 sequence at text[i], or 0 when it is not valid
// (overlong, surrogate, beyond U+10FFFF or truncated).
size_t SequenceLength(absl::string_view text, size_t i, char32_t* c) {
  const auto byte = [&](size_t k) {
    return static_cast<unsigned char>(text[k]);
  };
  const unsigned char b = byte(i);
  size_t n;
  char32_t value, min;
  if (b < 0x80) {
    *c = b;
    return 1;
  } else if ((b & 0xE0) == 0xC0) {
    n = 2, value = b & 0x1F, min = 0x80;
  } else if ((b & 0xF0) == 0xE0) {
    n = 3, value = b & 0x0F, min = 0x800;
  } else if ((b & 0xF8) == 0xF0) {
    n = 4, value = b & 0x07, min = 0x10000;
  } else {
    return 0;
  }
  if (i + n > text.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    value = (value << 6) | (byte(i + k) & 0x3F);
  }
  if (value < min || value > 0x10FFFF || (value >= 0xD800 && value < 0xE000)) {
    return 0;
  }
  *c = value;
  return n;
}

// Ranges whose lower case is the upper case plus a fixed offset.
struct CaseRange {
  char32_t upper_first, upper_last, lower_first;
};
constexpr CaseRange kCaseRanges[] = {
    {U'A', U'Z', U'a'},    {0xC0, 0xD6, 0xE0},    {0xD8, 0xDE, 0xF8},
    {0x391, 0x3A1, 0x3B1}, {0x3A3, 0x3AB, 0x3C3}, {0x410, 0x42F, 0x430},
    {0x400, 0x40F, 0x450},
};

}  // namespace

std::vector<char32_t> DecodeUtf8(absl::string_view text) {
  std::vector<char32_t> chars;
  chars.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    char32_t c;
    const size_t n = SequenceLength(text, i, &c);
    if (n == 0) {
      chars.push_back(0xDC00 + static_cast<unsigned char>(text[i]));
      ++i;
    } else {
      chars.push_back(c);
      i += n;
    }
  }
  return chars;
}

void AppendUtf8(char32_t c, std::string* out) {
  if (c >= 0xDC80 && c <= 0xDCFF) {  // An escaped invalid byte.
    out->push_back(static_cast<char>(c - 0xDC00));
  } else if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::string EncodeUtf8(const std::vector<char32_t>& chars) {
  std::string out;
  out.reserve(chars.size());
  for (char32_t c : chars) AppendUtf8(c, &out);
  return out;
}

size_t CodePointCount(absl::string_view text) {
  size_t count = 0;
  for (size_t i = 0; i < text.size(); ++count) {
    char32_t c;
    i += std::max<size_t>(1, SequenceLength(text, i, &c));
  }
  return count;
}

bool IsSpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 ||
         c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
         c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

char32_t ToUpper(char32_t c) {
  if (c == 0xFF) return 0x178;   // ÿ -> Ÿ
  if (c == 0x3C2) return 0x3A3;  // Final sigma.
  for (const CaseRange& r : kCaseRanges) {
    const char32_t last = r.lower_first + (r.upper_last - r.upper_first);
    if (c >= r.lower_first && c <= last) {
      return c - r.lower_first + r.upper_first;
    }
  }
  return c;
}

char32_t ToLower(char32_t c) {
  if (c == 0x178) return 0xFF;
  for (const CaseRange& r : kCaseRanges) {
    if (c >= r.upper_first && c <= r.upper_last) {
      return c - r.upper_first + r.lower_first;
    }
  }
  return c;
}

bool IsCased(char32_t c) {
  return ToUpper(c) != c || ToLower(c) != c || c == 0xDF;  // ß has no upper.
}

namespace {

template <typename Fn>
std::string MapChars(absl::string_view text, Fn fn) {
  std::vector<char32_t> chars = DecodeUtf8(text);
  for (size_t i = 0; i < chars.size(); ++i) chars[i] = fn(chars, i);
  return EncodeUtf8(chars);
}

}  // namespace

std::string Upper(absl::string_view text) {
  return MapChars(text, [](const auto& s, size_t i) { return ToUpper(s[i]); });
}

std::string Lower(absl::string_view text) {
  return MapChars(text, [](const auto& s, size_t i) {
    // Python's Final_Sigma: a capital sigma ending a word lowers to ς.
    if (s[i] == 0x3A3 && i > 0 && IsCased(s[i - 1]) &&
        (i + 1 == s.size() || !IsCased(s[i + 1]))) {
      return char32_t{0x3C2};
    }
    return ToLower(s[i]);
  });
}

std::string PyTitle(absl::string_view text) {
  std::vector<char32_t> chars = DecodeUtf8(text);
  bool previous_cased = false;
  for (char32_t& c : chars) {
    const bool cased = IsCased(c);
    c = previous_cased ? ToLower(c) : ToUpper(c);
    previous_cased = cased;
  }
  return EncodeUtf8(chars);
}

std::string Capitalize(absl::string_view text) {
  return MapChars(text, [](const auto& s, size_t i) {
    return i == 0 ? ToUpper(s[i]) : ToLower(s[i]);
  });
}

std::string Strip(absl::string_view text, const std::string* chars,
                  StripSide side) {
  const std::vector<char32_t> s = DecodeUtf8(text);
  std::vector<char32_t> set;
  if (chars != nullptr) set = DecodeUtf8(*chars);
  const auto strip = [&](char32_t c) {
    return chars == nullptr ? IsSpace(c)
                            : std::find(set.begin(), set.end(), c) != set.end();
  };
  size_t begin = 0, end = s.size();
  if (side != StripSide::kRight) {
    while (begin < end && strip(s[begin])) ++begin;
  }
  if (side != StripSide::kLeft) {
    while (end > begin && strip(s[end - 1])) --end;
  }
  return EncodeUtf8(std::vector<char32_t>(s.begin() + begin, s.begin() + end));
}

std::string PyReplace(const std::string& s, const std::string& old,
                      const std::string& replacement, int64_t count) {
  std::string out;
  if (old.empty()) {  // Python inserts `replacement` around every character.
    const std::vector<char32_t> chars = DecodeUtf8(s);
    for (size_t i = 0; i <= chars.size(); ++i) {
      if (count < 0 || static_cast<int64_t>(i) < count) out += replacement;
      if (i < chars.size()) AppendUtf8(chars[i], &out);
    }
    return out;
  }
  size_t pos = 0;
  for (int64_t n = 0; count < 0 || n < count; ++n) {
    const size_t found = s.find(old, pos);
    if (found == std::string::npos) break;
    out.append(s, pos, found - pos);
    out += replacement;
    pos = found + old.size();
  }
  out.append(s, pos, std::string::npos);
  return out;
}

}  // namespace jinja
}  // namespace moh
