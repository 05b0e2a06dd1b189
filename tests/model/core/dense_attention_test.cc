// Dense attention with a bounded workspace: chunking the queries never
// changes the result, and one chunk's scores and mask stay under the budget.
#include "model/core/dense_attention.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "model/core/llama_model.h"
#include "tests/base/test_paths.h"
#include "tests/model/core/llama_test_util.h"

namespace moh {
namespace {

const std::string kFixtures = test_paths::FixturesDir();

int64_t ChunkWorkspace(int64_t rows, int64_t heads, int64_t chunk,
                       int64_t kv_len) {
  return rows * chunk * kv_len * (heads * 4 + 1);
}

TEST(DenseAttentionQueryChunkTest, LargestChunkUnderTheBudget) {
  // 64 rows, 32 heads, a 2048-token prompt chunk over 2048 keys (the 8B
  // case): unchunked it would take 64*32*2048*2048*4 bytes = 32 GiB.
  const int64_t budget = int64_t{256} << 20;
  const int64_t chunk = DenseAttentionQueryChunk(64, 32, 2048, 2048, budget);
  EXPECT_GE(chunk, 1);
  EXPECT_LE(ChunkWorkspace(64, 32, chunk, 2048), budget);
  EXPECT_GT(ChunkWorkspace(64, 32, chunk + 1, 2048), budget);
  // Small steps take one chunk; a budget below one query gives chunks of 1.
  EXPECT_EQ(DenseAttentionQueryChunk(2, 4, 16, 32, budget), 16);
  EXPECT_EQ(DenseAttentionQueryChunk(2, 4, 16, 32, 1), 1);
}

// softmax(q k^T * scale + mask) v with every tensor materialized.
at::Tensor Reference(const DenseAttentionInputs& in) {
  const int64_t rows = in.queries.size(0), width = in.queries.size(1);
  const int64_t heads = in.queries.size(2), d = in.queries.size(3);
  const int64_t group = heads / in.key_cache.size(2);
  at::Tensor keys = in.key_cache.narrow(1, 0, in.kv_len)
                        .index_select(0, in.block_table.select(1, 0))
                        .repeat_interleave(group, 2);  // [B, L, H, D]
  at::Tensor values = in.value_cache.narrow(1, 0, in.kv_len)
                          .index_select(0, in.block_table.select(1, 0))
                          .repeat_interleave(group, 2);
  at::Tensor scores =
      at::einsum("bthd,blhd->bhtl", {in.queries, keys}) * in.scale;
  at::Tensor j = at::arange(in.kv_len).view({1, 1, 1, in.kv_len});
  at::Tensor visible = (j <= in.positions.view({rows, 1, width, 1})) &
                       (j < in.row_len.view({rows, 1, 1, 1}));
  scores.masked_fill_(visible.logical_not(),
                      -std::numeric_limits<float>::infinity());
  return at::einsum("bhtl,blhd->bthd", {at::softmax(scores, -1), values})
      .view({rows, width, heads, d});
}

TEST(DenseAttentionTest, ChunkedEqualsOneSoftmax) {
  at::manual_seed(7);
  DenseAttentionInputs in;
  const int64_t rows = 3, width = 9, heads = 4, kv_heads = 2, d = 8;
  in.queries = at::randn({rows, width, heads, d});
  in.key_cache = at::randn({4, 24, kv_heads, d});
  in.value_cache = at::randn({4, 24, kv_heads, d});
  in.block_table = at::tensor(std::vector<int64_t>{2, 0, 3}).view({3, 1});
  // Row 0: a 9-token prompt; row 1: decoding at 14 (padded); row 2: 4
  // tokens continuing at 5 (padding repeats its last position).
  std::vector<int64_t> pos;
  for (int64_t t = 0; t < width; ++t) pos.push_back(t);
  for (int64_t t = 0; t < width; ++t) pos.push_back(14);
  for (int64_t t = 0; t < width; ++t)
    pos.push_back(5 + std::min<int64_t>(t, 3));
  in.positions = at::tensor(pos).view({rows, width});
  in.row_len = at::tensor(std::vector<int64_t>{9, 15, 9});
  in.kv_len = 15;
  in.scale = 0.35;
  const at::Tensor expected = Reference(in);
  for (int64_t budget : {int64_t{1} << 30, int64_t{2000}, int64_t{1}}) {
    in.workspace_bytes = budget;
    const at::Tensor got = DenseAttention(in);
    ASSERT_EQ(got.sizes(), expected.sizes());
    EXPECT_LE((got - expected).abs().max().item<double>(), 1e-5)
        << "workspace " << budget;
  }
}

// One query per row (decode: the mask broadcasts over each KV group), with
// the mask made here or passed in as a step keeps it for its layers.
TEST(DenseAttentionTest, DecodeRowsWithAndWithoutAKeptMask) {
  at::manual_seed(8);
  DenseAttentionInputs in;
  const int64_t rows = 3, heads = 6, kv_heads = 2, d = 8;
  in.queries = at::randn({rows, 1, heads, d});
  in.key_cache = at::randn({4, 40, kv_heads, d});
  in.value_cache = at::randn({4, 40, kv_heads, d});
  in.block_table = at::tensor(std::vector<int64_t>{1, 3, 0}).view({3, 1});
  in.positions = at::tensor(std::vector<int64_t>{4, 30, 17}).view({rows, 1});
  in.row_len = at::tensor(std::vector<int64_t>{5, 31, 18});
  in.kv_len = 32;  // beyond the longest row (31), as a recorded step reads
  in.scale = 0.3;
  const at::Tensor expected = Reference(in);
  for (bool kept : {false, true}) {
    if (kept) in.visible = DenseVisible(in.positions, in.row_len, in.kv_len);
    const at::Tensor got = DenseAttention(in);
    ASSERT_EQ(got.sizes(), expected.sizes());
    EXPECT_FALSE(at::isnan(got).any().item<bool>());
    EXPECT_LE((got - expected).abs().max().item<double>(), 1e-5)
        << (kept ? "kept mask" : "own mask");
  }
}

// Through the model: a 150-token prompt in chunks beside a decoding row gives
// the same logits with a 4 KiB workspace (one query a chunk) as with the
// default one.
TEST(DenseAttentionTest, ModelOutputDoesNotDependOnTheWorkspace) {
  auto model = LlamaModel::Load(kFixtures + "/llama_learned",
                                DeviceOptions{"cpu", "float32"});
  ASSERT_TRUE(model.ok()) << model.status();
  (*model)->set_attention_mode(AttentionMode::kDense);
  std::vector<at::Tensor> logits[2];
  for (int run = 0; run < 2; ++run) {
    (*model)->set_attention_workspace_bytes(
        run == 0 ? kDefaultAttentionWorkspaceBytes : 4096);
    auto out = ChunkedPromptBesideDecode(**model, {0.5f, 1.0f});
    ASSERT_TRUE(out.ok()) << out.status();
    logits[run] = *out;
  }
  for (size_t i = 0; i < logits[0].size(); ++i) {
    const double scale = std::max(1.0, logits[0][i].abs().max().item<double>());
    EXPECT_LE((logits[0][i] - logits[1][i]).abs().max().item<double>(),
              1e-4 * scale)
        << "chunk " << i;
  }
}

}  // namespace
}  // namespace moh
