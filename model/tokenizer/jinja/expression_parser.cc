#include "model/tokenizer/jinja/expression_parser.h"

#include <algorithm>
#include <initializer_list>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace moh {
namespace jinja {
namespace {

using TK = Token::Kind;
using EK = Expr::Kind;

// Recursive descent with jinja2's precedence, loosest first: a if c else b;
// or; and; not; comparisons and in (chained); + -; ~; * / // %; **; unary
// - +; then a primary with its postfixes (.attr, [item], [a:b], calls),
// filters (| f) and tests (is t).
class ExpressionParser {
 public:
  explicit ExpressionParser(TokenStream& tokens) : tokens_(tokens) {}

  // An expression, or several separated by commas: a tuple (a list here).
  absl::StatusOr<ExprPtr> ParseTuple(bool with_conditional) {
    const int line = tokens_.Peek().line;
    MOH_ASSIGN_OR_RETURN(ExprPtr first, ParseExpression(with_conditional));
    if (!tokens_.IsOperator(",")) return first;
    std::vector<ExprPtr> items;
    items.push_back(std::move(first));
    while (tokens_.SkipOperator(",")) {
      if (tokens_.Peek().kind == TK::kBlockEnd ||
          tokens_.Peek().kind == TK::kVariableEnd || tokens_.IsName("if")) {
        break;
      }
      MOH_ASSIGN_OR_RETURN(ExprPtr item, ParseExpression(with_conditional));
      items.push_back(std::move(item));
    }
    return MakeExpr(EK::kTuple, line, std::move(items));
  }

