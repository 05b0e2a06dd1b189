// A ragged step of prompt chunks over a paged cache, for
// varlen_attention_test (the packed layout, on the CPU) and gpu_model_test
// (VarlenAttention on CUDA): rows at different lengths and starts, a block
// two rows read, and DenseAttention's result for the same step (the padded
// rows, positions and mask the model used before) as the reference.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "model/core/dense_attention.h"
#include "model/core/varlen_attention.h"

namespace moh::varlen_reference {

struct RaggedStep {
  std::vector<int32_t> num_tokens, start_positions;
  std::vector<std::vector<int32_t>> block_tables;
  int64_t block_size = 4, heads = 0, d = 0;
  at::Tensor key_cache, value_cache;  // [blocks, block_size, KV, D]
  at::Tensor queries;                 // [N, H, D]: row 0's, then row 1's, ...
  double scale = 1.0;
};

// Three rows: a 7-token prompt from 0; a 3-token chunk after 6 cached
// positions whose first block is row 0's (a shared prefix); a lone token
// after 9. H heads over KV heads of head_dim D, random, in `options`.
inline RaggedStep MakeRaggedStep(int64_t heads, int64_t kv_heads, int64_t d,
                                 const at::TensorOptions& options) {
  RaggedStep s;
  s.num_tokens = {7, 3, 1};
  s.start_positions = {0, 6, 9};
  s.block_tables = {{5, 2}, {5, 7, 0}, {3, 1, 8}};
  s.heads = heads;
  s.d = d;
  s.key_cache = at::randn({10, s.block_size, kv_heads, d}, options);
  s.value_cache = at::randn({10, s.block_size, kv_heads, d}, options);
  s.queries = at::randn({7 + 3 + 1, heads, d}, options);
  s.scale = 1.0 / std::sqrt(static_cast<double>(d));
  return s;
}

// DenseAttention over the step's padded rows, back in the ragged order:
// [N, H, D].
inline at::Tensor DenseReference(const RaggedStep& s) {
  const int64_t rows = static_cast<int64_t>(s.num_tokens.size());
  const int64_t width =
      *std::max_element(s.num_tokens.begin(), s.num_tokens.end());
  const at::TensorOptions ints =
      at::TensorOptions().dtype(at::kLong).device(s.queries.device());
  at::Tensor queries =
      at::zeros({rows, width, s.heads, s.d}, s.queries.options());
  at::Tensor positions = at::zeros({rows, width}, ints);
  at::Tensor row_len = at::zeros({rows}, ints);
  at::Tensor table = at::zeros({rows, 3}, ints);
  int64_t kv_len = 0, token = 0;
  std::vector<at::Tensor> valid;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = s.num_tokens[r], start = s.start_positions[r];
    queries[r].narrow(0, 0, t).copy_(s.queries.narrow(0, token, t));
    for (int64_t i = 0; i < width; ++i) {
      positions[r][i] = start + std::min(i, t - 1);  // padding repeats
    }
    row_len[r] = start + t;
    for (size_t b = 0; b < s.block_tables[r].size(); ++b) {
      table[r][b] = s.block_tables[r][b];
    }
    kv_len = std::max(kv_len, start + t);
    token += t;
  }
  DenseAttentionInputs in;
  in.queries = queries;
  in.key_cache = s.key_cache;
  in.value_cache = s.value_cache;
  in.block_table = table;
  in.positions = positions;
  in.row_len = row_len;
  in.kv_len = kv_len;
  in.scale = s.scale;
  const at::Tensor out = DenseAttention(in);
  for (int64_t r = 0; r < rows; ++r) {
    valid.push_back(out[r].narrow(0, 0, s.num_tokens[r]));
  }
  return at::cat(valid);
}

inline PackedKeyLayout Layout(const RaggedStep& s) {
  return PackKeyLayout(s.num_tokens, s.start_positions, s.block_tables, {},
                       s.block_size);
}

}  // namespace moh::varlen_reference
