// LanguageExecutor on the llama_learned fixture: greedy output equals
// the independent Python reference whatever the batch, queue, chunking and
// admission order; cancellation, deadlines, queue limits, draining, adaptive
// activation, validation and shutdown.
#include "service/language/language_executor.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/generation/generator.h"
#include "model/generation/language_model.h"
#include "nlohmann/json.hpp"
#include "prometheus/registry.h"
#include "service/metrics/metrics.h"
#include "tests/base/test_paths.h"

namespace moh {
namespace {

using nlohmann::json;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

const std::string kModelDir = test_paths::FixturesDir() + "/llama_learned";
const absl::Duration kWait = absl::Seconds(60);

json Golden() {
  std::ifstream in(kModelDir + "/golden.json");
  std::stringstream s;
  s << in.rdbuf();
  return json::parse(s.str());
}

// Records one job's stream. Optionally blocks the loop thread inside its first
// OnChunk until Release() (tests use this to hold the scheduler mid-step).
class Recorder : public GenerationObserver {
 public:
  explicit Recorder(bool block_first_chunk = false)
      : block_first_chunk_(block_first_chunk) {}

  void OnChunk(const GenerationChunk& chunk) override {
    {
      absl::MutexLock lock(&mu_);
      ++chunks_;
      text_ += chunk.text;
      ids_.insert(ids_.end(), chunk.token_ids.begin(), chunk.token_ids.end());
      logprobs_.insert(logprobs_.end(), chunk.logprobs.begin(),
                       chunk.logprobs.end());
      if (chunk.token_ids.empty()) ++chunks_without_ids_;
      if (terminal_calls_ > 0) ++calls_after_end_;
    }
    if (!first_chunk_.HasBeenNotified()) {
      first_chunk_.Notify();
      if (block_first_chunk_) release_.WaitForNotificationWithTimeout(kWait);
    }
  }
  void OnFinished(const GenerationSummary& summary) override {
    absl::MutexLock lock(&mu_);
    summary_ = summary;
    End();
  }
  void OnError(const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    status_ = status;
    End();
  }

  bool WaitDone() { return done_.WaitForNotificationWithTimeout(kWait); }
  bool WaitFirstChunk() {
    return first_chunk_.WaitForNotificationWithTimeout(kWait);
  }
  // Waits for the first chunk or the end, whichever comes first.
  void WaitFirstChunkOrDone() {
    const absl::Time until = absl::Now() + kWait;
    while (!first_chunk_.HasBeenNotified() && !done_.HasBeenNotified() &&
           absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  void Release() { release_.Notify(); }
  bool done() const { return done_.HasBeenNotified(); }

  absl::Status status() const {
    absl::MutexLock lock(&mu_);
    return status_;
  }
  GenerationSummary summary() const {
    absl::MutexLock lock(&mu_);
    return summary_;
  }
  std::vector<int32_t> ids() const {
    absl::MutexLock lock(&mu_);
    return ids_;
  }
  std::string text() const {
    absl::MutexLock lock(&mu_);
    return text_;
  }
  std::vector<LogprobEntry> logprobs() const {
    absl::MutexLock lock(&mu_);
    return logprobs_;
  }
  int chunks() const {
    absl::MutexLock lock(&mu_);
    return chunks_;
  }
  // Protocol violations: more than one terminal call, chunks after it, or
  // chunks without token ids.
  int violations() const {
    absl::MutexLock lock(&mu_);
    return std::max(0, terminal_calls_ - 1) + calls_after_end_ +
           chunks_without_ids_;
  }

 private:
  void End() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (++terminal_calls_ == 1) done_.Notify();
  }

  const bool block_first_chunk_;
  absl::Notification first_chunk_, release_, done_;
  mutable absl::Mutex mu_;
  int chunks_ ABSL_GUARDED_BY(mu_) = 0;
  int chunks_without_ids_ ABSL_GUARDED_BY(mu_) = 0;
  int terminal_calls_ ABSL_GUARDED_BY(mu_) = 0;
  int calls_after_end_ ABSL_GUARDED_BY(mu_) = 0;
  std::string text_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> ids_ ABSL_GUARDED_BY(mu_);
  std::vector<LogprobEntry> logprobs_ ABSL_GUARDED_BY(mu_);
  GenerationSummary summary_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

struct GoldenCase {
  float ratio;
  std::vector<int32_t> prompt;
  std::vector<int32_t> greedy;
};

class LanguageExecutorTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto lm = LanguageModel::Load(kModelDir, DeviceOptions{"cpu", "float32"});
    ASSERT_TRUE(lm.ok()) << lm.status();
    lm_ = new LanguageModel(std::move(*lm));
    const json golden = Golden();
    for (const json& c : golden["cases"]) {
      cases_.push_back(GoldenCase{
          c["ratio"].get<float>(),
          golden["prompts"][c["prompt"].get<int>()].get<std::vector<int32_t>>(),
          c["greedy"].get<std::vector<int32_t>>()});
    }
  }
  static void TearDownTestSuite() {
    delete lm_;
    lm_ = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(lm_, nullptr);
    ASSERT_GE(cases_.size(), 8u);
    metrics_registry_ = std::make_shared<prometheus::Registry>();
    metrics_ = std::make_unique<Metrics>(metrics_registry_);
    model_metrics_ = metrics_->ForModel("m", lm_->model->config().num_layers,
                                        lm_->model->config().num_heads, true);
  }

