// Tests for moh::Tokenizer on two tiny tokenizer.json files written by
// tests/testdata/tokenizer_make_testdata.py. Expected ids are derived by hand
// from those files (see the comments), not from this implementation.
//
// Byte-level file: the byte tokens use GPT-2's vocab order, so byte b has id
//   b - 33           for '!'..'~'   (H=39 a=64 b=65 e=68 h=71 l=75 o=78 ...)
//   94 + b - 0xA1    for 0xA1..0xAC (0xA5 "¥"=98, 0xA9 "©"=102)
//   106 + b - 0xAE   for 0xAE..0xFF (0xBD=121, 0xC3 "Ã"=127, 0xE4=160, ...)
//   188 + b          for 0x00..0x20 (newline "Ċ"=198, space "Ġ"=220)
//   221 + b - 0x7F   for 0x7F..0xA0 (0x8D=235, 0x91=239, 0x9F=253, 0xA0=254)
// Merges by rank: 0 H+e=256, 1 l+l=257, 2 He+ll=258, 3 Hell+o=259,
//   4 Ġ+w=260, 5 o+r=261, 6 Ġw+or=262, 7 l+d=263, 8 Ġwor+ld=264,
//   9 Ã+©=265 ("é"), 10 h+Ã©=266, 11 ä+½=267, 12 ä½+ł=268 ("你"),
//   13 3+4=270, 14 ł+Â=271 (0xA0 then 0xC2, "Â"=126). "Ġthere"=269 has no
//   merges (reachable by ignore_merges). <|begin_of_text|>=300,
//   <|end_of_text|>=301; 272..299 are unused ids.
//
// Metaspace file: <unk>=0 <s>=1 </s>=2, <0xXX>=3+XX, "▁"=259 H=260 e=261
//   l=262 o=263 w=264 r=265 d=266 é=267 你=268 h=280 i=281; merges by rank:
//   0 ▁+H=269, 1 l+l=270, 2 ▁H+e=271, 3 ▁He+ll=272, 4 ▁Hell+o=273,
//   5 ▁+w=274, 6 o+r=275, 7 ▁w+or=276, 8 l+d=277, 9 ▁wor+ld=278,
//   10 ▁+h=279; non-special added token <sep>=282 (lstrip, rstrip).
#include "model/tokenizer/tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/base/test_paths.h"

namespace moh {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using Ids = std::vector<int32_t>;

constexpr char kFffd[] = "\xEF\xBF\xBD";
const std::string kByteLevel = "tokenizer_bytelevel.json";
const std::string kMetaspace = "tokenizer_metaspace.json";

std::string TestdataPath(const std::string& name) {
  return test_paths::TestdataDir() + "/" + name;
}

std::unique_ptr<Tokenizer> Load(const std::string& name) {
  auto tokenizer = Tokenizer::FromFile(TestdataPath(name));
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  return tokenizer.ok() ? std::move(tokenizer).value() : nullptr;
}

nlohmann::json ReadJson(const std::string& name) {
  std::ifstream in(TestdataPath(name));
  return nlohmann::json::parse(in);
}

// Loads `name` after `edit` changed its JSON.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadEdited(
    const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j = ReadJson(name);
  edit(j);
  return Tokenizer::FromJson(j.dump(), "edited " + name);
}

std::unique_ptr<Tokenizer> MustLoadEdited(
    const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
  auto tokenizer = LoadEdited(name, edit);
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  return tokenizer.ok() ? std::move(tokenizer).value() : nullptr;
}

