// In-process generation and label scoring on the reference fixtures.
#include "model/generation/generator.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/core/best_logits.h"
#include "model/generation/language_model.h"
#include "nlohmann/json.hpp"
#include "tests/base/test_paths.h"
#include "tests/model/generation/generator_test_util.h"

namespace moh {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

const std::string kModelDir = test_paths::FixturesDir() + "/llama_learned";

json Golden() {
  std::ifstream in(kModelDir + "/golden.json");
  std::stringstream s;
  s << in.rdbuf();
  return json::parse(s.str());
}

bool IsValidUtf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = s[i];
    const int len = c < 0x80         ? 1
                    : (c >> 5) == 6  ? 2
                    : (c >> 4) == 14 ? 3
                    : (c >> 3) == 30 ? 4
                                     : 0;
    if (len == 0 || i + len > s.size()) return false;
    for (int k = 1; k < len; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) >> 6) != 2) return false;
    }
    i += len;
  }
  return true;
}

class GeneratorTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto lm = LanguageModel::Load(kModelDir, DeviceOptions{"cpu", "float32"});
    ASSERT_TRUE(lm.ok()) << lm.status();
    lm_ = new LanguageModel(std::move(*lm));
  }
  static void TearDownTestSuite() { delete lm_; }

  GenerationRequest Request(const std::string& prompt, int max_new_tokens) {
    GenerationRequest r;
    r.prompt_ids = lm_->tokenizer->Encode(prompt, /*add_special_tokens=*/true);
    r.sampling.max_new_tokens = max_new_tokens;
    return r;
  }

  static LanguageModel* lm_;
};

LanguageModel* GeneratorTest::lm_ = nullptr;

TEST_F(GeneratorTest, LoadsTokenizerAndEosFromDirectory) {
  ASSERT_NE(lm_->tokenizer, nullptr);
  EXPECT_THAT(lm_->eos_ids, ::testing::Contains(319));
  auto ids = lm_->tokenizer->Encode("the cat", true);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.front(), 318);  // <|begin_of_text|> from the post-processor
}

TEST_F(GeneratorTest, StreamedChunksAddUpToTheResult) {
  Generator generator(*lm_->model, lm_->tokenizer.get(), {});
  GenerationRequest request = Request("Once upon a time", 24);
  request.sampling.temperature = 1.0f;
  request.sampling.seed = 7;
  std::string streamed;
  std::vector<int32_t> streamed_ids;
  auto results =
      generator.Generate({request}, [&](size_t row, const GenerationChunk& c) {
        EXPECT_EQ(row, 0u);
        EXPECT_TRUE(IsValidUtf8(c.text)) << "chunk splits a UTF-8 character";
        streamed += c.text;
        streamed_ids.insert(streamed_ids.end(), c.token_ids.begin(),
                            c.token_ids.end());
      });
  ASSERT_TRUE(results.ok()) << results.status();
  const GenerationResult& r = (*results)[0];
  EXPECT_EQ(r.finish_reason, FinishReason::kLength);
  EXPECT_EQ(r.token_ids.size(), 24u);
  EXPECT_EQ(streamed_ids, r.token_ids);
  EXPECT_EQ(streamed, r.text);
  auto decoded =
      lm_->tokenizer->Decode(r.token_ids, /*skip_special_tokens=*/true);
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(r.text, *decoded);
  EXPECT_EQ(r.prompt_tokens, static_cast<int32_t>(request.prompt_ids.size()));
}

TEST_F(GeneratorTest, SeededSamplingIsReproducibleWhateverTheBatch) {
  Generator generator(*lm_->model, lm_->tokenizer.get(), {});
  GenerationRequest request = Request("the", 16);
  request.sampling.temperature = 1.2f;
  request.sampling.top_p = 0.95f;
  request.sampling.top_k = 50;
  request.sampling.seed = 1234;
  GenerationRequest other =
      Request("a much longer prompt that pads the batch", 5);
  other.ratio = 0.5f;
  auto alone = generator.Generate({request});
  auto batched = generator.Generate({other, request, other});
  ASSERT_TRUE(alone.ok() && batched.ok());
  EXPECT_EQ((*alone)[0].token_ids, (*batched)[1].token_ids);
  request.sampling.seed = 4321;
  auto reseeded = generator.Generate({request});
  ASSERT_TRUE(reseeded.ok());
  EXPECT_NE((*alone)[0].token_ids, (*reseeded)[0].token_ids);
}

