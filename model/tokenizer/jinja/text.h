// Python `str` behaviour over UTF-8 byte strings, for the chat-template
// engine (model/tokenizer/chat_template.h): code points, whitespace as
// str.isspace() sees it, case mapping, strip. Not part of the public API.
//
// Strings are processed as sequences of code points. A byte that is not part
// of valid UTF-8 decodes to U+DC80..U+DCFF (Python's "surrogateescape") and
// encodes back to itself, so no input is ever altered or rejected.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace moh {
namespace jinja {

std::vector<char32_t> DecodeUtf8(absl::string_view text);
void AppendUtf8(char32_t c, std::string* out);
std::string EncodeUtf8(const std::vector<char32_t>& chars);
// Number of code points (Python's len()).
size_t CodePointCount(absl::string_view text);

// str.isspace(): ASCII whitespace, \x1c-\x1f, U+0085, U+00A0, U+1680,
// U+2000-U+200A, U+2028, U+2029, U+202F, U+205F, U+3000.
bool IsSpace(char32_t c);
// Case mapping covers ASCII, Latin-1, Greek and Cyrillic (one code point to
// one code point); other characters are left as they are.
char32_t ToUpper(char32_t c);
char32_t ToLower(char32_t c);
bool IsCased(char32_t c);

std::string Upper(absl::string_view text);
std::string Lower(absl::string_view text);
// str.title(): a cased character after a cased one is lowered, any other
// cased character is uppered.
std::string PyTitle(absl::string_view text);
// str.capitalize(): the first character uppered, the rest lowered.
std::string Capitalize(absl::string_view text);

enum class StripSide { kLeft, kRight, kBoth };
// str.strip() (chars == nullptr: whitespace) / str.strip(chars).
std::string Strip(absl::string_view text, const std::string* chars,
                  StripSide side);

// str.replace(old, replacement, count); count < 0: every occurrence.
std::string PyReplace(const std::string& s, const std::string& old,
                      const std::string& replacement, int64_t count);

}  // namespace jinja
}  // namespace moh
