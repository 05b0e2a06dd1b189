#include "client/openai_http_client.h"

#include <curl/curl.h>

#include <memory>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace moh::client {
namespace {

using nlohmann::json;

// A body that is not a stream (an error, a model list) is kept up to this
// size; beyond it the request fails.
constexpr size_t kMaxBodyBytes = size_t{16} << 20;

void InitCurlOnce() {
  // Before any handle; thread-safe through the static's initialization.
  static const CURLcode init = curl_global_init(CURL_GLOBAL_DEFAULT);
  (void)init;
}

// The server's codes (service/http/openai_response.cc, HttpStatus) read back.
absl::StatusCode CodeOfHttpStatus(long http_status) {
  switch (http_status) {
    case 400:
      return absl::StatusCode::kInvalidArgument;
    case 401:
      return absl::StatusCode::kUnauthenticated;
    case 403:
      return absl::StatusCode::kPermissionDenied;
    case 404:
      return absl::StatusCode::kNotFound;
    case 429:
      return absl::StatusCode::kResourceExhausted;
    case 499:
      return absl::StatusCode::kCancelled;
    case 503:
      return absl::StatusCode::kUnavailable;
    case 504:
      return absl::StatusCode::kDeadlineExceeded;
    default:
      if (http_status >= 400 && http_status < 500) {
        return absl::StatusCode::kInvalidArgument;
      }
      return http_status >= 500 ? absl::StatusCode::kInternal
                                : absl::StatusCode::kUnknown;
  }
}

// "INVALID_ARGUMENT" -> kInvalidArgument; false for another name.
bool CodeOfName(const std::string& name, absl::StatusCode* code) {
  for (int c = 0; c <= 16; ++c) {
    const auto candidate = static_cast<absl::StatusCode>(c);
    if (absl::StatusCodeToString(candidate) == name) {
      *code = candidate;
      return true;
    }
  }
  return false;
}

std::string Excerpt(absl::string_view text) {
  constexpr size_t kMax = 200;
  return text.size() <= kMax ? std::string(text)
                             : absl::StrCat(text.substr(0, kMax), "...");
}

// What one transfer's callbacks share.
struct Transfer {
  CURL* curl = nullptr;
  const std::function<bool(const std::string&)>* on_event = nullptr;
  const std::atomic<bool>* cancel = nullptr;
  bool streaming = false;  // decided at the first body bytes
  bool started = false;
  bool stopped = false;  // on_event asked to stop
  bool too_big = false;
  SseSplitter splitter;
  std::string body;
};

size_t OnBody(char* data, size_t size, size_t count, void* user) {
  Transfer& t = *static_cast<Transfer*>(user);
  const size_t n = size * count;
  if (!t.started) {
    t.started = true;
    long status = 0;
    char* type = nullptr;
    curl_easy_getinfo(t.curl, CURLINFO_RESPONSE_CODE, &status);
    curl_easy_getinfo(t.curl, CURLINFO_CONTENT_TYPE, &type);
    t.streaming = t.on_event != nullptr && status == 200 && type != nullptr &&
                  absl::StartsWith(type, "text/event-stream");
  }
  if (!t.streaming) {
    if (t.body.size() + n > kMaxBodyBytes) {
      t.too_big = true;
      return 0;
    }
    t.body.append(data, n);
    return n;
  }
  t.splitter.Feed(absl::string_view(data, n), [&t](const std::string& event) {
    if (!t.stopped && !(*t.on_event)(event)) t.stopped = true;
  });
  return t.stopped ? 0 : n;  // 0 ends the transfer
}

int OnProgress(void* user, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
  const Transfer& t = *static_cast<const Transfer*>(user);
  return t.cancel != nullptr && t.cancel->load() ? 1 : 0;  // 1 aborts
}

struct CurlCleanup {
  void operator()(CURL* curl) const { curl_easy_cleanup(curl); }
};
struct HeadersCleanup {
  void operator()(curl_slist* list) const { curl_slist_free_all(list); }
};

}  // namespace