// Strict UTF-8 check written independently of the implementation.
bool IsValidUtf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    const int n = b < 0x80         ? 1
                  : (b >> 5) == 6  ? 2
                  : (b >> 4) == 14 ? 3
                  : (b >> 3) == 30 ? 4
                                   : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t cp = n == 1 ? b : b & (0x7F >> n);
    for (int k = 1; k < n; ++k) {
      const auto c = static_cast<unsigned char>(s[i + k]);
      if ((c & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (c & 0x3F);
    }
    const uint32_t min[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += n;
  }
  return true;
}

// Feeds `ids` one at a time; every chunk must be valid UTF-8 and all chunks
// plus Flush must equal Decode. Returns the chunks (Flush's last).
std::vector<std::string> Stream(const Tokenizer& tokenizer, const Ids& ids,
                                bool skip_special_tokens) {
  IncrementalDecoder decoder(tokenizer, skip_special_tokens);
  std::vector<std::string> chunks;
  std::string all;
  for (int32_t id : ids) {
    auto chunk = decoder.Push(id);
    EXPECT_TRUE(chunk.ok()) << chunk.status();
    if (!chunk.ok()) return chunks;
    EXPECT_TRUE(IsValidUtf8(*chunk)) << "chunk after id " << id;
    chunks.push_back(*chunk);
    all += *chunk;
  }
  chunks.push_back(decoder.Flush());
  EXPECT_TRUE(IsValidUtf8(chunks.back()));
  all += chunks.back();
  auto decoded = tokenizer.Decode(ids, skip_special_tokens);
  EXPECT_TRUE(decoded.ok()) << decoded.status();
  if (decoded.ok()) EXPECT_EQ(all, *decoded);
  return chunks;
}

struct Golden {
  std::string text;
  bool add_special_tokens;
  Ids ids;
};

void ExpectGoldens(const Tokenizer& tokenizer,
                   const std::vector<Golden>& goldens) {
  for (const Golden& g : goldens) {
    EXPECT_EQ(tokenizer.Encode(g.text, g.add_special_tokens), g.ids)
        << "text: \"" << g.text << "\"";
    Stream(tokenizer, g.ids, /*skip_special_tokens=*/false);
    Stream(tokenizer, g.ids, /*skip_special_tokens=*/true);
  }
}

// ------------------------------------------------------------ Byte-level --

TEST(ByteLevelTokenizerTest, GoldenEncodings) {
  auto tok = Load(kByteLevel);
  ASSERT_NE(tok, nullptr);
  ExpectGoldens(
      *tok,
      {
          // Regex pieces "Hello", " world"; both are whole vocab entries.
          {"Hello world", true, {300, 259, 264}},
          {"Hello world", false, {259, 264}},
          // Merges 0..3 give "Hello"; "w" (86) has no merge with it.
          {"Hellow", false, {259, 86}},
          // h Ã © l l o: l+l (rank 1), Ã+© (9), h+Ã© (10).
          {"h\xC3\xA9llo", false, {266, 257, 78}},
          // 你 = E4 BD A0 -> "ä½ł" merges to 268; 好 = E5 A5 BD stays bytes.
          {"你好", false, {268, 161, 98, 121}},
          // 👍 = F0 9F 91 8D, one piece with its leading space, no merges.
          {" 👍", false, {220, 172, 253, 239, 235}},
          // `\s+(?!\S)` leaves the last space to " b".
          {"a  b", false, {64, 220, 220, 65}},
          // Case-insensitive contraction (?i:'m) splits "I" | "'M".
          {"I'M", false, {40, 6, 44}},
          // l+l (rank 1) beats l+d (rank 7) on the shared middle "l".
          {"lld", false, {257, 67}},
          // Equal ranks: the leftmost pair merges first.
          {"lll", false, {257, 75}},
          // \p{N}{1,3} splits "123" | "45", so merge 3+4 must not apply.
          {"12345", false, {16, 17, 18, 19, 20}},
          {"a\n\nb", false, {64, 198, 198, 65}},
          // NBSP (C2 A0) is \s under PCRE2_UCP: pieces "a" | NBSP | NBSP "b",
          // so ł+Â cannot merge across the two NBSPs.
          {"a\u00A0\u00A0b", false, {64, 126, 254, 126, 254, 65}},
          // Special token in the middle; " there" is whole in the vocab.
          {"Hello<|end_of_text|> there", true, {300, 259, 301, 269}},
          {"", true, {300}},
          {"", false, {}},
      });
}

TEST(ByteLevelTokenizerTest, IgnoreMergesOffSplitsUnmergeableWord) {
  auto tok = MustLoadEdited(kByteLevel, [](nlohmann::json& j) {
    j["model"]["ignore_merges"] = false;
  });
  ASSERT_NE(tok, nullptr);
  // "Ġthere" is in the vocab but no merges build it: Ġ t h e r e.
  EXPECT_THAT(tok->Encode(" there", false),
              ElementsAre(220, 83, 71, 68, 81, 68));
  EXPECT_THAT(tok->Encode("Hello world", false), ElementsAre(259, 264));
}

TEST(ByteLevelTokenizerTest, Gpt2ByteLevelPreTokenizer) {
  auto tok = MustLoadEdited(kByteLevel, [](nlohmann::json& j) {
    j["pre_tokenizer"] = {{"type", "ByteLevel"},
                          {"add_prefix_space", true},
                          {"trim_offsets", true},
                          {"use_regex", true}};
  });
  ASSERT_NE(tok, nullptr);
  // add_prefix_space: "ĠHello" is not in the vocab, so Ġ + Hello.
  EXPECT_THAT(tok->Encode("Hello world", false), ElementsAre(220, 259, 264));
  // ` ?\p{N}+` keeps " 12345" whole, so merge 3+4 applies here.
  EXPECT_THAT(tok->Encode("12345", false), ElementsAre(220, 16, 17, 270, 20));
  EXPECT_THAT(tok->Encode("a  b", false), ElementsAre(220, 64, 220, 220, 65));
}

TEST(ByteLevelTokenizerTest, DecodeRoundTripsAndSpecialTokens) {
  auto tok = Load(kByteLevel);
  ASSERT_NE(tok, nullptr);
  for (const std::string text :
       {"Hello world", "h\xC3\xA9llo wörld", "你好，世界", "emoji 👍🏽 ok",
        "tabs\tand\nnewlines  ", "I'M 12345 x"}) {
    const Ids ids = tok->Encode(text, true);
    EXPECT_EQ(tok->Decode(ids, true).value_or("ERROR"), text);
    EXPECT_EQ(tok->Decode(ids, false).value_or("ERROR"),
              "<|begin_of_text|>" + text);
    Stream(*tok, ids, true);
  }
  EXPECT_EQ(tok->Decode({259, 301, 269}, true).value_or("ERROR"),
            "Hello there");
  EXPECT_EQ(tok->Decode({259, 301, 269}, false).value_or("ERROR"),
            "Hello<|end_of_text|> there");
}

TEST(ByteLevelTokenizerTest, InvalidUtf8BecomesReplacementCharacter) {
  auto tok = Load(kByteLevel);
  ASSERT_NE(tok, nullptr);
  // F0 9F is one truncated sequence: a single U+FFFD, as from_utf8_lossy.
  EXPECT_EQ(tok->Decode({172, 253}, false).value_or("ERROR"), kFffd);
  EXPECT_EQ(tok->Decode({172, 64}, false).value_or("ERROR"),
            std::string(kFffd) + "a");
  EXPECT_EQ(tok->Decode({253}, false).value_or("ERROR"), kFffd);
  // Invalid input is encoded as U+FFFD (EF BF BD) followed by "b".
  EXPECT_THAT(tok->Encode("a\xFF"
                          "b",
                          false),
              ElementsAre(64, 171, 123, 121, 65));
}

TEST(ByteLevelTokenizerTest, Accessors) {
  auto tok = Load(kByteLevel);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 302);
  EXPECT_EQ(tok->TokenToId("Ġthere"), 269);
  EXPECT_EQ(tok->TokenToId("<|end_of_text|>"), 301);
  EXPECT_EQ(tok->TokenToId("there"), std::nullopt);
  EXPECT_EQ(tok->IdToToken(220), "Ġ");
  EXPECT_EQ(tok->IdToToken(280), std::nullopt);
  EXPECT_TRUE(tok->IsSpecial(300));
  EXPECT_FALSE(tok->IsSpecial(259));
  EXPECT_FALSE(tok->IsSpecial(-3));
  EXPECT_EQ(tok->bos_id(), 300);
  EXPECT_EQ(tok->eos_id(), 301);
}

