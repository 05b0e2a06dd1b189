// moh-server configuration: the text-format file (proto/moh/v1/
// server_config.proto), its defaults, and its validation.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "moh/v1/server_config.pb.h"

namespace moh {

// Parses a text-format ServerConfig. INVALID_ARGUMENT naming the file and the
// parser's complaint (line and column); NOT_FOUND if it cannot be read.
absl::StatusOr<v1::ServerConfig> ReadServerConfigFile(const std::string& path);

// Fills every unset field with its documented default and checks every range;
// INVALID_ARGUMENT naming the field path (e.g.
// "models[1].batching.max_batch_size must be in [1, 4096], got 0").
absl::Status ResolveServerConfig(v1::ServerConfig* config);

// The shipped demo models under `demo_dir` (the repository's models/, see
// training/README.md): "demo-lm" (a MoH-LLaMA, `demo_dir`/demo-lm) and
// "demo-vit" (a MoH-ViT digit classifier, `demo_dir`/demo-vit).
v1::ServerConfig DemoServerConfig(const std::string& demo_dir);

}  // namespace moh
