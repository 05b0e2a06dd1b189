#include "model/core/model_config.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moh {
namespace {

using ::testing::HasSubstr;

constexpr char kLlamaBase[] = R"("model_type": "llama", "hidden_size": 64,
  "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2,
  "intermediate_size": 128, "vocab_size": 100, "rope_theta": 500000.0)";

absl::StatusOr<ModelConfig> Parse(const std::string& extra) {
  return ParseModelConfig(std::string("{") + kLlamaBase + extra + "}",
                          "cfg.json");
}

void ExpectError(const std::string& extra, const std::string& message) {
  auto config = Parse(extra);
  ASSERT_FALSE(config.ok()) << extra;
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("cfg.json"));
  EXPECT_THAT(std::string(config.status().message()), HasSubstr(message))
      << extra;
}

TEST(ModelConfigTest, PlainLlamaIsDense) {
  auto config = Parse("");
  ASSERT_TRUE(config.ok()) << config.status();
  const LlamaConfig& c = config->llama;
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.moh.router, RouterKind::kDense);
  ASSERT_EQ(c.moh.layers.size(), 2u);
  EXPECT_EQ(c.moh.layers[0].shared_heads, 8);
  EXPECT_DOUBLE_EQ(c.moh.DefaultRatio(), 1.0);
  EXPECT_DOUBLE_EQ(c.moh.MinRatio(), 1.0);
  EXPECT_EQ(c.moh.layers[0].TopKForRatio(0.5f), 0);
}

TEST(ModelConfigTest, ReleasedMohLlama3ConfigUsesQueryNormDefaults) {
  auto config = Parse(R"(, "architectures": ["LlamaForCausalLM"],
      "auto_map": {"AutoModelForCausalLM": "modeling_llama.LlamaForCausalLM"},
      "eos_token_id": [7, 9], "bos_token_id": 1)");
  ASSERT_TRUE(config.ok()) << config.status();
  const MohConfig& moh = config->llama.moh;
  EXPECT_EQ(moh.router, RouterKind::kQueryNorm);
  EXPECT_EQ(moh.layers[1].shared_heads, 4);
  EXPECT_EQ(moh.layers[1].top_k, 2);
  EXPECT_DOUBLE_EQ(moh.DefaultRatio(), 0.75);
  EXPECT_DOUBLE_EQ(moh.MinRatio(), 0.5);
  EXPECT_THAT(config->llama.eos_token_ids, ::testing::ElementsAre(7, 9));
  EXPECT_EQ(config->llama.bos_token_id, 1);
}

TEST(ModelConfigTest, ArchitectureAloneIdentifiesLlama) {
  auto config = ParseModelConfig(R"({"architectures": ["LlamaForCausalLM"],
      "hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1,
      "intermediate_size": 32, "vocab_size": 10})",
                                 "cfg.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->family, ModelFamily::kLlama);
}

TEST(ModelConfigTest, LearnedRouterWithPerLayerTopK) {
  auto config = Parse(R"(, "moh_router": "learned", "moh_shared_heads": 2,
      "moh_routed_top_k": [3, 2])");
  ASSERT_TRUE(config.ok()) << config.status();
  const MohConfig& moh = config->llama.moh;
  EXPECT_EQ(moh.router, RouterKind::kLearned);
  EXPECT_EQ(moh.layers[0].top_k, 3);
  EXPECT_EQ(moh.layers[1].top_k, 2);
  EXPECT_DOUBLE_EQ(moh.DefaultRatio(), (5.0 + 4.0) / 16.0);
  EXPECT_DOUBLE_EQ(moh.MinRatio(), 0.25);
}

TEST(ModelConfigTest, TopKForRatioFollowsSpecFormula) {
  // H = 8, S = 2, R = 6: K = clamp(floor(r * 8 + 0.5) - 2, 0, 6).
  MohLayerConfig layer{8, 2, 3};
  EXPECT_EQ(layer.TopKForRatio(0.0f), 3);   // default
  EXPECT_EQ(layer.TopKForRatio(-1.0f), 3);  // default
  EXPECT_EQ(layer.TopKForRatio(0.5f), 2);
  EXPECT_EQ(layer.TopKForRatio(0.75f), 4);
  EXPECT_EQ(layer.TopKForRatio(0.8125f), 5);  // 6.5 rounds up
  EXPECT_EQ(layer.TopKForRatio(1.0f), 6);
  EXPECT_EQ(layer.TopKForRatio(0.1f), 0);
  MohLayerConfig unrouted{6, 6, 0};
  EXPECT_EQ(unrouted.TopKForRatio(0.5f), 0);
}