TEST_F(GeneratorTest, EosEndsTheSequence) {
  const json golden = Golden();
  const json& c = golden["cases"][0];
  const auto greedy = c["greedy"].get<std::vector<int32_t>>();
  // Declare a greedy token that did not occur before it an EOS: generation
  // stops right there.
  size_t k = 1;
  while (k + 1 < greedy.size() && std::find(greedy.begin(), greedy.begin() + k,
                                            greedy[k]) != greedy.begin() + k) {
    ++k;
  }
  Generator generator(*lm_->model, lm_->tokenizer.get(), {greedy[k]});
  GenerationRequest request;
  request.prompt_ids =
      golden["prompts"][c["prompt"].get<int>()].get<std::vector<int32_t>>();
  request.sampling.max_new_tokens = 8;
  request.ratio = c["ratio"].get<float>();
  auto results = generator.Generate({request});
  ASSERT_TRUE(results.ok()) << results.status();
  EXPECT_EQ((*results)[0].finish_reason, FinishReason::kEos);
  EXPECT_EQ((*results)[0].token_ids,
            std::vector<int32_t>(greedy.begin(), greedy.begin() + k + 1));
}

// The first greedy position whose token did not occur before it.
size_t FirstNewToken(const std::vector<int32_t>& greedy) {
  size_t k = 1;
  while (k + 1 < greedy.size() && std::find(greedy.begin(), greedy.begin() + k,
                                            greedy[k]) != greedy.begin() + k) {
    ++k;
  }
  return k;
}

TEST_F(GeneratorTest, StopTokensEndIgnoreEosAndMinTokensDefer) {
  const json golden = Golden();
  const json& c = golden["cases"][0];
  const auto greedy = c["greedy"].get<std::vector<int32_t>>();
  ASSERT_GE(greedy.size(), 8u);
  const size_t k = FirstNewToken(greedy);
  GenerationRequest request;
  request.prompt_ids =
      golden["prompts"][c["prompt"].get<int>()].get<std::vector<int32_t>>();
  request.sampling.max_new_tokens = 8;
  request.ratio = c["ratio"].get<float>();
  auto run = [&](const std::vector<int32_t>& eos) {
    Generator generator(*lm_->model, lm_->tokenizer.get(), eos);
    auto results = generator.Generate({request});
    EXPECT_TRUE(results.ok()) << results.status();
    return std::move((*results)[0]);
  };
  // A stop token ends with STOP, counted.
  request.sampling.stop_token_ids = {greedy[k]};
  GenerationResult stopped = run({});
  EXPECT_EQ(stopped.finish_reason, FinishReason::kStop);
  EXPECT_EQ(stopped.token_ids,
            std::vector<int32_t>(greedy.begin(), greedy.begin() + k + 1));
  // Not before min_tokens: position k takes the next best token instead.
  request.sampling.min_tokens = static_cast<int32_t>(k) + 1;
  GenerationResult deferred = run({});
  ASSERT_GT(deferred.token_ids.size(), k);
  EXPECT_NE(deferred.token_ids[k], greedy[k]);
  EXPECT_EQ(std::vector<int32_t>(deferred.token_ids.begin(),
                                 deferred.token_ids.begin() + k),
            std::vector<int32_t>(greedy.begin(), greedy.begin() + k));
  // ignore_eos: the same token declared EOS ends nothing.
  request.sampling = SamplingParams();
  request.sampling.max_new_tokens = 8;
  EXPECT_EQ(run({greedy[k]}).finish_reason, FinishReason::kEos);
  request.sampling.ignore_eos = true;
  GenerationResult ignored = run({greedy[k]});
  EXPECT_EQ(ignored.finish_reason, FinishReason::kLength);
  EXPECT_EQ(ignored.token_ids,
            std::vector<int32_t>(greedy.begin(), greedy.begin() + 8));
}

TEST_F(GeneratorTest, StopStringTruncatesTheText) {
  Generator generator(*lm_->model, lm_->tokenizer.get(), {});
  GenerationRequest request = Request("Once upon a time", 20);
  auto full = generator.Generate({request});
  ASSERT_TRUE(full.ok());
  const std::string text = (*full)[0].text;
  ASSERT_GE(text.size(), 6u) << text;
  const std::string stop = text.substr(3, 3);
  request.sampling.stop = {stop};
  auto stopped = generator.Generate({request});
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ((*stopped)[0].finish_reason, FinishReason::kStop);
  EXPECT_EQ((*stopped)[0].text, text.substr(0, text.find(stop)));
}

TEST_F(GeneratorTest, RatioChangesEffectiveRatio) {
  Generator generator(*lm_->model, lm_->tokenizer.get(), {});
  GenerationRequest low = Request("the cat sat", 4);
  low.ratio = 0.5f;
  GenerationRequest full = low;
  full.ratio = 1.0f;
  auto results = generator.Generate({low, full});
  ASSERT_TRUE(results.ok());
  EXPECT_DOUBLE_EQ((*results)[0].effective_ratio, 0.5);  // S=2 + K=2 of 8 heads
  EXPECT_DOUBLE_EQ((*results)[1].effective_ratio, 1.0);
  // Counts cover prompt + generated tokens but the last, per (layer, head).
  const int64_t processed = low.prompt_ids.size() + 3;
  EXPECT_EQ((*results)[1].head_token_counts.sum().item<int64_t>(),
            processed * 2 * 8);
}

