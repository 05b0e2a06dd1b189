// The parsed form of a chat template (model/tokenizer/chat_template.h):
// statements (Node) holding expressions (Expr). Built by parser.h, run
// by renderer.h. Not part of the public API.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/tokenizer/jinja/value.h"

namespace moh {
namespace jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,      // value
    kName,         // name
    kList,         // [args...]
    kTuple,        // (args...), or args separated by commas
    kDict,         // {args[0]: args[1], args[2]: args[3], ...}
    kAttribute,    // args[0].name
    kItem,         // args[0][args[1]]
    kSlice,        // args[0][args[1]:args[2]:args[3]], absent parts null
    kCall,         // args[0](args[1...], kwargs)
    kFilter,       // args[0] | name(args[1...], kwargs)
    kTest,         // args[0] is [not] name(args[1...]); `negated`
    kUnary,        // name ("-", "+", "not") args[0]
    kBinary,       // args[0] name args[1]: + - * / // % ** ~ and or
    kCompare,      // args[0] ops[0] args[1] ops[1] args[2] ... (chained)
    kConditional,  // args[1] if args[0] else args[2] (args[2] may be null)
  };

  Kind kind;
  int line = 0;
  Value value;
  std::string name;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;  // ==, !=, <, <=, >, >=, in, not in
  bool negated = false;
};

struct Node;
using Body = std::vector<std::unique_ptr<Node>>;

struct Node {
  enum class Kind {
    kText,      // text
    kOutput,    // {{ expr }}
    kIf,        // conditions[i] guards bodies[i]; an extra last body: else
    kFor,       // for targets in expr [if filter]: bodies[0] [else bodies[1]]
    kSet,       // set targets = expr, or set targets[0].attribute = expr
    kSetBlock,  // set targets[0] %}bodies[0]{% endset
    kBreak,
    kContinue,
  };

  Kind kind;
  int line = 0;
  std::string text;
  ExprPtr expr;
  std::vector<ExprPtr> conditions;
  std::vector<Body> bodies;
  std::vector<std::string> targets;
  std::string attribute;
  ExprPtr filter;
};

}  // namespace jinja
}  // namespace moh
