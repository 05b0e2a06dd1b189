// The observer of one HTTP generation (openai_http_generation.h): it buffers
// what the model's callback thread delivers, each choice's text and
// log-probabilities and the summaries of finished choices, and wakes the
// request's connection, whose handler takes it. Thread-safe: the callback
// thread calls the observer's methods, the connection's thread Take.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "service/http/openai_api.h"
#include "service/net/http_connections.h"
#include "service/servable/servable_types.h"

namespace moh {

// One generation's output as the model's callback thread delivers it; the
// connection's handler takes it when its waker resumes it.
class GenerationSink : public GenerationObserver {
 public:
  // `every_chunk`: wake for each chunk (a stream), else only at the end.
  // `keep_tokens`: keep each choice's token ids (TokenIds).
  GenerationSink(std::shared_ptr<HttpWaker> waker, bool every_chunk,
                 bool keep_tokens = false)
      : waker_(std::move(waker)),
        every_chunk_(every_chunk),
        keep_tokens_(keep_tokens) {}

  struct Update {
    // New output since the last Take, one entry per choice that has some,
    // by index (without summaries).
    std::vector<openai::ChoiceOutput> outputs;
    // Choices that finished since the last Take.
    std::vector<GenerationSummary> finished;
    bool done = false;   // every choice finished, or the request failed
    absl::Status error;  // when it failed
  };

  void OnChunk(const GenerationChunk& chunk) override {
    {
      absl::MutexLock lock(&mu_);
      openai::ChoiceOutput& out = pending_[chunk.index];
      out.index = chunk.index;
      out.Append(chunk);
      if (keep_tokens_) {
        std::vector<int32_t>& ids = tokens_[chunk.index];
        ids.insert(ids.end(), chunk.token_ids.begin(), chunk.token_ids.end());
      }
    }
    if (every_chunk_) waker_->Wake();
  }
  void OnFinished(const GenerationSummary& summary) override {
    {
      absl::MutexLock lock(&mu_);
      finished_.push_back(summary);
      if (summary.last) done_ = true;
    }
    waker_->Wake();
  }
  void OnError(const absl::Status& status) override {
    {
      absl::MutexLock lock(&mu_);
      error_ = status;
      done_ = true;
    }
    waker_->Wake();
  }

  // Takes the output since the last Take (none, when there is none yet).
  Update Take() {
    absl::MutexLock lock(&mu_);
    Update update;
    for (auto& [index, out] : pending_)
      update.outputs.push_back(std::move(out));
    pending_.clear();
    update.finished.swap(finished_);
    update.done = done_;
    update.error = error_;
    return update;
  }

  // The token ids choice `index` generated so far (with keep_tokens).
  std::vector<int32_t> TokenIds(int32_t index) {
    absl::MutexLock lock(&mu_);
    return tokens_[index];
  }

 private:
  const std::shared_ptr<HttpWaker> waker_;
  const bool every_chunk_;
  const bool keep_tokens_;
  absl::Mutex mu_;
  std::map<int32_t, std::vector<int32_t>> tokens_ ABSL_GUARDED_BY(mu_);
  std::map<int32_t, openai::ChoiceOutput> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<GenerationSummary> finished_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

// One prompt's generation of a request that holds several (completions'
// batch form), into the request's sink: its choices are the request's from
// `first_choice` on, and its last summary is the request's last only once
// every prompt's has come (`prompts_left`, shared by the prompts).
class PromptObserver : public GenerationObserver {
 public:
  PromptObserver(std::shared_ptr<GenerationObserver> sink, int32_t first_choice,
                 std::shared_ptr<std::atomic<int32_t>> prompts_left)
      : sink_(std::move(sink)),
        first_choice_(first_choice),
        prompts_left_(std::move(prompts_left)) {}

  void OnChunk(const GenerationChunk& chunk) override {
    GenerationChunk shifted = chunk;
    shifted.index += first_choice_;
    sink_->OnChunk(shifted);
  }
  void OnFinished(const GenerationSummary& summary) override {
    GenerationSummary shifted = summary;
    shifted.index += first_choice_;
    shifted.last = summary.last && prompts_left_->fetch_sub(1) == 1;
    sink_->OnFinished(shifted);
  }
  void OnError(const absl::Status& status) override { sink_->OnError(status); }

 private:
  const std::shared_ptr<GenerationObserver> sink_;
  const int32_t first_choice_;
  const std::shared_ptr<std::atomic<int32_t>> prompts_left_;
};

}  // namespace moh