TEST_F(GeneratorTest, RejectsBadRequestsNamingTheField) {
  Generator generator(*lm_->model, lm_->tokenizer.get(), {});
  struct Case {
    std::function<void(GenerationRequest&)> mutate;
    std::string message;
  } cases[] = {
      {[](GenerationRequest& r) { r.prompt_ids.clear(); },
       "prompt_ids must have 1 to 255 tokens"},
      {[](GenerationRequest& r) { r.prompt_ids.assign(300, 1); },
       "prompt_ids must have 1 to 255 tokens"},
      {[](GenerationRequest& r) { r.prompt_ids[0] = 320; },
       "prompt_ids must be in [0, 320)"},
      {[](GenerationRequest& r) { r.sampling.max_new_tokens = 0; },
       "max_new_tokens"},
      {[](GenerationRequest& r) { r.sampling.max_new_tokens = 1000; },
       "max_new_tokens"},
      {[](GenerationRequest& r) { r.sampling.top_p = 1.5f; }, "top_p"},
      {[](GenerationRequest& r) { r.sampling.temperature = -1.0f; },
       "temperature"},
      {[](GenerationRequest& r) { r.ratio = 1.5f; }, "ratio must be in (0, 1]"},
      {[](GenerationRequest& r) { r.ratio = -0.5f; },
       "ratio must be in (0, 1]"},
      {[](GenerationRequest& r) { r.ratio = std::nanf(""); },
       "ratio must be in (0, 1]"},
  };
  for (auto& c : cases) {
    GenerationRequest request = Request("hello", 4);
    c.mutate(request);
    auto results = generator.Generate({Request("fine", 2), request});
    ASSERT_FALSE(results.ok()) << c.message;
    EXPECT_EQ(results.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(results.status().message()), HasSubstr(c.message));
  }
}

TEST_F(GeneratorTest, LabelScoresMatchReferenceLogits) {
  // log p(label | context) from the reference's logits of the whole prompt.
  const json golden = Golden();
  for (const json& c : golden["cases"]) {
    const auto prompt =
        golden["prompts"][c["prompt"].get<int>()].get<std::vector<int32_t>>();
    const size_t context_len = 3;
    std::vector<int32_t> context(prompt.begin(), prompt.begin() + context_len);
    std::vector<std::vector<int32_t>> labels = {
        {prompt.begin() + context_len, prompt.end()}, {prompt[context_len]}};
    auto scores =
        ScoreLabels(*lm_->model, context, labels, c["ratio"].get<float>());
    ASSERT_TRUE(scores.ok()) << scores.status();
    for (size_t i = 0; i < labels.size(); ++i) {
      double expected = 0;
      for (size_t j = 0; j < labels[i].size(); ++j) {
        std::vector<float> row =
            c["logits"][context_len + j - 1].get<std::vector<float>>();
        at::Tensor log_probs = at::log_softmax(at::tensor(row), 0);
        expected += log_probs[labels[i][j]].item<float>();
      }
      EXPECT_NEAR(scores->log_likelihoods[i], expected,
                  1e-3 * std::max(1.0, std::abs(expected)));
    }
  }
  auto half = ScoreLabels(*lm_->model, {1, 2, 3}, {{4}, {5, 6}}, 0.5f);
  ASSERT_TRUE(half.ok());
  EXPECT_EQ(half->tokens, 4 + 5);
  EXPECT_DOUBLE_EQ(EffectiveRatio(half->head_token_counts, half->tokens), 0.5);
  auto empty = ScoreLabels(*lm_->model, {1, 2}, {}, 0.0f);
  EXPECT_FALSE(empty.ok());
}

TEST_F(GeneratorTest, LabelScoringInGroupsOfOneSequenceMatchesOneBatch) {
  // Five labels of a 4-token context; a cache of 6 positions holds one row
  // (context + the longest label) at a time.
  const Activation activation =
      Activation::AtRatio(lm_->model->config().moh, 0.5f);
  const std::vector<int32_t> context = {1, 2, 3, 4};
  const std::vector<std::vector<int32_t>> labels = {
      {5}, {6, 7}, {8}, {9, 10}, {11}};
  auto whole = ScoreLabels(*lm_->model, context, labels, activation);
  auto grouped = ScoreLabels(*lm_->model, context, labels, activation, 6);
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_TRUE(grouped.ok()) << grouped.status();
  ASSERT_EQ(grouped->log_likelihoods.size(), labels.size());
  for (size_t i = 0; i < labels.size(); ++i) {
    EXPECT_NEAR(grouped->log_likelihoods[i], whole->log_likelihoods[i], 1e-4);
  }
  EXPECT_EQ(grouped->tokens, whole->tokens);
  EXPECT_TRUE(at::equal(grouped->head_token_counts, whole->head_token_counts));
  // A row longer than the cache is refused, naming the limit.
  auto too_long = ScoreLabels(*lm_->model, context, labels, activation, 5);
  ASSERT_FALSE(too_long.ok());
  EXPECT_THAT(std::string(too_long.status().message()),
              HasSubstr("text + label must fit in 5 tokens, got 6"));
}

