#include "model/tokenizer/jinja/parser.h"

#include <algorithm>
#include <initializer_list>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "model/tokenizer/jinja/expression_parser.h"
#include "model/tokenizer/jinja/lexer.h"
#include "model/tokenizer/jinja/token_stream.h"

namespace moh {
namespace jinja {
namespace {

using TK = Token::Kind;

// Tags of jinja2 that this engine does not implement.
constexpr absl::string_view kUnsupportedTags[] = {
    "macro", "call", "filter", "include",    "import", "from",  "extends",
    "block", "raw",  "with",   "autoescape", "do",     "trans", "print"};

// Tags that continue or close a block opened earlier.
bool IsClosingTag(absl::string_view tag) {
  return tag == "elif" || tag == "else" || absl::StartsWith(tag, "end");
}

// The statements of a template: text, {{ output }}, and the block tags.
class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  absl::StatusOr<Body> Run() {
    Body body;
    std::string stopped;
    MOH_RETURN_IF_ERROR(ParseBody({}, &body, &stopped));
    return body;
  }

 private:
  // Statements until a block tag named in `stop` (consumed up to its name,
  // returned in `stopped`) or, when `stop` is empty, the end.
  absl::Status ParseBody(std::initializer_list<absl::string_view> stop,
                         Body* body, std::string* stopped) {
    TokenStream::NestingGuard guard(&tokens_);
    MOH_RETURN_IF_ERROR(guard.Check());
    while (true) {
      const Token& token = tokens_.Peek();
      switch (token.kind) {
        case TK::kEnd:
          if (stop.size() == 0) return absl::OkStatus();
          return tokens_.ErrorHere(
              absl::StrCat("unexpected end of template, expected '",
                           absl::StrJoin(stop, "' or '"), "'"));
        case TK::kText: {
          auto node = std::make_unique<Node>();
          node->kind = Node::Kind::kText;
          node->line = token.line;
          node->text = tokens_.Next().text;
          body->push_back(std::move(node));
          break;
        }
        case TK::kVariableBegin: {
          auto node = std::make_unique<Node>();
          node->kind = Node::Kind::kOutput;
          node->line = tokens_.Next().line;
          MOH_ASSIGN_OR_RETURN(node->expr, ParseTuple(tokens_, true));
          if (tokens_.Peek().kind != TK::kVariableEnd) {
            return tokens_.Unexpected("'}}'");
          }
          tokens_.Next();
          body->push_back(std::move(node));
          break;
        }
        case TK::kBlockBegin: {
          tokens_.Next();
          MOH_ASSIGN_OR_RETURN(const std::string tag,
                               tokens_.ExpectName("a tag name"));
          if (std::find(stop.begin(), stop.end(), tag) != stop.end()) {
            *stopped = tag;
            return absl::OkStatus();
          }
          if (IsClosingTag(tag)) {
            const Token& name = tokens_.Previous();
            return SyntaxError(
                name.line, name.column,
                stop.size() == 0
                    ? absl::StrCat("unexpected '", tag, "'")
                    : absl::StrCat("unexpected '", tag, "', expected '",
                                   absl::StrJoin(stop, "' or '"), "'"));
          }
          MOH_RETURN_IF_ERROR(ParseStatement(tag, body));
          break;
        }
        default:
          return tokens_.Unexpected("template text or a tag");
      }
    }
  }

  absl::Status ParseStatement(const std::string& tag, Body* body) {
    auto node = std::make_unique<Node>();
    node->line = tokens_.Previous().line;
    if (tag == "if") {
      MOH_RETURN_IF_ERROR(ParseIf(node.get()));
    } else if (tag == "for") {
      MOH_RETURN_IF_ERROR(ParseFor(node.get()));
    } else if (tag == "set") {
      MOH_RETURN_IF_ERROR(ParseSet(node.get()));
    } else if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) {
        return SyntaxError(node->line, tokens_.Previous().column,
                           absl::StrCat("'", tag, "' outside a for loop"));
      }
      node->kind = tag == "break" ? Node::Kind::kBreak : Node::Kind::kContinue;
      MOH_RETURN_IF_ERROR(tokens_.ExpectBlockEnd());
    } else if (tag == "generation") {
      // transformers' {% generation %} only marks assistant text for its
      // masks; rendering is unchanged.
      MOH_RETURN_IF_ERROR(tokens_.ExpectBlockEnd());
      std::string stopped;
      MOH_RETURN_IF_ERROR(ParseBody({"endgeneration"}, body, &stopped));
      return tokens_.ExpectBlockEnd();
    } else {
      const Token& name = tokens_.Previous();
      const bool unsupported =
          std::find(std::begin(kUnsupportedTags), std::end(kUnsupportedTags),
                    tag) != std::end(kUnsupportedTags);
      return SyntaxError(
          name.line, name.column,
          unsupported ? absl::StrCat("'", tag,
                                     "' tags are not supported (only if, "
                                     "for, set, break and continue)")
                      : absl::StrCat("unexpected tag '", tag, "'"));
    }
    body->push_back(std::move(node));
    return absl::OkStatus();
  }

