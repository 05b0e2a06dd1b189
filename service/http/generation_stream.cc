#include "service/http/generation_stream.h"

#include <cstring>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace moh {
namespace {

using openai::Endpoint;
using Sink = GenerationSink;

// A streamed response: MHD pulls server-sent events from Read on the
// connection's polling thread; with none ready, Read suspends the connection
// until the model has more.
struct Stream {
  Running run;
  std::shared_ptr<HttpWaker> waker;
  std::string pending;  // bytes not yet handed to MHD
  size_t sent = 0;
  // Per choice: whether its first chunk went out, and the length of its
  // tokens' text so far (completions' text_offset).
  std::vector<bool> started;
  std::vector<bool> echoed;  // its first output had the echo put before it
  std::vector<int64_t> offsets;
  bool ended = false;      // the last event is in `pending`
  bool cancelled = false;  // the client went (or the server stops)

  void Event(const std::string& json) {
    absl::StrAppend(&pending, "data: ", json, "\n\n");
  }

  openai::Chunk NewChunk(openai::ChoiceOutput choice) {
    const size_t i = static_cast<size_t>(choice.index);
    openai::Chunk chunk{run.response_id, run.created, run.answered_model,
                        std::move(choice)};
    chunk.first = !started[i];
    chunk.asked = run.asked;
    chunk.offset = offsets[i];
    return chunk;
  }

  // Messages: each piece of text a content_block_delta; once done, the end
  // events (or an error event).
  void FillMessages() {
    Sink::Update update = run.sink->Take();
    for (const openai::ChoiceOutput& out : update.outputs) {
      if (!out.text.empty()) pending += anthropic::TextDeltaEvent(out.text);
    }
    for (GenerationSummary& summary : update.finished) {
      run.Finished(std::move(summary));
    }
    if (!update.done) return;
    run.RecordEnd(update);
    pending += update.error.ok() ? anthropic::StreamEndEvents(run.Message(""))
                                 : anthropic::ErrorEvent(update.error);
    ended = true;
  }

  // Turns the output so far into events.
  void Fill() {
    if (run.endpoint == Endpoint::kMessages) return FillMessages();
    Sink::Update update = run.sink->Take();
    // A token's text is needed twice (the offsets, the chunk's JSON): it is
    // decoded once.
    absl::flat_hash_map<int32_t, std::string> texts;
    const openai::TokenTextFn token_text = [&](int32_t id) {
      auto [it, fresh] = texts.try_emplace(id);
      if (fresh) it->second = run.servable->TokenText(id);
      return it->second;
    };
    for (openai::ChoiceOutput& out : update.outputs) {
      const size_t i = static_cast<size_t>(out.index);
      run.Echo(!echoed[i], &out);
      echoed[i] = true;
      int64_t length = 0;
      if (out.leading_token) length += token_text(*out.leading_token).size();
      for (const LogprobEntry& e : out.logprobs) {
        length += token_text(e.token.id).size();
      }
      openai::Chunk chunk = NewChunk(std::move(out));
      const openai::ChoiceOutput& c = chunk.choice;
      if (!c.text.empty() || !c.logprobs.empty() ||
          !c.prompt_logprobs.empty() ||
          (chunk.first && run.endpoint == Endpoint::kChatCompletions)) {
        Event(openai::ChunkJson(run.endpoint, chunk, token_text));
        started[i] = true;
        offsets[i] += length;
      }
    }
    for (const GenerationSummary& summary : update.finished) {
      run.Finished(summary);
      openai::ChoiceOutput last;
      last.index = summary.index;
      last.summary = &run.summaries.back();
      openai::Chunk chunk = NewChunk(std::move(last));
      chunk.first = false;
      Event(openai::ChunkJson(run.endpoint, chunk, token_text));
    }
    if (!update.done) return;
    run.RecordEnd(update);
    if (!update.error.ok()) {
      run.StopGenerations();  // the other prompts'
      // The status line went out with the first bytes: the error is an event.
      Event(openai::ErrorJson(update.error));
    } else if (run.include_usage) {
      openai::Chunk chunk{run.response_id, run.created, run.answered_model};
      Event(openai::UsageChunkJson(
          run.endpoint, chunk,
          openai::CombineSummaries(run.summaries, run.samples)));
    }
    absl::StrAppend(&pending, "data: [DONE]\n\n");
    ended = true;
  }

  // MHD_ContentReaderCallback.
  static ssize_t Read(void* cls, uint64_t /*pos*/, char* buf, size_t max) {
    auto* s = static_cast<Stream*>(cls);
    while (s->sent == s->pending.size()) {
      s->pending.clear();
      s->sent = 0;
      if (s->ended) return MHD_CONTENT_READER_END_OF_STREAM;
      if (s->waker->Departed()) {
        s->run.Cancel();
        s->cancelled = true;
        return MHD_CONTENT_READER_END_WITH_ERROR;
      }
      s->Fill();
      // Nothing yet: MHD calls again once the model's output resumes it.
      if (s->pending.empty() && !s->ended && s->waker->Suspend()) return 0;
    }
    const size_t n = std::min(max, s->pending.size() - s->sent);
    std::memcpy(buf, s->pending.data() + s->sent, n);
    s->sent += n;
    return static_cast<ssize_t>(n);
  }

  // MHD_ContentReaderFreeCallback: the response is done with, sent or not.
  static void Free(void* cls) {
    auto* s = static_cast<Stream*>(cls);
    if (!s->ended && !s->cancelled) s->run.Cancel();
    delete s;
  }
};

}  // namespace

MHD_Result StartStream(MHD_Connection* connection, Running run,
                       std::shared_ptr<HttpWaker> waker, int32_t n) {
  auto* stream = new Stream;
  stream->run = std::move(run);
  stream->waker = std::move(waker);
  stream->started.assign(n, false);
  stream->echoed.assign(n, false);
  stream->offsets.assign(n, 0);
  if (stream->run.endpoint == Endpoint::kMessages) {
    stream->pending = anthropic::StreamStartEvents(stream->run.response_id,
                                                   stream->run.answered_model);
  }
  MHD_Response* response = MHD_create_response_from_callback(
      MHD_SIZE_UNKNOWN, 16 << 10, &Stream::Read, stream, &Stream::Free);
  if (response == nullptr) {
    Stream::Free(stream);
    return MHD_NO;
  }
  MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE,
                          "text/event-stream");
  MHD_add_response_header(response, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
  MHD_add_response_header(response, "X-Request-Id",
                          stream->run.request_id.c_str());
  const MHD_Result result = MHD_queue_response(connection, 200, response);
  MHD_destroy_response(response);
  return result;
}

}  // namespace moh
