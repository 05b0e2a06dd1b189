// The hand-written parts of client/openai_http_client.h: server-sent events
// split from bytes in any pieces, and OpenAI error JSON read back into a
// status. The requests themselves are tested through the real binaries
// (tests/integration/test_clients.py, tests/bench_cli_test.py).
#include "client/openai_http_client.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace moh::client {
namespace {

std::vector<std::string> Split(const std::vector<std::string>& pieces) {
  SseSplitter splitter;
  std::vector<std::string> events;
  for (const std::string& piece : pieces) {
    splitter.Feed(piece,
                  [&](const std::string& data) { events.push_back(data); });
  }
  return events;
}

TEST(SseSplitterTest, OneEventPerBlankLine) {
  EXPECT_EQ(Split({"data: {\"a\":1}\n\ndata: [DONE]\n\n"}),
            (std::vector<std::string>{"{\"a\":1}", "[DONE]"}));
}

TEST(SseSplitterTest, AnySplitOfTheBytesGivesTheSameEvents) {
  const std::string stream =
      "data: one\r\n\r\ndata:two\n\n: a comment\nevent: x\ndata: 3\ndata: "
      "4\n\n";
  const std::vector<std::string> want = {"one", "two", "3\n4"};
  for (size_t cut = 0; cut <= stream.size(); ++cut) {
    EXPECT_EQ(Split({stream.substr(0, cut), stream.substr(cut)}), want)
        << "cut at " << cut;
  }
  std::vector<std::string> bytes;
  for (char c : stream) bytes.emplace_back(1, c);
  EXPECT_EQ(Split(bytes), want);
}

TEST(SseSplitterTest, IncompleteAndDatalessEventsAreNotDelivered) {
  EXPECT_EQ(Split({"event: ping\n\nid: 3\n\ndata: half"}),
            std::vector<std::string>{});
  EXPECT_EQ(Split({"data\n\n"}), std::vector<std::string>{""});
}

TEST(StatusFromErrorJsonTest, KeepsTheServersCodeAndSaysTheHttpStatus) {
  const absl::Status status = StatusFromErrorJson(
      400,
      R"({"error": {"message": "activation_ratio must be in [0, 1], got 2",
          "type": "invalid_request_error", "param": null,
          "code": "INVALID_ARGUMENT"}})");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(),
            "HTTP 400 invalid_request_error: activation_ratio must be in "
            "[0, 1], got 2");
  // An error event inside a 200 stream.
  EXPECT_EQ(StatusFromErrorJson(
                200, R"({"error": {"message": "m", "code": "UNAVAILABLE"}})")
                .code(),
            absl::StatusCode::kUnavailable);
}

TEST(StatusFromErrorJsonTest, OtherBodiesTakeTheCodeOfTheHttpStatus) {
  absl::Status status = StatusFromErrorJson(502, "<html>bad gateway</html>");
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(status.message(), "HTTP 502: <html>bad gateway</html>");
  EXPECT_EQ(StatusFromErrorJson(429, "").code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(StatusFromErrorJson(401, R"({"error": {"message": "no"}})").code(),
            absl::StatusCode::kUnauthenticated);
}

TEST(DecimalTest, FloatsAsTyped) {
  EXPECT_EQ(Decimal(0.7f), 0.7);
  EXPECT_EQ(Decimal(0.5f), 0.5);
  EXPECT_EQ(Decimal(2.0f), 2.0);
}

}  // namespace
}  // namespace moh::client
