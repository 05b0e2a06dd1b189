#include "model/tokenizer/jinja/renderer.h"

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/status_macros.h"
#include "model/tokenizer/jinja/builtins.h"
#include "model/tokenizer/jinja/filters.h"
#include "model/tokenizer/jinja/operators.h"

namespace moh {
namespace jinja {
namespace {

using Kind = Value::Kind;
using EK = Expr::Kind;
using NK = Node::Kind;

// The variables of one level: the template's top level, or one loop
// iteration (as in jinja2, a `set` inside a loop body is gone at the next
// iteration). Reads fall through to the enclosing scopes.
class Scope {
 public:
  explicit Scope(const Scope* parent) : parent_(parent) {}

  const Value* Find(absl::string_view name) const {
    for (const Scope* scope = this; scope != nullptr; scope = scope->parent_) {
      for (const auto& [key, value] : scope->vars_) {
        if (key == name) return &value;
      }
    }
    return nullptr;
  }

  void Set(const std::string& name, Value value) {
    SetItem(&vars_, name, std::move(value));
  }

 private:
  const Scope* parent_;
  Dict vars_;
};

// What a statement asks of the loop around it.
enum class Flow { kNormal, kBreak, kContinue };

class Renderer {
 public:
  explicit Renderer(const RenderLimits& limits) : limits_(limits) {}

  absl::Status Run(const Body& body, const Dict& globals, std::string* out) {
    Scope scope(nullptr);
    for (const auto& [name, value] : globals) scope.Set(name, value);
    return Exec(body, scope, out).status();
  }

 private:
  template <typename... Parts>
  static absl::Status ErrorAt(int line, const Parts&... parts) {
    return absl::InvalidArgumentError(
        absl::StrCat("chat template line ", line, ": ", parts...));
  }
  // A builtin's error with the line; raise_exception's (ABORTED) as it is.
  static absl::Status AtLine(int line, const absl::Status& status) {
    if (status.ok() || absl::IsAborted(status)) return status;
    return ErrorAt(line, status.message());
  }
  template <typename T>
  static absl::StatusOr<T> AtLine(int line, absl::StatusOr<T> result) {
    if (result.ok()) return result;
    return AtLine(line, result.status());
  }

  absl::Status Step(int line) {
    if (++steps_ <= limits_.max_steps) return absl::OkStatus();
    return ErrorAt(line, "more than ", limits_.max_steps,
                   " evaluation steps (a loop that runs too long?)");
  }

  absl::Status CheckOutput(int line, const std::string& out, bool ok) const {
    if (ok && out.size() <= limits_.max_output_bytes) return absl::OkStatus();
    return ErrorAt(line, "output longer than ", limits_.max_output_bytes,
                   " bytes");
  }

  // ------------------------------------------------------- statements --

  absl::StatusOr<Flow> Exec(const Body& body, Scope& scope, std::string* out) {
    for (const auto& node : body) {
      MOH_RETURN_IF_ERROR(Step(node->line));
      switch (node->kind) {
        case NK::kText:
          out->append(node->text);
          MOH_RETURN_IF_ERROR(CheckOutput(node->line, *out, true));
          break;
        case NK::kOutput: {
          MOH_ASSIGN_OR_RETURN(const Value value, Eval(*node->expr, scope));
          const bool ok = AppendStr(value, limits_.max_output_bytes, out);
          MOH_RETURN_IF_ERROR(CheckOutput(node->line, *out, ok));
          break;
        }
        case NK::kIf: {
          MOH_ASSIGN_OR_RETURN(const Flow flow, ExecIf(*node, scope, out));
          if (flow != Flow::kNormal) return flow;
          break;
        }
        case NK::kFor: {
          MOH_ASSIGN_OR_RETURN(const Flow flow, ExecFor(*node, scope, out));
          if (flow != Flow::kNormal) return flow;
          break;
        }
        case NK::kSet: {
          MOH_ASSIGN_OR_RETURN(const Value value, Eval(*node->expr, scope));
          MOH_RETURN_IF_ERROR(Assign(*node, value, scope));
          break;
        }
        case NK::kSetBlock: {
          std::string captured;
          MOH_ASSIGN_OR_RETURN(const Flow flow,
                               Exec(node->bodies[0], scope, &captured));
          scope.Set(node->targets[0], Value::String(std::move(captured)));
          if (flow != Flow::kNormal) return flow;
          break;
        }
        case NK::kBreak:
          return Flow::kBreak;
        case NK::kContinue:
          return Flow::kContinue;
      }
    }
    return Flow::kNormal;
  }