TEST(ByteLevelTokenizerTest, DecodeRejectsIdsOutsideTheVocabulary) {
  auto tok = Load(kByteLevel);
  ASSERT_NE(tok, nullptr);
  for (int32_t bad : {-1, 285, 302, 1 << 30}) {
    auto text = tok->Decode({259, bad}, false);
    EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(text.status().message(), HasSubstr(std::to_string(bad)));
  }
}

TEST(ByteLevelTokenizerTest, EncodeIsThreadSafe) {
  auto tok = Load(kByteLevel);
  ASSERT_NE(tok, nullptr);
  const std::string text =
      "Hello world<|end_of_text|> héllo 你好 👍 I'M 12345\n\n  there";
  const Ids expected = tok->Encode(text, true);
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        if (tok->Encode(text, true) != expected) ++mismatches[t];
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_THAT(mismatches, ElementsAre(0, 0, 0, 0));
}

// ------------------------------------------------------------- Metaspace --

TEST(MetaspaceTokenizerTest, GoldenEncodings) {
  auto tok = Load(kMetaspace);
  ASSERT_NE(tok, nullptr);
  ExpectGoldens(
      *tok,
      {
          // "▁Hello▁world": merges 0..4 build ▁Hello, 5..9 build ▁world.
          {"Hello world", true, {1, 273, 278}},
          // ▁ h é l l o: l+l (rank 1), ▁+h (10).
          {"h\xC3\xA9llo", false, {279, 267, 270, 263}},
          // 好 is not in the vocab: byte fallback <0xE5><0xA5><0xBD>.
          {"你好", false, {259, 268, 232, 168, 192}},
          // ▁H i ▁ then 👍 as <0xF0><0x9F><0x91><0x8D>.
          {"Hi 👍", false, {269, 281, 259, 243, 162, 148, 144}},
          // ▁ l l d: l+l (rank 1) beats l+d (rank 8); "lll" merges leftmost.
          {"lld", false, {259, 270, 266}},
          {"lll", false, {259, 270, 262}},
          // Added tokens split first; each part gets its own "▁" (HF legacy).
          {"Hello</s>world", true, {1, 273, 2, 278}},
          // <sep> strips the spaces around it (lstrip, rstrip).
          {"Hello <sep> world", false, {273, 282, 278}},
          {"", true, {1}},
      });
}

