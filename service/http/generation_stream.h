// A generation its model accepted, for the HTTP door
// (openai_http_generation.h): the request it came from, where its output goes
// and how it is counted (Running), and its answer as server-sent events when it
// streams (StartStream): OpenAI's chunks, or Anthropic's Messages events.
#pragma once

#include <microhttpd.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "service/http/anthropic_api.h"
#include "service/http/generation_sink.h"
#include "service/http/openai_api.h"
#include "service/metrics/metrics.h"
#include "service/metrics/request_log.h"
#include "service/net/http_connections.h"

namespace moh {

// A generation accepted by a model: the request it came from and where its
// output goes.
struct Running {
  openai::Endpoint endpoint = openai::Endpoint::kCompletions;
  Rpc rpc = Rpc::kCompletions;
  absl::Time start;
  std::string request_id;
  std::string model;
  std::string answered_model;  // the alias asked for, else `model`
  Servable* servable = nullptr;
  std::vector<uint64_t> ids;  // a generation per prompt
  int32_t samples = 1;        // `n` (choices per prompt)
  std::shared_ptr<GenerationSink> sink;
  std::string response_id;
  int64_t created = 0;
  bool include_usage = false;
  openai::LogprobsAsked asked;
  openai::Echo echo;
  std::vector<std::string> stops;            // Messages: its stop_sequences
  std::vector<GenerationSummary> summaries;  // of the choices finished
  bool recorded = false;

  // Messages: the finished message of choice 0.
  anthropic::Message Message(std::string text) const {
    anthropic::Message m{
        response_id, answered_model, std::move(text),
        summaries.empty() ? GenerationSummary() : summaries.front()};
    if (m.summary.finish_reason == FinishReason::kStop) {
      // Which stop string matched: the sampler says only that one did.
      std::vector<std::string> texts;
      for (int32_t id : sink->TokenIds(0)) {
        texts.push_back(servable->TokenText(id));
      }
      m.stop_sequence = anthropic::MatchedStopSequence(texts, stops);
      if (!m.stop_sequence && stops.size() == 1) m.stop_sequence = stops[0];
    }
    return m;
  }

  openai::TokenTextFn TokenText() const {
    return [model = servable](int32_t id) { return model->TokenText(id); };
  }
  // Echo's text of a prompt sent as token ids, decoded as one sequence (a
  // character split across tokens comes back whole). The ids were checked
  // when the generation was accepted, so decoding them cannot fail; if it
  // did, the echo would be empty rather than wrong.
  openai::DecodeFn Decode() const {
    return [model = servable](const std::vector<int32_t>& ids) {
      return model->Detokenize(ids).value_or(std::string());
    };
  }
  // A choice's output, echo applied (`first`: the choice's first output).
  void Echo(bool first, openai::ChoiceOutput* out) const {
    openai::ApplyEcho(echo, asked.prompt, Decode(), first, out);
  }
  // A choice's summary arrived.
  void Finished(GenerationSummary summary) {
    openai::ApplyEcho(echo, &summary);
    summaries.push_back(std::move(summary));
  }

  // Counts the request once.
  void Record(absl::StatusCode code) {
    if (recorded) return;
    recorded = true;
    RecordRequest(servable->metrics(), nullptr, rpc, model, code, start,
                  request_id);
  }
  // Counts the request as its end says: its error, or OK (CANCELLED when
  // the generation was cancelled).
  void RecordEnd(const GenerationSink::Update& end) {
    const bool cancelled = std::any_of(
        summaries.begin(), summaries.end(), [](const GenerationSummary& s) {
          return s.finish_reason == FinishReason::kCancelled;
        });
    Record(!end.error.ok() ? end.error.code()
           : cancelled     ? absl::StatusCode::kCancelled
                           : absl::StatusCode::kOk);
  }
  // The client went (or the server stops): the generation stops, counted
  // as CANCELLED.
  void Cancel() {
    StopGenerations();
    Record(absl::StatusCode::kCancelled);
  }
  // Every prompt's generation stops (one failed, or the request ends).
  void StopGenerations() {
    for (uint64_t id : ids) servable->CancelGenerate(id);
  }
};

// Answers with a stream of `n` choices, `run` moved into it.
MHD_Result StartStream(MHD_Connection* connection, Running run,
                       std::shared_ptr<HttpWaker> waker, int32_t n);

}  // namespace moh