TEST(ModelConfigTest, RejectsBadMohFields) {
  ExpectError(R"(, "moh_router": "magic")", "moh_router");
  ExpectError(R"(, "moh_shared_heads": 2, "moh_routed_top_k": [3])",
              "one per layer (2)");
  ExpectError(R"(, "moh_shared_heads": 2, "moh_routed_top_k": 7)",
              "must be in [0, 6]");
  ExpectError(R"(, "moh_shared_heads": 9, "moh_routed_top_k": 1)",
              "moh_shared_heads' must be in [0, 8]");
  ExpectError(R"(, "moh_shared_heads": 2, "moh_routed_top_k": 0)",
              "requires moh_shared_heads == num_attention_heads");
  ExpectError(R"(, "moh_router": "learned", "moh_routed_top_k": 2)",
              "moh_shared_heads' is required");
  ExpectError(R"(, "moh_shared_heads": "two", "moh_routed_top_k": 2)",
              "must be an integer");
}

TEST(ModelConfigTest, RejectsBadLlamaFields) {
  ExpectError(R"(, "num_key_value_heads": 3)",
              "must divide num_attention_heads");
  ExpectError(R"(, "hidden_act": "gelu")", "hidden_act");
  ExpectError(R"(, "rope_scaling": {"type": "linear", "factor": 2.0})",
              "rope_scaling");
  ExpectError(R"(, "eos_token_id": 100)", "eos_token_id' must be in [0, 99]");
  // head_dim 8: 16 M positions need 1024 MiB of tables (allowed), a head_dim
  // of 32 4096 MiB (refused before allocating).
  EXPECT_TRUE(Parse(R"(, "max_position_embeddings": 16777216)").ok());
  ExpectError(R"(, "max_position_embeddings": 16777216, "head_dim": 32)",
              "needs 4096 MiB of RoPE tables; at most 2048 MiB");
  auto missing = ParseModelConfig(R"({"model_type": "llama"})", "cfg.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("'vocab_size' is required"));
}

TEST(ModelConfigTest, RejectsBadJsonAndUnknownModelType) {
  auto bad = ParseModelConfig("{\"model_type\": ", "cfg.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("cfg.json: not valid JSON"));
  auto bert = ParseModelConfig(R"({"model_type": "bert"})", "cfg.json");
  ASSERT_FALSE(bert.ok());
  EXPECT_THAT(std::string(bert.status().message()), HasSubstr("\"bert\""));
}

constexpr char kVit[] = R"({"model_type": "moh_vit", "image_size": 16,
  "patch_size": 4, "num_channels": 3, "hidden_size": 48,
  "num_hidden_layers": 3, "num_attention_heads": 6, "intermediate_size": 96,
  "labels": ["a", "b"], "image_mean": [0.5, 0.5, 0.5],
  "image_std": [0.25, 0.25, 0.25], "moh_router": "learned",
  "moh_shared_heads": [2, 1, 6], "moh_routed_top_k": [2, 3, 0]})";

TEST(ModelConfigTest, VitWithPerLayerSharedHeads) {
  auto config = ParseModelConfig(kVit, "vit.json");
  ASSERT_TRUE(config.ok()) << config.status();
  const VitConfig& c = config->vit;
  EXPECT_EQ(config->family, ModelFamily::kVit);
  EXPECT_EQ(c.num_patches(), 16);
  EXPECT_EQ(c.labels.size(), 2u);
  EXPECT_EQ(c.moh.layers[2].routed_heads(), 0);
  EXPECT_DOUBLE_EQ(c.moh.DefaultRatio(), (4.0 + 4.0 + 6.0) / 18.0);
}

TEST(ModelConfigTest, VitRejectsMissingLabelsAndBadPatch) {
  std::string no_labels = kVit;
  const std::string labels = R"("labels": ["a", "b"])";
  no_labels.replace(no_labels.find(labels), labels.size(),
                    R"("labelz": ["a"])");
  auto config = ParseModelConfig(no_labels, "vit.json");
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("'labels'"));
  std::string bad_patch = kVit;
  bad_patch.replace(bad_patch.find("\"patch_size\": 4"), 15,
                    "\"patch_size\": 5");
  config = ParseModelConfig(bad_patch, "vit.json");
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(std::string(config.status().message()),
              HasSubstr("must divide image_size"));
}

}  // namespace
}  // namespace moh