// The best logits where the logits lie (best_logits.h): the Sampler's order
// (value, then the lower id), NaN as -inf, -0 as +0, within the limit.
TEST(BestLogitsTest, TheSamplersOrderExactlyWhateverTheTies) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const at::Tensor logits =
      at::tensor({1.0f,  3.0f,  nan,   3.0f,  -0.0f, 0.0f, 3.0f, 2.0f, 9.0f,  //
                  -inf,  -inf,  -inf,  -inf,  -inf,  -inf, -inf, -inf, -inf,  //
                  -2.0f, -1.0f, -0.0f, -3.0f, 0.0f,  inf,  -inf, inf,  5.0f})
          .view({3, 9});
  auto [values, ids] = BestLogits(logits, 8, 5);  // entry 8 is past the limit
  ASSERT_EQ(ids.sizes(), (at::IntArrayRef{3, 5}));
  const std::vector<int64_t> want = {1, 3, 6, 7, 0,   //
                                     0, 1, 2, 3, 4,   //
                                     5, 7, 2, 4, 1};  // 5.0 past 8 ignored
  EXPECT_EQ(std::vector<int64_t>(ids.data_ptr<int64_t>(),
                                 ids.data_ptr<int64_t>() + 15),
            want);
  EXPECT_EQ(values[0][0].item<float>(), 3.0f);
  EXPECT_EQ(values[1][0].item<float>(), -inf);
  EXPECT_EQ(values[2][0].item<float>(), inf);
  EXPECT_EQ(values[2][2].item<float>(), 0.0f);
  EXPECT_FALSE(std::signbit(values[2][2].item<float>()));
  // Random rows: the same as a stable sort of the values.
  at::manual_seed(3);
  const at::Tensor x = at::randint(-4, 4, {6, 300}).to(at::kFloat) * 0.5;
  auto [v, i] = BestLogits(x, 300, 40);
  for (int64_t r = 0; r < 6; ++r) {
    std::vector<int64_t> order(300);
    for (int64_t k = 0; k < 300; ++k) order[k] = k;
    const float* row = x[r].data_ptr<float>();
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return row[a] > row[b]; });
    order.resize(40);
    EXPECT_EQ(std::vector<int64_t>(i[r].data_ptr<int64_t>(),
                                   i[r].data_ptr<int64_t>() + 40),
              order)
        << "row " << r;
  }
}

// One step of a row reduced where its logits lie as a step does
// (language_steps.cc): BestLogits and RowStats of `logits` ([V]) for `plan`,
// then NextFromReduced, or Next on the whole row when those do not decide.
// Counts the latter in `*whole`.
absl::StatusOr<GenerationChunk> ReducedStep(
    SequenceOutput& output, const SequenceOutput::Reduction& plan,
    const at::Tensor& logits, int* whole, int64_t extra_best = 0) {
  const at::Tensor row = logits.unsqueeze(0);
  auto [values, ids] = BestLogits(row, plan.limit, plan.best + extra_best);
  values = values[0].contiguous();
  ids = ids[0].contiguous();
  at::Tensor stats;
  if (plan.stats) {
    stats = RowStats(row, plan.limit, RowReductionParams({plan.row}))[0]
                .contiguous();
  }
  auto reduced = output.NextFromReduced(
      plan, absl::MakeConstSpan(values.data_ptr<float>(), values.numel()),
      absl::MakeConstSpan(ids.data_ptr<int64_t>(), ids.numel()),
      stats.defined()
          ? absl::MakeConstSpan(stats.data_ptr<double>(), stats.numel())
          : absl::Span<const double>());
  if (!reduced.ok()) return reduced.status();
  if (reduced->has_value()) return std::move(**reduced);
  ++*whole;
  return output.Next(logits);
}

// The log partition is summed in another order: a last-bit difference.
void ExpectSameLogprob(const TokenLogprob& got, const TokenLogprob& want,
                       int64_t step) {
  EXPECT_EQ(got.id, want.id) << "step " << step;
  if (std::isfinite(want.logprob)) {
    EXPECT_NEAR(got.logprob, want.logprob, 1e-6 * (1 + std::fabs(want.logprob)))
        << "step " << step;
  } else {
    EXPECT_EQ(got.logprob, want.logprob) << "step " << step;
  }
}

void ExpectSameLogprobs(const GenerationChunk& got, const GenerationChunk& want,
                        int64_t step) {
  ASSERT_EQ(got.logprobs.size(), want.logprobs.size()) << "step " << step;
  for (size_t i = 0; i < want.logprobs.size(); ++i) {
    const LogprobEntry& g = got.logprobs[i];
    const LogprobEntry& w = want.logprobs[i];
    ExpectSameLogprob(g.token, w.token, step);
    EXPECT_EQ(g.rank, w.rank) << "step " << step;
    ASSERT_EQ(g.top.size(), w.top.size()) << "step " << step;
    for (size_t k = 0; k < w.top.size(); ++k) {
      ExpectSameLogprob(g.top[k], w.top[k], step);
    }
  }
}

