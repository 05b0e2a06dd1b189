#include "model/generation/sampler.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moh {
namespace {

using ::testing::Each;
using ::testing::HasSubstr;
using ::testing::Lt;
using ::testing::Ne;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

at::Tensor Logits(std::vector<float> values) { return at::tensor(values); }

// Logits whose softmax is `probs`.
at::Tensor LogitsOfProbs(const std::vector<double>& probs) {
  std::vector<float> logits;
  for (double p : probs) logits.push_back(static_cast<float>(std::log(p)));
  return Logits(logits);
}

SamplingParams Params(float temperature, int32_t top_k = 0, float top_p = 1.0f,
                      uint64_t seed = 1234) {
  SamplingParams params;
  params.temperature = temperature;
  params.top_k = top_k;
  params.top_p = top_p;
  params.seed = seed;
  return params;
}

std::vector<int32_t> Draws(Sampler& sampler, const at::Tensor& logits, int n,
                           absl::Span<const int32_t> history = {}) {
  std::vector<int32_t> ids;
  for (int i = 0; i < n; ++i) ids.push_back(sampler.Sample(logits, history));
  return ids;
}

std::vector<int32_t> Draws(const SamplingParams& params,
                           const at::Tensor& logits, int n) {
  Sampler sampler(params);
  return Draws(sampler, logits, n);
}

std::set<int32_t> Support(const std::vector<int32_t>& ids) {
  return std::set<int32_t>(ids.begin(), ids.end());
}

// A 100-token vocabulary with varied logits.
at::Tensor VariedLogits() {
  std::vector<float> v;
  for (int i = 0; i < 100; ++i) v.push_back(std::sin(i * 0.7f) * 2.0f);
  return Logits(v);
}

TEST(SamplerTest, GreedyIsArgmaxWithLowestIndexOnTies) {
  Sampler sampler(Params(0.0f, /*top_k=*/3, /*top_p=*/0.5f));
  EXPECT_EQ(sampler.Sample(Logits({1, 3, 3, 2}), {}), 1);
  EXPECT_EQ(sampler.Sample(Logits({-5, -2, -2, -3}), {}), 1);
  EXPECT_EQ(sampler.Sample(Logits({0, 0, 0}), {}), 0);
  EXPECT_EQ(sampler.Sample(Logits({1, 2, 7}), {}), 2);
}

TEST(SamplerTest, NanCountsAsMinusInfinity) {
  Sampler greedy(Params(0.0f));
  EXPECT_EQ(greedy.Sample(Logits({kNan, 1, 0.5}), {}), 1);
  EXPECT_THAT(Draws(Params(1.0f), Logits({kNan, -kInf, 2, kNan}), 50), Each(2));
  // Everything masked: token 0 rather than garbage.
  EXPECT_EQ(Sampler(Params(1.0f)).Sample(Logits({-kInf, -kInf, kNan}), {}), 0);
}

// A grammar's mask (grammar.h): ids outside it are never drawn, whatever
// their logits, and greedy takes the best allowed one.
TEST(SamplerTest, MaskedIdsAreNeverDrawn) {
  // Allowed: 1, 3 and 33 (bit 1 of the second word).
  const std::vector<uint32_t> mask = {(1u << 1) | (1u << 3), 1u << 1};
  std::vector<float> values(40, 0.0f);
  values[0] = 9;  // best, not allowed
  values[3] = 2;
  values[33] = 1;
  values[39] = kInf;  // not allowed either
  Sampler greedy(Params(0.0f));
  EXPECT_EQ(greedy.Sample(Logits(values), {}, 0, absl::MakeConstSpan(mask)), 3);
  // Allowed probabilities e^2 : e^1 : e^0 (0.67, 0.24, 0.09): top_p 0.9
  // keeps the first two.
  for (const auto& [top_p, expected] :
       {std::pair<float, std::set<int32_t>>{1.0f, {1, 3, 33}},
        {0.9f, {3, 33}}}) {
    Sampler sampler(Params(1.0f, 0, top_p));
    std::set<int32_t> drawn;
    for (int i = 0; i < 300; ++i) {
      drawn.insert(
          sampler.Sample(Logits(values), {}, 0, absl::MakeConstSpan(mask)));
    }
    EXPECT_EQ(drawn, expected) << top_p;
  }
  // Penalties first, the mask after: a penalised id stays out.
  SamplingParams penalized = Params(0.0f);
  penalized.repetition_penalty = 100.0f;
  const std::vector<int32_t> seen = {3};
  EXPECT_EQ(Sampler(penalized).Sample(Logits(values), seen, 0,
                                      absl::MakeConstSpan(mask)),
            33);
  // Nothing allowed is finite: the lowest allowed id.
  std::vector<float> none(40, -kInf);
  EXPECT_EQ(Sampler(Params(1.0f))
                .Sample(Logits(none), {}, 0, absl::MakeConstSpan(mask)),
            1);
  // An empty mask allows nothing; no mask allows everything.
  EXPECT_EQ(greedy.Sample(Logits(values), {}), 39);
}

// Found by fuzz/sampling_fuzzer: +inf made every weight NaN and the nucleus
// empty (a read before the first candidate).
TEST(SamplerTest, InfinityTakesAllTheProbability) {
  for (float top_p : {1.0f, 0.5f}) {
    for (int32_t top_k : {0, 2}) {
      EXPECT_THAT(
          Draws(Params(1.0f, top_k, top_p), Logits({1, kInf, 0, kInf}), 20),
          Each(1));
    }
  }
  SamplingParams penalized = Params(1.0f, 0, 0.9f);
  penalized.repetition_penalty = 1e-10f;
  Sampler sampler(penalized);
  const std::vector<int32_t> seen = {2};
  EXPECT_EQ(sampler.Sample(Logits({1, 2, 1e30f}), seen), 2);
}

TEST(SamplerTest, SameSeedSameDrawsDifferentSeedsDiffer) {
  const at::Tensor logits = VariedLogits();
  const std::vector<int32_t> a = Draws(Params(1.0f, 0, 1.0f, 42), logits, 200);
  EXPECT_EQ(a, Draws(Params(1.0f, 0, 1.0f, 42), logits, 200));
  EXPECT_NE(a, Draws(Params(1.0f, 0, 1.0f, 43), logits, 200));
  EXPECT_GT(Support(a).size(), 10u);  // really random, not constant
}

TEST(SamplerTest, IndependentOfOtherSamplersAndTorchGenerator) {
  const at::Tensor logits = VariedLogits();
  const std::vector<int32_t> alone =
      Draws(Params(1.0f, 0, 1.0f, 7), logits, 100);
  // Interleaved with another sequence and with LibTorch's global generator.
  Sampler mine(Params(1.0f, 0, 1.0f, 7));
  Sampler other(Params(1.0f, 0, 1.0f, 7));
  std::vector<int32_t> interleaved;
  for (int i = 0; i < 100; ++i) {
    at::manual_seed(i);
    at::rand({4});
    other.Sample(logits, {});
    interleaved.push_back(mine.Sample(logits, {}));
  }
  EXPECT_EQ(interleaved, alone);
}

TEST(SamplerTest, UnsetSeedIsReportedAndReplayable) {
  SamplingParams params = Params(1.0f);
  params.seed.reset();
  Sampler first(params);
  const at::Tensor logits = VariedLogits();
  const std::vector<int32_t> drawn = Draws(first, logits, 100);
  EXPECT_EQ(drawn, Draws(Params(1.0f, 0, 1.0f, first.seed()), logits, 100));
  EXPECT_NE(Sampler(params).seed(), first.seed());
}

TEST(SamplerTest, TopK1IsGreedyAtAnyTemperature) {
  const at::Tensor logits = VariedLogits();
  const int32_t argmax = Sampler(Params(0.0f)).Sample(logits, {});
  for (float t : {0.3f, 1.0f, 10.0f, 1000.0f}) {
    EXPECT_THAT(Draws(Params(t, /*top_k=*/1), logits, 300), Each(argmax))
        << "temperature " << t;
  }
}

TEST(SamplerTest, TinyTopPIsGreedy) {
  const at::Tensor logits = VariedLogits();
  const int32_t argmax = Sampler(Params(0.0f)).Sample(logits, {});
  EXPECT_THAT(Draws(Params(5.0f, 0, /*top_p=*/1e-6f), logits, 300),
              Each(argmax));
}

TEST(SamplerTest, FrequenciesMatchSoftmaxOverTemperature) {
  const std::vector<float> logits = {1.0f, 2.0f, 0.5f, -1.0f, 1.5f};
  for (float t : {0.7f, 2.0f}) {
    std::vector<double> expected;
    double sum = 0;
    for (float x : logits) sum += std::exp(x / t);
    for (float x : logits) expected.push_back(std::exp(x / t) / sum);

    constexpr int kDraws = 20000;
    std::vector<int> counts(logits.size());
    for (int32_t id : Draws(Params(t), Logits(logits), kDraws)) ++counts[id];
    for (size_t i = 0; i < logits.size(); ++i) {
      EXPECT_NEAR(counts[i] / double{kDraws}, expected[i], 0.015)
          << "token " << i << " temperature " << t;
    }
  }
}

TEST(SamplerTest, TopKRestrictsSupportExactly) {
  const at::Tensor logits =
      Logits({0.1, 2.0, -1.0, 1.9, 0.0, 1.8, 1.7, -3, 0, 1});
  EXPECT_EQ(Support(Draws(Params(5.0f, /*top_k=*/3), logits, 3000)),
            (std::set<int32_t>{1, 3, 5}));
  // Ties at the cut keep the lowest ids.
  EXPECT_EQ(Support(Draws(Params(1.0f, 2), Logits({1, 2, 2, 2, 0}), 1000)),
            (std::set<int32_t>{1, 2}));
  // k >= vocab is off.
  EXPECT_EQ(Support(Draws(Params(1.0f, 5), Logits({0, 0, 0}), 1000)).size(),
            3u);
}

TEST(SamplerTest, TopPKeepsSmallestNucleusReachingP) {
  // Probabilities by id: 0.1, 0.3, 0.4, 0.2; highest first: 2, 1, 3, 0.
  const at::Tensor logits = LogitsOfProbs({0.1, 0.3, 0.4, 0.2});
  auto support = [&](int32_t top_k, float top_p) {
    return Support(Draws(Params(1.0f, top_k, top_p), logits, 3000));
  };
  EXPECT_EQ(support(0, 0.35f), (std::set<int32_t>{2}));           // 0.4
  EXPECT_EQ(support(0, 0.65f), (std::set<int32_t>{1, 2}));        // 0.7
  EXPECT_EQ(support(0, 0.75f), (std::set<int32_t>{1, 2, 3}));     // 0.9
  EXPECT_EQ(support(0, 0.95f), (std::set<int32_t>{0, 1, 2, 3}));  // 1.0
  // After top-k=2 the probabilities are renormalised: 0.4/0.7 = 0.57 >= 0.5.
  EXPECT_EQ(support(2, 0.5f), (std::set<int32_t>{2}));
  EXPECT_EQ(support(2, 0.6f), (std::set<int32_t>{1, 2}));
}

TEST(SamplerTest, TopPOnLargeFlatVocabulary) {
  // 5000 equal logits, top_p just above one half: ids [0, 2501) qualify, as
  // ties prefer the lowest ids. Far more than the 256-token fast path.
  const std::vector<int32_t> ids =
      Draws(Params(1.0f, 0, /*top_p=*/0.5001f), at::zeros({5000}), 2000);
  EXPECT_THAT(ids, Each(Lt(2501)));
  EXPECT_GE(*std::max_element(ids.begin(), ids.end()), 2480);
}

TEST(SamplerTest, TopPOnLargeVocabularyMatchesFullSort) {
  std::vector<float> logits;
  for (int i = 0; i < 3000; ++i) logits.push_back(std::sin(i * 1.3f) * 3.0f);
  constexpr float kTopP = 0.8f;
  // Reference nucleus: sort everything, in double.
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  double total = 0;
  for (float x : logits) total += std::exp(double{x});
  std::set<int32_t> nucleus;
  double mass = 0;
  for (int32_t id : order) {
    if (mass >= kTopP * total) break;
    mass += std::exp(double{logits[id]});
    nucleus.insert(id);
  }
  ASSERT_GT(nucleus.size(), 256u);        // beyond the fast path
  ASSERT_GT(mass / total - kTopP, 1e-4);  // not a rounding coin toss

  const std::set<int32_t> drawn =
      Support(Draws(Params(1.0f, 0, kTopP), Logits(logits), 4000));
  EXPECT_TRUE(std::includes(nucleus.begin(), nucleus.end(), drawn.begin(),
                            drawn.end()));
  EXPECT_GT(drawn.size(), nucleus.size() / 2) << nucleus.size();
}

TEST(SamplerTest, RepetitionPenaltyDividesPositiveAndMultipliesNegative) {
  SamplingParams params = Params(0.0f);
  params.repetition_penalty = 2.0f;
  Sampler sampler(params);
  const std::vector<int32_t> seen = {0};
  // 2.0 / 2 = 1.0 < 1.5.
  EXPECT_EQ(sampler.Sample(Logits({2.0, 1.5, -1.0}), {}), 0);
  EXPECT_EQ(sampler.Sample(Logits({2.0, 1.5, -1.0}), seen), 1);
  // -1.0 * 2 = -2.0 < -1.5.
  EXPECT_EQ(sampler.Sample(Logits({-1.0, -1.5, -3.0}), seen), 1);
  // Penalised once per distinct id: 2.0 / 2 = 1.0 > 0.9 (not 2.0 / 8).
  const std::vector<int32_t> repeated = {0, 0, 0, 42, -1};
  EXPECT_EQ(sampler.Sample(Logits({2.0, 0.9}), repeated), 0);
  // The caller's logits are left alone.
  const at::Tensor logits = Logits({2.0, 1.5});
  sampler.Sample(logits, seen);
  EXPECT_EQ(logits[0].item<float>(), 2.0f);

  // A penalty below 1 favours seen tokens: 1.0 / 0.5 = 2.0 > 1.5.
  params.repetition_penalty = 0.5f;
  EXPECT_EQ(Sampler(params).Sample(Logits({1.0, 1.5}), seen), 0);
  // Applied before top-k when sampling.
  params = Params(1.0f, /*top_k=*/1);
  params.repetition_penalty = 2.0f;
  Sampler penalised(params);
  EXPECT_THAT(Draws(penalised, Logits({2.0, 1.5}), 20), Each(0));
  EXPECT_THAT(Draws(penalised, Logits({2.0, 1.5}), 20, seen), Each(1));
}

TEST(SamplerTest, PresenceAndFrequencyPenaltiesCountTheOutputOnly) {
  SamplingParams params = Params(0.0f);
  params.presence_penalty = 0.5f;
  params.frequency_penalty = 0.25f;
  Sampler sampler(params);
  // History: prompt {1, 1}, then the output {0, 0, 0}: token 0 drops by
  // 0.5 + 3 * 0.25 = 1.25, token 1 (prompt only) not at all.
  const std::vector<int32_t> history = {1, 1, 0, 0, 0};
  EXPECT_EQ(sampler.Sample(Logits({3.0, 1.8, 1.0}), history, 3), 1);  // 1.75
  EXPECT_EQ(sampler.Sample(Logits({3.0, 1.7, 1.0}), history, 3), 0);
  // All five generated: token 1 drops by 0.5 + 2 * 0.25 too.
  EXPECT_EQ(sampler.Sample(Logits({3.0, 1.8, 1.0}), history, 5), 0);
  // Without generated tokens nothing is penalised (the prompt is not).
  EXPECT_EQ(sampler.Sample(Logits({3.0, 1.8, 1.0}), history, 0), 0);
  // Only the frequency part repeats: 2.0 - 0.75 > 1.2 > 2.0 - 1.0.
  EXPECT_EQ(sampler.Sample(Logits({2.0, 1.2}), {0}, 1), 0);
  EXPECT_EQ(sampler.Sample(Logits({2.0, 1.2}), {0, 0}, 2), 1);
  // Negative values favour repeats; ids outside the vocabulary are ignored.
  params.presence_penalty = -1.0f;
  params.frequency_penalty = 0.0f;
  EXPECT_EQ(Sampler(params).Sample(Logits({1.0, 1.5}), {0, 7, -2}, 3), 0);
}

TEST(SamplerTest, LogitBiasIsAddedBeforeThePenalties) {
  SamplingParams params = Params(0.0f);
  params.logit_bias = {{1, 0.75f}, {2, -100.0f}, {7, 50.0f}};  // 7: no such id
  Sampler sampler(params);
  EXPECT_EQ(sampler.Sample(Logits({2.0, 1.5, 3.0}), {}), 1);  // 2.25 > 2.0
  EXPECT_EQ(sampler.Sample(Logits({2.0, 1.0, 3.0}), {}), 0);  // 1.75 < 2.0
  // Then the repetition penalty, on the biased logit: (-0.1 + 1) / 2 < 0.5
  // (the penalty first would give -0.1 * 2 + 1 > 0.5).
  params.logit_bias = {{1, 1.0f}};
  EXPECT_EQ(Sampler(params).Sample(Logits({0.5, -0.1}), {1}), 1);
  params.repetition_penalty = 2.0f;
  EXPECT_EQ(Sampler(params).Sample(Logits({0.5, -0.1}), {1}), 0);
  // When sampling, -100 leaves a token no probability to speak of, 100
  // takes it all.
  params = Params(1.0f);
  params.logit_bias = {{0, -100.0f}};
  EXPECT_THAT(Draws(params, Logits({5.0, 0.0, 0.0}), 50), Each(Ne(0)));
  params.logit_bias = {{2, 100.0f}};
  EXPECT_THAT(Draws(params, Logits({5.0, 0.0, 0.0}), 50), Each(2));
  // An id listed twice adds both.
  params = Params(0.0f);
  params.logit_bias = {{1, 0.6f}, {1, 0.6f}};
  EXPECT_EQ(Sampler(params).Sample(Logits({2.0, 1.0}), {}), 1);
}

TEST(SamplerTest, MinPKeepsTokensAtLeastMinPTimesTheBest) {
  // Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.5 keeps p >= 0.25, i.e.
  // {0, 1}; min_p 0.25 keeps p >= 0.125: {0, 1, 2}.
  const at::Tensor logits = LogitsOfProbs({0.5, 0.3, 0.15, 0.05});
  auto support = [&](float min_p, float temperature) {
    SamplingParams params = Params(temperature);
    params.min_p = min_p;
    Sampler sampler(params);
    return Support(Draws(sampler, logits, 3000));
  };
  EXPECT_EQ(support(0.5f, 1.0f), (std::set<int32_t>{0, 1}));
  EXPECT_EQ(support(0.25f, 1.0f), (std::set<int32_t>{0, 1, 2}));
  EXPECT_EQ(support(1.0f, 1.0f), (std::set<int32_t>{0}));
  EXPECT_EQ(support(0.0f, 1.0f), (std::set<int32_t>{0, 1, 2, 3}));
  // After temperature 2 the ratios are square roots: sqrt(0.15 / 0.5) =
  // 0.55 >= 0.5 keeps token 2; sqrt(0.05 / 0.5) = 0.32 does not keep 3.
  EXPECT_EQ(support(0.5f, 2.0f), (std::set<int32_t>{0, 1, 2}));
}

TEST(ComputeLogprobsTest, LogSoftmaxRankAndTopAlternatives) {
  const at::Tensor logits = Logits({1.0, 3.0, 2.0, 3.0, kNan});
  double z = 0;
  for (float x : {1.0f, 3.0f, 2.0f, 3.0f}) z += std::exp(x);
  const LogprobEntry entry = ComputeLogprobs(logits, 2, 3);
  EXPECT_EQ(entry.token.id, 2);
  EXPECT_NEAR(entry.token.logprob, 2.0 - std::log(z), 1e-6);
  EXPECT_EQ(entry.rank, 3);  // after 1 and 3
  ASSERT_EQ(entry.top.size(), 3u);
  EXPECT_EQ(entry.top[0].id, 1);  // ties: the lower id first
  EXPECT_EQ(entry.top[1].id, 3);
  EXPECT_EQ(entry.top[2].id, 2);
  EXPECT_NEAR(entry.top[0].logprob, 3.0 - std::log(z), 1e-6);
  EXPECT_EQ(ComputeLogprobs(logits, 1, 0).rank, 1);
  EXPECT_TRUE(ComputeLogprobs(logits, 1, 0).top.empty());
  // NaN is -inf; asking for more than the vocabulary gives all of it.
  const LogprobEntry nan = ComputeLogprobs(logits, 4, 10);
  EXPECT_EQ(nan.token.logprob, -kInf);
  EXPECT_EQ(nan.rank, 5);
  EXPECT_EQ(nan.top.size(), 5u);
  // Other dtypes and strides.
  const at::Tensor table = at::tensor({0.0, 1.0, 0.0, 1.0}, at::kDouble);
  EXPECT_NEAR(
      ComputeLogprobs(table.view({2, 2}).select(1, 0), 0, 1).token.logprob,
      std::log(0.5), 1e-6);
  EXPECT_THROW(ComputeLogprobs(logits, 5, 0), c10::Error);
}

TEST(SamplerTest, AcceptsOtherDtypesAndStrides) {
  Sampler sampler(Params(0.0f));
  const at::Tensor table =
      at::tensor({0.0, 3.0, 5.0, 2.0, 0.5, -1.0}, at::kDouble).view({3, 2});
  EXPECT_EQ(sampler.Sample(table.select(1, 0), {}), 1);  // {0, 5, 0.5}
  EXPECT_EQ(sampler.Sample(table.select(1, 1), {}), 0);  // {3, 2, -1}
  EXPECT_EQ(sampler.Sample(Logits({1, 4, 2}).to(at::kHalf), {}), 1);
}

TEST(SamplerTest, LogitsOnTheHostDrawAsTheirTensor) {
  const at::Tensor logits = VariedLogits();
  const auto host = absl::MakeConstSpan(logits.data_ptr<float>(), 100);
  const std::vector<int32_t> history = {3, 7, 7, 42};
  for (SamplingParams params :
       {Params(0.0f), Params(0.8f), Params(1.3f, 5), Params(0.7f, 0, 0.9f),
        Params(1.0f, 10, 0.5f)}) {
    params.repetition_penalty = 1.3f;
    params.min_p = 0.01f;
    Sampler from_tensor(params), from_span(params);
    for (int i = 0; i < 50; ++i) {
      ASSERT_EQ(from_span.Sample(host, history, 2),
                from_tensor.Sample(logits, history, 2))
          << "draw " << i << " temperature " << params.temperature;
    }
  }
  Sampler sampler(Params(1.0f));
  EXPECT_THROW(sampler.Sample(absl::Span<const float>(), {}), c10::Error);
}

TEST(SamplerTest, RejectsMalformedLogits) {
  Sampler sampler(Params(1.0f));
  EXPECT_THROW(sampler.Sample(at::zeros({2, 3}), {}), c10::Error);
  EXPECT_THROW(sampler.Sample(at::zeros({0}), {}), c10::Error);
  EXPECT_THROW(sampler.Sample(at::zeros({3}, at::kLong), {}), c10::Error);
}

TEST(ValidateSamplingParamsTest, AcceptsDefaultsAndBoundaries) {
  EXPECT_TRUE(ValidateSamplingParams(SamplingParams(), 64).ok());
  SamplingParams params;
  params.max_new_tokens = 1;
  params.temperature = 0.0f;
  params.top_p = 1.0f;
  params.top_k = 0;
  params.stop.assign(kMaxStopStrings, std::string(kMaxStopStringBytes, 'x'));
  EXPECT_TRUE(ValidateSamplingParams(params, 1).ok());
  params.temperature = 100.0f;
  params.top_p = 1e-6f;
  params.repetition_penalty = 1e-3f;
  EXPECT_TRUE(ValidateSamplingParams(params, 1).ok());
}

struct BadCase {
  std::string name;
  std::function<void(SamplingParams&)> mutate;
  std::string message;
};

TEST(ValidateSamplingParamsTest, NamesTheFieldAndRange) {
  const std::vector<BadCase> cases = {
      {"zero tokens", [](SamplingParams& p) { p.max_new_tokens = 0; },
       "sampling.max_new_tokens must be in [1, 100], got 0"},
      {"over limit", [](SamplingParams& p) { p.max_new_tokens = 101; },
       "sampling.max_new_tokens must be in [1, 100], got 101"},
      {"negative temperature", [](SamplingParams& p) { p.temperature = -0.5f; },
       "sampling.temperature must be finite and >= 0, got -0.5"},
      {"nan temperature", [](SamplingParams& p) { p.temperature = kNan; },
       "sampling.temperature must be finite and >= 0, got nan"},
      {"inf temperature", [](SamplingParams& p) { p.temperature = kInf; },
       "sampling.temperature must be finite and >= 0, got inf"},
      {"negative top_k", [](SamplingParams& p) { p.top_k = -1; },
       "sampling.top_k must be >= 0"},
      {"top_p above 1", [](SamplingParams& p) { p.top_p = 1.5f; },
       "sampling.top_p must be in (0, 1], got 1.5"},
      {"top_p zero", [](SamplingParams& p) { p.top_p = 0.0f; },
       "sampling.top_p must be in (0, 1], got 0"},
      {"top_p negative", [](SamplingParams& p) { p.top_p = -0.1f; },
       "sampling.top_p must be in (0, 1], got -0.1"},
      {"top_p nan", [](SamplingParams& p) { p.top_p = kNan; },
       "sampling.top_p must be in (0, 1], got nan"},
      {"penalty zero", [](SamplingParams& p) { p.repetition_penalty = 0.0f; },
       "sampling.repetition_penalty must be finite and > 0"},
      {"penalty negative",
       [](SamplingParams& p) { p.repetition_penalty = -1.0f; },
       "sampling.repetition_penalty must be finite and > 0"},
      {"penalty nan", [](SamplingParams& p) { p.repetition_penalty = kNan; },
       "sampling.repetition_penalty must be finite and > 0"},
      {"penalty inf", [](SamplingParams& p) { p.repetition_penalty = kInf; },
       "sampling.repetition_penalty must be finite and > 0"},
      {"too many stops",
       [](SamplingParams& p) { p.stop.assign(kMaxStopStrings + 1, "x"); },
       "sampling.stop must be at most 16 strings, got 17 strings"},
      {"empty stop",
       [](SamplingParams& p) {
         p.stop = {"a", ""};
       },
       "sampling.stop[1] must be 1 to 256 bytes, got 0 bytes"},
      {"long stop", [](SamplingParams& p) { p.stop = {std::string(257, 'x')}; },
       "sampling.stop[0] must be 1 to 256 bytes, got 257 bytes"},
      {"presence", [](SamplingParams& p) { p.presence_penalty = 2.5f; },
       "sampling.presence_penalty must be in [-2, 2] (0 = off), got 2.5"},
      {"frequency nan", [](SamplingParams& p) { p.frequency_penalty = kNan; },
       "sampling.frequency_penalty must be in [-2, 2] (0 = off), got nan"},
      {"min_p", [](SamplingParams& p) { p.min_p = 1.5f; },
       "sampling.min_p must be in [0, 1] (0 = off), got 1.5"},
      {"logprobs", [](SamplingParams& p) { p.logprobs = 21; },
       "sampling.logprobs must be in [0, 20] (absent = none), got 21"},
      {"prompt_logprobs", [](SamplingParams& p) { p.prompt_logprobs = -1; },
       "sampling.prompt_logprobs must be in [0, 20] (absent = none), got -1"},
      {"logit_bias id",
       [](SamplingParams& p) {
         p.logit_bias = {{-3, 1.0f}};
       },
       "sampling.logit_bias must be token ids >= 0, got -3"},
      {"logit_bias value",
       [](SamplingParams& p) {
         p.logit_bias = {{3, 100.5f}};
       },
       "sampling.logit_bias must be biases in [-100, 100], got 100.5"},
      {"logit_bias nan",
       [](SamplingParams& p) {
         p.logit_bias = {{3, kNan}};
       },
       "sampling.logit_bias must be biases in [-100, 100], got nan"},
      {"logit_bias entries",
       [](SamplingParams& p) {
         p.logit_bias.assign(kMaxLogitBias + 1, {0, 1});
       },
       "sampling.logit_bias must be at most 1024 entries, got 1025 entries"},
  };
  for (const BadCase& c : cases) {
    SamplingParams params;
    c.mutate(params);
    const absl::Status status = ValidateSamplingParams(params, 100);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message)) << c.name;
  }
}