  std::unique_ptr<LanguageExecutor> MakeScheduler(
      LanguageExecutor::Options options = {},
      const LanguageModel* lm = nullptr) {
    options.model_name = "test";
    auto scheduler = LanguageExecutor::Create(
        options, lm != nullptr ? *lm : *lm_, model_metrics_);
    EXPECT_TRUE(scheduler.ok()) << scheduler.status();
    return scheduler.ok() ? std::move(*scheduler) : nullptr;
  }

  static GenerationJob Job(const std::vector<int32_t>& prompt,
                           int max_new_tokens, float ratio = 0.0f) {
    GenerationJob job;
    job.prompt_ids = prompt;
    job.sampling.max_new_tokens = max_new_tokens;
    job.ratio = ratio;
    return job;
  }
  static GenerationJob Job(const GoldenCase& c) {
    return Job(c.prompt, c.greedy.size(), c.ratio);
  }
  // The Generator's request for what `job` asks.
  static GenerationRequest RequestOf(const GenerationJob& job) {
    GenerationRequest request;
    request.prompt_ids = job.prompt_ids;
    request.sampling = job.sampling;
    request.ratio = job.ratio;
    return request;
  }

  // Submits and returns the recorder (fails the test if Submit fails).
  std::shared_ptr<Recorder> Run(LanguageExecutor& scheduler, GenerationJob job,
                                bool block = false, uint64_t* id = nullptr) {
    auto recorder = std::make_shared<Recorder>(block);
    absl::StatusOr<uint64_t> submitted =
        scheduler.Submit(std::move(job), recorder);
    EXPECT_TRUE(submitted.ok()) << submitted.status();
    if (id != nullptr && submitted.ok()) *id = *submitted;
    return recorder;
  }

  // The job finished normally with exactly the golden greedy tokens.
  static void ExpectGolden(Recorder& r, const GoldenCase& c) {
    ASSERT_TRUE(r.WaitDone());
    ASSERT_TRUE(r.status().ok()) << r.status();
    EXPECT_EQ(r.violations(), 0);
    EXPECT_THAT(r.ids(), ElementsAreArray(c.greedy))
        << "ratio " << c.ratio << " prompt size " << c.prompt.size();
    const GenerationSummary s = r.summary();
    EXPECT_EQ(s.finish_reason, FinishReason::kLength);
    EXPECT_EQ(s.prompt_tokens, static_cast<int32_t>(c.prompt.size()));
    EXPECT_EQ(s.completion_tokens, static_cast<int32_t>(c.greedy.size()));
    EXPECT_EQ(s.routed_tokens,
              static_cast<int64_t>(c.prompt.size() + c.greedy.size() - 1));
    // The ratio applied: the one asked for, or the trained default.
    const double applied =
        c.ratio > 0 ? c.ratio : lm_->model->config().moh.DefaultRatio();
    EXPECT_FLOAT_EQ(s.applied_ratio, static_cast<float>(applied));
  }

  double CounterSum(const std::string& name) {
    double sum = 0;
    for (const auto& family : metrics_registry_->Collect()) {
      if (family.name != name) continue;
      for (const auto& m : family.metric) sum += m.counter.value;
    }
    return sum;
  }

  // Observations of histogram `name` with label kind=`kind`.
  uint64_t HistogramCount(const std::string& name, const std::string& kind) {
    for (const auto& family : metrics_registry_->Collect()) {
      if (family.name != name) continue;
      for (const auto& m : family.metric) {
        for (const auto& label : m.label) {
          if (label.name == "kind" && label.value == kind) {
            return m.histogram.sample_count;
          }
        }
      }
    }
    return 0;
  }