TEST(MetaspaceTokenizerTest, UnknownCharactersWithoutByteFallback) {
  for (bool fuse : {true, false}) {
    auto tok = MustLoadEdited(kMetaspace, [fuse](nlohmann::json& j) {
      j["model"]["byte_fallback"] = false;
      j["model"]["fuse_unk"] = fuse;
    });
    ASSERT_NE(tok, nullptr);
    EXPECT_EQ(tok->Encode("你好好", false),
              fuse ? Ids({259, 268, 0}) : Ids({259, 268, 0, 0}));
  }
}

TEST(MetaspaceTokenizerTest, Decode) {
  auto tok = Load(kMetaspace);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->Decode({1, 273, 278}, true).value_or("ERROR"), "Hello world");
  // Strip removes the first character only when it is a space.
  EXPECT_EQ(tok->Decode({1, 273, 278}, false).value_or("ERROR"),
            "<s> Hello world");
  EXPECT_EQ(tok->Decode({273, 282, 278}, true).value_or("ERROR"),
            "Hello<sep> world");
  // Only one leading space is stripped.
  EXPECT_EQ(tok->Decode({259, 273}, true).value_or("ERROR"), " Hello");
  EXPECT_EQ(tok->Decode({243, 162, 148, 144}, true).value_or("ERROR"), "👍");
  // An invalid byte run gives one U+FFFD per byte, as HF's ByteFallback.
  EXPECT_EQ(tok->Decode({243, 162}, true).value_or("ERROR"),
            std::string(kFffd) + kFffd);
  EXPECT_EQ(tok->Decode({269, 243}, true).value_or("ERROR"),
            std::string("H") + kFffd);
  for (const std::string text :
       {"Hello world", "h\xC3\xA9llo", "你好", "Hi 👍"}) {
    EXPECT_EQ(tok->Decode(tok->Encode(text, true), true).value_or("ERROR"),
              text);
  }
  EXPECT_EQ(tok->vocab_size(), 283);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_TRUE(tok->IsSpecial(2));
  EXPECT_FALSE(tok->IsSpecial(282));  // <sep> is added but not special.
  EXPECT_EQ(tok->TokenToId("<0x0A>"), 13);
}