// Greedy rows reduced where the logits lie: PlanReduction asks for the
// best logit, and it streams what Next would from the whole row, NaN, ties
// and -inf rows included.
TEST_F(GeneratorTest, ArgmaxOnTheLogitsDeviceStreamsWhatNextWould) {
  const int64_t vocab = lm_->tokenizer->vocab_size();
  const int64_t padded = vocab + 5;  // rows past the tokenizer: never drawn
  const std::vector<int32_t> prompt = {1, 2, 3};
  SamplingParams greedy;
  greedy.max_new_tokens = 6;
  SequenceOutput full(greedy, prompt, lm_->tokenizer.get(), {}),
      reduced(greedy, prompt, lm_->tokenizer.get(), {});
  EXPECT_EQ(
      SequenceOutput(greedy, prompt, nullptr, {}).PlanReduction(padded)->limit,
      padded);
  at::manual_seed(5);
  at::Tensor logits = at::randn({6, padded});
  logits[0][padded - 1] = 100.0f;       // past the tokenizer
  logits[1][7] = logits[1][3] = 50.0f;  // a tie: the lower id
  logits[2][0] = std::numeric_limits<float>::quiet_NaN();
  logits[2][9] = 50.0f;
  logits[3].fill_(-std::numeric_limits<float>::infinity());  // token 0
  logits[4][vocab - 1] = std::numeric_limits<float>::infinity();
  const at::Tensor ids = BestLogits(logits, vocab, 1).second.select(1, 0);
  ASSERT_EQ(ids.size(0), 6);
  EXPECT_EQ(ids[1].item<int64_t>(), 3);
  EXPECT_EQ(ids[2].item<int64_t>(), 9);
  EXPECT_EQ(ids[3].item<int64_t>(), 0);
  EXPECT_EQ(ids[4].item<int64_t>(), vocab - 1);
  int whole = 0;
  for (int64_t step = 0; step < 6; ++step) {
    const auto plan = reduced.PlanReduction(padded);
    ASSERT_TRUE(plan.has_value());
    EXPECT_EQ(plan->limit, vocab);
    EXPECT_EQ(plan->best, 1);
    EXPECT_FALSE(plan->stats);
    auto want = full.Next(logits[step]);
    auto got = ReducedStep(reduced, *plan, logits[step], &whole);
    ASSERT_TRUE(want.ok() && got.ok()) << want.status() << got.status();
    EXPECT_EQ(got->token_ids, want->token_ids) << "step " << step;
    EXPECT_EQ(got->text, want->text) << "step " << step;
  }
  EXPECT_EQ(whole, 0);
  EXPECT_EQ(reduced.history(), full.history());
  EXPECT_EQ(reduced.finish_reason(), full.finish_reason());

  // Draws that need the whole row.
  auto planned = [&](void (*set)(SamplingParams&)) {
    SamplingParams p = greedy;
    set(p);
    return SequenceOutput(p, prompt, lm_->tokenizer.get(), {})
        .PlanReduction(padded)
        .has_value();
  };
  EXPECT_FALSE(planned([](SamplingParams& p) { p.repetition_penalty = 1.1f; }));
  EXPECT_FALSE(planned([](SamplingParams& p) { p.presence_penalty = 0.5f; }));
  EXPECT_FALSE(planned([](SamplingParams& p) { p.frequency_penalty = 0.5f; }));
  // min_tokens holds the end tokens back until it is reached.
  SamplingParams early = greedy;
  early.min_tokens = 1;
  SequenceOutput held(early, prompt, lm_->tokenizer.get(), {2});
  EXPECT_FALSE(held.PlanReduction(padded).has_value());
  ASSERT_TRUE(held.Next(logits[0]).ok());
  EXPECT_TRUE(held.PlanReduction(padded).has_value());
}

// Top-k rows reduced where the logits lie: the best top_k + 1 logits draw
// what Next draws from the whole row, with the same seed, under
// temperature, min_p and top_p, NaN and equal values.
TEST_F(GeneratorTest, TopLogitsOnTheLogitsDeviceDrawWhatNextWould) {
  const int64_t vocab = lm_->tokenizer->vocab_size();
  const std::vector<int32_t> prompt = {1, 2, 3};
  SamplingParams sampled;
  sampled.max_new_tokens = 40;
  sampled.temperature = 0.9f;
  sampled.top_k = 6;
  sampled.top_p = 0.9f;
  sampled.min_p = 0.02f;
  sampled.seed = 77;
  SequenceOutput full(sampled, prompt, lm_->tokenizer.get(), {}),
      reduced(sampled, prompt, lm_->tokenizer.get(), {});
  at::manual_seed(9);
  // Values on a coarse grid: many equal, also across the top-k cut.
  const at::Tensor logits = at::round(at::randn({40, vocab + 3}) * 2) * 0.5;
  logits.select(1, 11).fill_(std::numeric_limits<float>::quiet_NaN());
  int64_t differing = 0;
  int whole = 0;
  for (int64_t step = 0; step < 40; ++step) {
    const auto plan = reduced.PlanReduction(vocab + 3);
    ASSERT_TRUE(plan.has_value());
    EXPECT_EQ(plan->limit, vocab);
    ASSERT_EQ(plan->best, 7);
    EXPECT_EQ(plan->draw, SequenceOutput::Reduction::Draw::kTopK);
    auto want = full.Next(logits[step]);
    // More than needed, as a batch with other rows reduces.
    auto got = ReducedStep(reduced, *plan, logits[step], &whole, 2);
    ASSERT_TRUE(want.ok() && got.ok()) << want.status() << got.status();
    ASSERT_EQ(got->token_ids, want->token_ids) << "step " << step;
    differing +=
        got->token_ids[0] !=
        BestLogits(logits[step].unsqueeze(0), vocab, 1).second.item<int64_t>();
  }
  EXPECT_EQ(whole, 0);
  EXPECT_GT(differing, 0) << "every draw was the argmax: nothing sampled";
}