  static LanguageModel* lm_;
  static std::vector<GoldenCase> cases_;
  std::shared_ptr<prometheus::Registry> metrics_registry_;
  std::unique_ptr<Metrics> metrics_;
  ModelMetrics* model_metrics_ = nullptr;
};

LanguageModel* LanguageExecutorTest::lm_ = nullptr;
std::vector<GoldenCase> LanguageExecutorTest::cases_;

TEST_F(LanguageExecutorTest, AllGoldenCasesAtOnceWithMixedRatios) {
  auto scheduler = MakeScheduler();
  ASSERT_NE(scheduler, nullptr);
  EXPECT_EQ(scheduler->max_seq_len(),
            lm_->model->config().max_position_embeddings);
  std::vector<std::shared_ptr<Recorder>> recorders;
  for (const GoldenCase& c : cases_)
    recorders.push_back(Run(*scheduler, Job(c)));
  for (size_t i = 0; i < cases_.size(); ++i) {
    ExpectGolden(*recorders[i], cases_[i]);
    const GenerationSummary s = recorders[i]->summary();
    ASSERT_EQ(s.head_tokens.size(),
              static_cast<size_t>(lm_->model->config().num_layers *
                                  lm_->model->config().num_heads));
    int64_t used = 0;
    for (int64_t n : s.head_tokens) used += n;
    EXPECT_DOUBLE_EQ(
        s.effective_ratio,
        static_cast<double>(used) / (s.routed_tokens * s.head_tokens.size()));
    if (cases_[i].ratio == 1.0f) EXPECT_DOUBLE_EQ(s.effective_ratio, 1.0);
    if (cases_[i].ratio == 0.5f) EXPECT_DOUBLE_EQ(s.effective_ratio, 0.5);
    // Text is the decoding of the ids (no EOS or stop string involved).
    auto decoded = lm_->tokenizer->Decode(recorders[i]->ids(), true);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(recorders[i]->text(), *decoded);
  }
  EXPECT_EQ(scheduler->num_running(), 0);
  EXPECT_EQ(scheduler->num_waiting(), 0);
  int64_t generated = 0;
  for (const GoldenCase& c : cases_) generated += c.greedy.size();
  EXPECT_EQ(CounterSum("moh_generated_tokens_total"), generated);
}

TEST_F(LanguageExecutorTest, StaggeredSubmissionsJoinTheRunningBatch) {
  auto scheduler = MakeScheduler();
  ASSERT_NE(scheduler, nullptr);
  const size_t half = cases_.size() / 2;
  std::vector<std::shared_ptr<Recorder>> recorders;
  for (size_t i = 0; i < half; ++i) {
    recorders.push_back(Run(*scheduler, Job(cases_[i])));
  }
  // The first ones are decoding when the rest arrive.
  for (size_t i = 0; i < half; ++i) ASSERT_TRUE(recorders[i]->WaitFirstChunk());
  for (size_t i = half; i < cases_.size(); ++i) {
    recorders.push_back(Run(*scheduler, Job(cases_[i])));
    if (i % 3 == 0) ASSERT_TRUE(recorders.back()->WaitFirstChunk());
  }
  for (size_t i = 0; i < cases_.size(); ++i) {
    ExpectGolden(*recorders[i], cases_[i]);
  }
}

TEST_F(LanguageExecutorTest, ChunkedPrefillMatchesUnchunked) {
  // Long prompts: every golden prompt concatenated, rotated per job.
  std::vector<int32_t> all;
  for (const GoldenCase& c : cases_) {
    if (c.ratio != cases_[0].ratio) break;
    all.insert(all.end(), c.prompt.begin(), c.prompt.end());
  }
  ASSERT_GT(all.size(), 20u);
  std::vector<GenerationJob> jobs;
  const float ratios[] = {0.0f, 0.5f, 0.75f, 1.0f};
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> prompt(all.begin() + i, all.end() - 3 * i);
    jobs.push_back(Job(prompt, 12, ratios[i]));
  }
  LanguageExecutor::Options chunked;
  chunked.prefill_token_budget = 3;
  LanguageExecutor::Options whole;
  std::vector<std::vector<int32_t>> outputs[2];
  std::vector<double> ratios_out[2];
  int k = 0;
  for (const auto& options : {chunked, whole}) {
    auto scheduler = MakeScheduler(options);
    ASSERT_NE(scheduler, nullptr);
    std::vector<std::shared_ptr<Recorder>> recorders;
    for (const GenerationJob& job : jobs)
      recorders.push_back(Run(*scheduler, job));
    for (auto& r : recorders) {
      ASSERT_TRUE(r->WaitDone());
      ASSERT_TRUE(r->status().ok()) << r->status();
      outputs[k].push_back(r->ids());
      ratios_out[k].push_back(r->summary().effective_ratio);
      EXPECT_EQ(r->summary().routed_tokens,
                static_cast<int64_t>(r->summary().prompt_tokens + 12 - 1));
    }
    if (k == 0) {
      // At most 3 prompt tokens per step: the prompts took many steps.
      int64_t prompt_tokens = 0;
      for (const GenerationJob& job : jobs)
        prompt_tokens += job.prompt_ids.size();
      EXPECT_EQ(CounterSum("moh_prompt_tokens_total"), prompt_tokens);
      EXPECT_GE(HistogramCount("moh_batch_size", "prefill"),
                (prompt_tokens + 2) / 3);
    }
    ++k;
  }
  // The static-batch reference Generator agrees as well.
  Generator generator(*lm_->model, lm_->tokenizer.get(), lm_->eos_ids);
  for (size_t i = 0; i < jobs.size(); ++i) {
    EXPECT_EQ(outputs[0][i], outputs[1][i]) << "job " << i;
    EXPECT_NEAR(ratios_out[0][i], ratios_out[1][i], 1e-9);
    auto reference = generator.Generate({RequestOf(jobs[i])});
    ASSERT_TRUE(reference.ok()) << reference.status();
    EXPECT_EQ(outputs[0][i], (*reference)[0].token_ids) << "job " << i;
    EXPECT_NEAR(ratios_out[0][i], (*reference)[0].effective_ratio, 1e-9);
  }
}

TEST_F(LanguageExecutorTest, QueuedJobsRunWhenSlotsFree) {
  LanguageExecutor::Options options;
  options.max_running = 2;
  auto scheduler = MakeScheduler(options);
  ASSERT_NE(scheduler, nullptr);
  std::vector<std::shared_ptr<Recorder>> recorders;
  for (size_t i = 0; i < 6; ++i)
    recorders.push_back(Run(*scheduler, Job(cases_[i])));
  EXPECT_LE(scheduler->num_running(), 2);
  for (size_t i = 0; i < 6; ++i) ExpectGolden(*recorders[i], cases_[i]);
  EXPECT_EQ(scheduler->num_running(), 0);
}

TEST_F(LanguageExecutorTest, CancelMidStreamFreesTheSlot) {
  LanguageExecutor::Options options;
  options.max_running = 1;
  auto scheduler = MakeScheduler(options);
  ASSERT_NE(scheduler, nullptr);
  uint64_t id = 0;
  auto cancelled = Run(*scheduler, Job(cases_[0].prompt, 200), true, &id);
  auto next = Run(*scheduler, Job(cases_[1]));  // waits for the only slot
  ASSERT_TRUE(cancelled->WaitFirstChunk());
  scheduler->Cancel(id);
  cancelled->Release();
  ASSERT_TRUE(cancelled->WaitDone());
  ASSERT_TRUE(cancelled->status().ok()) << cancelled->status();
  const GenerationSummary s = cancelled->summary();
  EXPECT_EQ(s.finish_reason, FinishReason::kCancelled);
  EXPECT_LT(s.completion_tokens, 200);
  EXPECT_EQ(s.completion_tokens, static_cast<int32_t>(cancelled->ids().size()));
  EXPECT_EQ(cancelled->violations(), 0);
  ExpectGolden(*next, cases_[1]);
  EXPECT_EQ(scheduler->num_running(), 0);
  scheduler->Cancel(id);  // finished: no-op
  scheduler->Cancel(12345);
}

// Requests reaching an idle scheduler 20 ms apart start in one step when it
// waits (idle_gather) for more, and in a step each when it does not.
TEST_F(LanguageExecutorTest, IdleSchedulerGathersArrivals) {
  for (const absl::Duration gather :
       {absl::Milliseconds(100), absl::ZeroDuration()}) {
    SetUp();  // fresh metrics
    LanguageExecutor::Options options;
    options.max_running = 3;  // the third arrival ends the wait
    options.idle_gather = gather;
    auto scheduler = MakeScheduler(options);
    ASSERT_NE(scheduler, nullptr);
    std::vector<std::shared_ptr<Recorder>> recorders;
    for (size_t i = 0; i < 3; ++i) {
      if (i > 0) absl::SleepFor(absl::Milliseconds(20));
      recorders.push_back(Run(*scheduler, Job(cases_[i])));
    }
    for (size_t i = 0; i < 3; ++i) ExpectGolden(*recorders[i], cases_[i]);
    const uint64_t prefill_steps = HistogramCount("moh_batch_size", "prefill");
    if (gather > absl::ZeroDuration()) {
      EXPECT_EQ(prefill_steps, 1u);
    } else {
      EXPECT_GE(prefill_steps, 2u);
    }
  }
}

// The idle wait ends as soon as as many requests are back as the loop last
// ran together, and a request arriving after that starts in a step of its
// own. Without the early end, each of the bursts below would start in one
// step (every arrival comes within idle_gather of the previous one).
TEST_F(LanguageExecutorTest, IdleGatherEndsWhenTheClientsAreBack) {
  LanguageExecutor::Options options;
  options.max_running = 4;
  options.idle_gather = absl::Milliseconds(100);
  auto scheduler = MakeScheduler(options);
  ASSERT_NE(scheduler, nullptr);
  const auto finish = [](Recorder& r) {
    ASSERT_TRUE(r.WaitDone());
    EXPECT_TRUE(r.status().ok()) << r.status();
    EXPECT_EQ(r.ids().size(), 16u);
  };
  // Submits requests `delays` apart, the first holding the loop in its first
  // chunk until all are in; returns how many prefill steps they took.
  const auto burst = [&](const std::vector<absl::Duration>& delays) {
    const uint64_t before = HistogramCount("moh_batch_size", "prefill");
    std::vector<std::shared_ptr<Recorder>> recorders;
    for (size_t i = 0; i <= delays.size(); ++i) {
      if (i > 0) absl::SleepFor(delays[i - 1]);
      recorders.push_back(
          Run(*scheduler, Job(cases_[i].prompt, 16), /*block=*/i == 0));
    }
    recorders[0]->Release();
    for (auto& r : recorders) finish(*r);
    return HistogramCount("moh_batch_size", "prefill") - before;
  };
  // Nothing ran yet: the first request waits out idle_gather alone.
  auto lone = Run(*scheduler, Job(cases_[0].prompt, 16));
  finish(*lone);
  // The loop last ran one request: the next starts at once, and one 50 ms
  // behind it starts in a step of its own (the two then run together).
  EXPECT_EQ(burst({absl::Milliseconds(50)}), 2u);
  // The loop last ran two: it waits for the second, 20 ms behind the first,
  // and starts them together; a third 50 ms later has its own step.
  EXPECT_EQ(burst({absl::Milliseconds(20), absl::Milliseconds(50)}), 2u);
}

TEST_F(LanguageExecutorTest, CancelWhileQueued) {
  LanguageExecutor::Options options;
  options.max_running = 1;
  auto scheduler = MakeScheduler(options);
  ASSERT_NE(scheduler, nullptr);
  auto first = Run(*scheduler, Job(cases_[0]), /*block=*/true);
  ASSERT_TRUE(first->WaitFirstChunk());
  uint64_t id = 0;
  auto queued = Run(*scheduler, Job(cases_[1]), false, &id);
  EXPECT_EQ(scheduler->num_waiting(), 1);
  scheduler->Cancel(id);
  first->Release();
  ASSERT_TRUE(queued->WaitDone());
  EXPECT_EQ(queued->summary().finish_reason, FinishReason::kCancelled);
  EXPECT_EQ(queued->summary().completion_tokens, 0);
  EXPECT_EQ(queued->chunks(), 0);
  ExpectGolden(*first, cases_[0]);
}

TEST_F(LanguageExecutorTest, ExpiredDeadlineIsNeverComputed) {
  auto scheduler = MakeScheduler();
  ASSERT_NE(scheduler, nullptr);
  GenerationJob job = Job(cases_[0]);
  job.deadline = absl::Now() - absl::Seconds(1);
  auto expired = Run(*scheduler, job);
  auto fine = Run(*scheduler, Job(cases_[0]));
  ASSERT_TRUE(expired->WaitDone());
  EXPECT_EQ(expired->status().code(), absl::StatusCode::kDeadlineExceeded)
      << expired->status();
  EXPECT_EQ(expired->chunks(), 0);
  ExpectGolden(*fine, cases_[0]);
}

TEST_F(LanguageExecutorTest, DeadlinePassingDuringGenerationStopsIt) {
  auto scheduler = MakeScheduler();
  ASSERT_NE(scheduler, nullptr);
  GenerationJob job = Job(cases_[0].prompt, 200);
  job.deadline = absl::Now() + absl::Seconds(1);
  auto recorder = Run(*scheduler, job, /*block=*/true);
  // Hold the loop inside the first chunk until the deadline has passed.
  recorder->WaitFirstChunkOrDone();
  while (absl::Now() <= job.deadline) absl::SleepFor(absl::Milliseconds(50));
  recorder->Release();
  ASSERT_TRUE(recorder->WaitDone());
  EXPECT_EQ(recorder->status().code(), absl::StatusCode::kDeadlineExceeded)
      << recorder->status();
  EXPECT_LT(recorder->ids().size(), 200u);
  EXPECT_EQ(scheduler->num_running(), 0);
}

TEST_F(LanguageExecutorTest, FullQueueIsRejectedAtOnce) {
  LanguageExecutor::Options options;
  options.max_running = 1;
  options.max_queued_requests = 2;
  auto scheduler = MakeScheduler(options);
  ASSERT_NE(scheduler, nullptr);
  auto running = Run(*scheduler, Job(cases_[0]), /*block=*/true);
  ASSERT_TRUE(running->WaitFirstChunk());  // holds the only slot
  auto a = Run(*scheduler, Job(cases_[1]));
  auto b = Run(*scheduler, Job(cases_[2]));
  EXPECT_EQ(scheduler->num_waiting(), 2);
  auto rejected =
      scheduler->Submit(Job(cases_[3]), std::make_shared<Recorder>());
  EXPECT_EQ(rejected.status().code(), absl::StatusCode::kResourceExhausted)
      << rejected.status();
  running->Release();
  ExpectGolden(*running, cases_[0]);
  ExpectGolden(*a, cases_[1]);
  ExpectGolden(*b, cases_[2]);
}

TEST_F(LanguageExecutorTest, StopAcceptingDrainsTheAdmittedJobs) {
  LanguageExecutor::Options options;
  options.max_running = 1;
  auto scheduler = MakeScheduler(options);
  ASSERT_NE(scheduler, nullptr);
  auto running = Run(*scheduler, Job(cases_[0]), /*block=*/true);
  ASSERT_TRUE(running->WaitFirstChunk());
  auto queued = Run(*scheduler, Job(cases_[1]));
  scheduler->StopAccepting();
  auto late = scheduler->Submit(Job(cases_[2]), std::make_shared<Recorder>());
  EXPECT_EQ(late.status().code(), absl::StatusCode::kUnavailable)
      << late.status();
  running->Release();
  ExpectGolden(*running, cases_[0]);
  ExpectGolden(*queued, cases_[1]);
}

TEST_F(LanguageExecutorTest, AdaptiveModeLowersRatiosUnderLoad) {
  const GoldenCase* full = nullptr;
  const GoldenCase* half = nullptr;
  for (const GoldenCase& c : cases_) {
    if (c.ratio == 1.0f && full == nullptr) full = &c;
  }
  ASSERT_NE(full, nullptr);
  for (const GoldenCase& c : cases_) {
    if (c.ratio == 0.5f && c.prompt == full->prompt) half = &c;
  }
  ASSERT_NE(half, nullptr);
  LanguageExecutor::Options options;
  options.max_running = 1;
  options.adaptive_queue_depth = 1;
  auto scheduler = MakeScheduler(options);
  ASSERT_NE(scheduler, nullptr);
  GenerationJob job = Job(*full);
  job.min_ratio = 0.5f;
  // Admitted alone: not lowered. It holds the slot while 4 more queue up.
  auto first = Run(*scheduler, job, /*block=*/true);
  ASSERT_TRUE(first->WaitFirstChunk());
  std::vector<std::shared_ptr<Recorder>> queued;
  for (int i = 0; i < 4; ++i) queued.push_back(Run(*scheduler, job));
  first->Release();
  ExpectGolden(*first, *full);
  EXPECT_DOUBLE_EQ(first->summary().effective_ratio, 1.0);
  // Admitted with 4, 3 and 2 waiting: lowered; the last with 1: not.
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(queued[i]->WaitDone());
    const bool lowered = i < 3;
    const GoldenCase& expected = lowered ? *half : *full;
    EXPECT_THAT(queued[i]->ids(), ElementsAreArray(expected.greedy)) << i;
    EXPECT_EQ(queued[i]->summary().applied_ratio, lowered ? 0.5f : 1.0f) << i;
    EXPECT_DOUBLE_EQ(queued[i]->summary().effective_ratio, lowered ? 0.5 : 1.0)
        << i;
  }
  EXPECT_EQ(CounterSum("moh_activation_ratio_lowered_total"), 3);
}

