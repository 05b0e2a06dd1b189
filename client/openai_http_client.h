// A small client of moh-server's OpenAI-compatible HTTP API
// (service/http/openai_http.h) over libcurl, shared by `moh-client chat` and
// `moh-bench --api=openai`.
//
// One request is one curl easy handle (so one connection) on the calling
// thread. A streamed response (server-sent events) is split into its events'
// data by SseSplitter, the one piece of HTTP parsing written here; libcurl
// does the rest (HTTP/1.1, chunked transfer, TLS).
//
// Errors: every failure is an absl::Status. A response carrying OpenAI's error
// JSON ({"error": {"message", "type", "code"}}, in the body or as a streamed
// event after the status line) keeps the server's code (its "code" is the
// canonical code's name, e.g. INVALID_ARGUMENT) and says "HTTP <status>
// <type>: <message>"; other HTTP failures take the code of their status.
// Transport failures: UNAVAILABLE (cannot connect, connection broken),
// DEADLINE_EXCEEDED (past the timeout), CANCELLED (the cancel flag).
//
// Thread-safety: an OpenAiHttpClient is immutable; any number of threads may
// make requests through one at once.
#ifndef MOH_CLIENT_OPENAI_HTTP_CLIENT_H_
#define MOH_CLIENT_OPENAI_HTTP_CLIENT_H_

#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/connection.h"
#include "nlohmann/json.hpp"

namespace moh::client {

// Splits a server-sent event stream (text/event-stream) into events. Each
// event's data is its "data:" lines (one leading space dropped) joined by
// '\n'; comments, other fields and events without data are skipped. Lines
// may end with "\n", "\r\n" or "\r". Not thread-safe.
class SseSplitter {
 public:
  // Appends `bytes` (any split of the stream) and calls `on_data` with the
  // data of each event they complete, in order.
  void Feed(absl::string_view bytes,
            const std::function<void(const std::string&)>& on_data);

 private:
  void TakeLine(absl::string_view line,
                const std::function<void(const std::string&)>& on_data);

  std::string line_;           // the incomplete last line
  bool skip_newline_ = false;  // the last line ended with '\r'
  std::string data_;           // the event so far
  bool has_data_ = false;
};

// A float as the decimal it was typed as (0.7, not 0.699999988), for JSON.
double Decimal(float value);

// The status of an OpenAI error JSON object ({"error": {...}}) sent with
// `http_status`; UNKNOWN quoting the text when it is not one.
absl::Status StatusFromErrorJson(long http_status, absl::string_view text);

class OpenAiHttpClient {
 public:
  // Each streamed chunk's JSON, in order.
  using ChunkFn = std::function<void(const nlohmann::json& chunk)>;

  // To connection.http (HOST:PORT); HTTPS when connection.tls_ca_file is set
  // (trusting that CA, with the client certificate when given); the bearer
  // token of connection.token when set. `timeout`: of each request, from its
  // start; zero: none.
  OpenAiHttpClient(const Connection& connection, absl::Duration timeout);

  // "http://HOST:PORT" or "https://HOST:PORT".
  const std::string& base_url() const { return base_url_; }

  // POSTs `body` to `path` (e.g. "/v1/chat/completions"), which must ask for
  // a stream, and calls `on_chunk` with each event's JSON until "[DONE]".
  // OK after "[DONE]"; a stream that ends without it is UNAVAILABLE. When
  // `cancel` is set and turns true, the connection is closed (within about a
  // second) and the result is CANCELLED.
  absl::Status Stream(const std::string& path, const nlohmann::json& body,
                      const ChunkFn& on_chunk,
                      const std::atomic<bool>* cancel = nullptr) const;

  // GET `path`; its JSON body.
  absl::StatusOr<nlohmann::json> Get(const std::string& path) const;

 private:
  // Performs one request; `on_event` receives the events of a 200
  // text/event-stream response, any other body is collected in the result.
  absl::Status Perform(const std::string& path, const std::string* post_body,
                       const std::function<bool(const std::string&)>& on_event,
                       const std::atomic<bool>* cancel, long* http_status,
                       std::string* body) const;

  std::string base_url_;
  Connection connection_;
  absl::Duration timeout_;
};

}  // namespace moh::client

#endif  // MOH_CLIENT_OPENAI_HTTP_CLIENT_H_