void SseSplitter::Feed(absl::string_view bytes,
                       const std::function<void(const std::string&)>& on_data) {
  for (const char c : bytes) {
    if (skip_newline_) {
      skip_newline_ = false;
      if (c == '\n') continue;  // the "\n" of a "\r\n"
    }
    if (c == '\r' || c == '\n') {
      skip_newline_ = c == '\r';
      TakeLine(line_, on_data);
      line_.clear();
    } else {
      line_ += c;
    }
  }
}

void SseSplitter::TakeLine(
    absl::string_view line,
    const std::function<void(const std::string&)>& on_data) {
  if (line.empty()) {  // the end of an event
    if (has_data_) on_data(data_);
    data_.clear();
    has_data_ = false;
    return;
  }
  const size_t colon = line.find(':');
  if (colon == 0) return;  // a comment
  const absl::string_view field = line.substr(0, colon);
  if (field != "data") return;  // event, id, retry: not used here
  absl::string_view value =
      colon == absl::string_view::npos ? "" : line.substr(colon + 1);
  if (absl::StartsWith(value, " ")) value.remove_prefix(1);
  if (has_data_) data_ += '\n';
  data_.append(value.data(), value.size());
  has_data_ = true;
}

double Decimal(float value) {
  double decimal = value;
  absl::SimpleAtod(absl::StrCat(value), &decimal);
  return decimal;
}

absl::Status StatusFromErrorJson(long http_status, absl::string_view text) {
  const std::string where = http_status == 200
                                ? "HTTP 200, in the event stream"
                                : absl::StrCat("HTTP ", http_status);
  const json parsed = json::parse(text, nullptr, /*allow_exceptions=*/false);
  const json* error = nullptr;
  if (parsed.is_object() && parsed.contains("error") &&
      parsed["error"].is_object()) {
    error = &parsed["error"];
  }
  if (error == nullptr) {
    return absl::Status(
        http_status == 200 ? absl::StatusCode::kUnknown
                           : CodeOfHttpStatus(http_status),
        absl::StrCat(where, ": ", text.empty() ? "(no body)" : Excerpt(text)));
  }
  const auto string_field = [error](const char* name) {
    auto it = error->find(name);
    return it != error->end() && it->is_string() ? it->get<std::string>()
                                                 : std::string();
  };
  absl::StatusCode code = CodeOfHttpStatus(http_status);
  CodeOfName(string_field("code"), &code);
  const std::string type = string_field("type");
  return absl::Status(code, absl::StrCat(where, type.empty() ? "" : " ", type,
                                         ": ", string_field("message")));
}

OpenAiHttpClient::OpenAiHttpClient(const Connection& connection,
                                   absl::Duration timeout)
    : base_url_(
          absl::StrCat(connection.tls_ca_file.empty() ? "http://" : "https://",
                       connection.http)),
      connection_(connection),
      timeout_(timeout) {
  InitCurlOnce();
}