  absl::Status ParseIf(Node* node) {
    node->kind = Node::Kind::kIf;
    std::string stopped = "if";
    while (stopped == "if" || stopped == "elif") {
      MOH_ASSIGN_OR_RETURN(ExprPtr condition, ParseTuple(tokens_, false));
      node->conditions.push_back(std::move(condition));
      MOH_RETURN_IF_ERROR(tokens_.ExpectBlockEnd());
      node->bodies.emplace_back();
      MOH_RETURN_IF_ERROR(
          ParseBody({"elif", "else", "endif"}, &node->bodies.back(), &stopped));
    }
    if (stopped == "else") {
      MOH_RETURN_IF_ERROR(tokens_.ExpectBlockEnd());
      node->bodies.emplace_back();
      MOH_RETURN_IF_ERROR(ParseBody({"endif"}, &node->bodies.back(), &stopped));
    }
    return tokens_.ExpectBlockEnd();
  }

  // Names separated by commas, optionally in parentheses: for/set targets.
  absl::Status ParseTargets(std::vector<std::string>* targets) {
    const bool parens = tokens_.SkipOperator("(");
    do {
      MOH_ASSIGN_OR_RETURN(std::string name,
                           tokens_.ExpectName("a variable name"));
      targets->push_back(std::move(name));
    } while (tokens_.SkipOperator(","));
    if (parens) MOH_RETURN_IF_ERROR(tokens_.ExpectOperator(")"));
    return absl::OkStatus();
  }

  absl::Status ParseFor(Node* node) {
    node->kind = Node::Kind::kFor;
    MOH_RETURN_IF_ERROR(ParseTargets(&node->targets));
    if (!tokens_.SkipName("in")) return tokens_.Unexpected("'in'");
    MOH_ASSIGN_OR_RETURN(node->expr, ParseTuple(tokens_, false));
    if (tokens_.SkipName("if")) {
      MOH_ASSIGN_OR_RETURN(node->filter, ParseExpression(tokens_, true));
    }
    if (tokens_.IsName("recursive")) {
      return tokens_.ErrorHere("recursive loops are not supported");
    }
    MOH_RETURN_IF_ERROR(tokens_.ExpectBlockEnd());
    ++loop_depth_;
    node->bodies.emplace_back();
    std::string stopped;
    absl::Status status =
        ParseBody({"else", "endfor"}, &node->bodies.back(), &stopped);
    --loop_depth_;
    MOH_RETURN_IF_ERROR(status);
    if (stopped == "else") {
      MOH_RETURN_IF_ERROR(tokens_.ExpectBlockEnd());
      node->bodies.emplace_back();
      MOH_RETURN_IF_ERROR(
          ParseBody({"endfor"}, &node->bodies.back(), &stopped));
    }
    return tokens_.ExpectBlockEnd();
  }

  absl::Status ParseSet(Node* node) {
    node->kind = Node::Kind::kSet;
    if (tokens_.Peek().kind == TK::kName && tokens_.IsOperator(".", 1)) {
      node->targets.push_back(tokens_.Next().text);
      tokens_.Next();
      MOH_ASSIGN_OR_RETURN(node->attribute,
                           tokens_.ExpectName("an attribute name"));
    } else {
      MOH_RETURN_IF_ERROR(ParseTargets(&node->targets));
    }
    if (tokens_.SkipOperator("=")) {
      MOH_ASSIGN_OR_RETURN(node->expr, ParseTuple(tokens_, true));
      return tokens_.ExpectBlockEnd();
    }
    if (tokens_.Peek().kind != TK::kBlockEnd || node->targets.size() != 1 ||
        !node->attribute.empty()) {
      return tokens_.Unexpected("'='");
    }
    tokens_.Next();
    node->kind = Node::Kind::kSetBlock;
    node->bodies.emplace_back();
    std::string stopped;
    MOH_RETURN_IF_ERROR(ParseBody({"endset"}, &node->bodies.back(), &stopped));
    return tokens_.ExpectBlockEnd();
  }

  TokenStream tokens_;
  int loop_depth_ = 0;
};

}  // namespace

absl::StatusOr<Body> ParseTemplate(absl::string_view source) {
  MOH_ASSIGN_OR_RETURN(std::vector<Token> tokens, Tokenize(source));
  return Parser(std::move(tokens)).Run();
}

}  // namespace jinja
}  // namespace moh
