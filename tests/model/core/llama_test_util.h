// Scenarios shared by the LLaMA model tests.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "absl/status/statusor.h"
#include "model/core/llama_model.h"

namespace moh {

// A 150-token prompt prefilled in chunks of 50 (row 0, ratio ratios[0]) beside
// a row that decodes one token a step after a 3-token prompt (row 1,
// ratios[1]), in a fresh cache: the valid logits of each of the 3 steps,
// row 0's then row 1's. Seeded: the same tokens on every call.
inline absl::StatusOr<std::vector<at::Tensor>> ChunkedPromptBesideDecode(
    const LlamaModel& model, const std::vector<float>& ratios) {
  at::manual_seed(11);
  const at::Tensor prompt = at::randint(300, {2, 150}, at::kLong);
  KvCache cache = model.CreateKvCache(2, 160);
  std::vector<int32_t> start = {0, 0};
  std::vector<at::Tensor> logits;
  for (int chunk = 0; chunk < 3; ++chunk) {
    DecoderBatch batch;
    batch.all_logits = true;
    const int32_t row1 = chunk == 0 ? 3 : 1;
    batch.token_ids = prompt.narrow(1, chunk * 50, 50).clone();
    batch.num_tokens = {50, row1};
    batch.slots = {1, 0};
    batch.start_positions = start;
    batch.ratios = ratios;
    auto out = model.Forward(batch, cache);
    if (!out.ok()) return out.status();
    logits.push_back(
        at::cat({out->logits[0], out->logits[1].narrow(0, 0, row1)}));
    start[0] += 50;
    start[1] += row1;
  }
  return logits;
}

}  // namespace moh
