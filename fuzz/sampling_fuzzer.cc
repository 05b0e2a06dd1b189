// Fuzzes a request's sampling settings (model/generation/sampler.h):
// ValidateSamplingParams on any field values (floats as raw bit patterns:
// NaN, infinities), then, for settings it accepts, the Sampler on fuzzed
// logits and history and the StopStringMatcher on fuzzed streamed text.
// Checked: a refusal is INVALID_ARGUMENT; a sampled id lies in the vocabulary
// and is the same for the same seed; its log-probability entry is no NaN and
// at most 0, its rank in [1, vocab], its alternatives best first; the matcher
// emits a prefix of the text,
// cut right before the earliest stop string it has seen, everything when none
// appears.
#include <ATen/ATen.h>
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz/fuzz_check.h"
#include "model/generation/sampler.h"

namespace {

float AnyFloat(FuzzedDataProvider& in) {
  const uint32_t bits = in.ConsumeIntegral<uint32_t>();
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

void CheckSampler(const moh::SamplingParams& params, FuzzedDataProvider& in) {
  const int vocab = in.ConsumeIntegralInRange<int>(1, 300);
  std::vector<float> logits(vocab);
  for (float& logit : logits) {
    logit = in.ConsumeBool() ? AnyFloat(in)
                             : in.ConsumeIntegralInRange<int>(-20, 20) / 4.0f;
  }
  std::vector<int32_t> history(in.ConsumeIntegralInRange<int>(0, 16));
  for (int32_t& id : history) id = in.ConsumeIntegralInRange(-2, vocab + 1);
  const at::Tensor tensor = at::from_blob(logits.data(), {vocab}, at::kFloat);
  moh::Sampler first(params);
  moh::Sampler second(params);
  size_t generated = in.ConsumeIntegralInRange<size_t>(0, history.size());
  for (int step = 0; step < 2; ++step) {
    const int32_t id = first.Sample(tensor, history, generated);
    MOH_FUZZ_CHECK(id >= 0 && id < vocab,
                   absl::StrCat("sampled ", id, " of ", vocab));
    MOH_FUZZ_CHECK(second.Sample(tensor, history, generated) == id,
                   "two samplers with one seed disagree");
    const moh::LogprobEntry entry = moh::ComputeLogprobs(
        tensor, id, params.logprobs.value_or(moh::kMaxLogprobs));
    MOH_FUZZ_CHECK(entry.token.id == id && entry.token.logprob <= 0.0f,
                   absl::StrCat("logprob ", entry.token.logprob));
    MOH_FUZZ_CHECK(entry.rank >= 1 && entry.rank <= vocab,
                   absl::StrCat("rank ", entry.rank, " of ", vocab));
    for (size_t i = 0; i < entry.top.size(); ++i) {
      MOH_FUZZ_CHECK(
          entry.top[i].logprob <= 0.0f &&
              (i == 0 || entry.top[i].logprob <= entry.top[i - 1].logprob),
          "alternatives out of order");
    }
    history.push_back(id);
    ++generated;
  }
}

void CheckStopStrings(const std::vector<std::string>& stops,
                      FuzzedDataProvider& in) {
  moh::StopStringMatcher matcher(stops);
  std::string text, emitted;
  size_t stopped_at = std::string::npos;  // Text length when it stopped.
  while (in.remaining_bytes() > 0 && stopped_at == std::string::npos) {
    const std::string piece = in.ConsumeRandomLengthString(16);
    text += piece;
    moh::StopStringMatcher::Result result = matcher.Push(piece);
    emitted += result.emit;
    if (result.stopped) stopped_at = text.size();
  }
  MOH_FUZZ_CHECK(text.compare(0, emitted.size(), emitted) == 0,
                 "emitted text is not a prefix of the text");
  if (stopped_at == std::string::npos) {
    emitted += matcher.Flush();
    MOH_FUZZ_CHECK(emitted == text, "text lost without a stop string");
  } else {
    MOH_FUZZ_CHECK(matcher.Flush().empty(), "Flush after a stop");
  }
  const size_t seen = std::min(stopped_at, text.size());
  bool cut_at_stop = stopped_at == std::string::npos;
  for (const std::string& stop : stops) {
    const size_t at = text.find(stop);
    if (at != std::string::npos && at + stop.size() <= seen) {
      MOH_FUZZ_CHECK(at >= emitted.size(),
                     absl::StrCat("emitted past stop string \"", stop, "\""));
    }
    cut_at_stop |= text.compare(emitted.size(), stop.size(), stop) == 0;
  }
  MOH_FUZZ_CHECK(cut_at_stop, "stopped, but not before a stop string");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  moh::SamplingParams params;
  params.max_new_tokens = in.ConsumeIntegral<int32_t>();
  params.temperature = AnyFloat(in);
  params.top_k = in.ConsumeIntegral<int32_t>();
  params.top_p = AnyFloat(in);
  params.repetition_penalty = AnyFloat(in);
  params.seed = in.ConsumeIntegral<uint64_t>();
  params.stop.resize(in.ConsumeIntegralInRange<int>(0, moh::kMaxStopStrings));
  for (std::string& stop : params.stop) stop = in.ConsumeRandomLengthString(8);
  params.presence_penalty = AnyFloat(in);
  params.frequency_penalty = AnyFloat(in);
  params.min_p = AnyFloat(in);
  if (in.ConsumeBool()) params.logprobs = in.ConsumeIntegral<int32_t>();
  const int32_t limit = in.ConsumeIntegral<int32_t>();
  const absl::Status valid = moh::ValidateSamplingParams(params, limit);
  if (!valid.ok()) {
    moh::fuzz::CheckInvalidArgument(valid);
    return 0;
  }
  CheckSampler(params, in);
  CheckStopStrings(params.stop, in);
  return 0;
}
