// Requests and checks shared by the generation tests on the CPU and on CUDA.
#pragma once

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "model/generation/generator.h"
#include "model/tokenizer/tokenizer.h"

namespace moh {

// Six requests, one batch, that draw each way StepDraws plans: greedy,
// top-k with log-probabilities, top-p, temperature alone with
// log-probabilities, temperature alone, and a penalty (whole rows), at
// ratios 1.0 and 0.5, 12 tokens each past EOS.
inline std::vector<GenerationRequest> MixedDrawRequests(
    const Tokenizer& tokenizer) {
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 6; ++i) {
    GenerationRequest r;
    r.prompt_ids = tokenizer.Encode(i % 2 ? "Once upon a time" : "the owl",
                                    /*add_special_tokens=*/true);
    r.sampling.max_new_tokens = 12;
    r.ratio = i % 2 ? 0.5f : 1.0f;
    r.sampling.ignore_eos = true;
    r.sampling.seed = 60 + i;
    if (i > 0) r.sampling.temperature = 0.9f;
    if (i == 1) r.sampling.top_k = 4;
    if (i == 2) r.sampling.top_p = 0.8f;
    if (i == 1 || i == 3) r.sampling.logprobs = 2;
    if (i == 5) r.sampling.frequency_penalty = 0.4f;
    requests.push_back(r);
  }
  return requests;
}

// `got` drew what `want` drew: the same ids and text, and log-probabilities
// within `tolerance` (relative; the log partition summed in another order).
inline void ExpectSameDraws(const std::vector<GenerationResult>& got,
                            const std::vector<GenerationResult>& want,
                            double tolerance) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const GenerationResult& g = got[i];
    const GenerationResult& w = want[i];
    EXPECT_EQ(g.token_ids, w.token_ids) << "row " << i;
    EXPECT_EQ(g.text, w.text) << "row " << i;
    ASSERT_EQ(g.logprobs.size(), w.logprobs.size()) << "row " << i;
    for (size_t t = 0; t < g.logprobs.size(); ++t) {
      const LogprobEntry& a = g.logprobs[t];
      const LogprobEntry& b = w.logprobs[t];
      EXPECT_EQ(a.token.id, b.token.id) << "row " << i << " token " << t;
      EXPECT_EQ(a.rank, b.rank) << "row " << i << " token " << t;
      if (std::isfinite(b.token.logprob)) {
        EXPECT_NEAR(a.token.logprob, b.token.logprob,
                    tolerance * (1 + std::fabs(b.token.logprob)))
            << "row " << i << " token " << t;
      } else {
        EXPECT_EQ(a.token.logprob, b.token.logprob)
            << "row " << i << " token " << t;
      }
    }
  }
}

}  // namespace moh