TEST_F(LanguageExecutorTest, ValidationNamesTheField) {
  auto scheduler = MakeScheduler();
  ASSERT_NE(scheduler, nullptr);
  const int32_t max_len = scheduler->max_seq_len();
  struct Case {
    GenerationJob job;
    std::string message;
  };
  std::vector<Case> cases;
  const std::vector<int32_t> prompt = cases_[0].prompt;
  cases.push_back({Job({}, 4), "prompt"});
  cases.push_back({Job({1, 320}, 4), "token_ids must be in [0, 320)"});
  cases.push_back({Job({-1}, 4), "token_ids"});
  cases.push_back({Job(std::vector<int32_t>(max_len, 1), 1), "prompt"});
  cases.push_back({Job(std::vector<int32_t>(max_len - 5, 1), 6),
                   absl::StrCat("max_seq_len ", max_len)});
  cases.push_back({Job(prompt, 0), "sampling.max_new_tokens"});
  GenerationJob job = Job(prompt, 4);
  job.sampling.temperature = -1;
  cases.push_back({job, "sampling.temperature"});
  job = Job(prompt, 4, 1.5f);
  cases.push_back({job, "activation.ratio must be in (0, 1]"});
  job = Job(prompt, 4, std::nanf(""));
  cases.push_back({job, "activation.ratio"});
  job = Job(prompt, 4, 0.5f);
  job.min_ratio = 0.75f;
  cases.push_back({job, "activation.min_ratio must be 0 (off) or in (0, 0.5]"});
  job = Job(prompt, 4, 0.0f);  // default ratio: 9/16 on this model
  job.min_ratio = 0.75f;
  cases.push_back({job, "activation.min_ratio"});
  job = Job(prompt, 4, 0.5f);
  job.min_ratio = -0.1f;
  cases.push_back({job, "activation.min_ratio"});
  for (const Case& c : cases) {
    auto recorder = std::make_shared<Recorder>();
    auto id = scheduler->Submit(c.job, recorder);
    ASSERT_FALSE(id.ok()) << c.message;
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(id.status().message()), HasSubstr(c.message));
    EXPECT_EQ(recorder->chunks(), 0);
    EXPECT_FALSE(recorder->done());
  }
  // The boundary itself is fine.
  auto edge = Run(*scheduler, Job(std::vector<int32_t>(max_len - 5, 1), 5));
  ASSERT_TRUE(edge->WaitDone());
  EXPECT_TRUE(edge->status().ok()) << edge->status();
  EXPECT_EQ(edge->summary().completion_tokens, 5);
  job = Job(prompt, 2, 0.0f);
  job.min_ratio = 0.5f;  // below the default ratio
  EXPECT_TRUE(scheduler->Submit(job, std::make_shared<Recorder>()).ok());

  // Options.
  LanguageExecutor::Options options;
  options.max_seq_len = lm_->model->config().max_position_embeddings + 1;
  auto bad = LanguageExecutor::Create(options, *lm_, nullptr);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("max_seq_len"));
  options = {};
  options.prefill_token_budget = 0;
  bad = LanguageExecutor::Create(options, *lm_, nullptr);
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("prefill_token_budget"));
  options = {};
  options.max_running = 0;
  bad = LanguageExecutor::Create(options, *lm_, nullptr);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("max_running"));
}

