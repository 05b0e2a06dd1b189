// The language family's steps under the engine loop (engine_loop.h): the
// StepExecutor that turns each plan into one LlamaModel::Forward over the
// planned rows (decode rows and prompt chunks), samples, and streams each
// sequence's new text to its observer. LanguageExecutor (language_executor.h)
// validates and submits; this file runs. Loop thread only.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/time/time.h"
#include "model/core/activation.h"
#include "model/generation/generator.h"
#include "model/generation/language_model.h"
#include "service/engine/callback_thread.h"
#include "service/engine/engine_loop.h"
#include "service/language/language_executor.h"
#include "service/metrics/metrics.h"
#include "service/servable/servable_types.h"

namespace moh {

// One Generate sample inside the loop. Owned by the loop thread.
struct Sequence {
  GenerationJob job;
  Activation activation;  // resolved at Submit; lowered at admission
  // The ratio ceiling: its nominal activation reads no routed head (routed K
  // 0 in every layer) and the model has a narrow KV width, so its KV is
  // stored narrow (LlamaModel::narrow_kv_heads). Fixed at Submit: lowering
  // never widens it, and a wide request lowered to K = 0 stays wide.
  bool narrow = false;
  std::shared_ptr<GenerationObserver> observer;
  absl::Time submit_time;
  std::optional<SequenceOutput> output;  // sampling, stop strings, text
  int64_t processed = 0;                 // tokens run through the model
  std::vector<int64_t> head_tokens;      // [L * H]
  absl::Time last_token_time;
  // With job.sampling.prompt_logprobs: entries computed so far, delivered
  // with the first chunk.
  std::vector<LogprobEntry> prompt_logprobs;
};

// The steps of one model's sequences over a paged KV cache of `kv_blocks`
// blocks of `kv_block_size` positions (allocated here: throws when it does
// not fit). `lm` and `callbacks` outlive it; `metrics` may be null.
std::unique_ptr<StepExecutor<Sequence>> NewLanguageSteps(
    const LanguageModel& lm, int32_t kv_blocks, int32_t kv_block_size,
    ModelMetrics* metrics, CallbackThread* callbacks);

}  // namespace moh