// Pushes `pieces`, returns everything emitted (Flush included unless stopped)
// and whether it stopped.
std::pair<std::string, bool> Stream(StopStringMatcher& matcher,
                                    const std::vector<std::string>& pieces) {
  std::string out;
  bool stopped = false;
  for (const std::string& piece : pieces) {
    StopStringMatcher::Result r = matcher.Push(piece);
    out += r.emit;
    stopped = r.stopped;
  }
  out += matcher.Flush();
  return {out, stopped};
}

std::vector<std::string> Bytes(std::string_view text) {
  std::vector<std::string> bytes;
  for (char c : text) bytes.emplace_back(1, c);
  return bytes;
}

TEST(StopStringMatcherTest, WithoutStopsEmitsEverythingAtOnce) {
  StopStringMatcher matcher({});
  EXPECT_EQ(matcher.Push("hello").emit, "hello");
  EXPECT_EQ(matcher.Push(" world").emit, " world");
  EXPECT_EQ(matcher.Flush(), "");
}

TEST(StopStringMatcherTest, StopSplitAcrossPushes) {
  StopStringMatcher matcher({"</s>"});
  StopStringMatcher::Result r = matcher.Push("Hello wor");
  EXPECT_EQ(r.emit, "Hello wor");
  EXPECT_FALSE(r.stopped);
  r = matcher.Push("ld</");
  EXPECT_EQ(r.emit, "ld");  // "</" held back
  EXPECT_FALSE(r.stopped);
  r = matcher.Push("s> tail");
  EXPECT_EQ(r.emit, "");
  EXPECT_TRUE(r.stopped);
  r = matcher.Push("more");
  EXPECT_EQ(r.emit, "");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(matcher.Flush(), "");

  StopStringMatcher bytewise({"</s>"});
  EXPECT_EQ(Stream(bytewise, Bytes("a</b></s>c")),
            std::make_pair(std::string("a</b>"), true));
}

