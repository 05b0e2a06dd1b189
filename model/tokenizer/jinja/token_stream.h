// A cursor over a chat template's tokens (lexer.h) with the checks the
// statement and expression parsers share, and the nesting bound that keeps
// a hostile template from exhausting the stack. Not part of the public API.
#pragma once

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "model/tokenizer/jinja/lexer.h"

namespace moh {
namespace jinja {

// Blocks and expressions nest at most this deep, so that parsing and
// rendering a hostile template cannot exhaust the stack.
inline constexpr int kMaxNesting = 100;

class TokenStream {
 public:
  // `tokens` ends with a kEnd token (as Tokenize returns them).
  explicit TokenStream(std::vector<Token> tokens)
      : tokens_(std::move(tokens)) {}

  // The current token, or one `ahead` of it (kEnd past the end).
  const Token& Peek(size_t ahead = 0) const {
    return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)];
  }
  // The token before the current one.
  const Token& Previous() const { return tokens_[pos_ == 0 ? 0 : pos_ - 1]; }
  // Returns the current token and moves past it (never past kEnd).
  const Token& Next() {
    const Token& token = Peek();
    if (pos_ + 1 < tokens_.size()) ++pos_;
    return token;
  }

  bool IsOperator(absl::string_view op, size_t ahead = 0) const {
    return Peek(ahead).kind == Token::Kind::kOperator && Peek(ahead).text == op;
  }
  bool IsName(absl::string_view name, size_t ahead = 0) const {
    return Peek(ahead).kind == Token::Kind::kName && Peek(ahead).text == name;
  }
  // Moves past the operator or name when it is the current token.
  bool SkipOperator(absl::string_view op) { return IsOperator(op) && Skip(); }
  bool SkipName(absl::string_view name) { return IsName(name) && Skip(); }

  // A syntax error at the current token.
  absl::Status ErrorHere(absl::string_view what) const {
    return SyntaxError(Peek().line, Peek().column, what);
  }
  // "expected <expected>, found <the current token>".
  absl::Status Unexpected(absl::string_view expected) const {
    return ErrorHere(
        absl::StrCat("expected ", expected, ", found ", Describe(Peek())));
  }
  absl::Status ExpectOperator(absl::string_view op) {
    if (SkipOperator(op)) return absl::OkStatus();
    return Unexpected(absl::StrCat("'", op, "'"));
  }
  absl::Status ExpectBlockEnd() {
    if (Peek().kind != Token::Kind::kBlockEnd) return Unexpected("'%}'");
    Next();
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> ExpectName(absl::string_view what) {
    if (Peek().kind != Token::Kind::kName) return Unexpected(what);
    return Next().text;
  }

  // One level of nesting while alive; Check() fails beyond kMaxNesting.
  class NestingGuard {
   public:
    explicit NestingGuard(TokenStream* tokens) : tokens_(tokens) {
      ++tokens_->depth_;
    }
    ~NestingGuard() { --tokens_->depth_; }
    NestingGuard(const NestingGuard&) = delete;
    NestingGuard& operator=(const NestingGuard&) = delete;
    absl::Status Check() const {
      if (tokens_->depth_ <= kMaxNesting) return absl::OkStatus();
      return tokens_->ErrorHere(
          absl::StrCat("nested more than ", kMaxNesting, " levels deep"));
    }

   private:
    TokenStream* tokens_;
  };

 private:
  bool Skip() {
    Next();
    return true;
  }

  static std::string Describe(const Token& token) {
    switch (token.kind) {
      case Token::Kind::kText:
        return "template text";
      case Token::Kind::kVariableBegin:
        return "'{{'";
      case Token::Kind::kVariableEnd:
        return "'}}'";
      case Token::Kind::kBlockBegin:
        return "'{%'";
      case Token::Kind::kBlockEnd:
        return "'%}'";
      case Token::Kind::kString:
        return "a string";
      case Token::Kind::kInt:
      case Token::Kind::kFloat:
        return "a number";
      case Token::Kind::kEnd:
        return "end of template";
      default:
        return absl::StrCat("'", token.text, "'");
    }
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int depth_ = 0;
};

}  // namespace jinja
}  // namespace moh
