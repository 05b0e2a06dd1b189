// Reading the JSON bodies of the HTTP API's requests (OpenAI's endpoints,
// Anthropic's Messages, the tokenizer's): every value is read by its type, so
// a wrong one is the client's INVALID_ARGUMENT naming the field and the
// values it takes, never an exception; a field the endpoint does not know is
// refused by name. Field names are the endpoint's own (FieldError keeps them).
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace moh {
namespace json_body {

// `body` as a JSON object whose every field is one of `known`: else
// INVALID_ARGUMENT (not JSON, not an object, or "\"x\" is not a field of this
// endpoint (fields: ...)", about no one field).
absl::StatusOr<nlohmann::json> ReadObject(absl::string_view body,
                                          const std::set<std::string>& known);

// Reads an object's fields; a null value counts as absent (clients send null
// for "default").
class Fields {
 public:
  explicit Fields(const nlohmann::json& object) : object_(object) {}

  // The value of `name`, or null when it is absent or null.
  const nlohmann::json* Get(const std::string& name) const;
  // A number in [lo, hi] ((lo, hi] when `lo_open`).
  absl::StatusOr<std::optional<double>> Number(const std::string& name,
                                               double lo, double hi,
                                               bool lo_open = false) const;
  // An integer in [lo, hi].
  absl::StatusOr<std::optional<int64_t>> Integer(const std::string& name,
                                                 int64_t lo, int64_t hi) const;
  absl::StatusOr<bool> Bool(const std::string& name, bool fallback) const;
  // Empty when absent.
  absl::StatusOr<std::string> String(const std::string& name) const;

 private:
  const nlohmann::json& object_;
};

// moh-serve's own fields of every generating endpoint: the activation
// (SPEC §2), each in [0, 1].
inline constexpr const char* kActivationFields[] = {"activation_ratio",
                                                    "min_activation_ratio"};
// Reads them: `ratio` and `min_ratio`, 0 (the model's default, no floor) when
// absent. The ranges against the model are checked when it accepts the call.
absl::Status ReadActivation(const Fields& f, float* ratio, float* min_ratio);

// The request's error for a JSON library exception that escaped a read (one
// that did not check its value's type): INVALID_ARGUMENT, not the server's.
absl::Status TypeError(const std::exception& e);

}  // namespace json_body
}  // namespace moh