TEST(StopStringMatcherTest, EarliestMatchWins) {
  StopStringMatcher matcher({"END", "STOP"});
  StopStringMatcher::Result r = matcher.Push("one STOP two END");
  EXPECT_EQ(r.emit, "one ");
  EXPECT_TRUE(r.stopped);

  StopStringMatcher reversed({"STOP", "END"});
  EXPECT_EQ(Stream(reversed, Bytes("x END y STOP")),
            std::make_pair(std::string("x "), true));
  // The earliest start wins, whichever ends first...
  StopStringMatcher nested({"bc", "abcd"});
  EXPECT_EQ(Stream(nested, {"xa", "bcd"}),
            std::make_pair(std::string("x"), true));
  // ...but a stop string that is complete wins over one that might follow.
  StopStringMatcher pending({"abcd", "bc"});
  EXPECT_EQ(Stream(pending, {"xa", "bc", "d"}),
            std::make_pair(std::string("xa"), true));
}

TEST(StopStringMatcherTest, HeldPrefixIsReleasedWhenItDoesNotMatch) {
  StopStringMatcher matcher({"###"});
  EXPECT_EQ(matcher.Push("x #").emit, "x ");
  EXPECT_EQ(matcher.Push("#").emit, "");
  StopStringMatcher::Result r = matcher.Push(" y");
  EXPECT_EQ(r.emit, "## y");
  EXPECT_FALSE(r.stopped);
}

