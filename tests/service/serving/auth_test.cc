// Bearer-token authentication (service/serving/auth.h): the token file, the
// HTTP Authorization header and the x-api-key header Anthropic's clients send.
#include "service/serving/auth.h"

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moh {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<TokenAuth> AuthWith(const std::string& text) {
  const std::string path =
      ::testing::TempDir() + "/tokens_" +
      ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::ofstream(path) << text;
  auto auth = TokenAuth::FromFile(path);
  std::remove(path.c_str());
  EXPECT_TRUE(auth.ok()) << auth.status();
  return auth.ok() ? std::move(*auth) : nullptr;
}

TEST(TokenAuthTest, FileSkipsCommentsAndBlankLines) {
  auto auth = AuthWith("# tokens\n\n  sesame  \nsecond\n");
  ASSERT_NE(auth, nullptr);
  EXPECT_TRUE(auth->CheckHeader("Bearer sesame").ok());
  EXPECT_TRUE(auth->CheckHeader("Bearer second").ok());
  EXPECT_FALSE(auth->CheckHeader("Bearer # tokens").ok());
  EXPECT_FALSE(TokenAuth::FromFile("/nonexistent/tokens").ok());
}

TEST(TokenAuthTest, AuthorizationHeader) {
  auto auth = AuthWith("sesame\n");
  ASSERT_NE(auth, nullptr);
  EXPECT_THAT(auth->CheckHeader(std::nullopt).message(),
              HasSubstr("Authorization: Bearer <token>"));
  EXPECT_THAT(auth->CheckHeader("sesame").message(),
              HasSubstr("must be \"Bearer <token>\""));
  EXPECT_EQ(auth->CheckHeader("Bearer sesam").code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(auth->CheckHeader("Bearer sesame").code(), absl::StatusCode::kOk);
}

TEST(TokenAuthTest, ApiKeyOrAuthorization) {
  auto auth = AuthWith("sesame\n");
  ASSERT_NE(auth, nullptr);
  EXPECT_TRUE(auth->CheckHeaders(std::nullopt, "sesame").ok());
  EXPECT_TRUE(auth->CheckHeaders("Bearer sesame", std::nullopt).ok());
  // x-api-key holds the token alone, and is the one checked when present.
  EXPECT_THAT(auth->CheckHeaders(std::nullopt, "Bearer sesame").message(),
              HasSubstr("x-api-key: unknown token"));
  EXPECT_FALSE(auth->CheckHeaders("Bearer sesame", "wrong").ok());
  EXPECT_THAT(auth->CheckHeaders("Bearer wrong", std::nullopt).message(),
              HasSubstr("authorization: unknown token"));
  const absl::Status none = auth->CheckHeaders(std::nullopt, std::nullopt);
  EXPECT_EQ(none.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(none.message(), HasSubstr("\"x-api-key: <token>\""));
  EXPECT_FALSE(auth->CheckHeaders(std::nullopt, "").ok());
}

}  // namespace
}  // namespace moh