  absl::StatusOr<ExprPtr> ParseExpression(bool with_conditional) {
    TokenStream::NestingGuard guard(&tokens_);
    MOH_RETURN_IF_ERROR(guard.Check());
    MOH_ASSIGN_OR_RETURN(ExprPtr expr, ParseOr());
    while (with_conditional && tokens_.IsName("if")) {
      const int line = tokens_.Next().line;
      MOH_ASSIGN_OR_RETURN(ExprPtr condition, ParseOr());
      ExprPtr otherwise;
      if (tokens_.SkipName("else")) {
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

  using Level = absl::StatusOr<ExprPtr> (ExpressionParser::*)();

  // Left-associative binary operators `ops` over operands parsed by `next`.
  absl::StatusOr<ExprPtr> ParseBinary(
      Level next, std::initializer_list<absl::string_view> ops, bool names) {
    MOH_ASSIGN_OR_RETURN(ExprPtr left, (this->*next)());
    while (true) {
      const Token& token = tokens_.Peek();
      const bool match =
          token.kind == (names ? TK::kName : TK::kOperator) &&
          std::find(ops.begin(), ops.end(), token.text) != ops.end();
      if (!match) return left;
      const int line = token.line;
      std::string op = tokens_.Next().text;
      MOH_ASSIGN_OR_RETURN(ExprPtr right, (this->*next)());
      left = MakeExpr(EK::kBinary, line,
                      Args(std::move(left), std::move(right)), std::move(op));
    }
  }

  absl::StatusOr<ExprPtr> ParseOr() {
    return ParseBinary(&ExpressionParser::ParseAnd, {"or"}, true);
  }
  absl::StatusOr<ExprPtr> ParseAnd() {
    return ParseBinary(&ExpressionParser::ParseNot, {"and"}, true);
  }
  absl::StatusOr<ExprPtr> ParseNot() {
    if (!tokens_.IsName("not")) return ParseCompare();
    const int line = tokens_.Next().line;
    TokenStream::NestingGuard guard(&tokens_);
    MOH_RETURN_IF_ERROR(guard.Check());
    MOH_ASSIGN_OR_RETURN(ExprPtr operand, ParseNot());
    return MakeExpr(EK::kUnary, line, Args(std::move(operand)), "not");
  }

  absl::StatusOr<ExprPtr> ParseCompare() {
    const int line = tokens_.Peek().line;
    MOH_ASSIGN_OR_RETURN(ExprPtr first, ParseMath1());
    std::vector<ExprPtr> operands;
    std::vector<std::string> ops;
    operands.push_back(std::move(first));
    while (true) {
      static constexpr absl::string_view kOps[] = {"==", "!=", "<",
                                                   "<=", ">",  ">="};
      if (tokens_.Peek().kind == TK::kOperator &&
          std::find(std::begin(kOps), std::end(kOps), tokens_.Peek().text) !=
              std::end(kOps)) {
        ops.push_back(tokens_.Next().text);
      } else if (tokens_.SkipName("in")) {
        ops.push_back("in");
      } else if (tokens_.IsName("not") && tokens_.IsName("in", 1)) {
        tokens_.Next(), tokens_.Next();
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
    return ParseBinary(&ExpressionParser::ParseConcat, {"+", "-"}, false);
  }
  absl::StatusOr<ExprPtr> ParseConcat() {
    return ParseBinary(&ExpressionParser::ParseMath2, {"~"}, false);
  }
  absl::StatusOr<ExprPtr> ParseMath2() {
    return ParseBinary(&ExpressionParser::ParsePow, {"*", "/", "//", "%"},
                       false);
  }
  absl::StatusOr<ExprPtr> ParsePow() {
    return ParseBinary(&ExpressionParser::ParseFilteredUnary, {"**"}, false);
  }
  absl::StatusOr<ExprPtr> ParseFilteredUnary() { return ParseUnary(true); }

  absl::StatusOr<ExprPtr> ParseUnary(bool with_filter) {
    TokenStream::NestingGuard guard(&tokens_);
    MOH_RETURN_IF_ERROR(guard.Check());
    ExprPtr expr;
    if (tokens_.IsOperator("-") || tokens_.IsOperator("+")) {
      const int line = tokens_.Peek().line;
      std::string op = tokens_.Next().text;
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
    const Token& token = tokens_.Peek();
    const int line = token.line;
    auto literal = [&](Value value) {
      auto expr = MakeExpr(EK::kLiteral, line, {});
      expr->value = std::move(value);
      return expr;
    };
    switch (token.kind) {
      case TK::kName: {
        const std::string name = tokens_.Next().text;
        if (name == "true" || name == "True") return literal(Value::Bool(true));
        if (name == "false" || name == "False") {
          return literal(Value::Bool(false));
        }
        if (name == "none" || name == "None") return literal(Value::None());
        return MakeExpr(EK::kName, line, {}, name);
      }
      case TK::kString: {
        std::string text = tokens_.Next().text;
        while (tokens_.Peek().kind == TK::kString) text += tokens_.Next().text;
        return literal(Value::String(std::move(text)));
      }
      case TK::kInt:
        return literal(Value::Int(tokens_.Next().int_value));
      case TK::kFloat:
        return literal(Value::Float(tokens_.Next().float_value));
      case TK::kOperator:
        if (token.text == "(") return ParseParenthesized();
        if (token.text == "[") return ParseList();
        if (token.text == "{") return ParseDict();
        break;
      default:
        break;
    }
    return tokens_.Unexpected("an expression");
  }

  absl::StatusOr<ExprPtr> ParseParenthesized() {
    const int line = tokens_.Next().line;
    if (tokens_.SkipOperator(")")) return MakeExpr(EK::kTuple, line, {});
    MOH_ASSIGN_OR_RETURN(ExprPtr first, ParseExpression(true));
    if (tokens_.SkipOperator(")")) return first;
    std::vector<ExprPtr> items;
    items.push_back(std::move(first));
    while (tokens_.SkipOperator(",")) {
      if (tokens_.IsOperator(")")) break;
      MOH_ASSIGN_OR_RETURN(ExprPtr item, ParseExpression(true));
      items.push_back(std::move(item));
    }
    MOH_RETURN_IF_ERROR(tokens_.ExpectOperator(")"));
    return MakeExpr(EK::kTuple, line, std::move(items));
  }

  absl::StatusOr<ExprPtr> ParseList() {
    const int line = tokens_.Next().line;
    std::vector<ExprPtr> items;
    while (!tokens_.SkipOperator("]")) {
      if (!items.empty()) MOH_RETURN_IF_ERROR(tokens_.ExpectOperator(","));
      if (tokens_.SkipOperator("]")) break;
      MOH_ASSIGN_OR_RETURN(ExprPtr item, ParseExpression(true));
      items.push_back(std::move(item));
    }
    return MakeExpr(EK::kList, line, std::move(items));
  }

  absl::StatusOr<ExprPtr> ParseDict() {
    const int line = tokens_.Next().line;
    std::vector<ExprPtr> items;
    while (!tokens_.SkipOperator("}")) {
      if (!items.empty()) MOH_RETURN_IF_ERROR(tokens_.ExpectOperator(","));
      if (tokens_.SkipOperator("}")) break;
      MOH_ASSIGN_OR_RETURN(ExprPtr key, ParseExpression(true));
      MOH_RETURN_IF_ERROR(tokens_.ExpectOperator(":"));
      MOH_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
      items.push_back(std::move(key));
      items.push_back(std::move(value));
    }
    return MakeExpr(EK::kDict, line, std::move(items));
  }

  // .name, .0, [index], [start:stop:step] and calls after a primary.
  absl::StatusOr<ExprPtr> ParsePostfix(ExprPtr expr) {
    while (true) {
      const int line = tokens_.Peek().line;
      if (tokens_.SkipOperator(".")) {
        if (tokens_.Peek().kind == TK::kInt) {
          auto index = MakeExpr(EK::kLiteral, line, {});
          index->value = Value::Int(tokens_.Next().int_value);
          expr = MakeExpr(EK::kItem, line,
                          Args(std::move(expr), std::move(index)));
          continue;
        }
        MOH_ASSIGN_OR_RETURN(std::string name,
                             tokens_.ExpectName("an attribute name"));
        expr = MakeExpr(EK::kAttribute, line, Args(std::move(expr)), name);
      } else if (tokens_.SkipOperator("[")) {
        MOH_ASSIGN_OR_RETURN(expr, ParseSubscript(std::move(expr), line));
      } else if (tokens_.IsOperator("(")) {
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
      if (tokens_.IsOperator(":") || tokens_.IsOperator("]")) {
        parts.push_back(nullptr);
      } else {
        MOH_ASSIGN_OR_RETURN(ExprPtr part, ParseExpression(true));
        parts.push_back(std::move(part));
      }
      if (parts.size() == 3 || !tokens_.SkipOperator(":")) break;
      slice = true;
    }
    MOH_RETURN_IF_ERROR(tokens_.ExpectOperator("]"));
    std::vector<ExprPtr> args;
    args.push_back(std::move(target));
    if (!slice) {
      if (parts[0] == nullptr) return tokens_.Unexpected("an index");
      args.push_back(std::move(parts[0]));
      return MakeExpr(EK::kItem, line, std::move(args));
    }
    parts.resize(3);
    for (ExprPtr& part : parts) args.push_back(std::move(part));
    return MakeExpr(EK::kSlice, line, std::move(args));
  }

  // "(args, name=value)" into `call` (whose args[0] is set by the caller).
  absl::Status ParseArguments(Expr* call) {
    MOH_RETURN_IF_ERROR(tokens_.ExpectOperator("("));
    bool first = true;
    while (!tokens_.SkipOperator(")")) {
      if (!first) MOH_RETURN_IF_ERROR(tokens_.ExpectOperator(","));
      first = false;
      if (tokens_.SkipOperator(")")) break;
      if (tokens_.IsOperator("*") || tokens_.IsOperator("**")) {
        return tokens_.ErrorHere("*args and **kwargs are not supported");
      }
      if (tokens_.Peek().kind == TK::kName && tokens_.IsOperator("=", 1)) {
        std::string name = tokens_.Next().text;
        tokens_.Next();
        MOH_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
        call->kwargs.emplace_back(std::move(name), std::move(value));
        continue;
      }
      if (!call->kwargs.empty()) {
        return tokens_.ErrorHere(
            "positional argument after a keyword argument");
      }
      MOH_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
      call->args.push_back(std::move(value));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<ExprPtr> ParseCall(ExprPtr callee) {
    auto call = std::make_unique<Expr>();
    call->kind = EK::kCall;
    call->line = tokens_.Peek().line;
    call->args.push_back(std::move(callee));
    MOH_RETURN_IF_ERROR(ParseArguments(call.get()));
    return ExprPtr(std::move(call));
  }

  // "| filter(args)", "is [not] test(args)" and calls, left to right.
  absl::StatusOr<ExprPtr> ParseFiltersAndTests(ExprPtr expr) {
    while (true) {
      const int line = tokens_.Peek().line;
      if (tokens_.SkipOperator("|")) {
        auto filter = std::make_unique<Expr>();
        filter->kind = EK::kFilter;
        filter->line = line;
        MOH_ASSIGN_OR_RETURN(filter->name, tokens_.ExpectName("a filter name"));
        filter->args.push_back(std::move(expr));
        if (tokens_.IsOperator("(")) {
          MOH_RETURN_IF_ERROR(ParseArguments(filter.get()));
        }
        expr = std::move(filter);
      } else if (tokens_.SkipName("is")) {
        auto test = std::make_unique<Expr>();
        test->kind = EK::kTest;
        test->line = line;
        test->negated = tokens_.SkipName("not");
        MOH_ASSIGN_OR_RETURN(test->name, tokens_.ExpectName("a test name"));
        test->args.push_back(std::move(expr));
        if (tokens_.IsOperator("(")) {
          MOH_RETURN_IF_ERROR(ParseArguments(test.get()));
        } else if (TakesBareTestArgument()) {
          // "x is divisibleby 3", "x is sameas false".
          MOH_ASSIGN_OR_RETURN(ExprPtr arg, ParsePrimary());
          MOH_ASSIGN_OR_RETURN(arg, ParsePostfix(std::move(arg)));
          test->args.push_back(std::move(arg));
        }
        expr = std::move(test);
      } else if (tokens_.IsOperator("(")) {
        MOH_ASSIGN_OR_RETURN(expr, ParseCall(std::move(expr)));
      } else {
        return expr;
      }
    }
  }

  bool TakesBareTestArgument() const {
    const Token& token = tokens_.Peek();
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

 private:
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

  TokenStream& tokens_;
};

}  // namespace

absl::StatusOr<ExprPtr> ParseExpression(TokenStream& tokens,
                                        bool with_conditional) {
  return ExpressionParser(tokens).ParseExpression(with_conditional);
}

absl::StatusOr<ExprPtr> ParseTuple(TokenStream& tokens, bool with_conditional) {
  return ExpressionParser(tokens).ParseTuple(with_conditional);
}

}  // namespace jinja
}  // namespace moh
