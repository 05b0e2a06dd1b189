// The text helpers of model/tokenizer/tokenizer_pipeline.h: UTF-8, GPT-2's
// byte-level alphabet, character classes, and the PCRE2 Regex.
#include <algorithm>
#include <cctype>

#include "absl/strings/str_cat.h"
#include "model/tokenizer/tokenizer_pipeline.h"

namespace moh {
namespace tokenizer_internal {

// ---------------------------------------------------------------- UTF-8 --

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

char32_t CharBefore(std::string_view s, size_t pos, size_t* begin) {
  size_t b = pos - 1;
  while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
  *begin = b;
  int len = 0;
  return DecodeUtf8(s.substr(b), &len);
}

bool IsSpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
         c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

const std::string& ByteLevelChar(uint8_t byte) {
  return ByteLevel().byte_to_char[byte];
}

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

bool IsWordChar(char32_t c) {
  if (c < 0x80) return std::isalnum(static_cast<int>(c)) || c == '_';
  static const Regex* word = Regex::Compile(R"(^\w$)").value().release();
  return !word->FindAll(EncodeUtf8(c)).empty();
}

}  // namespace tokenizer_internal
}  // namespace moh