TEST_F(LanguageExecutorTest, StopStringsNeedATokenizer) {
  auto lm = LanguageModel::Load(kModelDir, DeviceOptions{"cpu", "float32"});
  ASSERT_TRUE(lm.ok()) << lm.status();
  lm->tokenizer.reset();
  auto scheduler = MakeScheduler({}, &*lm);
  ASSERT_NE(scheduler, nullptr);
  GenerationJob job = Job(cases_[0]);
  job.sampling.stop = {"x"};
  auto rejected = scheduler->Submit(job, std::make_shared<Recorder>());
  EXPECT_EQ(rejected.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(rejected.status().message()),
              HasSubstr("sampling.stop"));
  // Without a tokenizer: ids only, no text.
  auto recorder = Run(*scheduler, Job(cases_[0]));
  ExpectGolden(*recorder, cases_[0]);
  EXPECT_EQ(recorder->text(), "");
}

TEST_F(LanguageExecutorTest, EosAndStopStringsEndLikeTheGenerator) {
  const GoldenCase& c = cases_[0];
  // Declare a greedy token that did not occur before it an EOS.
  size_t k = 2;
  while (k + 1 < c.greedy.size() &&
         std::find(c.greedy.begin(), c.greedy.begin() + k, c.greedy[k]) !=
             c.greedy.begin() + k) {
    ++k;
  }
  auto lm = LanguageModel::Load(kModelDir, DeviceOptions{"cpu", "float32"});
  ASSERT_TRUE(lm.ok()) << lm.status();
  lm->eos_ids = {c.greedy[k]};
  auto scheduler = MakeScheduler({}, &*lm);
  ASSERT_NE(scheduler, nullptr);
  Generator generator(*lm->model, lm->tokenizer.get(), lm->eos_ids);
  auto decoded = lm_->tokenizer->Decode(c.greedy, true);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  const std::string full_text = *decoded;
  ASSERT_GE(full_text.size(), 4u);
  std::vector<GenerationJob> jobs = {Job(c)};
  for (size_t at : {size_t{1}, full_text.size() / 2}) {
    GenerationJob stop = Job(c);
    stop.sampling.stop = {full_text.substr(at, 2)};
    jobs.push_back(stop);
  }
  for (const GenerationJob& job : jobs) {
    auto recorder = Run(*scheduler, job);
    ASSERT_TRUE(recorder->WaitDone());
    ASSERT_TRUE(recorder->status().ok()) << recorder->status();
    auto reference = generator.Generate({RequestOf(job)});
    ASSERT_TRUE(reference.ok()) << reference.status();
    const GenerationResult& expected = (*reference)[0];
    EXPECT_EQ(recorder->ids(), expected.token_ids);
    EXPECT_EQ(recorder->text(), expected.text);
    EXPECT_EQ(recorder->summary().finish_reason, expected.finish_reason);
    EXPECT_EQ(recorder->summary().completion_tokens,
              static_cast<int32_t>(expected.token_ids.size()));
    EXPECT_NEAR(recorder->summary().effective_ratio, expected.effective_ratio,
                1e-9);
  }
  // The plain job ends at the EOS id, which is streamed without text.
  auto eos = Run(*scheduler, Job(c));
  ASSERT_TRUE(eos->WaitDone());
  EXPECT_EQ(eos->summary().finish_reason, FinishReason::kEos);
  EXPECT_EQ(eos->ids().back(), c.greedy[k]);
  EXPECT_EQ(eos->ids().size(), k + 1);
}