namespace moh {
namespace {

absl::StatusOr<ModelConfig> ParseTransNext(const std::string& fields) {
  return ParseModelConfig(
      R"({"model_type": "moh_transnext", "labels": ["a", "b"])" + fields + "}",
      "cfg.json");
}

void ExpectTransNextError(const std::string& fields,
                          const std::string& message) {
  auto config = ParseTransNext(fields);
  ASSERT_FALSE(config.ok()) << fields;
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(config.status().message()), HasSubstr(message))
      << fields;
}

// The released variants' layouts (MoH-ViT/transnext.py).
TEST(TransNextConfigTest, VariantsFillTheArchitecture) {
  auto base = ParseTransNext(R"(, "variant": "moh_transnext_base_75")");
  ASSERT_TRUE(base.ok()) << base.status();
  ASSERT_EQ(base->family, ModelFamily::kTransNext);
  const TransNextConfig& b = base->transnext;
  ASSERT_EQ(b.stages.size(), 4u);
  EXPECT_EQ(b.stages[2].embed_dim, 384);
  EXPECT_EQ(b.stages[2].num_heads, 16);
  EXPECT_EQ(b.stages[2].depth, 23);
  EXPECT_EQ(b.stages[3].sr_ratio, 1);
  EXPECT_EQ(b.stages[0].glu_hidden(), 512);  // int(2 * 768 / 3)
  EXPECT_EQ(b.image_size, 224);
  EXPECT_EQ(b.resize_size, 256);
  ASSERT_EQ(b.moh.layers.size(), 38u);
  // Stage 3: 4 shared, 8 of 12 routed; stage 4: 5 shared, 16 of 27.
  EXPECT_EQ(b.moh.layers[10].shared_heads, 4);
  EXPECT_EQ(b.moh.layers[10].top_k, 8);
  EXPECT_EQ(b.moh.layers[10].stage, 2);
  EXPECT_EQ(b.moh.layers[10].block, 0);
  EXPECT_EQ(b.moh.layers[37].routed_heads(), 27);
  EXPECT_EQ(b.moh.layers[37].block, 4);
  EXPECT_EQ(b.moh.layers[0].routed_heads(), 0);  // stage 1 only re-weights
  EXPECT_EQ(b.LayerStages().size(), 38u);

  auto small = ParseTransNext(R"(, "variant": "moh_transnext_small_80")");
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->transnext.moh.layers.size(), 37u);
  EXPECT_EQ(small->transnext.stages[3].shared_heads, 8);
  auto base50 = ParseTransNext(R"(, "variant": "moh_transnext_base_50")");
  ASSERT_TRUE(base50.ok()) << base50.status();
  EXPECT_EQ(base50->transnext.moh.layers[0].top_k, 2);  // every stage routes
  EXPECT_LT(base50->transnext.moh.DefaultRatio(),
            base->transnext.moh.DefaultRatio());
}

TEST(TransNextConfigTest, RejectsBadFieldsNamingThem) {
  ExpectTransNextError(R"(, "variant": "moh_transnext_huge")",
                       "field 'variant' must be one of moh_transnext_base_75");
  ExpectTransNextError("", "field 'embed_dims' is required");
  const std::string tiny =
      R"(, "embed_dims": [8, 16, 32, 32], "num_heads": [2, 4, 4, 4],
      "depths": [1, 1, 2, 1], "image_size": 64)";
  EXPECT_TRUE(ParseTransNext(tiny).ok()) << ParseTransNext(tiny).status();
  ExpectTransNextError(tiny + R"(, "image_size": 100)",
                       "must be a multiple of 32");
  ExpectTransNextError(
      R"(, "embed_dims": [8, 16, 30, 32], "num_heads": [2, 4, 4, 4],
      "depths": [1, 1, 2, 1], "image_size": 64)",
      "field 'num_heads[2]' must divide embed_dims[2] (30), got 4");
  ExpectTransNextError(tiny + R"(, "moh_shared_heads": [2, 1, 2, 0],
      "moh_routed_top_k": [0, 4, 1, 2])",
                       "field 'moh_routed_top_k[1]' must be in [1, 3]");
  ExpectTransNextError(tiny + R"(, "moh_shared_heads": [2, 4, 4, 4],
      "moh_routed_top_k": [0, 0, 1, 0])",
                       "must be 0 when every head is shared");
  ExpectTransNextError(tiny + R"(, "sr_ratios": [8, 4, 2, 2])",
                       "field 'sr_ratios[3]' must be 1");
  ExpectTransNextError(tiny + R"(, "sr_ratios": [32, 4, 2, 1])",
                       "at most the stage's resolution (16)");
  ExpectTransNextError(tiny + R"(, "depths": [1, 1, 2])",
                       "field 'depths' must be a list of 4 ints");
}

}  // namespace
}  // namespace moh