TEST(MetaspaceTokenizerTest, MetaspacePreTokenizerAndDecoder) {
  auto edit = [](const std::string& scheme) {
    return [scheme](nlohmann::json& j) {
      const nlohmann::json metaspace = {{"type", "Metaspace"},
                                        {"replacement", "▁"},
                                        {"prepend_scheme", scheme},
                                        {"split", false}};
      j["normalizer"] = nullptr;
      j["pre_tokenizer"] = metaspace;
      j["decoder"] = metaspace;
    };
  };
  auto first = MustLoadEdited(kMetaspace, edit("first"));
  ASSERT_NE(first, nullptr);
  EXPECT_THAT(first->Encode("Hello world", true), ElementsAre(1, 273, 278));
  // "first": no "▁" after the added token: w o r l d -> w, or, ld.
  EXPECT_THAT(first->Encode("Hello</s>world", true),
              ElementsAre(1, 273, 2, 264, 275, 277));
  EXPECT_EQ(first->Decode({273, 278}, true).value_or("ERROR"), "Hello world");
  Stream(*first, {1, 273, 2, 264, 275, 277}, true);

  auto always = MustLoadEdited(kMetaspace, edit("always"));
  ASSERT_NE(always, nullptr);
  EXPECT_THAT(always->Encode("Hello</s>world", true),
              ElementsAre(1, 273, 2, 278));
}

TEST(TokenizerOptionsTest, SingleWordAddedToken) {
  auto tok = MustLoadEdited(kMetaspace, [](nlohmann::json& j) {
    j["added_tokens"][3]["single_word"] = true;
    j["added_tokens"][3]["lstrip"] = false;
    j["added_tokens"][3]["rstrip"] = false;
  });
  ASSERT_NE(tok, nullptr);
  // Glued to "Hello" it is not a word: < s e p > go through byte fallback
  // (<0x3C>=63, <0x73>=118, e=261, <0x70>=115, <0x3E>=65).
  EXPECT_THAT(tok->Encode("Hello<sep>", false),
              ElementsAre(273, 63, 118, 261, 115, 65));
  // Without lstrip/rstrip the spaces stay: "▁Hello▁" and "▁▁world".
  EXPECT_THAT(tok->Encode("Hello <sep> world", false),
              ElementsAre(273, 259, 282, 259, 278));
}

TEST(TokenizerOptionsTest, SplitRemovedAndNoDecoder) {
  auto tok = MustLoadEdited(kByteLevel, [](nlohmann::json& j) {
    j["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Split"},
                                              {"pattern", {{"String", " "}}},
                                              {"behavior", "Removed"},
                                              {"invert", false}};
    j["decoder"] = nullptr;
  });
  ASSERT_NE(tok, nullptr);
  // "Hello" | "world" (space removed): w o r l d -> w, or, ld.
  EXPECT_THAT(tok->Encode("Hello world", false),
              ElementsAre(259, 86, 261, 263));
  // Without a decoder HF joins the raw tokens with spaces.
  EXPECT_EQ(tok->Decode({259, 264}, false).value_or("ERROR"), "Hello Ġworld");
  Stream(*tok, {300, 259, 264}, false);
}