// RowStats (best_logits.h) against the Sampler's own arithmetic in double:
// the log partition, the tempered weights' sum under a min-p cut, the draw
// by inverse CDF in id order at a given uniform, its logit and rank.
TEST(RowStatsTest, TheSamplersSumsAndDraw) {
  const float inf = std::numeric_limits<float>::infinity();
  at::manual_seed(21);
  const int64_t vocab = 500;
  at::Tensor logits = at::randn({4, vocab + 7}) * 3;
  logits[1][17] = std::numeric_limits<float>::quiet_NaN();
  logits[2].narrow(0, 0, 300).fill_(-inf);
  std::vector<RowReduction> reductions(4);
  reductions[0] = {1.0f, -inf, 0.5};
  reductions[1] = {0.7f, 0.7f * std::log(0.05f), 0.99};
  reductions[2] = {2.5f, -inf, 0.0};
  reductions[3] = {1.3f, 1.3f * std::log(0.3f), 0.25};
  const at::Tensor stats =
      RowStats(logits, vocab, RowReductionParams(reductions)).contiguous();
  ASSERT_EQ(stats.sizes(), (at::IntArrayRef{4, kRowStats}));
  const at::Tensor keys_ids = BestLogits(logits, vocab, vocab).second;
  for (int64_t r = 0; r < 4; ++r) {
    const RowReduction& red = reductions[r];
    std::vector<float> x(vocab);
    for (int64_t i = 0; i < vocab; ++i) {
      const float v = logits[r][i].item<float>();
      x[i] = std::isnan(v) ? -inf : v;
    }
    const float max = *std::max_element(x.begin(), x.end());
    double z = 0.0;
    for (float v : x) z += std::exp(static_cast<double>(v) - max);
    std::vector<double> cumulative(vocab);
    double sum = 0.0;
    for (int64_t i = 0; i < vocab; ++i) {
      const float w = x[i] < max + red.min_p_offset
                          ? 0.0f
                          : std::exp((x[i] - max) / red.temperature);
      cumulative[i] = sum += w;
    }
    const double target = red.uniform * sum;
    const int64_t id =
        std::upper_bound(cumulative.begin(), cumulative.end(), target) -
        cumulative.begin();
    const double* got = stats[r].data_ptr<double>();
    EXPECT_NEAR(got[kLogPartition], max + std::log(z), 1e-9) << "row " << r;
    EXPECT_NEAR(got[kWeightSum], sum, kRowSumTolerance * sum) << "row " << r;
    EXPECT_NEAR(got[kDrawTarget], target, kRowSumTolerance * sum);
    ASSERT_EQ(got[kDrawId], id) << "row " << r;
    EXPECT_NEAR(got[kDrawUpTo], cumulative[id], kRowSumTolerance * sum);
    EXPECT_NEAR(got[kDrawBelow], id > 0 ? cumulative[id - 1] : 0.0,
                kRowSumTolerance * sum);
    EXPECT_EQ(got[kDrawLogit], x[id]);
    const int64_t* order = keys_ids[r].data_ptr<int64_t>();
    EXPECT_EQ(got[kDrawRank], std::find(order, order + vocab, id) - order + 1)
        << "row " << r;
  }
}

// One pass for both (what a step asks for): BestLogits' and RowStats'
// results exactly, and no stats without params.
TEST(RowStatsTest, ReduceLogitsIsBestLogitsAndRowStats) {
  at::manual_seed(22);
  at::Tensor logits = at::randn({3, 300}) * 2;
  logits[0][5] = std::numeric_limits<float>::quiet_NaN();
  logits[1][7] = -0.0f;
  const at::Tensor params = RowReductionParams(
      {{1.0f, -std::numeric_limits<float>::infinity(), 0.3},
       {0.5f, 0.5f * std::log(0.1f), 0.9},
       {2.0f, -std::numeric_limits<float>::infinity(), -1.0}});
  const ReducedLogits both = ReduceLogits(logits, 290, 7, params);
  const auto [values, ids] = BestLogits(logits, 290, 7);
  EXPECT_TRUE(at::equal(both.values, values));
  EXPECT_TRUE(at::equal(both.ids, ids));
  EXPECT_TRUE(at::equal(both.stats, RowStats(logits, 290, params)));
  EXPECT_FALSE(ReduceLogits(logits, 290, 7, at::Tensor()).stats.defined());
}

