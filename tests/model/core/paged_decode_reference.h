// The paged decode kernel's check (model/kernels/cuda_paged_decode.cu), for
// gpu_model_test.cc (on CUDA, through PagedDecode) and
// cuda_kernels_emulated_test.cc (the same kernel run on the CPU).
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "model/core/dense_attention.h"
#include "model/core/paged_decode_attention.h"
#include "model/kernels/cuda_paged_decode.h"

namespace moh {

// Heads, KV heads and head dim of the queries, KV heads of the cache (the
// kernel reads the view of its first kv_heads), the type, the tolerance
// relative to the largest output.
struct PagedCase {
  int64_t heads, kv_heads, head_dim, cache_kv_heads;
  at::ScalarType type;
  double tolerance;
};

// The kernel (`run`: PagedDecode on CUDA, or its emulation on the CPU, with
// inputs on `device`) against DenseAttention on the CPU, on fresh random
// inputs: rows of 1 to 700 keys (up to 22 splits), blocks two rows share,
// a row whose position is below its length, a KV-head view of a wider
// cache; with a work list leaving (row, KV group) pairs out; and each row
// alone. The batch runs at each of `batch_splits` keys a thread block (0:
// the kernel's choice), the rest at `split_keys` (the emulation takes
// fewer thread blocks than the GPU: each is seconds on the CPU).
inline void CheckPagedDecode(
    const PagedCase& c,
    const std::function<at::Tensor(const PagedDecodeInputs&)>& run,
    const at::Device& device,
    const std::vector<int>& batch_splits = {0, kPagedDecodeSplit},
    int split_keys = 0) {
  constexpr int64_t kBlock = 16, kBlocks = 160;
  const std::vector<int64_t> lengths = {1, 17, 300, 700, 513, 256};
  const int64_t rows = static_cast<int64_t>(lengths.size());
  at::manual_seed(c.heads * 131 + c.head_dim);
  const at::Tensor full_keys =
      at::randn({kBlocks, kBlock, c.cache_kv_heads, c.head_dim}).to(c.type);
  const at::Tensor full_values = at::randn_like(full_keys);
  const at::Tensor keys = full_keys.narrow(2, 0, c.kv_heads);
  const at::Tensor values = full_values.narrow(2, 0, c.kv_heads);
  // Each row's blocks from a shuffled pool; row 4 starts with row 3's first
  // 16 blocks (a shared prefix).
  const at::Tensor pool = at::randperm(kBlocks, at::kLong);
  const int64_t per_row = 700 / kBlock + 1;
  at::Tensor table = at::zeros({rows, per_row}, at::kLong);
  int64_t next = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < per_row; ++b) {
      table[r][b] = (r == 4 && b < 16) ? table[3][b].item<int64_t>()
                                       : pool[next++ % kBlocks].item<int64_t>();
    }
  }
  at::Tensor row_len = at::tensor(lengths, at::kLong);
  at::Tensor positions = row_len - 1;
  positions[2] = 297;  // reads 298 of its 300 keys
  const at::Tensor queries = at::randn({rows, c.heads, c.head_dim}).to(c.type);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));

  DenseAttentionInputs dense;
  dense.queries = queries.to(at::kFloat).unsqueeze(1);
  dense.key_cache = keys.to(at::kFloat);
  dense.value_cache = values.to(at::kFloat);
  dense.block_table = table;
  dense.positions = positions.unsqueeze(1);
  dense.row_len = row_len;
  dense.kv_len = 700;
  dense.scale = scale;
  const at::Tensor expected = DenseAttention(dense).squeeze(1);

  const PagedDecodeInputs paged{queries.to(device),
                                keys.to(device),
                                values.to(device),
                                table.to(device),
                                positions.to(device),
                                row_len.to(device),
                                700,
                                scale};
  const double bound = c.tolerance * expected.abs().max().item<double>();
  // The kernel's choice for these 6 rows is 32 or 64 keys a thread block;
  // a large batch's 256.
  for (const int keys : batch_splits) {
    PagedDecodeInputs split = paged;
    split.split_keys = keys;
    const at::Tensor got = run(split).to(at::kFloat).cpu();
    ASSERT_EQ(got.sizes(), expected.sizes());
    ASSERT_FALSE(at::isnan(got).any().item<bool>()) << keys;
    EXPECT_LE((got - expected).abs().max().item<double>(), bound) << keys;
  }
  // MoH's gates: each head's output times its gate, exactly 0 where the
  // gate is (a whole row's groups, -0, a head at 0 in a group that stays).
  // That the groups whose gates are all 0 read no key (the work list) does
  // not show in the outputs.
  {
    const int64_t group = c.heads / c.kv_heads;
    const at::Tensor group_on = at::rand({rows, c.kv_heads}) < 0.6;
    group_on[0].fill_(false);  // a row with no group at all
    group_on[1].fill_(true);
    const at::Tensor head_on = group_on.repeat_interleave(group, 1);
    at::Tensor gates = (at::rand({rows, c.heads}) + 0.5) * head_on;
    gates[1][0] = 0.0f;  // one head of an attended group
    gates[2].masked_fill_(head_on[2].logical_not(), -0.0);
    gates = gates.to(c.type);
    PagedDecodeInputs gated = paged;
    gated.gates = gates.to(device);
    gated.split_keys = split_keys;
    const at::Tensor out = run(gated).to(at::kFloat).cpu();
    ASSERT_FALSE(at::isnan(out).any().item<bool>());
    const at::Tensor want = expected * gates.to(at::kFloat).unsqueeze(-1);
    EXPECT_LE((out - want).abs().max().item<double>(), 2 * bound);
    const at::Tensor zero = gates.to(at::kFloat).eq(0).unsqueeze(-1);
    EXPECT_EQ(out.masked_select(zero).abs().max().item<float>(), 0.0f);
  }
  // One row at a time agrees too (no row reads another's keys).
  for (int64_t r = 0; r < rows; ++r) {
    PagedDecodeInputs one = paged;
    one.split_keys = split_keys;
    one.queries = paged.queries.narrow(0, r, 1);
    one.block_table = paged.block_table.narrow(0, r, 1);
    one.positions = paged.positions.narrow(0, r, 1);
    one.row_len = paged.row_len.narrow(0, r, 1);
    const at::Tensor alone = run(one).to(at::kFloat).cpu();
    EXPECT_LE((alone - expected.narrow(0, r, 1)).abs().max().item<double>(),
              bound)
        << "row " << r;
  }
}

}  // namespace moh
