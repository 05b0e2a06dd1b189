// The packed layout of prompt chunks (varlen_attention.h) on the CPU: where
// each row's keys lie, and that attention over them with FlashAttention's
// bottom-right causal rule (written out here) is the model's dense
// attention over padded rows with their positions' mask. VarlenAttention
// itself runs on CUDA only (gpu_model_test).
#include "model/core/varlen_attention.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

#include "tests/model/core/varlen_attention_reference.h"

namespace moh {
namespace {

using namespace varlen_reference;

TEST(PackKeyLayoutTest, RowsKeysInTurnThroughTheirBlocks) {
  const RaggedStep s = MakeRaggedStep(4, 2, 8, at::kFloat);
  const PackedKeyLayout layout = Layout(s);
  // Blocks of 4: row 0 (7 keys) in 5, 2; row 1 (9) in 5 (shared), 7, 0;
  // row 2 (10) in 3, 1, 8.
  const std::vector<int64_t> index = {20, 21, 22, 23, 8,  9,  10,  // row 0
                                      20, 21, 22, 23, 28, 29, 30, 31, 0, 12,
                                      13, 14, 15, 4,  5,  6,  7,  32, 33};
  EXPECT_EQ(layout.index, index);
  EXPECT_EQ(layout.cum_q, (std::vector<int32_t>{0, 7, 10, 11}));
  EXPECT_EQ(layout.cum_k, (std::vector<int32_t>{0, 7, 16, 26}));
  EXPECT_EQ(layout.max_q, 7);
  EXPECT_EQ(layout.max_k, 10);
}

TEST(PackKeyLayoutTest, SlotsHoldWholeSequences) {
  const PackedKeyLayout layout = PackKeyLayout({2, 1}, {1, 0}, {}, {3, 0}, 16);
  EXPECT_EQ(layout.index, (std::vector<int64_t>{48, 49, 50, 0}));
  EXPECT_EQ(layout.cum_k, (std::vector<int32_t>{0, 3, 4}));
  EXPECT_EQ(layout.max_k, 3);
}

// FlashAttention's varlen rule written out: row r's queries [t, H, D] over
// its packed keys [L, KV, D], query i seeing keys j <= L - t + i.
at::Tensor BottomRightCausal(const RaggedStep& s, const PackedKeyLayout& l) {
  const at::Tensor index = at::tensor(l.index);
  const at::Tensor keys = s.key_cache.flatten(0, 1).index_select(0, index);
  const at::Tensor values = s.value_cache.flatten(0, 1).index_select(0, index);
  const int64_t group = s.heads / s.key_cache.size(2);
  std::vector<at::Tensor> out;
  for (size_t r = 0; r + 1 < l.cum_q.size(); ++r) {
    const int64_t t = l.cum_q[r + 1] - l.cum_q[r];
    const int64_t len = l.cum_k[r + 1] - l.cum_k[r];
    const at::Tensor q = s.queries.narrow(0, l.cum_q[r], t).transpose(0, 1);
    auto heads = [&](const at::Tensor& x) {  // [H, L, D]
      return x.narrow(0, l.cum_k[r], len)
          .repeat_interleave(group, 1)
          .transpose(0, 1);
    };
    const at::Tensor scores =
        at::matmul(q, heads(keys).transpose(1, 2)) * s.scale;  // [H, t, L]
    const at::Tensor i = at::arange(t).view({t, 1});
    const at::Tensor j = at::arange(len).view({1, len});
    const at::Tensor hidden = j > (len - t) + i;
    const at::Tensor probs =
        at::softmax(scores.masked_fill(hidden, -INFINITY), -1);
    out.push_back(at::matmul(probs, heads(values)).transpose(0, 1));
  }
  return at::cat(out);
}

TEST(PackKeyLayoutTest, BottomRightCausalOverPackedKeysIsDenseAttention) {
  at::manual_seed(3);
  for (const int64_t kv_heads : {int64_t{4}, int64_t{2}, int64_t{1}}) {
    const RaggedStep s = MakeRaggedStep(4, kv_heads, 16, at::kFloat);
    const at::Tensor got = BottomRightCausal(s, Layout(s));
    const at::Tensor want = DenseReference(s);
    ASSERT_EQ(got.sizes(), want.sizes());
    EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-5))
        << "KV heads " << kv_heads << ": largest difference "
        << (got - want).abs().max().item<double>();
  }
}

TEST(VarlenAttentionTest, ServesNothingOnTheCpu) {
  const RaggedStep s = MakeRaggedStep(4, 2, 16, at::kBFloat16);
  EXPECT_FALSE(VarlenAttentionServes(s.queries, s.key_cache));
}

}  // namespace
}  // namespace moh
