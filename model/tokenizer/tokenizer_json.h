// Internals of the tokenizer.json loader (model/tokenizer/tokenizer_loader.cc):
// reading JSON members with errors that name the field, as INVALID_ARGUMENT
// "<field>: <what>" (e.g. "pre_tokenizer.pretokenizers[1].pattern: ...").
// Not part of the public API.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/tokenizer/tokenizer_pipeline.h"

namespace moh {
namespace tokenizer_internal {

using json = nlohmann::json;

// Ids are stored in dense tables; this bounds them against corrupt files.
inline constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;
// Ids below the largest that no token may leave unused: the tables' size
// stays proportional to the file's (a 200-byte file with an id of 16
// million allocated 16 million strings, found by fuzzing). Real files
// number their tokens without gaps.
inline constexpr int64_t kMaxUnusedTokenIds = int64_t{1} << 16;

// "<where>.<key>", or `key` at the top level (`where` empty).
std::string Field(absl::string_view where, absl::string_view key);
// INVALID_ARGUMENT `field: unsupported value "value"`.
absl::Status Unsupported(absl::string_view field, absl::string_view value);
// INVALID_ARGUMENT `field: what`.
absl::Status Invalid(absl::string_view field, absl::string_view what);

// `value` for messages: a scalar as JSON, an array or object by its kind only
// (dump() recurses: a deeply nested value would overflow the stack).
std::string Describe(const json& value);

// Member `key` of `obj`; nullptr when absent or null.
const json* Get(const json& obj, const char* key);
// Member `key`, `dflt` when absent; an error when not a boolean.
absl::StatusOr<bool> GetBool(const json& obj, const char* key, bool dflt,
                             absl::string_view where);
// Member `key`; an error when absent or not an integer.
absl::StatusOr<int64_t> GetInt(const json& obj, const char* key,
                               absl::string_view where);
// Member `key`; an error when absent or not a string.
absl::StatusOr<std::string> GetString(const json& obj, const char* key,
                                      absl::string_view where);
// Member `key`, a string of exactly one UTF-8 character.
absl::StatusOr<std::string> GetChar(const json& obj, const char* key,
                                    absl::string_view where);
// A Split/Replace "pattern": {"String": s} into `literal`, or {"Regex": r}
// into `regex` (refused when `regex` is null).
absl::Status GetPattern(const json& obj, absl::string_view where,
                        std::string* literal, std::string* regex);
// `id` as an int32_t in [0, kMaxTokenId]; an error naming `field` otherwise.
absl::StatusOr<int32_t> CheckId(int64_t id, absl::string_view field);
// Calls `load(element, where)` for each element of the array `obj[key]`.
absl::Status ForEach(
    const json& obj, const char* key, const std::string& where,
    const std::function<absl::Status(const json&, const std::string&)>& load);
// Regex::Compile, its error naming `field`.
absl::StatusOr<std::unique_ptr<Regex>> CompileAt(absl::string_view pattern,
                                                 absl::string_view field);

}  // namespace tokenizer_internal
}  // namespace moh