// Top-p alone, temperature alone (with min_p) and log-probabilities, each
// reduced where the logits lie: the draws and entries Next makes from the
// whole row, with the same seed. A nucleus past the best 256 (a flat row)
// is left to the whole row, drawing the same.
TEST_F(GeneratorTest, SumsOnTheLogitsDeviceDrawWhatNextWould) {
  const int64_t vocab = lm_->tokenizer->vocab_size();
  ASSERT_GT(vocab, 256) << "a nucleus past the best 256 needs more";
  const std::vector<int32_t> prompt = {1, 2, 3};
  using Draw = SequenceOutput::Reduction::Draw;
  struct Case {
    float temperature, top_p, min_p;
    int32_t logprobs;
    Draw draw;
  };
  const std::vector<Case> cases = {
      {0.8f, 0.9f, 0.0f, -1, Draw::kNucleus},
      {1.5f, 0.999f, 0.2f, 3, Draw::kNucleus},  // min_p cuts the nucleus
      {1.0f, 1.0f, 0.0f, -1, Draw::kOnDevice},
      {0.6f, 1.0f, 0.05f, 2, Draw::kOnDevice},
      {0.0f, 1.0f, 0.0f, 5, Draw::kArgmax},
  };
  at::manual_seed(12);
  const int64_t steps = 60;
  at::Tensor logits = at::randn({steps, vocab + 3}) * 2.5;
  logits.select(1, 13).fill_(std::numeric_limits<float>::quiet_NaN());
  logits[7].fill_(0.25f);  // flat: a nucleus of nearly every id
  logits[8].fill_(-std::numeric_limits<float>::infinity());
  logits[9][4] = std::numeric_limits<float>::infinity();
  for (size_t c = 0; c < cases.size(); ++c) {
    SamplingParams p;
    p.max_new_tokens = steps;
    p.temperature = cases[c].temperature;
    p.top_p = cases[c].top_p;
    p.min_p = cases[c].min_p;
    if (cases[c].logprobs >= 0) p.logprobs = cases[c].logprobs;
    p.seed = 300 + c;
    SequenceOutput full(p, prompt, lm_->tokenizer.get(), {}),
        reduced(p, prompt, lm_->tokenizer.get(), {});
    int whole = 0;
    int64_t differing = 0;
    for (int64_t step = 0; step < steps; ++step) {
      const auto plan = reduced.PlanReduction(vocab + 3);
      ASSERT_TRUE(plan.has_value()) << "case " << c;
      EXPECT_EQ(plan->draw, cases[c].draw) << "case " << c;
      auto want = full.Next(logits[step]);
      auto got = ReducedStep(reduced, *plan, logits[step], &whole);
      ASSERT_TRUE(want.ok() && got.ok()) << want.status() << got.status();
      ASSERT_EQ(got->token_ids, want->token_ids)
          << "case " << c << " step " << step;
      ExpectSameLogprobs(*got, *want, step);
      differing +=
          got->token_ids[0] != BestLogits(logits[step].unsqueeze(0), vocab, 1)
                                   .second.item<int64_t>();
    }
    if (cases[c].draw == Draw::kNucleus) {
      EXPECT_GE(whole, 1) << "case " << c << ": the flat row's nucleus";
    }
    EXPECT_LE(whole, 3) << "case " << c;
    if (cases[c].temperature > 0) EXPECT_GT(differing, 5) << "case " << c;
  }
}

// The certificates: a sum within kRowSumTolerance of a decision's edge
// leaves the draw to the whole row, drawing nothing (the RNG's sequence is
// the same as if the row had been whole throughout).
TEST(SamplerTest, ReducedDrawsNearAnEdgeAreLeftToTheWholeRow) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 5;
  Sampler sampler(p), twin(p);
  const double u = sampler.PeekUniform();
  EXPECT_EQ(sampler.PeekUniform(), u);
  std::vector<double> stats(kRowStats, 0.0);
  stats[kWeightSum] = 10.0;
  stats[kDrawTarget] = u * 10.0;
  stats[kDrawBelow] = stats[kDrawTarget] * (1 - 1e-7);  // too close
  stats[kDrawUpTo] = stats[kDrawTarget] + 1.0;
  EXPECT_FALSE(sampler.TakeRowDraw(0.0f, stats));
  stats[kDrawBelow] = stats[kDrawTarget] * (1 - 1e-5);
  EXPECT_TRUE(sampler.TakeRowDraw(0.0f, stats));
  EXPECT_FALSE(sampler.TakeRowDraw(std::numeric_limits<float>::infinity(),
                                   stats));  // +inf: no draw
  // The draw took u: the next is the RNG's second.
  const at::Tensor flat = at::zeros({4});
  EXPECT_EQ(twin.Sample(flat, {}), static_cast<int32_t>(u * 4));
  EXPECT_EQ(sampler.PeekUniform(), twin.PeekUniform());

  // Top-p: the nucleus's edge within the tolerance of the threshold.
  p.top_p = 0.5f;
  Sampler nucleus(p);
  const std::vector<float> best = {0.0f, 0.0f, 0.0f, 0.0f};  // weights 1
  EXPECT_EQ(nucleus.DrawNucleusFromBest(best, 4.0 * (1 + 1e-7)),
            std::nullopt);  // 2 of 4 is the edge
  EXPECT_EQ(nucleus.DrawNucleusFromBest(best, 20.0), std::nullopt);  // past
  const std::optional<int32_t> drawn = nucleus.DrawNucleusFromBest(best, 5.0);
  ASSERT_TRUE(drawn.has_value());
  EXPECT_LT(*drawn, 3);
}

