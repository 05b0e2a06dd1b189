// The step's indices of LlamaModel::Forward (llama_model.cc), shared with
// its graph path (llama_model_graphs.cc).
#pragma once

#include <cstdint>
#include <vector>

#include "model/core/llama_model.h"

namespace moh {

// The step's indices. Every per-step index is computed on the host and
// uploaded in one pinned, non-blocking copy: nothing here waits for the
// device. Layout of `host`:
// positions [B*T] | row_len [B] | block table [B*n] | per token: row,
// position, padded index, cache block, cache offset [5*N] | routed K per
// layer and token [L*N] | the tokens whose logits are returned [B*tail] |
// with narrow rows: those rows [Bn], their tokens [Nn], the others' [Nw].
struct LlamaModel::StepIndices {
  std::vector<int64_t> host;
  int64_t table_width = 1;
  int64_t kv_len = 0;  // the longest row's positions after the step
  std::vector<int64_t> max_top_k, min_top_k;  // per layer, over the rows
  std::vector<uint8_t> is_narrow;             // [B]; empty: no narrow row
  int64_t narrow_rows = 0, narrow_tokens = 0;
  int64_t tokens = 0;  // N: the step's valid tokens

  // `graph`: a decode step to be recorded (GraphEligible) reads
  // GraphKvLen(kv_len) keys, at most a slot's `block_size`, and its block
  // tables are that wide.
  StepIndices(const DecoderBatch& batch, const MohConfig& moh,
              int64_t block_size, int64_t fold, int64_t num_layers, int64_t n,
              int64_t tail, bool graph);
};

}  // namespace moh