TEST_F(LanguageExecutorTest, SeededSamplingIgnoresBatchMates) {
  GenerationJob job = Job(cases_[0].prompt, 24);
  job.sampling.temperature = 1.0f;
  job.sampling.top_p = 0.9f;
  job.sampling.seed = 1234;
  std::vector<int32_t> alone;
  {
    auto scheduler = MakeScheduler();
    ASSERT_NE(scheduler, nullptr);
    auto r = Run(*scheduler, job);
    ASSERT_TRUE(r->WaitDone());
    alone = r->ids();
  }
  ASSERT_EQ(alone.size(), 24u);
  LanguageExecutor::Options options;
  options.prefill_token_budget = 4;
  auto scheduler = MakeScheduler(options);
  ASSERT_NE(scheduler, nullptr);
  std::vector<std::shared_ptr<Recorder>> mates;
  for (size_t i = 1; i < 6; ++i) {
    GenerationJob mate = Job(cases_[i].prompt, 10 + i, cases_[i].ratio);
    mate.sampling.temperature = 0.8f;
    mate.sampling.seed = i;
    mates.push_back(Run(*scheduler, mate));
  }
  ASSERT_TRUE(mates[0]->WaitFirstChunk());
  auto r = Run(*scheduler, job);
  ASSERT_TRUE(r->WaitDone());
  EXPECT_EQ(r->ids(), alone);
  for (auto& m : mates) ASSERT_TRUE(m->WaitDone());
}

