// One tokenizer request over HTTP (POST /tokenize, POST /detokenize, GET
// /tokenizer_info: vLLM's endpoints, tokenize_api.h) from the moment its
// body is whole until it is answered. Tokenizing up to a megabyte is work, so
// it runs on a request worker, as a generation is prepared (the same threads,
// the same queue bound: RESOURCE_EXHAUSTED, 429, when full), while the
// connection is suspended; its HttpWaker resumes it with the answer. The
// model is found as a generation's (dispatch.h); metrics and the request log
// count it as rpc Tokenize, Detokenize or TokenizerInfo. Routes and
// authentication are openai_http.cc's.
#pragma once

#include <microhttpd.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "service/http/openai_http_generation.h"
#include "service/metrics/metrics.h"

namespace moh {

// The tokenizer endpoint at `path` (/tokenize, /detokenize,
// /tokenizer_info) as `*rpc`; false for any other path.
bool TokenizerPath(absl::string_view path, Rpc* rpc);

class HttpTokenizerRequest {
 public:
  struct Request {
    Rpc rpc = Rpc::kTokenize;     // kTokenize, kDetokenize or kTokenizerInfo
    std::string body;             // the POST endpoints'
    std::string model;            // GET /tokenizer_info's ?model=
    BodyReservation reservation;  // given back once the body is parsed
    absl::Time start;
    std::string request_id;
    bool draining = false;  // the server drains: refused, UNAVAILABLE
  };

  // Queues `request` on a request worker (the connection's thread then
  // calls Continue). A full queue (RESOURCE_EXHAUSTED) or a draining server
  // (UNAVAILABLE) is counted here; the caller answers it.
  static absl::StatusOr<std::unique_ptr<HttpTokenizerRequest>> Start(
      const HttpGeneration::Env& env, MHD_Connection* connection,
      Request request);

  // On the connection's thread, right after Start and whenever MHD calls the
  // handler again: answers once the worker is done, else suspends the
  // connection (MHD_YES); MHD_NO when the client left or the server stops.
  // Sets `*answered` once nothing more is to be done.
  MHD_Result Continue(MHD_Connection* connection, bool* answered);

  // The connection ended before the answer, or its handler failed: counted
  // with `code` (the worker's result, if it comes, is dropped).
  void Abandon(absl::StatusCode code);

  struct Call;  // shared with the request worker (tokenize_http.cc)

 private:
  explicit HttpTokenizerRequest(std::shared_ptr<Call> call)
      : call_(std::move(call)) {}

  const std::shared_ptr<Call> call_;
};

}  // namespace moh