namespace moh {
namespace {

absl::StatusOr<ModelConfig> ParseDit(const std::string& fields) {
  return ParseModelConfig(R"({"model_type": "moh_dit")" + fields + "}",
                          "cfg.json");
}

// The released configurations (MoH-DiT/models.py).
TEST(DitConfigTest, VariantsFillTheArchitecture) {
  auto xl = ParseDit(R"(, "variant": "MoH-DiT-XL/2-90")");
  ASSERT_TRUE(xl.ok()) << xl.status();
  ASSERT_EQ(xl->family, ModelFamily::kDit);
  const DitConfig& c = xl->dit;
  EXPECT_EQ(c.hidden_size, 1152);
  EXPECT_EQ(c.depth, 28);
  EXPECT_EQ(c.input_size, 32);
  EXPECT_EQ(c.out_channels(), 8);
  EXPECT_EQ(c.tokens(), 256);
  ASSERT_EQ(c.moh.layers.size(), 28u);
  EXPECT_EQ(c.num_heads[0], 8);
  EXPECT_EQ(c.num_heads[27], 24);
  EXPECT_EQ(c.head_dim[27], 72);  // 24 x 72 = 1728 != 1152
  EXPECT_EQ(c.moh.layers[27].shared_heads, 16);
  EXPECT_EQ(c.moh.layers[27].top_k, 3);
  EXPECT_EQ(c.moh.layers[0].routed_heads(), 0);
  EXPECT_EQ(c.labels.size(), 1000u);
  EXPECT_EQ(c.labels[207], "207");
  auto s75 = ParseDit(R"(, "variant": "MoH-DiT-S/2-75")");
  ASSERT_TRUE(s75.ok()) << s75.status();
  EXPECT_EQ(s75->dit.head_dim[0], 64);  // 384 / 6
  EXPECT_EQ(s75->dit.moh.layers[6].top_k, 2);
  EXPECT_EQ(
      ParseDit(R"(, "variant": "MoH-DiT-L/2-75")")->dit.moh.layers[8].top_k, 4);
}

TEST(DitConfigTest, RejectsBadFieldsNamingThem) {
  auto error = [](const std::string& fields) {
    auto c = ParseDit(fields);
    return c.ok() ? std::string("ok") : std::string(c.status().message());
  };
  EXPECT_THAT(error(R"(, "variant": "DiT-XL/2")"),
              HasSubstr("field 'variant' must be one of MoH-DiT-XL/2-90"));
  EXPECT_THAT(error(R"(, "hidden_size": 64)"),
              HasSubstr("'depth' is required"));
  const std::string tiny = R"(, "hidden_size": 32, "depth": 2, "input_size": 8,
      "num_heads": [2, 4], "num_classes": 10)";
  EXPECT_EQ(error(tiny), "ok");
  EXPECT_THAT(error(tiny + R"(, "patch_size": 3)"),
              HasSubstr("'patch_size' must divide input_size (8)"));
  EXPECT_THAT(error(tiny + R"(, "moh_shared_heads": [2, 1],
      "moh_routed_top_k": [0, 4])"),
              HasSubstr("'moh_routed_top_k[1]' must be in [1, 3]"));
  EXPECT_THAT(error(tiny + R"(, "labels": ["a"])"),
              HasSubstr("'labels' must have num_classes (10) names"));
  EXPECT_THAT(error(tiny + R"(, "default_guidance": 0.5)"),
              HasSubstr("'default_guidance' must be in [1, 100]"));
}

}  // namespace
}  // namespace moh