TEST(StopStringMatcherTest, FlushReturnsHeldText) {
  StopStringMatcher matcher({"\n\n", "User:"});
  EXPECT_EQ(matcher.Push("done\nUs").emit, "done\n");
  EXPECT_EQ(matcher.Flush(), "Us");
  EXPECT_EQ(matcher.Flush(), "");
}

TEST(StopStringMatcherTest, MultiByteUtf8IsUnharmed) {
  // "✓" and "✗" share their first two bytes.
  const std::string text = "héllo ✓ wörld 你好";
  StopStringMatcher matcher({"✗"});
  std::string out;
  for (const std::string& byte : Bytes(text)) {
    const std::string emit = matcher.Push(byte).emit;
    // Never a piece that splits a character.
    EXPECT_TRUE(emit.empty() ||
                (static_cast<unsigned char>(emit[0]) & 0xC0) != 0x80)
        << "piece starts inside a character";
    out += emit;
  }
  out += matcher.Flush();
  EXPECT_EQ(out, text);

  StopStringMatcher chinese({"。"});
  EXPECT_EQ(Stream(chinese, Bytes("你好。再见")),
            std::make_pair(std::string("你好"), true));

  // An incomplete character is held back until Flush.
  StopStringMatcher tail({});
  EXPECT_EQ(tail.Push("a\xE4\xBD").emit, "a");
  EXPECT_EQ(tail.Push("\xA0").emit, "\xE4\xBD\xA0");  // 你
  EXPECT_EQ(tail.Push("\xE4").emit, "");
  EXPECT_EQ(tail.Flush(), "\xE4");
}

}  // namespace
}  // namespace moh