TEST(TokenizerOptionsTest, StripStopHoldsTrailingSpaces) {
  auto tok = MustLoadEdited(kMetaspace, [](nlohmann::json& j) {
    j["decoder"]["decoders"][3]["stop"] = 1;
  });
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->Decode({273, 259}, true).value_or("ERROR"), "Hello");
  EXPECT_THAT(Stream(*tok, {273, 259, 278}, true),
              ElementsAre("Hello", "", "  world", ""));
  EXPECT_THAT(Stream(*tok, {273, 259}, true), ElementsAre("Hello", "", ""));
}

// --------------------------------------------------- Incremental decoding --

TEST(IncrementalDecoderTest, ByteLevelHoldsIncompleteCharacters) {
  auto tok = Load(kByteLevel);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Stream(*tok, {259, 220, 172, 253, 239, 235, 264}, false),
              ElementsAre("Hello", " ", "", "", "", "👍", " world", ""));
  // 你 as three separate byte tokens.
  EXPECT_THAT(Stream(*tok, {160, 121, 254}, false),
              ElementsAre("", "", "你", ""));
  // An incomplete character at the end becomes U+FFFD on Flush.
  EXPECT_THAT(Stream(*tok, {64, 172, 253}, false),
              ElementsAre("a", "", "", kFffd));
  // A byte that cannot continue the sequence settles it at once.
  EXPECT_THAT(Stream(*tok, {172, 64}, false),
              ElementsAre("", std::string(kFffd) + "a", ""));
}

TEST(IncrementalDecoderTest, MetaspaceStripsOnlyTheFirstLeadingSpace) {
  auto tok = Load(kMetaspace);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Stream(*tok, {273, 278}, false),
              ElementsAre("Hello", " world", ""));
  EXPECT_THAT(Stream(*tok, {259, 273}, false), ElementsAre("", " Hello", ""));
  EXPECT_THAT(Stream(*tok, {1, 273}, true), ElementsAre("", "Hello", ""));
  EXPECT_THAT(Stream(*tok, {1, 273}, false), ElementsAre("<s>", " Hello", ""));
}

TEST(IncrementalDecoderTest, MetaspaceByteRunIsHeldUntilItEnds) {
  auto tok = Load(kMetaspace);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Stream(*tok, {273, 259, 243, 162, 148, 144, 278}, true),
              ElementsAre("Hello", " ", "", "", "", "", "👍 world", ""));
  EXPECT_THAT(Stream(*tok, {269, 243, 162, 148, 144}, true),
              ElementsAre("H", "", "", "", "", "👍"));
  EXPECT_THAT(Stream(*tok, {269, 243, 162}, true),
              ElementsAre("H", "", "", std::string(kFffd) + kFffd));
}

