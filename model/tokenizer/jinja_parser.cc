#include "model/tokenizer/jinja_parser.h"

#include <algorithm>
#include <initializer_list>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "model/tokenizer/jinja_lexer.h"

namespace moh {
namespace jinja {
namespace {

using TK = Token::Kind;
using EK = Expr::Kind;

// Tags of jinja2 that this engine does not implement.
constexpr absl::string_view kUnsupportedTags[] = {
    "macro", "call", "filter", "include",    "import", "from",  "extends",
    "block", "raw",  "with",   "autoescape", "do",     "trans", "print"};

// Tags that continue or close a block opened earlier.
bool IsClosingTag(absl::string_view tag) {
  return tag == "elif" || tag == "else" || absl::StartsWith(tag, "end");
}

std::string Describe(const Token& token) {
  switch (token.kind) {
    case TK::kText:
      return "template text";
    case TK::kVariableBegin:
      return "'{{'";
    case TK::kVariableEnd:
      return "'}}'";
    case TK::kBlockBegin:
      return "'{%'";
    case TK::kBlockEnd:
      return "'%}'";
    case TK::kString:
      return "a string";
    case TK::kInt:
    case TK::kFloat:
      return "a number";
    case TK::kEnd:
      return "end of template";
    default:
      return absl::StrCat("'", token.text, "'");
  }
}

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
  // ------------------------------------------------------------ tokens --

