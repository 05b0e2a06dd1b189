#include "base/field_error.h"

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace moh {
namespace {

constexpr char kFieldPayload[] = "type.moh-serve.dev/field";

}  // namespace

absl::Status FieldError(absl::string_view field, absl::string_view what) {
  absl::Status status =
      absl::InvalidArgumentError(absl::StrCat(field, " ", what));
  status.SetPayload(kFieldPayload, absl::Cord(field));
  return status;
}

std::optional<std::string> ErrorField(const absl::Status& status) {
  const auto field = status.GetPayload(kFieldPayload);  // absl::optional
  if (!field.has_value()) return std::nullopt;
  return std::string(*field);
}

std::string MessageNaming(
    const absl::Status& status,
    const std::function<std::string(absl::string_view field)>& rename) {
  const std::optional<std::string> field = ErrorField(status);
  const absl::string_view message = status.message();
  // The field opens the message FieldError made.
  if (!field.has_value() || !absl::StartsWith(message, *field)) {
    return std::string(message);
  }
  return absl::StrCat(rename(*field), message.substr(field->size()));
}

}  // namespace moh
