#include "model/tokenizer/jinja/lexer.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/tokenizer/jinja/text.h"

namespace moh {
namespace jinja {

absl::Status SyntaxError(int line, int column, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("chat template line ", line, " col ", column, ": ", what));
}

namespace {

// "\r\n" and "\r" become "\n"; one trailing newline is dropped (jinja2's
// keep_trailing_newline=False).
std::string NormalizeNewlines(absl::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out.push_back('\n');
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out.push_back(source[i]);
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

// Whether every code point of `text` is whitespace (Python's \s).
bool AllSpace(absl::string_view text) {
  for (char32_t c : DecodeUtf8(text)) {
    if (!IsSpace(c)) return false;
  }
  return true;
}

// Python's str.rstrip().
std::string RStrip(absl::string_view text) {
  return Strip(text, nullptr, StripSide::kRight);
}

bool IsDigit(char c) { return c >= '0' && c <= '9'; }
bool IsNameStart(char c) {
  return std::isalpha(static_cast<unsigned char>(c)) || c == '_';
}
bool IsNameChar(char c) { return IsNameStart(c) || IsDigit(c); }

constexpr absl::string_view kTwoCharOperators[] = {
    "//", "**", "==", "!=", "<=", ">="};
constexpr absl::string_view kOneCharOperators = "+-*/%~<>=()[]{},.:|;";

class Lexer {
 public:
  explicit Lexer(absl::string_view source) : src_(NormalizeNewlines(source)) {}

  absl::StatusOr<std::vector<Token>> Run() {
    bool line_starting = true;
    while (pos_ < src_.size()) {
      const size_t start = FindTagStart(pos_);
      if (start == std::string::npos) {
        EmitText(src_.substr(pos_), pos_);
        pos_ = src_.size();
        break;
      }
      const char type = src_[start + 1];
      size_t after = start + 2;
      char sign = 0;
      if (after < src_.size() && (src_[after] == '-' || src_[after] == '+')) {
        sign = src_[after++];
      }
      std::string text = src_.substr(pos_, start - pos_);
      if (sign == '-') {
        text = RStrip(text);
      } else if (sign != '+' && type != '{') {
        // lstrip_blocks: a block or comment tag preceded on its line by
        // whitespace only takes that whitespace away.
        const size_t line_start = text.rfind('\n') + 1;  // npos + 1 == 0
        if ((line_start > 0 || line_starting) && line_start < text.size() &&
            AllSpace(absl::string_view(text).substr(line_start))) {
          text.resize(line_start);
        }
      }
      EmitText(std::move(text), pos_);
      pos_ = after;
      if (type == '#') {
        MOH_RETURN_IF_ERROR(SkipComment(start));
      } else {
        MOH_RETURN_IF_ERROR(LexTag(start, type == '%'));
      }
      line_starting = src_[pos_ - 1] == '\n';
    }
    Token end{Token::Kind::kEnd};
    SetPosition(src_.size(), &end);
    tokens_.push_back(std::move(end));
    return std::move(tokens_);
  }

 private:
  size_t FindTagStart(size_t from) const {
    for (size_t i = src_.find('{', from); i != std::string::npos;
         i = src_.find('{', i + 1)) {
      if (i + 1 < src_.size() &&
          (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) {
        return i;
      }
    }
    return std::string::npos;
  }

  // Line and column of byte `pos`; positions are asked in increasing order.
  void SetPosition(size_t pos, Token* token) {
    for (; cursor_ < pos; ++cursor_) {
      if (src_[cursor_] == '\n') {
        ++line_, column_ = 1;
      } else if ((static_cast<unsigned char>(src_[cursor_]) & 0xC0) != 0x80) {
        ++column_;
      }
    }
    token->line = line_;
    token->column = column_;
  }

  // Errors may point back to a tag's start: counted afresh.
  absl::Status ErrorAt(size_t pos, absl::string_view what) const {
    int line = 1, column = 1;
    for (size_t i = 0; i < pos; ++i) {
      if (src_[i] == '\n') {
        ++line, column = 1;
      } else if ((static_cast<unsigned char>(src_[i]) & 0xC0) != 0x80) {
        ++column;
      }
    }
    return SyntaxError(line, column, what);
  }

  void Emit(Token::Kind kind, size_t pos, std::string text = "") {
    Token token{kind, std::move(text)};
    SetPosition(pos, &token);
    tokens_.push_back(std::move(token));
  }

  void EmitText(std::string text, size_t pos) {
    if (!text.empty()) Emit(Token::Kind::kText, pos, std::move(text));
  }

  void SkipSpace() {
    while (pos_ < src_.size()) {
      size_t next = pos_ + 1;
      while (next < src_.size() &&
             (static_cast<unsigned char>(src_[next]) & 0xC0) == 0x80) {
        ++next;
      }
      const std::vector<char32_t> c =
          DecodeUtf8(src_.substr(pos_, next - pos_));
      if (c.size() != 1 || !IsSpace(c[0])) return;
      pos_ = next;
    }
  }

  // After "-%}", "-}}" or "-#}": all whitespace; after "%}" or "#}": one
  // newline (trim_blocks); after "+%}" or "}}": nothing.
  void SkipAfterTag(char sign, bool trim_newline) {
    if (sign == '-') {
      SkipSpace();
    } else if (sign != '+' && trim_newline && pos_ < src_.size() &&
               src_[pos_] == '\n') {
      ++pos_;
    }
  }

  absl::Status SkipComment(size_t start) {
    const size_t end = src_.find("#}", pos_);
    if (end == std::string::npos) {
      // jinja2 ends quietly on a comment opened at the very end.
      if (pos_ == src_.size()) return absl::OkStatus();
      return ErrorAt(start, "comment is not closed with '#}'");
    }
    const char sign = end > pos_ ? src_[end - 1] : 0;
    pos_ = end + 2;
    SkipAfterTag(sign, /*trim_newline=*/true);
    return absl::OkStatus();
  }

  // The tokens of a {{ ... }} or {% ... %} tag starting at `start`.
  absl::Status LexTag(size_t start, bool block) {
    Emit(block ? Token::Kind::kBlockBegin : Token::Kind::kVariableBegin, start);
    const absl::string_view close = block ? "%}" : "}}";
    std::string brackets;  // Unclosed ( [ {: their end tags are operators.
    while (true) {
      SkipSpace();
      if (pos_ >= src_.size()) {
        return ErrorAt(start,
                       absl::StrCat("tag is not closed with '", close, "'"));
      }
      const absl::string_view rest = absl::string_view(src_).substr(pos_);
      if (brackets.empty()) {
        char sign = 0;
        if (rest.size() > 2 && (rest[0] == '-' || (block && rest[0] == '+')) &&
            rest.substr(1, 2) == close) {
          sign = rest[0];
        }
        if (sign != 0 || rest.substr(0, 2) == close) {
          Emit(block ? Token::Kind::kBlockEnd : Token::Kind::kVariableEnd,
               pos_);
          pos_ += sign != 0 ? 3 : 2;
          SkipAfterTag(sign, /*trim_newline=*/block);
          return absl::OkStatus();
        }
      }
      MOH_RETURN_IF_ERROR(LexExpressionToken(&brackets));
    }
  }

  absl::Status LexExpressionToken(std::string* brackets) {
    const char c = src_[pos_];
    if (IsDigit(c)) return LexNumber();
    if (IsNameStart(c)) {
      size_t end = pos_;
      while (end < src_.size() && IsNameChar(src_[end])) ++end;
      Emit(Token::Kind::kName, pos_, src_.substr(pos_, end - pos_));
      pos_ = end;
      return absl::OkStatus();
    }
    if (c == '\'' || c == '"') return LexString();
    for (absl::string_view op : kTwoCharOperators) {
      if (absl::string_view(src_).substr(pos_, 2) == op) {
        Emit(Token::Kind::kOperator, pos_, std::string(op));
        pos_ += 2;
        return absl::OkStatus();
      }
    }
    if (kOneCharOperators.find(c) == absl::string_view::npos) {
      return ErrorAt(pos_, absl::StrCat("unexpected character '",
                                        src_.substr(pos_, 1), "'"));
    }
    static constexpr absl::string_view kOpen = "([{", kClose = ")]}";
    if (kOpen.find(c) != absl::string_view::npos) {
      brackets->push_back(c);
    } else if (const size_t k = kClose.find(c); k != absl::string_view::npos) {
      if (brackets->empty() || brackets->back() != kOpen[k]) {
        return ErrorAt(pos_,
                       absl::StrCat("unexpected '", std::string(1, c), "'"));
      }
      brackets->pop_back();
    }
    Emit(Token::Kind::kOperator, pos_, std::string(1, c));
    ++pos_;
    return absl::OkStatus();
  }

  // Digits with single underscores between them, from `pos`; its end.
  size_t ScanDigits(size_t pos) const {
    while (pos < src_.size() &&
           (IsDigit(src_[pos]) || (src_[pos] == '_' && pos + 1 < src_.size() &&
                                   IsDigit(src_[pos + 1])))) {
      ++pos;
    }
    return pos;
  }

  // The end of an integer starting with '0' (jinja2 reads 0b.., 0o.., 0x..,
  // or zeros alone: "05" is 0 then 5); `base` its base.
  size_t ScanZeroInteger(size_t start, int* base) const {
    const auto is_digit_of = [](char c, int b) {
      c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      const int d = IsDigit(c)               ? c - '0'
                    : (c >= 'a' && c <= 'f') ? c - 'a' + 10
                                             : 99;
      return d < b;
    };
    // After the first digit, each further one may follow one underscore.
    const auto scan = [&](size_t pos, int b) {
      while (pos < src_.size()) {
        const size_t digit = src_[pos] == '_' ? pos + 1 : pos;
        if (digit >= src_.size() || !is_digit_of(src_[digit], b)) break;
        pos = digit + 1;
      }
      return pos;
    };
    const char prefix = start + 1 < src_.size()
                            ? static_cast<char>(std::tolower(
                                  static_cast<unsigned char>(src_[start + 1])))
                            : 0;
    *base = prefix == 'b' ? 2 : prefix == 'o' ? 8 : prefix == 'x' ? 16 : 10;
    if (*base != 10) {
      const size_t end = scan(start + 2, *base);
      if (end > start + 2) return end;
      *base = 10;
    }
    return scan(start + 1, 1);  // Base 1: only '0' is a digit.
  }

  absl::Status LexNumber() {
    const size_t start = pos_;
    size_t end = ScanDigits(pos_);
    int base = 10;
    bool is_float = false;
    // jinja2 reads "x.1.2" as x . 1 . 2: no fraction after a '.'.
    const bool after_dot = start > 0 && src_[start - 1] == '.';
    if (!after_dot && end + 1 < src_.size() && src_[end] == '.' &&
        IsDigit(src_[end + 1])) {
      end = ScanDigits(end + 1);
      is_float = true;
    }
    if (!after_dot && end < src_.size() &&
        (src_[end] == 'e' || src_[end] == 'E')) {
      size_t digits = end + 1;
      if (digits < src_.size() &&
          (src_[digits] == '+' || src_[digits] == '-')) {
        ++digits;
      }
      if (digits < src_.size() && IsDigit(src_[digits])) {
        end = ScanDigits(digits);
        is_float = true;
      }
    }
    if (!is_float && src_[start] == '0') end = ScanZeroInteger(start, &base);
    std::string text;
    for (size_t i = start + (base == 10 ? 0 : 2); i < end; ++i) {
      if (src_[i] != '_') text.push_back(src_[i]);
    }
    Emit(is_float ? Token::Kind::kFloat : Token::Kind::kInt, start);
    Token& token = tokens_.back();
    errno = 0;
    if (is_float) {
      token.float_value = std::strtod(text.c_str(), nullptr);
    } else {
      token.int_value = std::strtoll(text.c_str(), nullptr, base);
      if (errno == ERANGE) {
        return ErrorAt(start, "integer literal does not fit in 64 bits");
      }
    }
    pos_ = end;
    return absl::OkStatus();
  }

  absl::Status LexString() {
    const size_t start = pos_;
    const char quote = src_[pos_];
    size_t end = pos_ + 1;
    while (end < src_.size() && src_[end] != quote) {
      end += src_[end] == '\\' ? 2 : 1;
    }
    if (end >= src_.size()) return ErrorAt(start, "string is not closed");
    std::string value;
    MOH_RETURN_IF_ERROR(DecodeEscapes(
        absl::string_view(src_).substr(start + 1, end - start - 1), start,
        &value));
    Emit(Token::Kind::kString, start, std::move(value));
    pos_ = end + 1;
    return absl::OkStatus();
  }

  // Python's "unicode-escape" decoding, as jinja2 applies to literals.
  absl::Status DecodeEscapes(absl::string_view s, size_t at, std::string* out) {
    const auto hex = [&](size_t from, size_t n, char32_t* c) {
      if (from + n > s.size()) return false;
      *c = 0;
      for (size_t k = from; k < from + n; ++k) {
        const char h = static_cast<char>(std::tolower(s[k]));
        if (IsDigit(h)) {
          *c = *c * 16 + (h - '0');
        } else if (h >= 'a' && h <= 'f') {
          *c = *c * 16 + (h - 'a' + 10);
        } else {
          return false;
        }
      }
      return true;
    };
    for (size_t i = 0; i < s.size(); ++i) {
      if (s[i] != '\\' || i + 1 == s.size()) {
        out->push_back(s[i]);
        continue;
      }
      const char e = s[++i];
      static constexpr absl::string_view kSimple = "\\'\"abfnrtv";
      static constexpr absl::string_view kValues = "\\'\"\a\b\f\n\r\t\v";
      if (const size_t k = kSimple.find(e); k != absl::string_view::npos) {
        out->push_back(kValues[k]);
      } else if (e == '\n') {
        // A line continuation.
      } else if (e >= '0' && e <= '7') {
        char32_t c = 0;
        size_t n = 0;
        for (; n < 3 && i + n < s.size() && s[i + n] >= '0' && s[i + n] <= '7';
             ++n) {
          c = c * 8 + (s[i + n] - '0');
        }
        i += n - 1;
        AppendUtf8(c, out);
      } else if (e == 'x' || e == 'u' || e == 'U') {
        const size_t n = e == 'x' ? 2 : (e == 'u' ? 4 : 8);
        char32_t c;
        if (!hex(i + 1, n, &c) || c > 0x10FFFF) {
          return ErrorAt(at, absl::StrCat("bad \\", std::string(1, e),
                                          " escape in string"));
        }
        i += n;
        AppendUtf8(c, out);
      } else if (e == 'N') {
        return ErrorAt(at, "\\N{...} escapes are not supported");
      } else {
        out->push_back('\\');
        out->push_back(e);
      }
    }
    return absl::OkStatus();
  }

  const std::string src_;
  size_t pos_ = 0;
  std::vector<Token> tokens_;
  size_t cursor_ = 0;
  int line_ = 1, column_ = 1;
};

}  // namespace

absl::StatusOr<std::vector<Token>> Tokenize(absl::string_view source) {
  return Lexer(source).Run();
}

}  // namespace jinja
}  // namespace moh