  const Token& Peek(size_t ahead = 0) const {
    return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)];
  }
  const Token& Next() {
    const Token& token = Peek();
    if (pos_ + 1 < tokens_.size()) ++pos_;
    return token;
  }
  bool IsOperator(absl::string_view op, size_t ahead = 0) const {
    return Peek(ahead).kind == TK::kOperator && Peek(ahead).text == op;
  }
  bool IsName(absl::string_view name, size_t ahead = 0) const {
    return Peek(ahead).kind == TK::kName && Peek(ahead).text == name;
  }
  bool SkipOperator(absl::string_view op) {
    if (!IsOperator(op)) return false;
    Next();
    return true;
  }
  bool SkipName(absl::string_view name) {
    if (!IsName(name)) return false;
    Next();
    return true;
  }
  absl::Status ErrorHere(absl::string_view what) const {
    return SyntaxError(Peek().line, Peek().column, what);
  }
  absl::Status Unexpected(absl::string_view expected) const {
    return ErrorHere(
        absl::StrCat("expected ", expected, ", found ", Describe(Peek())));
  }
  absl::Status ExpectOperator(absl::string_view op) {
    if (SkipOperator(op)) return absl::OkStatus();
    return Unexpected(absl::StrCat("'", op, "'"));
  }
  absl::Status ExpectBlockEnd() {
    if (Peek().kind != TK::kBlockEnd) return Unexpected("'%}'");
    Next();
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> ExpectName(absl::string_view what) {
    if (Peek().kind != TK::kName) return Unexpected(what);
    return Next().text;
  }
  // Counts one level of nesting while alive; the constructor's caller checks
  // `ok()`.
  class NestingGuard {
   public:
    explicit NestingGuard(Parser* parser) : parser_(parser) {
      ++parser_->depth_;
    }
    ~NestingGuard() { --parser_->depth_; }
    absl::Status Check() const {
      if (parser_->depth_ <= kMaxNesting) return absl::OkStatus();
      return parser_->ErrorHere(
          absl::StrCat("nested more than ", kMaxNesting, " levels deep"));
    }

   private:
    Parser* parser_;
  };

  static ExprPtr MakeExpr(EK kind, int line, std::vector<ExprPtr> args,
                          std::string name = "") {
    auto expr = std::make_unique<Expr>();
    expr->kind = kind;
    expr->line = line;
    expr->args = std::move(args);
    expr->name = std::move(name);
    return expr;
  }
  static std::vector<ExprPtr> Args(ExprPtr a, ExprPtr b = nullptr) {
    std::vector<ExprPtr> args;
    args.push_back(std::move(a));
    if (b != nullptr) args.push_back(std::move(b));
    return args;
  }

  // -------------------------------------------------------- statements --

  // Statements until a block tag named in `stop` (consumed up to its name,
  // returned in `stopped`) or, when `stop` is empty, the end.
  absl::Status ParseBody(std::initializer_list<absl::string_view> stop,
                         Body* body, std::string* stopped) {
    NestingGuard guard(this);
    MOH_RETURN_IF_ERROR(guard.Check());
    while (true) {
      const Token& token = Peek();
      switch (token.kind) {
        case TK::kEnd:
          if (stop.size() == 0) return absl::OkStatus();
          return ErrorHere(
              absl::StrCat("unexpected end of template, expected '",
                           absl::StrJoin(stop, "' or '"), "'"));
        case TK::kText: {
          auto node = std::make_unique<Node>();
          node->kind = Node::Kind::kText;
          node->line = token.line;
          node->text = Next().text;
          body->push_back(std::move(node));
          break;
        }
        case TK::kVariableBegin: {
          auto node = std::make_unique<Node>();
          node->kind = Node::Kind::kOutput;
          node->line = Next().line;
          MOH_ASSIGN_OR_RETURN(node->expr, ParseTuple(true));
          if (Peek().kind != TK::kVariableEnd) return Unexpected("'}}'");
          Next();
          body->push_back(std::move(node));
          break;
        }
        case TK::kBlockBegin: {
          Next();
          MOH_ASSIGN_OR_RETURN(const std::string tag, ExpectName("a tag name"));
          if (std::find(stop.begin(), stop.end(), tag) != stop.end()) {
            *stopped = tag;
            return absl::OkStatus();
          }
          if (IsClosingTag(tag)) {
            const Token& name = tokens_[pos_ - 1];
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
          return Unexpected("template text or a tag");
      }
    }
  }

  absl::Status ParseStatement(const std::string& tag, Body* body) {
    auto node = std::make_unique<Node>();
    node->line = tokens_[pos_ - 1].line;
    if (tag == "if") {
      MOH_RETURN_IF_ERROR(ParseIf(node.get()));
    } else if (tag == "for") {
      MOH_RETURN_IF_ERROR(ParseFor(node.get()));
    } else if (tag == "set") {
      MOH_RETURN_IF_ERROR(ParseSet(node.get()));
    } else if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) {
        return SyntaxError(node->line, tokens_[pos_ - 1].column,
                           absl::StrCat("'", tag, "' outside a for loop"));
      }
      node->kind = tag == "break" ? Node::Kind::kBreak : Node::Kind::kContinue;
      MOH_RETURN_IF_ERROR(ExpectBlockEnd());
    } else if (tag == "generation") {
      // transformers' {% generation %} only marks assistant text for its
      // masks; rendering is unchanged.
      MOH_RETURN_IF_ERROR(ExpectBlockEnd());
      std::string stopped;
      MOH_RETURN_IF_ERROR(ParseBody({"endgeneration"}, body, &stopped));
      return ExpectBlockEnd();
    } else {
      const Token& name = tokens_[pos_ - 1];
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
      MOH_ASSIGN_OR_RETURN(ExprPtr condition, ParseTuple(false));
      node->conditions.push_back(std::move(condition));
      MOH_RETURN_IF_ERROR(ExpectBlockEnd());
      node->bodies.emplace_back();
      MOH_RETURN_IF_ERROR(
          ParseBody({"elif", "else", "endif"}, &node->bodies.back(), &stopped));
    }
    if (stopped == "else") {
      MOH_RETURN_IF_ERROR(ExpectBlockEnd());
      node->bodies.emplace_back();
      MOH_RETURN_IF_ERROR(ParseBody({"endif"}, &node->bodies.back(), &stopped));
    }
    return ExpectBlockEnd();
  }

  // Names separated by commas, optionally in parentheses: for/set targets.
  absl::Status ParseTargets(std::vector<std::string>* targets) {
    const bool parens = SkipOperator("(");
    do {
      MOH_ASSIGN_OR_RETURN(std::string name, ExpectName("a variable name"));
      targets->push_back(std::move(name));
    } while (SkipOperator(","));
    if (parens) MOH_RETURN_IF_ERROR(ExpectOperator(")"));
    return absl::OkStatus();
  }

  absl::Status ParseFor(Node* node) {
    node->kind = Node::Kind::kFor;
    MOH_RETURN_IF_ERROR(ParseTargets(&node->targets));
    if (!SkipName("in")) return Unexpected("'in'");
    MOH_ASSIGN_OR_RETURN(node->expr, ParseTuple(false));
    if (SkipName("if")) {
      MOH_ASSIGN_OR_RETURN(node->filter, ParseExpression(true));
    }
    if (IsName("recursive")) {
      return ErrorHere("recursive loops are not supported");
    }
    MOH_RETURN_IF_ERROR(ExpectBlockEnd());
    ++loop_depth_;
    node->bodies.emplace_back();
    std::string stopped;
    absl::Status status =
        ParseBody({"else", "endfor"}, &node->bodies.back(), &stopped);
    --loop_depth_;
    MOH_RETURN_IF_ERROR(status);
    if (stopped == "else") {
      MOH_RETURN_IF_ERROR(ExpectBlockEnd());
      node->bodies.emplace_back();
      MOH_RETURN_IF_ERROR(
          ParseBody({"endfor"}, &node->bodies.back(), &stopped));
    }
    return ExpectBlockEnd();
  }

  absl::Status ParseSet(Node* node) {
    node->kind = Node::Kind::kSet;
    if (Peek().kind == TK::kName && IsOperator(".", 1)) {
      node->targets.push_back(Next().text);
      Next();
      MOH_ASSIGN_OR_RETURN(node->attribute, ExpectName("an attribute name"));
    } else {
      MOH_RETURN_IF_ERROR(ParseTargets(&node->targets));
    }
    if (SkipOperator("=")) {
      MOH_ASSIGN_OR_RETURN(node->expr, ParseTuple(true));
      return ExpectBlockEnd();
    }
    if (Peek().kind != TK::kBlockEnd || node->targets.size() != 1 ||
        !node->attribute.empty()) {
      return Unexpected("'='");
    }
    Next();
    node->kind = Node::Kind::kSetBlock;
    node->bodies.emplace_back();
    std::string stopped;
    MOH_RETURN_IF_ERROR(ParseBody({"endset"}, &node->bodies.back(), &stopped));
    return ExpectBlockEnd();
  }

  // ------------------------------------------------------- expressions --

  // An expression, or several separated by commas: a tuple (a list here).
  absl::StatusOr<ExprPtr> ParseTuple(bool with_conditional) {
    const int line = Peek().line;
    MOH_ASSIGN_OR_RETURN(ExprPtr first, ParseExpression(with_conditional));
    if (!IsOperator(",")) return first;
    std::vector<ExprPtr> items;
    items.push_back(std::move(first));
    while (SkipOperator(",")) {
      if (Peek().kind == TK::kBlockEnd || Peek().kind == TK::kVariableEnd ||
          IsName("if")) {
        break;
      }
      MOH_ASSIGN_OR_RETURN(ExprPtr item, ParseExpression(with_conditional));
      items.push_back(std::move(item));
    }
    return MakeExpr(EK::kList, line, std::move(items));
  }

  absl::StatusOr<ExprPtr> ParseExpression(bool with_conditional) {
    NestingGuard guard(this);
    MOH_RETURN_IF_ERROR(guard.Check());
    MOH_ASSIGN_OR_RETURN(ExprPtr expr, ParseOr());
    while (with_conditional && IsName("if")) {
      const int line = Next().line;
      MOH_ASSIGN_OR_RETURN(ExprPtr condition, ParseOr());
      ExprPtr otherwise;
      if (SkipName("else")) {
        MOH_ASSIGN_OR_RETURN(otherwise, ParseExpression(true));
      }
      std::vector<ExprPtr> args;
      args.push_back(std::move(condition));
      args.push_back(std::move(expr));
      args.push_back(std::move(otherwise));
      expr = MakeExpr(EK::kConditional, line, std::move(args));
    }
    return expr;
  }

  using Level = absl::StatusOr<ExprPtr> (Parser::*)();

  // Left-associative binary operators `ops` over operands parsed by `next`.
  absl::StatusOr<ExprPtr> ParseBinary(
      Level next, std::initializer_list<absl::string_view> ops, bool names) {
    MOH_ASSIGN_OR_RETURN(ExprPtr left, (this->*next)());
    while (true) {
      const Token& token = Peek();
      const bool match =
          token.kind == (names ? TK::kName : TK::kOperator) &&
          std::find(ops.begin(), ops.end(), token.text) != ops.end();
      if (!match) return left;
      const int line = token.line;
      std::string op = Next().text;
      MOH_ASSIGN_OR_RETURN(ExprPtr right, (this->*next)());
      left = MakeExpr(EK::kBinary, line,
                      Args(std::move(left), std::move(right)), std::move(op));
    }
  }

  absl::StatusOr<ExprPtr> ParseOr() {
    return ParseBinary(&Parser::ParseAnd, {"or"}, true);
  }
  absl::StatusOr<ExprPtr> ParseAnd() {
    return ParseBinary(&Parser::ParseNot, {"and"}, true);
  }
  absl::StatusOr<ExprPtr> ParseNot() {
    if (!IsName("not")) return ParseCompare();
    const int line = Next().line;
    NestingGuard guard(this);
    MOH_RETURN_IF_ERROR(guard.Check());
    MOH_ASSIGN_OR_RETURN(ExprPtr operand, ParseNot());
    return MakeExpr(EK::kUnary, line, Args(std::move(operand)), "not");
  }

  absl::StatusOr<ExprPtr> ParseCompare() {
    const int line = Peek().line;
    MOH_ASSIGN_OR_RETURN(ExprPtr first, ParseMath1());
    std::vector<ExprPtr> operands;
    std::vector<std::string> ops;
    operands.push_back(std::move(first));
    while (true) {
      static constexpr absl::string_view kOps[] = {"==", "!=", "<",
                                                   "<=", ">",  ">="};
      if (Peek().kind == TK::kOperator &&
          std::find(std::begin(kOps), std::end(kOps), Peek().text) !=
              std::end(kOps)) {
        ops.push_back(Next().text);
      } else if (SkipName("in")) {
        ops.push_back("in");
      } else if (IsName("not") && IsName("in", 1)) {
        Next(), Next();
        ops.push_back("not in");
      } else {
        break;
      }
      MOH_ASSIGN_OR_RETURN(ExprPtr operand, ParseMath1());
      operands.push_back(std::move(operand));
    }
    if (ops.empty()) return std::move(operands[0]);
    ExprPtr compare = MakeExpr(EK::kCompare, line, std::move(operands));
    compare->ops = std::move(ops);
    return compare;
  }

  absl::StatusOr<ExprPtr> ParseMath1() {
    return ParseBinary(&Parser::ParseConcat, {"+", "-"}, false);
  }
  absl::StatusOr<ExprPtr> ParseConcat() {
    return ParseBinary(&Parser::ParseMath2, {"~"}, false);
  }
  absl::StatusOr<ExprPtr> ParseMath2() {
    return ParseBinary(&Parser::ParsePow, {"*", "/", "//", "%"}, false);
  }
  absl::StatusOr<ExprPtr> ParsePow() {
    return ParseBinary(&Parser::ParseFilteredUnary, {"**"}, false);
  }
  absl::StatusOr<ExprPtr> ParseFilteredUnary() { return ParseUnary(true); }

  absl::StatusOr<ExprPtr> ParseUnary(bool with_filter) {
    NestingGuard guard(this);
    MOH_RETURN_IF_ERROR(guard.Check());
    ExprPtr expr;
    if (IsOperator("-") || IsOperator("+")) {
      const int line = Peek().line;
      std::string op = Next().text;
      MOH_ASSIGN_OR_RETURN(ExprPtr operand, ParseUnary(false));
      expr = MakeExpr(EK::kUnary, line, Args(std::move(operand)), op);
    } else {
      MOH_ASSIGN_OR_RETURN(expr, ParsePrimary());
    }
    MOH_ASSIGN_OR_RETURN(expr, ParsePostfix(std::move(expr)));
    if (with_filter) {
      MOH_ASSIGN_OR_RETURN(expr, ParseFiltersAndTests(std::move(expr)));
    }
    return expr;
  }

  absl::StatusOr<ExprPtr> ParsePrimary() {
    const Token& token = Peek();
    const int line = token.line;
    auto literal = [&](Value value) {
      auto expr = MakeExpr(EK::kLiteral, line, {});
      expr->value = std::move(value);
      return expr;
    };
    switch (token.kind) {
      case TK::kName: {
        const std::string name = Next().text;
        if (name == "true" || name == "True") return literal(Value::Bool(true));
        if (name == "false" || name == "False") {
          return literal(Value::Bool(false));
        }
        if (name == "none" || name == "None") return literal(Value::None());
        return MakeExpr(EK::kName, line, {}, name);
      }
      case TK::kString: {
        std::string text = Next().text;
        while (Peek().kind == TK::kString) text += Next().text;
        return literal(Value::String(std::move(text)));
      }
      case TK::kInt:
        return literal(Value::Int(Next().int_value));
      case TK::kFloat:
        return literal(Value::Float(Next().float_value));
      case TK::kOperator:
        if (token.text == "(") return ParseParenthesized();
        if (token.text == "[") return ParseList();
        if (token.text == "{") return ParseDict();
        break;
      default:
        break;
    }
    return Unexpected("an expression");
  }

  absl::StatusOr<ExprPtr> ParseParenthesized() {
    const int line = Next().line;
    if (SkipOperator(")")) return MakeExpr(EK::kList, line, {});
    MOH_ASSIGN_OR_RETURN(ExprPtr first, ParseExpression(true));
    if (SkipOperator(")")) return first;
    std::vector<ExprPtr> items;
    items.push_back(std::move(first));
    while (SkipOperator(",")) {
      if (IsOperator(")")) break;
      MOH_ASSIGN_OR_RETURN(ExprPtr item, ParseExpression(true));
      items.push_back(std::move(item));
    }
    MOH_RETURN_IF_ERROR(ExpectOperator(")"));
    return MakeExpr(EK::kList, line, std::move(items));
  }

  absl::StatusOr<ExprPtr> ParseList() {
    const int line = Next().line;
    std::vector<ExprPtr> items;
    while (!SkipOperator("]")) {
      if (!items.empty()) MOH_RETURN_IF_ERROR(ExpectOperator(","));
      if (SkipOperator("]")) break;
      MOH_ASSIGN_OR_RETURN(ExprPtr item, ParseExpression(true));
      items.push_back(std::move(item));
    }
    return MakeExpr(EK::kList, line, std::move(items));
  }

  absl::StatusOr<ExprPtr> ParseDict() {
    const int line = Next().line;
    std::vector<ExprPtr> items;
    while (!SkipOperator("}")) {
      if (!items.empty()) MOH_RETURN_IF_ERROR(ExpectOperator(","));
      if (SkipOperator("}")) break;
      MOH_ASSIGN_OR_RETURN(ExprPtr key, ParseExpression(true));
      MOH_RETURN_IF_ERROR(ExpectOperator(":"));
      MOH_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
      items.push_back(std::move(key));
      items.push_back(std::move(value));
    }
    return MakeExpr(EK::kDict, line, std::move(items));
  }

  // .name, .0, [index], [start:stop:step] and calls after a primary.
  absl::StatusOr<ExprPtr> ParsePostfix(ExprPtr expr) {
    while (true) {
      const int line = Peek().line;
      if (SkipOperator(".")) {
        if (Peek().kind == TK::kInt) {
          auto index = MakeExpr(EK::kLiteral, line, {});
          index->value = Value::Int(Next().int_value);
          expr = MakeExpr(EK::kItem, line,
                          Args(std::move(expr), std::move(index)));
          continue;
        }
        MOH_ASSIGN_OR_RETURN(std::string name, ExpectName("an attribute name"));
        expr = MakeExpr(EK::kAttribute, line, Args(std::move(expr)), name);
      } else if (SkipOperator("[")) {
        MOH_ASSIGN_OR_RETURN(expr, ParseSubscript(std::move(expr), line));
      } else if (IsOperator("(")) {
        MOH_ASSIGN_OR_RETURN(expr, ParseCall(std::move(expr)));
      } else {
        return expr;
      }
    }
  }

  absl::StatusOr<ExprPtr> ParseSubscript(ExprPtr target, int line) {
    std::vector<ExprPtr> parts;  // start, stop, step
    bool slice = false;
    while (true) {
      if (IsOperator(":") || IsOperator("]")) {
        parts.push_back(nullptr);
      } else {
        MOH_ASSIGN_OR_RETURN(ExprPtr part, ParseExpression(true));
        parts.push_back(std::move(part));
      }
      if (parts.size() == 3 || !SkipOperator(":")) break;
      slice = true;
    }
    MOH_RETURN_IF_ERROR(ExpectOperator("]"));
    std::vector<ExprPtr> args;
    args.push_back(std::move(target));
    if (!slice) {
      if (parts[0] == nullptr) return Unexpected("an index");
      args.push_back(std::move(parts[0]));
      return MakeExpr(EK::kItem, line, std::move(args));
    }
    parts.resize(3);
    for (ExprPtr& part : parts) args.push_back(std::move(part));
    return MakeExpr(EK::kSlice, line, std::move(args));
  }

  // "(args, name=value)" into `call` (whose args[0] is set by the caller).
  absl::Status ParseArguments(Expr* call) {
    MOH_RETURN_IF_ERROR(ExpectOperator("("));
    bool first = true;
    while (!SkipOperator(")")) {
      if (!first) MOH_RETURN_IF_ERROR(ExpectOperator(","));
      first = false;
      if (SkipOperator(")")) break;
      if (IsOperator("*") || IsOperator("**")) {
        return ErrorHere("*args and **kwargs are not supported");
      }
      if (Peek().kind == TK::kName && IsOperator("=", 1)) {
        std::string name = Next().text;
        Next();
        MOH_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
        call->kwargs.emplace_back(std::move(name), std::move(value));
        continue;
      }
      if (!call->kwargs.empty()) {
        return ErrorHere("positional argument after a keyword argument");
      }
      MOH_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
      call->args.push_back(std::move(value));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<ExprPtr> ParseCall(ExprPtr callee) {
    auto call = std::make_unique<Expr>();
    call->kind = EK::kCall;
    call->line = Peek().line;
    call->args.push_back(std::move(callee));
    MOH_RETURN_IF_ERROR(ParseArguments(call.get()));
    return ExprPtr(std::move(call));
  }

  // "| filter(args)", "is [not] test(args)" and calls, left to right.
  absl::StatusOr<ExprPtr> ParseFiltersAndTests(ExprPtr expr) {
    while (true) {
      const int line = Peek().line;
      if (SkipOperator("|")) {
        auto filter = std::make_unique<Expr>();
        filter->kind = EK::kFilter;
        filter->line = line;
        MOH_ASSIGN_OR_RETURN(filter->name, ExpectName("a filter name"));
        filter->args.push_back(std::move(expr));
        if (IsOperator("(")) MOH_RETURN_IF_ERROR(ParseArguments(filter.get()));
        expr = std::move(filter);
      } else if (SkipName("is")) {
        auto test = std::make_unique<Expr>();
        test->kind = EK::kTest;
        test->line = line;
        test->negated = SkipName("not");
        MOH_ASSIGN_OR_RETURN(test->name, ExpectName("a test name"));
        test->args.push_back(std::move(expr));
        if (IsOperator("(")) {
          MOH_RETURN_IF_ERROR(ParseArguments(test.get()));
        } else if (TakesBareTestArgument()) {
          // "x is divisibleby 3", "x is sameas false".
          MOH_ASSIGN_OR_RETURN(ExprPtr arg, ParsePrimary());
          MOH_ASSIGN_OR_RETURN(arg, ParsePostfix(std::move(arg)));
          test->args.push_back(std::move(arg));
        }
        expr = std::move(test);
      } else if (IsOperator("(")) {
        MOH_ASSIGN_OR_RETURN(expr, ParseCall(std::move(expr)));
      } else {
        return expr;
      }
    }
  }

  bool TakesBareTestArgument() const {
    const Token& token = Peek();
    switch (token.kind) {
      case TK::kName:
        return token.text != "else" && token.text != "or" &&
               token.text != "and";
      case TK::kString:
      case TK::kInt:
      case TK::kFloat:
        return true;
      case TK::kOperator:
        return token.text == "[" || token.text == "{";
      default:
        return false;
    }
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
};

}  // namespace

absl::StatusOr<Body> ParseTemplate(absl::string_view source) {
  MOH_ASSIGN_OR_RETURN(std::vector<Token> tokens, Tokenize(source));
  return Parser(std::move(tokens)).Run();
}

}  // namespace jinja
}  // namespace moh
