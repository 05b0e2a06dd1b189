#include "client/commands.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/head_load_table.h"
#include "client/interrupt_watcher.h"
#include "client/text_table.h"

namespace moh::client {
namespace {

using moh::v1::ModelInfo;

// "24 x 8 heads (2 shared + 6 routed, top-3)"; runs of identical layers are
// grouped, different runs joined with "; ".
std::string SummarizeLayers(const ModelInfo& info) {
  std::vector<std::string> groups;
  int i = 0;
  while (i < info.layers_size()) {
    const moh::v1::LayerHeads& layer = info.layers(i);
    int j = i + 1;
    while (j < info.layers_size() &&
           info.layers(j).SerializeAsString() == layer.SerializeAsString()) {
      ++j;
    }
    std::string group =
        absl::StrFormat("%d x %d heads", j - i, layer.num_heads());
    if (layer.shared_heads() > 0 || layer.routed_heads() > 0) {
      absl::StrAppendFormat(&group, " (%d shared + %d routed, top-%d)",
                            layer.shared_heads(), layer.routed_heads(),
                            layer.default_top_k());
    }
    groups.push_back(std::move(group));
    i = j;
  }
  return groups.empty() ? "-" : absl::StrJoin(groups, "; ");
}

std::string OrDash(const std::string& s) { return s.empty() ? "-" : s; }

// The head-load table, with shared heads marked when ListModels tells which.
void PrintHeadLoad(moh::v1::Inference::StubInterface& stub,
                   const std::string& model, const moh::v1::Routing& routing,
                   const CallOptions& call) {
  std::vector<int32_t> shared;
  grpc::ClientContext context;
  ConfigureContext(call, &context);
  CancelOnInterrupt cancel(&context);
  moh::v1::ListModelsResponse models;
  if (stub.ListModels(&context, moh::v1::ListModelsRequest(), &models).ok()) {
    shared = SharedHeadsFor(models, model, routing);
  }
  std::fputs(FormatHeadLoadTable(routing, shared).c_str(), stderr);
}

// One sample of a Generate stream, put together.
struct Sample {
  std::string text;
  std::vector<moh::v1::TokenLogprob> logprobs;
  std::vector<moh::v1::TokenLogprob> prompt_logprobs;
  moh::v1::GenerateResponse last;  // the message with the finish reason

