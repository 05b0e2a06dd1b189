// Runs a parsed chat template (ast.h) with jinja2's semantics:
// per-iteration loop scopes, namespace() as the one mutable value, the
// default Undefined. Not part of the public API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "model/tokenizer/jinja/ast.h"
#include "model/tokenizer/jinja/value.h"

namespace moh {
namespace jinja {

struct RenderLimits {
  // Output, and any string built on the way, is at most this long.
  size_t max_output_bytes = 1 << 20;
  // Expression evaluations, statements and loop iterations together.
  int64_t max_steps = 1000000;
};

// The text `body` renders to with `globals` defined. raise_exception(msg):
// INVALID_ARGUMENT `msg`; any other runtime error (unknown filter, bad
// types, undefined used as a value, a limit reached): INVALID_ARGUMENT
// "chat template line L: <what>".
absl::StatusOr<std::string> Render(const Body& body, const Dict& globals,
                                   const RenderLimits& limits);

}  // namespace jinja
}  // namespace moh