// A step's plan (StepDraws): the rows whose reduced logits decide their draw
// set the batch's reduction, the others come back whole, in row order, and
// rows that draw nothing read no logits. Without `reduce`, every row whole.
TEST_F(GeneratorTest, StepDrawsReduceWhatTheReducedLogitsDecide) {
  const int64_t vocab = lm_->model->config().vocab_size;
  const std::vector<int32_t> prompt = {1, 2, 3};
  SamplingParams greedy, top_k, penalty, nucleus;
  greedy.max_new_tokens = top_k.max_new_tokens = 4;
  penalty.max_new_tokens = nucleus.max_new_tokens = 4;
  top_k.temperature = penalty.temperature = nucleus.temperature = 0.7f;
  top_k.top_k = 5;
  penalty.presence_penalty = 0.5f;
  nucleus.top_p = 0.9f;
  const Tokenizer* tokenizer = lm_->tokenizer.get();
  SequenceOutput a(greedy, prompt, tokenizer, {}),
      b(penalty, prompt, tokenizer, {}), c(top_k, prompt, tokenizer, {}),
      d(nucleus, prompt, tokenizer, {});
  DecoderBatch batch;
  StepDraws draws({&a, &b, nullptr, &c, &d}, vocab, true, batch);
  EXPECT_EQ(batch.top_logits_limit, tokenizer->vocab_size());
  EXPECT_EQ(batch.top_logits, 256);  // the nucleus's best 256
  EXPECT_EQ(batch.whole_logits,
            std::vector<bool>({false, true, false, false, false}));
  ASSERT_EQ(batch.row_reductions.size(), 5u);
  EXPECT_FLOAT_EQ(batch.row_reductions[4].temperature, 0.7f);
  for (size_t r : {0, 2, 3}) {  // no sums asked: left at the defaults
    EXPECT_EQ(batch.row_reductions[r].temperature, 1.0f) << "row " << r;
  }
  const std::vector<int64_t> rows = {draws.whole_row(0), draws.whole_row(1),
                                     draws.whole_row(2), draws.whole_row(3),
                                     draws.whole_row(4)};
  EXPECT_EQ(rows, std::vector<int64_t>({-1, 0, -1, -1, -1}));

  DecoderBatch plain;
  StepDraws whole({&a, nullptr, &b}, vocab, false, plain);
  EXPECT_EQ(plain.top_logits, 0);
  EXPECT_TRUE(plain.whole_logits.empty());
  EXPECT_EQ(whole.whole_row(0), 0);
  EXPECT_EQ(whole.whole_row(1), 1);  // every row of the step's logits
  EXPECT_EQ(whole.whole_row(2), 2);
}

// Generator with its steps reduced where the logits lie (what a GPU does;
// MOH_REDUCE_LOGITS=1 here) generates what it does from whole rows: one
// batch of greedy, top-k, top-p, temperature-alone, log-probability and
// penalty rows at two ratios, the prefill step and the decode steps.
TEST_F(GeneratorTest, StepsReducedWhereTheLogitsLieGenerateTheSame) {
  setenv("MOH_REDUCE_LOGITS", "1", 1);
  const Generator reducing(*lm_->model, lm_->tokenizer.get(), lm_->eos_ids);
  unsetenv("MOH_REDUCE_LOGITS");
  const Generator whole(*lm_->model, lm_->tokenizer.get(), lm_->eos_ids);
  EXPECT_FALSE(ReduceLogitsWhereTheyLie(*lm_->model));
  setenv("MOH_REDUCE_LOGITS", "0", 1);  // whole rows on any device
  EXPECT_FALSE(ReduceLogitsWhereTheyLie(*lm_->model));
  setenv("MOH_REDUCE_LOGITS", "1", 1);
  EXPECT_TRUE(ReduceLogitsWhereTheyLie(*lm_->model));
  unsetenv("MOH_REDUCE_LOGITS");
  const std::vector<GenerationRequest> requests =
      MixedDrawRequests(*lm_->tokenizer);
  auto got = reducing.Generate(requests);
  auto want = whole.Generate(requests);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(want.ok()) << want.status();
  ExpectSameDraws(*got, *want, 1e-6);
}

}  // namespace
}  // namespace moh