TEST(IncrementalDecoderTest, FlushStartsANewSequenceAndBadIdsAreRejected) {
  auto tok = Load(kMetaspace);
  ASSERT_NE(tok, nullptr);
  IncrementalDecoder decoder(*tok, true);
  EXPECT_EQ(decoder.Push(273).value_or("ERROR"), "Hello");
  EXPECT_EQ(decoder.Push(-1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(decoder.Push(283).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(decoder.Push(278).value_or("ERROR"), " world");
  EXPECT_THAT(decoder.Flush(), IsEmpty());
  EXPECT_EQ(decoder.Push(278).value_or("ERROR"), "world");
}

// ----------------------------------------------------------------- Errors --

void ExpectLoadError(const std::string& base,
                     const std::function<void(nlohmann::json&)>& edit,
                     const std::vector<std::string>& fragments) {
  auto tok = LoadEdited(base, edit);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr("edited " + base));
  for (const std::string& fragment : fragments) {
    EXPECT_THAT(tok.status().message(), HasSubstr(fragment));
  }
}

TEST(TokenizerErrorTest, UnsupportedFeaturesNameFieldAndValue) {
  using J = nlohmann::json;
  ExpectLoadError(kByteLevel, [](J& j) { j["model"]["type"] = "WordPiece"; },
                  {"model.type", "WordPiece"});
  ExpectLoadError(kByteLevel, [](J& j) { j["model"]["type"] = "Unigram"; },
                  {"model.type", "Unigram"});
  ExpectLoadError(kMetaspace,
                  [](J& j) {
                    j["normalizer"] = {{"type", "NFKC"}};
                  },
                  {"normalizer.type", "NFKC"});
  ExpectLoadError(
      kByteLevel,
      [](J& j) {
        j["pre_tokenizer"]["pretokenizers"][1] = {{"type", "Digits"}};
      },
      {"pre_tokenizer.pretokenizers[1].type", "Digits"});
  ExpectLoadError(kByteLevel,
                  [](J& j) {
                    j["pre_tokenizer"] = {{"type", "Whitespace"}};
                  },
                  {"pre_tokenizer.type", "Whitespace"});
  ExpectLoadError(kByteLevel,
                  [](J& j) {
                    j["decoder"] = {{"type", "CTC"}};
                  },
                  {"decoder.type", "CTC"});
  ExpectLoadError(kMetaspace,
                  [](J& j) {
                    j["post_processor"] = {{"type", "BertProcessing"}};
                  },
                  {"post_processor.type", "BertProcessing"});
  ExpectLoadError(kMetaspace,
                  [](J& j) {
                    j["pre_tokenizer"] = {{"type", "Split"},
                                          {"pattern", {{"String", " "}}},
                                          {"behavior", "Sideways"},
                                          {"invert", false}};
                  },
                  {"pre_tokenizer.behavior", "Sideways"});
}

TEST(TokenizerErrorTest, MalformedContentNamesTheField) {
  using J = nlohmann::json;
  ExpectLoadError(kMetaspace, [](J& j) { j["model"]["merges"][0] = "▁ zz"; },
                  {"model.merges[0]", "zz"});
  ExpectLoadError(kByteLevel,
                  [](J& j) { j["model"]["merges"][2] = J::array({"H"}); },
                  {"model.merges[2]"});
  ExpectLoadError(kByteLevel, [](J& j) { j["model"]["vocab"]["Ġthere"] = "x"; },
                  {"model.vocab", "Ġthere"});
  ExpectLoadError(kByteLevel, [](J& j) { j["model"]["vocab"] = J::array(); },
                  {"model.vocab"});
  ExpectLoadError(kByteLevel, [](J& j) { j.erase("model"); }, {"model"});
  ExpectLoadError(kByteLevel,
                  [](J& j) {
                    j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] =
                        "(a";
                  },
                  {"pre_tokenizer.pretokenizers[0].pattern.Regex"});
  ExpectLoadError(kByteLevel, [](J& j) { j["added_tokens"][0]["id"] = -5; },
                  {"added_tokens[0].id"});
  ExpectLoadError(kMetaspace, [](J& j) { j["model"]["unk_token"] = "<nope>"; },
                  {"model.unk_token"});
  ExpectLoadError(kByteLevel, [](J& j) { j = J::array(); }, {"JSON object"});
}

// Found by fuzz/tokenizer_json_fuzzer: a template id naming no token (here
// after the added tokens were dropped, and in the suffix) was emitted by
// Encode and refused by Decode.
TEST(TokenizerErrorTest, TemplateIdsMustNameTokens) {
  using J = nlohmann::json;
  ExpectLoadError(kByteLevel, [](J& j) { j.erase("added_tokens"); },
                  {"post_processor", "id 300 outside vocabulary"});
  ExpectLoadError(
      kMetaspace,
      [](J& j) {
        j["post_processor"]["single"].push_back(
            {{"SpecialToken", {{"id", "</x>"}}}});
        j["post_processor"]["special_tokens"]["</x>"] = {{"ids", {5000}}};
      },
      {"post_processor", "id 5000 outside vocabulary"});
}

// Found by fuzzing: refused values were printed with dump(), which recurses;
// 100000 nested arrays overflowed the stack.
TEST(TokenizerErrorTest, DeeplyNestedValuesAreNotPrinted) {
  const std::string nested =
      std::string(100000, '[') + std::string(100000, ']');
  for (const char* field : {"type", "dropout", "end_of_word_suffix"}) {
    SCOPED_TRACE(field);
    std::string text = R"({"model":{"type":"BPE","vocab":{},"merges":[],")";
    text += field;
    text += R"(":)" + nested + "}}";
    auto tok = Tokenizer::FromJson(text, "nested.json");
    ASSERT_FALSE(tok.ok());
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(tok.status().message()),
                HasSubstr(std::string("model.") + field +
                          ": unsupported value \"(an array)\""));
  }
}

