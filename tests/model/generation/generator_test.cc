// In-process generation and label scoring on the reference fixtures.
#include "model/generation/generator.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/core/best_logits.h"
#include "model/generation/language_model.h"
#include "nlohmann/json.hpp"

namespace moh {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

const std::string kModelDir = std::string(MOH_FIXTURES_DIR) + "/llama_learned";

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

// Greedy rows reduced where the logits lie (language_steps.cc): ArgmaxLimit
// says when the argmax is the draw, and BestLogits + NextArgmax stream what
// Next would from the whole row, NaN, ties and -inf rows included.
TEST_F(GeneratorTest, ArgmaxOnTheLogitsDeviceStreamsWhatNextWould) {
  const int64_t vocab = lm_->tokenizer->vocab_size();
  const int64_t padded = vocab + 5;  // rows past the tokenizer: never drawn
  const std::vector<int32_t> prompt = {1, 2, 3};
  SamplingParams greedy;
  greedy.max_new_tokens = 6;
  SequenceOutput full(greedy, prompt, lm_->tokenizer.get(), {}),
      reduced(greedy, prompt, lm_->tokenizer.get(), {});
  EXPECT_EQ(SequenceOutput(greedy, prompt, nullptr, {}).ArgmaxLimit(padded),
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
  for (int64_t step = 0; step < 6; ++step) {
    ASSERT_EQ(reduced.ArgmaxLimit(padded), vocab);
    auto want = full.Next(logits[step]);
    auto got = reduced.NextArgmax(ids[step].item<int64_t>());
    ASSERT_TRUE(want.ok() && got.ok()) << want.status() << got.status();
    EXPECT_EQ(got->token_ids, want->token_ids) << "step " << step;
    EXPECT_EQ(got->text, want->text) << "step " << step;
  }
  EXPECT_EQ(reduced.history(), full.history());
  EXPECT_EQ(reduced.finish_reason(), full.finish_reason());

  // Draws the argmax is not.
  auto limit = [&](void (*set)(SamplingParams&)) {
    SamplingParams p = greedy;
    set(p);
    return SequenceOutput(p, prompt, lm_->tokenizer.get(), {})
        .ArgmaxLimit(padded);
  };
  EXPECT_EQ(limit([](SamplingParams& p) { p.temperature = 0.7f; }),
            std::nullopt);
  EXPECT_EQ(limit([](SamplingParams& p) { p.repetition_penalty = 1.1f; }),
            std::nullopt);
  EXPECT_EQ(limit([](SamplingParams& p) { p.presence_penalty = 0.5f; }),
            std::nullopt);
  EXPECT_EQ(limit([](SamplingParams& p) { p.frequency_penalty = 0.5f; }),
            std::nullopt);
  EXPECT_EQ(limit([](SamplingParams& p) { p.logprobs = 0; }), std::nullopt);
  // min_tokens holds the end tokens back until it is reached.
  SamplingParams early = greedy;
  early.min_tokens = 1;
  SequenceOutput held(early, prompt, lm_->tokenizer.get(), {2});
  EXPECT_EQ(held.ArgmaxLimit(padded), std::nullopt);
  ASSERT_TRUE(held.Next(logits[0]).ok());
  EXPECT_EQ(held.ArgmaxLimit(padded), vocab);
}

// Top-k rows reduced where the logits lie: the best top_k + 1 logits and
// NextFromTop draw what Next draws from the whole row, with the same seed,
// under temperature, min_p and top_p, NaN and equal values.
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
  for (int64_t step = 0; step < 40; ++step) {
    const auto top = reduced.TopLogitsNeeded(vocab + 3);
    ASSERT_TRUE(top.has_value());
    EXPECT_EQ(top->limit, vocab);
    ASSERT_EQ(top->count, 7);
    auto [values, ids] = BestLogits(logits.narrow(0, step, 1), top->limit,
                                    top->count + 2);  // more than needed
    values = values[0].contiguous();
    ids = ids[0].contiguous();
    auto want = full.Next(logits[step]);
    auto got = reduced.NextFromTop(
        values, absl::MakeConstSpan(ids.data_ptr<int64_t>(), ids.numel()));
    ASSERT_TRUE(want.ok() && got.ok()) << want.status() << got.status();
    ASSERT_EQ(got->token_ids, want->token_ids) << "step " << step;
    differing += got->token_ids[0] != ids[0].item<int64_t>();
  }
  EXPECT_GT(differing, 0) << "every draw was the argmax: nothing sampled";

  // Draws the best few do not decide.
  auto needed = [&](void (*set)(SamplingParams&)) {
    SamplingParams p = sampled;
    set(p);
    return SequenceOutput(p, prompt, lm_->tokenizer.get(), {})
        .TopLogitsNeeded(vocab)
        .has_value();
  };
  EXPECT_FALSE(needed([](SamplingParams& p) { p.top_k = 0; }));
  EXPECT_FALSE(needed([](SamplingParams& p) { p.temperature = 0.0f; }));
  EXPECT_FALSE(needed([](SamplingParams& p) { p.repetition_penalty = 1.3f; }));
  EXPECT_FALSE(needed([](SamplingParams& p) { p.logprobs = 2; }));
  EXPECT_FALSE(needed([](SamplingParams& p) { p.top_k = 1 << 20; }));
}

}  // namespace
}  // namespace moh