  void Add(moh::v1::GenerateResponse& message) {
    text += message.text();
    logprobs.insert(logprobs.end(), message.logprobs().begin(),
                    message.logprobs().end());
    prompt_logprobs.insert(prompt_logprobs.end(),
                           message.prompt_logprobs().begin(),
                           message.prompt_logprobs().end());
    if (message.finish_reason() != moh::v1::FINISH_REASON_UNSPECIFIED) {
      last.Swap(&message);
    }
  }
};

// Log-probabilities, one token a line: id, text, log-probability, rank and
// the alternatives.
void PrintLogprobs(const std::string& what,
                   const std::vector<moh::v1::TokenLogprob>& entries) {
  if (entries.empty()) return;
  absl::FPrintF(stderr, "%s logprobs:\n", what);
  for (const moh::v1::TokenLogprob& e : entries) {
    std::vector<std::string> top;
    for (const moh::v1::TopLogprob& t : e.top_logprobs()) {
      top.push_back(absl::StrFormat("%d %s %.4f", t.token_id(),
                                    absl::CHexEscape(t.token()), t.logprob()));
    }
    absl::FPrintF(stderr, "  %6d %-14s %9.4f rank %-4d %s\n", e.token_id(),
                  absl::StrCat("\"", absl::CHexEscape(e.token()), "\""),
                  e.logprob(), e.rank(), absl::StrJoin(top, ", "));
  }
}

// Reads a server stream to its end, cancelled on Ctrl-C: `start` opens it
// on the context it is given, `on_message` sees each message in turn (the one
// object, read into again). Returns the stream's status.
template <typename Response, typename StartFn, typename OnMessageFn>
grpc::Status ReadStream(const CallOptions& call, StartFn start,
                        OnMessageFn on_message) {
  grpc::ClientContext context;
  ConfigureContext(call, &context);
  CancelOnInterrupt cancel(&context);
  std::unique_ptr<grpc::ClientReaderInterface<Response>> reader =
      start(&context);
  Response message;
  while (reader->Read(&message)) on_message(message);
  return reader->Finish();
}

}  // namespace

int RunListModels(moh::v1::Inference::StubInterface& stub,
                  const CallOptions& call) {
  grpc::ClientContext context;
  ConfigureContext(call, &context);
  CancelOnInterrupt cancel(&context);
  moh::v1::ListModelsResponse response;
  const grpc::Status status =
      stub.ListModels(&context, moh::v1::ListModelsRequest(), &response);
  if (!status.ok()) return ReportRpcError(status);

  TextTable table({"NAME", "FAMILY", "ROUTER", "LAYERS", "RATIO", "MIN_RATIO",
                   "DEVICE", "DTYPE", "WEIGHTS", "KV_DTYPE", "MAX_SEQ", "STATE",
                   "REASON"});
  for (int c : {4, 5, 10}) table.AlignRight(c);
  for (const ModelInfo& info : response.models()) {
    table.AddRow(
        {info.name(), OrDash(info.family()), OrDash(info.router()),
         SummarizeLayers(info), absl::StrFormat("%.3f", info.default_ratio()),
         absl::StrFormat("%.3f", info.min_ratio()), OrDash(info.device()),
         OrDash(info.dtype()), OrDash(info.weights()),
         OrDash(info.kv_cache_dtype()),
         info.max_seq_len() > 0 ? absl::StrCat(info.max_seq_len()) : "-",
         ModelInfo::State_Name(info.state()), info.failure_reason()});
  }
  std::fputs(table.Render().c_str(), stdout);
  if (response.models_size() == 0) std::fputs("(no models)\n", stdout);
  return kExitOk;
}

int RunGenerate(moh::v1::Inference::StubInterface& stub,
                const moh::v1::GenerateRequest& request,
                const CallOptions& call) {
  // One sample streams its text as it comes; several are printed whole, in
  // index order, once the stream has ended.
  const int samples = std::max(request.n(), 1);
  std::vector<Sample> out(samples);
  bool ends_with_newline = true;
  const grpc::Status status = ReadStream<moh::v1::GenerateResponse>(
      call,
      [&](grpc::ClientContext* context) {
        return stub.Generate(context, request);
      },
      [&](moh::v1::GenerateResponse& message) {
        if (message.index() < 0 || message.index() >= samples) return;
        Sample& sample = out[message.index()];
        const std::string& text = message.text();
        if (samples == 1 && !text.empty()) {
          std::fwrite(text.data(), 1, text.size(), stdout);
          std::fflush(stdout);
          ends_with_newline = text.back() == '\n';
        }
        sample.Add(message);
      });
  if (samples > 1) {
    for (int i = 0; i < samples; ++i) {
      absl::PrintF("[%d] %s\n", i, out[i].text);
    }
  }
  // Keeps the summary on its own line in a terminal; pipes get the text as is.
  if (!ends_with_newline && isatty(STDOUT_FILENO)) std::fputs("\n", stdout);
  std::fflush(stdout);
  if (!status.ok()) return ReportRpcError(status);

  for (int i = 0; i < samples; ++i) {
    const moh::v1::GenerateResponse& last = out[i].last;
    const std::string tag = samples > 1 ? absl::StrCat("[", i, "] ") : "";
    if (i == 0) PrintLogprobs("prompt", out[0].prompt_logprobs);
    PrintLogprobs(absl::StrCat(tag, "tokens"), out[i].logprobs);
    absl::FPrintF(stderr, "%sfinish_reason: %s\n", tag,
                  moh::v1::FinishReason_Name(last.finish_reason()));
    absl::FPrintF(stderr, "%susage: prompt_tokens %d, completion_tokens %d\n",
                  tag, last.usage().prompt_tokens(),
                  last.usage().completion_tokens());
    PrintActivation(last.effective_activation_ratio(), last.activation_ratio());
    if (request.include_routing()) {
      PrintHeadLoad(stub, request.model(), last.routing(), call);
    }
  }
  return kExitOk;
}

int RunGenerateImage(moh::v1::Inference::StubInterface& stub,
                     const moh::v1::GenerateImageRequest& request,
                     const std::string& out, const CallOptions& call) {
  moh::v1::GenerateImageResponse last;
  const grpc::Status status = ReadStream<moh::v1::GenerateImageResponse>(
      call,
      [&](grpc::ClientContext* context) {
        return stub.GenerateImage(context, request);
      },
      [&](moh::v1::GenerateImageResponse& message) {
        if (request.progress() && message.png().empty()) {
          absl::FPrintF(stderr, "step %d/%d\n", message.step(),
                        message.steps());
        }
        last.Swap(&message);
      });
  if (!status.ok()) return ReportRpcError(status);
  std::FILE* file = std::fopen(out.c_str(), "wb");
  const std::string& png = last.png();
  const bool written = file != nullptr && std::fwrite(png.data(), 1, png.size(),
                                                      file) == png.size();
  if (file != nullptr && std::fclose(file) != 0) {
    absl::FPrintF(stderr, "moh-client: cannot write %s\n", out);
    return kExitFailure;
  }
  if (!written) {
    absl::FPrintF(stderr, "moh-client: cannot write %s\n", out);
    return kExitFailure;
  }
  absl::FPrintF(stderr,
                "wrote %s: %dx%d PNG, class %d, seed %u, %d steps, guidance "
                "%g\n",
                out, last.width(), last.height(), last.class_index(),
                last.seed(), last.steps(), last.guidance_scale());
  PrintActivation(last.effective_activation_ratio(), last.activation_ratio());
  absl::FPrintF(
      stderr, "timings: queue %.3f s, sampling %.3f s, decode %.3f s\n",
      last.timings().queue_seconds(), last.timings().sampling_seconds(),
      last.timings().decode_seconds());
  if (request.include_routing()) {
    PrintHeadLoad(stub, request.model(), last.routing(), call);
  }
  return kExitOk;
}

int RunClassify(moh::v1::Inference::StubInterface& stub,
                const moh::v1::ClassifyRequest& request,
                const CallOptions& call) {
  grpc::ClientContext context;
  ConfigureContext(call, &context);
  CancelOnInterrupt cancel(&context);
  moh::v1::ClassifyResponse response;
  const grpc::Status status = stub.Classify(&context, request, &response);
  if (!status.ok()) return ReportRpcError(status);

  const bool text = request.input_case() == moh::v1::ClassifyRequest::kText;
  std::vector<std::string> header = {"LABEL", "INDEX", "SCORE"};
  if (text) header.push_back("LOG_LIKELIHOOD");
  TextTable table(std::move(header));
  for (int c : {1, 2, 3}) table.AlignRight(c);
  for (const moh::v1::ClassScore& c : response.classes()) {
    std::vector<std::string> row = {c.label(), absl::StrCat(c.index()),
                                    absl::StrFormat("%.4f", c.score())};
    if (text) row.push_back(absl::StrFormat("%.4f", c.log_likelihood()));
    table.AddRow(std::move(row));
  }
  std::fputs(table.Render().c_str(), stdout);
  std::fflush(stdout);
  PrintActivation(response.effective_activation_ratio(),
                  response.activation_ratio());
  if (request.include_routing()) {
    PrintHeadLoad(stub, request.model(), response.routing(), call);
  }
  return kExitOk;
}

int RunHealthCheck(grpc::health::v1::Health::StubInterface& stub,
                   const std::string& service, const CallOptions& call) {
  using grpc::health::v1::HealthCheckResponse;
  grpc::ClientContext context;
  ConfigureContext(call, &context);
  CancelOnInterrupt cancel(&context);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  HealthCheckResponse response;
  const grpc::Status status = stub.Check(&context, request, &response);
  if (!status.ok()) return ReportRpcError(status);
  std::printf(
      "%s\n",
      HealthCheckResponse::ServingStatus_Name(response.status()).c_str());
  return response.status() == HealthCheckResponse::SERVING ? kExitOk
                                                           : kExitFailure;
}

}  // namespace moh::client
