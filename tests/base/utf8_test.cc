#include "base/utf8.h"

#include <string>

#include "gtest/gtest.h"

namespace moh {
namespace {

const std::string kBad = "\xEF\xBF\xBD";  // U+FFFD

TEST(Utf8Test, ValidTextIsKept) {
  for (const std::string text :
       {std::string(), std::string("plain"), std::string("caf\xC3\xA9"),
        std::string("\xF0\x9F\x98\x80 smile"), std::string("nul\0in", 6)}) {
    EXPECT_TRUE(IsValidUtf8(text)) << text;
    EXPECT_EQ(LossyUtf8(text), text);
  }
}

TEST(Utf8Test, EachMaximalInvalidSubpartBecomesOneReplacement) {
  // A pickle's global name with one stray byte, as a checkpoint may hold.
  EXPECT_EQ(LossyUtf8("torch._\xC8tils"), "torch._" + kBad + "tils");
  // A lone continuation byte, a surrogate, an overlong form, a code point
  // past U+10FFFF: each invalid, one replacement per maximal subpart.
  EXPECT_EQ(LossyUtf8("a\x80z"), "a" + kBad + "z");
  EXPECT_EQ(LossyUtf8("\xED\xA0\x80"), kBad + kBad + kBad);
  EXPECT_EQ(LossyUtf8("\xC0\xAF"), kBad + kBad);
  EXPECT_EQ(LossyUtf8("\xF4\x90\x80\x80"), kBad + kBad + kBad + kBad);
  // A character cut short: its start is one subpart; at the end, too.
  EXPECT_EQ(LossyUtf8("\xE2\x82z"), kBad + "z");
  EXPECT_EQ(LossyUtf8("end\xE2\x82"), "end" + kBad);
  for (const char* text : {"torch._\xC8tils", "\xFF\xFE", "end\xE2\x82"}) {
    EXPECT_FALSE(IsValidUtf8(text)) << text;
    EXPECT_TRUE(IsValidUtf8(LossyUtf8(text))) << text;
  }
}

}  // namespace
}  // namespace moh
