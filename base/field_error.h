// Errors about one request field. The field travels with the status (a
// payload), by its name in the gRPC API ("sampling.top_p",
// "activation.ratio"); each front door renders it its own way (the
// OpenAI-compatible API: "top_p", "activation_ratio", and OpenAI's `param`),
// without rewriting message text that may hold a client's own words.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace moh {

// INVALID_ARGUMENT "<field> <what>", e.g. FieldError("sampling.top_p",
// "must be in (0, 1], got 0").
absl::Status FieldError(absl::string_view field, absl::string_view what);

// The field `status` is about (its gRPC name), if FieldError made it.
std::optional<std::string> ErrorField(const absl::Status& status);

// `status`'s message with its field named by `rename` (the message as it is
// when it names no field).
std::string MessageNaming(
    const absl::Status& status,
    const std::function<std::string(absl::string_view field)>& rename);

}  // namespace moh