  absl::StatusOr<Flow> ExecIf(const Node& node, Scope& scope,
                              std::string* out) {
    for (size_t i = 0; i < node.conditions.size(); ++i) {
      MOH_ASSIGN_OR_RETURN(const Value condition,
                           Eval(*node.conditions[i], scope));
      if (condition.Truthy()) return Exec(node.bodies[i], scope, out);
    }
    if (node.bodies.size() > node.conditions.size()) {
      return Exec(node.bodies.back(), scope, out);
    }
    return Flow::kNormal;
  }

  absl::StatusOr<Flow> ExecFor(const Node& node, Scope& scope,
                               std::string* out) {
    MOH_ASSIGN_OR_RETURN(const Value iterable, Eval(*node.expr, scope));
    MOH_ASSIGN_OR_RETURN(List items, AtLine(node.line, Iterate(iterable)));
    if (node.filter != nullptr) {
      List kept;
      for (Value& item : items) {
        MOH_RETURN_IF_ERROR(Step(node.line));
        Scope iteration(&scope);
        MOH_RETURN_IF_ERROR(Unpack(node.targets, item, node.line, iteration));
        MOH_ASSIGN_OR_RETURN(const Value keep, Eval(*node.filter, iteration));
        if (keep.Truthy()) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < n; ++i) {
      MOH_RETURN_IF_ERROR(Step(node.line));
      Scope iteration(&scope);
      MOH_RETURN_IF_ERROR(Unpack(node.targets, items[i], node.line, iteration));
      Dict loop = {
          {"index", Value::Int(i + 1)},    {"index0", Value::Int(i)},
          {"revindex", Value::Int(n - i)}, {"revindex0", Value::Int(n - i - 1)},
          {"first", Value::Bool(i == 0)},  {"last", Value::Bool(i == n - 1)},
          {"length", Value::Int(n)},       {"depth", Value::Int(1)},
          {"depth0", Value::Int(0)}};
      if (i > 0) loop.emplace_back("previtem", items[i - 1]);
      if (i + 1 < n) loop.emplace_back("nextitem", items[i + 1]);
      iteration.Set("loop", Value::MakeDict(std::move(loop)));
      MOH_ASSIGN_OR_RETURN(const Flow flow,
                           Exec(node.bodies[0], iteration, out));
      if (flow == Flow::kBreak) break;
    }
    if (n == 0 && node.bodies.size() > 1) {
      return Exec(node.bodies[1], scope, out);
    }
    return Flow::kNormal;
  }

  // `targets = value`: one name, or several unpacked from a sequence.
  absl::Status Unpack(const std::vector<std::string>& targets,
                      const Value& value, int line, Scope& scope) {
    if (targets.size() == 1) {
      scope.Set(targets[0], value);
      return absl::OkStatus();
    }
    MOH_ASSIGN_OR_RETURN(const List items, AtLine(line, Iterate(value)));
    if (items.size() != targets.size()) {
      return ErrorAt(line, "cannot unpack ", items.size(), " values into ",
                     targets.size(), " names");
    }
    for (size_t i = 0; i < items.size(); ++i) scope.Set(targets[i], items[i]);
    return absl::OkStatus();
  }

  absl::Status Assign(const Node& node, const Value& value, Scope& scope) {
    if (node.attribute.empty()) {
      return Unpack(node.targets, value, node.line, scope);
    }
    const Value* ns = scope.Find(node.targets[0]);
    if (ns == nullptr || !ns->is(Kind::kNamespace)) {
      return ErrorAt(node.line, "cannot assign attribute on non-namespace '",
                     node.targets[0], "'");
    }
    if (HoldsNamespace(value)) {
      return ErrorAt(node.line, "a namespace cannot hold a namespace");
    }
    SetItem(&ns->MutableAttributes(), node.attribute, value);
    return absl::OkStatus();
  }

  // ------------------------------------------------------ expressions --

  absl::StatusOr<Value> Eval(const Expr& expr, const Scope& scope) {
    MOH_RETURN_IF_ERROR(Step(expr.line));
    switch (expr.kind) {
      case EK::kLiteral:
        return expr.value;
      case EK::kName:
        if (const Value* value = scope.Find(expr.name)) return *value;
        if (IsGlobalFunction(expr.name)) return Value::Function(expr.name);
        return Value::Undefined(absl::StrCat("'", expr.name, "' is undefined"));
      case EK::kList:
      case EK::kTuple:
      case EK::kDict:
        return EvalContainer(expr, scope);
      case EK::kAttribute: {
        MOH_ASSIGN_OR_RETURN(const Value object, Eval(*expr.args[0], scope));
        return AtLine(expr.line, GetAttribute(object, expr.name));
      }
      case EK::kItem: {
        MOH_ASSIGN_OR_RETURN(const Value object, Eval(*expr.args[0], scope));
        MOH_ASSIGN_OR_RETURN(const Value key, Eval(*expr.args[1], scope));
        return AtLine(expr.line, GetItem(object, key));
      }
      case EK::kSlice:
        return EvalSlice(expr, scope);
      case EK::kCall:
        return EvalCall(expr, scope);
      case EK::kFilter: {
        MOH_ASSIGN_OR_RETURN(const Value value, Eval(*expr.args[0], scope));
        MOH_ASSIGN_OR_RETURN(const CallArgs args, EvalArgs(expr, scope));
        return AtLine(expr.line, ApplyFilter(expr.name, value, args,
                                             limits_.max_output_bytes));
      }
      case EK::kTest: {
        MOH_ASSIGN_OR_RETURN(const Value value, Eval(*expr.args[0], scope));
        MOH_ASSIGN_OR_RETURN(const CallArgs args, EvalArgs(expr, scope));
        MOH_ASSIGN_OR_RETURN(
            const bool result,
            AtLine(expr.line, ApplyTest(expr.name, value, args)));
        return Value::Bool(result != expr.negated);
      }
      case EK::kUnary: {
        MOH_ASSIGN_OR_RETURN(const Value operand, Eval(*expr.args[0], scope));
        if (expr.name == "not") return Value::Bool(!operand.Truthy());
        return AtLine(expr.line, UnaryOperation(expr.name, operand));
      }
      case EK::kBinary:
        return EvalBinary(expr, scope);
      case EK::kCompare:
        return EvalCompare(expr, scope);
      case EK::kConditional: {
        MOH_ASSIGN_OR_RETURN(const Value condition, Eval(*expr.args[0], scope));
        if (condition.Truthy()) return Eval(*expr.args[1], scope);
        if (expr.args[2] != nullptr) return Eval(*expr.args[2], scope);
        return Value::Undefined(
            "the inline if-expression evaluated to false and has no else");
      }
    }
    return ErrorAt(expr.line, "unknown expression");
  }

  absl::StatusOr<CallArgs> EvalArgs(const Expr& expr, const Scope& scope,
                                    size_t first = 1) {
    CallArgs args;
    for (size_t i = first; i < expr.args.size(); ++i) {
      MOH_ASSIGN_OR_RETURN(Value value, Eval(*expr.args[i], scope));
      args.positional.push_back(std::move(value));
    }
    for (const auto& [name, arg] : expr.kwargs) {
      MOH_ASSIGN_OR_RETURN(Value value, Eval(*arg, scope));
      args.keyword.emplace_back(name, std::move(value));
    }
    return args;
  }

  absl::StatusOr<Value> EvalContainer(const Expr& expr, const Scope& scope) {
    MOH_ASSIGN_OR_RETURN(CallArgs items, EvalArgs(expr, scope, 0));
    Value result;
    if (expr.kind == EK::kList) {
      result = Value::MakeList(std::move(items.positional));
    } else if (expr.kind == EK::kTuple) {
      result = Value::MakeTuple(std::move(items.positional));
    } else {
      Dict dict;
      for (size_t i = 0; i + 1 < items.positional.size(); i += 2) {
        const Value& key = items.positional[i];
        if (!key.is(Kind::kString)) {
          return ErrorAt(expr.line, "dict keys must be strings, not '",
                         key.TypeName(), "'");
        }
        SetItem(&dict, key.AsString(), items.positional[i + 1]);
      }
      result = Value::MakeDict(std::move(dict));
    }
    if (result.depth() > kMaxValueDepth) {
      return ErrorAt(expr.line, "values nested more than ", kMaxValueDepth,
                     " levels deep");
    }
    return result;
  }

  absl::StatusOr<Value> EvalSlice(const Expr& expr, const Scope& scope) {
    MOH_ASSIGN_OR_RETURN(const Value object, Eval(*expr.args[0], scope));
    std::optional<int64_t> bounds[3];
    for (int i = 0; i < 3; ++i) {
      if (expr.args[i + 1] == nullptr) continue;
      MOH_ASSIGN_OR_RETURN(const Value bound, Eval(*expr.args[i + 1], scope));
      if (bound.is(Kind::kInt) || bound.is(Kind::kBool)) {
        bounds[i] = bound.AsInt();
      } else if (!bound.is(Kind::kNone)) {
        return ErrorAt(expr.line, "slice indices must be integers or none");
      }
    }
    return AtLine(expr.line, GetSlice(object, bounds[0], bounds[1], bounds[2]));
  }

  absl::StatusOr<Value> EvalCall(const Expr& expr, const Scope& scope) {
    const Expr& callee = *expr.args[0];
    if (callee.kind == EK::kAttribute) {  // A method: "x".strip(), d.items().
      MOH_ASSIGN_OR_RETURN(const Value object, Eval(*callee.args[0], scope));
      MOH_ASSIGN_OR_RETURN(const CallArgs args, EvalArgs(expr, scope));
      return AtLine(expr.line, CallMethod(object, callee.name, args,
                                          limits_.max_output_bytes));
    }
    MOH_ASSIGN_OR_RETURN(const Value function, Eval(callee, scope));
    MOH_ASSIGN_OR_RETURN(const CallArgs args, EvalArgs(expr, scope));
    if (function.is(Kind::kFunction)) {
      return AtLine(expr.line, CallGlobalFunction(function.AsString(), args));
    }
    if (function.is(Kind::kUndefined)) {
      return ErrorAt(expr.line, function.AsString());
    }
    return ErrorAt(expr.line, "'", function.TypeName(),
                   "' object is not callable");
  }

  absl::StatusOr<Value> EvalBinary(const Expr& expr, const Scope& scope) {
    MOH_ASSIGN_OR_RETURN(const Value left, Eval(*expr.args[0], scope));
    if (expr.name == "and" && !left.Truthy()) return left;
    if (expr.name == "or" && left.Truthy()) return left;
    MOH_ASSIGN_OR_RETURN(const Value right, Eval(*expr.args[1], scope));
    if (expr.name == "and" || expr.name == "or") return right;
    if (expr.name == "~") {
      std::string text;
      const bool ok = AppendStr(left, limits_.max_output_bytes, &text) &&
                      AppendStr(right, limits_.max_output_bytes, &text);
      MOH_RETURN_IF_ERROR(CheckOutput(expr.line, text, ok));
      return Value::String(std::move(text));
    }
    return AtLine(expr.line, BinaryOperation(expr.name, left, right,
                                             limits_.max_output_bytes));
  }

  absl::StatusOr<Value> EvalCompare(const Expr& expr, const Scope& scope) {
    MOH_ASSIGN_OR_RETURN(Value left, Eval(*expr.args[0], scope));
    for (size_t i = 0; i < expr.ops.size(); ++i) {
      MOH_ASSIGN_OR_RETURN(Value right, Eval(*expr.args[i + 1], scope));
      const std::string& op = expr.ops[i];
      bool result;
      if (op == "==" || op == "!=") {
        result = Equals(left, right) == (op == "==");
      } else if (op == "in" || op == "not in") {
        MOH_ASSIGN_OR_RETURN(const bool found,
                             AtLine(expr.line, Contains(right, left)));
        result = found == (op == "in");
      } else {
        for (const Value* v : {&left, &right}) {
          if (v->is(Kind::kUndefined)) return ErrorAt(expr.line, v->AsString());
        }
        MOH_ASSIGN_OR_RETURN(const int c,
                             AtLine(expr.line, Compare(left, right)));
        result = op == "<"    ? c < 0
                 : op == "<=" ? c <= 0
                 : op == ">"  ? c > 0
                              : c >= 0;
      }
      if (!result) return Value::Bool(false);
      left = std::move(right);
    }
    return Value::Bool(true);
  }

  const RenderLimits limits_;
  int64_t steps_ = 0;
};

}  // namespace

absl::StatusOr<std::string> Render(const Body& body, const Dict& globals,
                                   const RenderLimits& limits) {
  std::string out;
  const absl::Status status = Renderer(limits).Run(body, globals, &out);
  if (absl::IsAborted(status)) {  // raise_exception(msg)
    return absl::InvalidArgumentError(status.message());
  }
  if (!status.ok()) return status;
  return out;
}

}  // namespace jinja
}  // namespace moh
