// OpenAI's `response_format` (structured outputs) on POST /v1/completions and
// /v1/chat/completions, as vLLM takes it on both: absent, null or
// {"type": "text"} (free text), {"type": "json_object"}, or
// {"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
// "strict": ...}}. Only the reading of the field: the schema is compiled and
// checked (size, depth, satisfiable) by the servable (model/generation/
// grammar.h), whose errors name response_format.json_schema.schema.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json_fwd.hpp"
#include "service/servable/servable_types.h"

namespace moh {
namespace openai {

// Reads `body`'s response_format (a JSON object's field) into
// call->response_format; `raw_body` is the text `body` was parsed from, read
// again for a schema so that its properties keep the client's order (the
// order the output writes them in). INVALID_ARGUMENT naming the field
// ("response_format.type", "response_format.json_schema.schema", ...) when
// it is not one of the forms above.
absl::Status ReadResponseFormat(const nlohmann::json& body,
                                absl::string_view raw_body, GenerateCall* call);

}  // namespace openai
}  // namespace moh