// One batch mixing the rows reduced where the logits lie (greedy; top-k,
// with min_p and top_p; top-p alone; temperature alone, drawn on the
// device; log-probabilities: DecoderBatch::top_logits and row_reductions)
// with a row copied whole (a penalty) and one whose nucleus lies past the
// best 256 (read whole after the reduction): each streams what the
// Generator, which samples every row from the whole of it, makes alone.
TEST_F(LanguageExecutorTest, RowsReducedOnTheDeviceDrawLikeTheGenerator) {
  // What a GPU step does, on the CPU (read as the scheduler is made); short
  // prompt chunks put rows mid-prompt (no logits) beside the others.
  setenv("MOH_REDUCE_LOGITS", "1", 1);
  LanguageExecutor::Options options;
  options.prefill_token_budget = 4;
  auto scheduler = MakeScheduler(options);
  unsetenv("MOH_REDUCE_LOGITS");
  ASSERT_NE(scheduler, nullptr);
  Generator generator(*lm_->model, lm_->tokenizer.get(), lm_->eos_ids);
  std::vector<GenerationJob> jobs;
  for (size_t i = 0; i < 9; ++i) {
    const GoldenCase& c = cases_[i % cases_.size()];
    GenerationJob job = Job(c.prompt, 16, c.ratio);
    job.sampling.ignore_eos = true;
    job.sampling.seed = 40 + i;
    if (i > 0) job.sampling.temperature = 1.0f;
    if (i == 1 || i == 2 || i == 4) job.sampling.top_k = 2 + i;
    if (i == 2 || i == 7) job.sampling.min_p = 0.05f;
    if (i == 2 || i == 3) job.sampling.top_p = 0.8f;
    if (i == 4 || i == 7) job.sampling.logprobs = 2;
    if (i == 5) job.sampling.presence_penalty = 0.5f;
    if (i == 8) {
      job.sampling.temperature = 50.0f;  // flat: a nucleus of nearly all
      job.sampling.top_p = 0.99f;
      job.sampling.logprobs = 0;
    }
    jobs.push_back(job);
  }
  std::vector<std::shared_ptr<Recorder>> recorders;
  for (const GenerationJob& job : jobs)
    recorders.push_back(Run(*scheduler, job));
  int sampled = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    ASSERT_TRUE(recorders[i]->WaitDone());
    ASSERT_TRUE(recorders[i]->status().ok()) << recorders[i]->status();
    GenerationRequest request = RequestOf(jobs[i]);
    auto reference = generator.Generate({request});
    ASSERT_TRUE(reference.ok()) << reference.status();
    EXPECT_EQ(recorders[i]->ids(), (*reference)[0].token_ids) << "job " << i;
    ASSERT_EQ(recorders[i]->ids().size(), 16u);
    const std::vector<LogprobEntry> logprobs = recorders[i]->logprobs();
    ASSERT_EQ(logprobs.size(), (*reference)[0].logprobs.size()) << "job " << i;
    for (size_t t = 0; t < logprobs.size(); ++t) {
      const LogprobEntry& want = (*reference)[0].logprobs[t];
      EXPECT_EQ(logprobs[t].rank, want.rank) << "job " << i << " token " << t;
      EXPECT_NEAR(logprobs[t].token.logprob, want.token.logprob,
                  1e-5 * (1 + std::fabs(want.token.logprob)))
          << "job " << i << " token " << t;
      ASSERT_EQ(logprobs[t].top.size(), want.top.size());
      for (size_t k = 0; k < want.top.size(); ++k) {
        EXPECT_EQ(logprobs[t].top[k].id, want.top[k].id);
      }
    }
    request.sampling.temperature = 0.0f;
    auto greedy = generator.Generate({request});
    ASSERT_TRUE(greedy.ok()) << greedy.status();
    sampled += recorders[i]->ids() != (*greedy)[0].token_ids;
  }
  EXPECT_GE(sampled, 6) << "the sampled jobs drew their argmax throughout";
}

TEST_F(LanguageExecutorTest, DestructorFailsJobsInFlight) {
  std::vector<std::shared_ptr<Recorder>> recorders;
  {
    LanguageExecutor::Options options;
    options.max_running = 2;
    auto scheduler = MakeScheduler(options);
    ASSERT_NE(scheduler, nullptr);
    for (size_t i = 0; i < 6; ++i) {
      recorders.push_back(Run(*scheduler, Job(cases_[i].prompt, 240)));
    }
    ASSERT_TRUE(recorders[0]->WaitFirstChunk());
  }
  int unavailable = 0;
  for (auto& r : recorders) {
    ASSERT_TRUE(r->done());  // delivered before the destructor returned
    EXPECT_EQ(r->violations(), 0);
    if (!r->status().ok()) {
      EXPECT_EQ(r->status().code(), absl::StatusCode::kUnavailable);
      EXPECT_THAT(std::string(r->status().message()),
                  HasSubstr("shutting down"));
      ++unavailable;
    }
  }
  // The 4 queued jobs could only start after 240 tokens of the first two.
  EXPECT_GE(unavailable, 4);
}

}  // namespace
}  // namespace moh