absl::Status OpenAiHttpClient::Perform(
    const std::string& path, const std::string* post_body,
    const std::function<bool(const std::string&)>& on_event,
    const std::atomic<bool>* cancel, long* http_status,
    std::string* body) const {
  std::unique_ptr<CURL, CurlCleanup> curl(curl_easy_init());
  if (curl == nullptr) return absl::InternalError("curl_easy_init failed");
  CURL* const c = curl.get();
  std::unique_ptr<curl_slist, HeadersCleanup> headers;
  const auto add_header = [&headers](const std::string& header) {
    headers.reset(curl_slist_append(headers.release(), header.c_str()));
  };
  if (!connection_.token.empty()) {
    add_header("Authorization: Bearer " + connection_.token);
  }
  if (post_body != nullptr) {
    add_header("Content-Type: application/json");
    add_header("Accept: text/event-stream, application/json");
    curl_easy_setopt(c, CURLOPT_POST, 1L);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, post_body->data());
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE,
                     static_cast<curl_off_t>(post_body->size()));
  }
  const std::string url = base_url_ + path;
  Transfer transfer;
  transfer.curl = c;
  transfer.on_event = post_body != nullptr ? &on_event : nullptr;
  transfer.cancel = cancel;
  char error_buffer[CURL_ERROR_SIZE] = "";
  curl_easy_setopt(c, CURLOPT_URL, url.c_str());
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers.get());
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);  // threads; no SIGALRM
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, error_buffer);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, OnBody);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &transfer);
  curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
  curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, OnProgress);
  curl_easy_setopt(c, CURLOPT_XFERINFODATA, &transfer);
  if (timeout_ > absl::ZeroDuration()) {
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS,
                     static_cast<long>(absl::ToInt64Milliseconds(timeout_)));
  }
  if (!connection_.tls_ca_file.empty()) {
    curl_easy_setopt(c, CURLOPT_CAINFO, connection_.tls_ca_file.c_str());
    if (!connection_.tls_cert_file.empty()) {
      curl_easy_setopt(c, CURLOPT_SSLCERT, connection_.tls_cert_file.c_str());
      curl_easy_setopt(c, CURLOPT_SSLKEY, connection_.tls_key_file.c_str());
    }
  }

  const CURLcode result = curl_easy_perform(c);
  *http_status = 0;
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, http_status);
  *body = std::move(transfer.body);
  if (result == CURLE_OK || (result == CURLE_WRITE_ERROR && transfer.stopped)) {
    return absl::OkStatus();
  }
  const std::string what = absl::StrFormat(
      "%s %s: %s", post_body != nullptr ? "POST" : "GET", url,
      error_buffer[0] != '\0' ? error_buffer : curl_easy_strerror(result));
  if (transfer.too_big) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%s: the response is over %d bytes", url, kMaxBodyBytes));
  }
  switch (result) {
    case CURLE_ABORTED_BY_CALLBACK:
      return absl::CancelledError(absl::StrCat(url, ": cancelled"));
    case CURLE_OPERATION_TIMEDOUT:
      return absl::DeadlineExceededError(what);
    default:
      return absl::UnavailableError(what);
  }
}

absl::Status OpenAiHttpClient::Stream(const std::string& path,
                                      const nlohmann::json& body,
                                      const ChunkFn& on_chunk,
                                      const std::atomic<bool>* cancel) const {
  const std::string post = body.dump();
  bool done = false;
  absl::Status event_error;
  const std::function<bool(const std::string&)> on_event =
      [&](const std::string& data) {
        if (data == "[DONE]") {
          done = true;
          return false;
        }
        const json chunk = json::parse(data, nullptr, false);
        if (!chunk.is_object()) {
          event_error = absl::UnavailableError(
              absl::StrCat("an event is not a JSON object: ", Excerpt(data)));
          return false;
        }
        if (chunk.contains("error")) {
          event_error = StatusFromErrorJson(200, data);
          return false;
        }
        on_chunk(chunk);
        return true;
      };
  long http_status = 0;
  std::string error_body;
  absl::Status status =
      Perform(path, &post, on_event, cancel, &http_status, &error_body);
  if (!event_error.ok()) return event_error;
  if (!status.ok()) return status;
  if (http_status != 200) return StatusFromErrorJson(http_status, error_body);
  if (!done) {
    return absl::UnavailableError(
        error_body.empty()
            ? absl::StrCat(base_url_, path,
                           ": the event stream ended without [DONE]")
            : absl::StrCat(base_url_, path, ": expected an event stream, got ",
                           Excerpt(error_body)));
  }
  return absl::OkStatus();
}

absl::StatusOr<nlohmann::json> OpenAiHttpClient::Get(
    const std::string& path) const {
  long http_status = 0;
  std::string body;
  absl::Status status =
      Perform(path, nullptr, nullptr, nullptr, &http_status, &body);
  if (!status.ok()) return status;
  if (http_status != 200) return StatusFromErrorJson(http_status, body);
  json parsed = json::parse(body, nullptr, false);
  if (parsed.is_discarded()) {
    return absl::UnavailableError(absl::StrCat(
        base_url_, path, ": the body is not JSON: ", Excerpt(body)));
  }
  return parsed;
}

}  // namespace moh::client