TEST(TokenizerErrorTest, DeeplyNestedSequencesAreRefusedNotRecursed) {
  // 100000 Sequences in Sequences would exhaust the loader's stack.
  const int depth = 100000;
  std::string nested;
  for (int i = 0; i < depth; ++i) {
    nested += R"({"type":"Sequence","normalizers":[)";
  }
  nested += R"({"type":"Lowercase"})";
  for (int i = 0; i < depth; ++i) nested += "]}";
  nlohmann::json j = ReadJson(kMetaspace);
  j.erase("normalizer");
  const std::string text = j.dump();
  const std::string with_nesting =
      R"({"normalizer":)" + nested + "," + text.substr(1);
  auto tok = Tokenizer::FromJson(with_nesting, "nested.json");
  ASSERT_FALSE(tok.ok());
  EXPECT_THAT(std::string(tok.status().message()),
              HasSubstr("may nest at most 16 deep"));
  // Two levels, as real files have, still load.
  auto two = LoadEdited(kMetaspace, [](nlohmann::json& j) {
    j["normalizer"] = nlohmann::json::parse(
        R"({"type":"Sequence","normalizers":[{"type":"Sequence",)"
        R"("normalizers":[{"type":"Prepend","prepend":"x"}]}]})");
  });
  EXPECT_TRUE(two.ok()) << two.status();
}

// Found by fuzzing: an added token's id of 16 million in a 200-byte file
// allocated a table of 16 million strings (a timeout under ASan). Ids may
// leave at most kMaxUnusedTokenIds unnamed below the largest.
TEST(TokenizerErrorTest, SparseIdsAreRefused) {
  auto sparse = LoadEdited(kMetaspace, [](nlohmann::json& j) {
    j["added_tokens"] = nlohmann::json::parse(
        R"([{"id": 16114084, "content": "x", "special": true}])");
  });
  ASSERT_FALSE(sparse.ok());
  EXPECT_EQ(sparse.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(sparse.status().message()),
              HasSubstr("the largest id, 16114084, leaves"));
  EXPECT_THAT(std::string(sparse.status().message()),
              HasSubstr("at most 65536 may be"));
  // A gap of 65,536 ids past the vocabulary still loads.
  const int64_t vocab = ReadJson(kMetaspace)["model"]["vocab"].size();
  auto gap = LoadEdited(kMetaspace, [&](nlohmann::json& j) {
    j["added_tokens"] = nlohmann::json::array(
        {{{"id", vocab + 65536 - 1}, {"content", "x"}, {"special", true}}});
  });
  EXPECT_TRUE(gap.ok()) << gap.status();
}

TEST(TokenizerErrorTest, FilesThatCannotBeReadOrParsed) {
  const std::string missing = TestdataPath("tokenizer_does_not_exist.json");
  auto tok = Tokenizer::FromFile(missing);
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(tok.status().message(), HasSubstr(missing));

  const std::string bad = ::testing::TempDir() + "/tokenizer_malformed.json";
  std::ofstream(bad) << "{\"model\": {\"type\": \"BPE\", \"vocab\": {";
  tok = Tokenizer::FromFile(bad);
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr(bad));
  EXPECT_THAT(tok.status().message(), HasSubstr("malformed"));

  tok = Tokenizer::FromJson("", "empty.json");
  EXPECT_THAT(tok.status().message(), HasSubstr("empty.json"));
}

}  // namespace
}  // namespace moh
