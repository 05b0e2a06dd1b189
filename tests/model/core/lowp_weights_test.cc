// DeviceOptions::weights: the fixture model's logits with bfloat16 linear
// weights (Bf16Linear) and int8 ones (Int8Linear), converted as they load,
// against float32's, over a chunked prompt beside a decoding row (prefill's
// panel path and decode's few-row path, float32 activations) and a prompt
// in one chunk (the prefill product: activations rounded to bfloat16 on
// AVX512_BF16 CPUs, to int8 per 32 values on AVX512_VNNI), at ratio 1 and 0.5
// (the head-sparse pair kernel's per-head slices of q_proj and o_proj), in each
// attention mode; and the settings it refuses, each naming the field.
// Pre-quantized checkpoints (config.json's quantization_config: int8
// weights with a scale per row as llm-compressor and bitsandbytes save
// them) load as they are stored, equal to what `weights: "int8"` makes of
// the float32 fixture, widen where int8 cannot run, and a malformed one
// fails naming the field or tensor. A step longer than the MLP's row chunk
// gives each of its prompts the logits it gets alone, in every format.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <system_error>
#include <vector>

#include "model/checkpoint/safetensors_reader.h"
#include "model/checkpoint/safetensors_writer.h"
#include "model/core/linear.h"
#include "model/core/llama_model.h"
#include "model/kernels/cpu_isa.h"
#include "nlohmann/json.hpp"
#include "tests/base/test_paths.h"
#include "tests/model/core/llama_test_util.h"
#include "tests/model/core/lowp_weights_test_util.h"

namespace moh {
namespace {

const std::string kFixtures = test_paths::FixturesDir();

std::unique_ptr<LlamaModel> Load(const std::string& weights = "") {
  return LoadWithWeights<LlamaModel>(kFixtures + "/llama_learned", weights);
}

// bfloat16 keeps 8 bits of mantissa (relative rounding <= 2^-9 per weight,
// the tied embedding's too): measured at most 0.051 of the largest logit
// (chunk 1), the same under avx512f, avx2 and portable (LibTorch over the
// same bf16 weights widened): the rounding's, not the kernels'; 0.067 where
// AVX512_BF16 rounds the activations of 9-128-row products too (these
// 53-row chunks: Bf16DotRowsLinear), argmax agreement 0.941. int8 rounds each
// weight by <= half its row's largest / 127: this fixture's weights move
// 0.0060 of their norm (bf16: 0.0016; groups of 32 as Q8_0's: 0.0053), and
// the logits at most 0.18 (chunk 1), again the same under every ISA; its
// argmax agreement measured >= 0.92. Where AVX512_VNNI quantizes x per 32
// values as well (Q8_0's activations: these chunks through
// Int8DotRowsLinear), 0.24 (chunk 1) with agreement >= 0.882; the bound
// keeps a margin over that. The one-chunk prefill below: bfloat16
// 0.049 widening W (avx512f, avx2, portable), 0.063 (agreement 0.973) where
// AVX512_BF16 rounds the activations as well; int8 0.17 widening W, 0.21
// (agreement 0.913) where AVX512_VNNI quantizes x (Int8DotLinear).
class LowpWeightsTest : public ::testing::TestWithParam<WeightsPrecision> {};

TEST_P(LowpWeightsTest, LogitsWithinBoundOfFloat32) {
  const WeightsPrecision& p = GetParam();
  for (AttentionMode mode : {AttentionMode::kAuto, AttentionMode::kDense,
                             AttentionMode::kHeadSparseAten}) {
    std::unique_ptr<LlamaModel> f32 = Load(), lowp = Load(p.weights);
    ASSERT_TRUE(f32 && lowp);
    EXPECT_EQ(lowp->linear_weights(), p.format);
    f32->set_attention_mode(mode);
    lowp->set_attention_mode(mode);
    auto want = ChunkedPromptBesideDecode(*f32, {1.0f, 0.5f});
    auto got = ChunkedPromptBesideDecode(*lowp, {1.0f, 0.5f});
    ASSERT_TRUE(want.ok() && got.ok());
    for (size_t i = 0; i < want->size(); ++i) {
      ExpectLogitsWithinBound((*want)[i], (*got)[i], p,
                              "chunk " + std::to_string(i) + " mode " +
                                  std::to_string(static_cast<int>(mode)));
    }
  }
}

// One 150-token prompt in a single step: every projection takes the
// prefill product (past kMaxStreamedRows rows), which rounds the
// activations too where the CPU has the dot-product extension (bfloat16 on
// AVX512_BF16, int8 per 32 values on AVX512_VNNI). The chunks above (53
// rows) never reach it.
TEST_P(LowpWeightsTest, OneChunkPrefillWithinBoundOfFloat32) {
  const WeightsPrecision& p = GetParam();
  std::unique_ptr<LlamaModel> f32 = Load(), lowp = Load(p.weights);
  ASSERT_TRUE(f32 && lowp);
  at::manual_seed(11);
  const at::Tensor prompt = at::randint(300, {1, 150}, at::kLong);
  std::vector<at::Tensor> logits;
  for (const LlamaModel* model : {f32.get(), lowp.get()}) {
    KvCache cache = model->CreateKvCache(1, 160);
    DecoderBatch batch;
    batch.all_logits = true;
    batch.token_ids = prompt;
    batch.num_tokens = {150};
    batch.slots = {0};
    batch.start_positions = {0};
    batch.ratios = {1.0f};
    auto out = model->Forward(batch, cache);
    ASSERT_TRUE(out.ok()) << out.status();
    logits.push_back(out->logits[0]);
  }
  ExpectLogitsWithinBound(logits[0], logits[1], p, "one 150-token chunk");
}

INSTANTIATE_TEST_SUITE_P(
    Formats, LowpWeightsTest,
    ::testing::Values(
        WeightsPrecision{"bfloat16", WeightFormat::kBfloat16, 0.08, 0.9},
        WeightsPrecision{"int8", WeightFormat::kInt8, 0.3, 0.85}),
    [](const ::testing::TestParamInfo<WeightsPrecision>& info) {
      return info.param.weights;
    });

// A step longer than the MLP's row chunk on CPU (LlamaModel::MlpDown: 1,024
// rows): six 200-token prompts in one step (1,200 rows, two chunks) give
// each prompt the logits it gets in a step with only its pair (400 rows, one
// chunk, the same ratios: even rows 1.0, odd 0.5), in every weight format.
// Each row's sums are the same in any chunk, so the bound is float32
// rounding's.
TEST(LongStepTest, MlpInRowChunksEqualsEachPromptAlone) {
  constexpr int64_t kRows = 6, kTokens = 200;
  for (const std::string weights : {"", "bfloat16", "int8"}) {
    std::unique_ptr<LlamaModel> model = Load(weights);
    ASSERT_TRUE(model);
    at::manual_seed(5);
    const at::Tensor prompts = at::randint(300, {kRows, kTokens}, at::kLong);
    auto run = [&](int64_t first, int64_t rows) {
      KvCache cache = model->CreateKvCache(rows, kTokens);
      DecoderBatch batch;
      batch.all_logits = true;
      batch.token_ids = prompts.narrow(0, first, rows).clone();
      for (int64_t r = 0; r < rows; ++r) {
        batch.num_tokens.push_back(kTokens);
        batch.slots.push_back(static_cast<int32_t>(r));
        batch.start_positions.push_back(0);
        batch.ratios.push_back(r % 2 == 0 ? 1.0f : 0.5f);
      }
      auto out = model->Forward(batch, cache);
      EXPECT_TRUE(out.ok()) << out.status();
      return out.ok() ? out->logits : at::Tensor();
    };
    const at::Tensor together = run(0, kRows);  // [rows, tokens, vocab]
    ASSERT_TRUE(together.defined());
    for (int64_t first = 0; first < kRows; first += 2) {
      const at::Tensor pair = run(first, 2);
      ASSERT_TRUE(pair.defined());
      for (int64_t r = first; r < first + 2; ++r) {
        const at::Tensor want = pair[r - first];
        const double scale = std::max(1.0, want.abs().max().item<double>());
        const double error = (together[r] - want).abs().max().item<double>();
        EXPECT_FALSE(std::isnan(error)) << weights << " row " << r;
        EXPECT_LE(error, 1e-5 * scale) << weights << " row " << r;
      }
    }
  }
}

TEST(LowpWeightsRefusalTest, RefusalsNameTheField) {
  ExpectWeightsRefusalsNameTheField<LlamaModel>(kFixtures + "/llama_learned");
}

// The fixture directories of llama_learned pre-quantized in each layout
// (tests/reference/make_fixtures.py).
const std::vector<std::string> kPrequantizedLayouts = {"compressed_tensors",
                                                       "bitsandbytes"};
std::string PrequantizedDir(const std::string& layout) {
  return kFixtures + "/llama_learned_int8_" + layout;
}

// Logits of ChunkedPromptBesideDecode at ratios 1 and 0.5.
std::vector<at::Tensor> ChunkedLogits(const LlamaModel& model) {
  auto logits = ChunkedPromptBesideDecode(model, {1.0f, 0.5f});
  EXPECT_TRUE(logits.ok()) << logits.status();
  return logits.ok() ? *logits : std::vector<at::Tensor>{};
}

// The checkpoint holds what load-time quantization makes of llama_learned
// (same int8 values, same scales: SCB / 127 for bitsandbytes), so the
// models are the same but for the order of float32 sums.
TEST(PrequantizedTest, LoadsAsStoredEqualToLoadTimeInt8) {
  std::unique_ptr<LlamaModel> quantized_at_load = Load("int8");
  ASSERT_TRUE(quantized_at_load);
  const std::vector<at::Tensor> want = ChunkedLogits(*quantized_at_load);
  for (const std::string& layout : kPrequantizedLayouts) {
    std::unique_ptr<LlamaModel> model =
        LoadWithWeights<LlamaModel>(PrequantizedDir(layout));
    ASSERT_TRUE(model) << layout;
    EXPECT_EQ(model->linear_weights(), WeightFormat::kInt8) << layout;
    const std::vector<at::Tensor> got = ChunkedLogits(*model);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      const double scale = want[i].abs().max().item<double>();
      const double error = (want[i] - got[i]).abs().max().item<double>();
      EXPECT_LE(error, 1e-5 * scale) << layout << " chunk " << i;
    }
  }
}

// As bfloat16 weights, or under a bfloat16 dtype (where int8 weights cannot
// run), the int8 values are widened at load: within int8's bound of
// float32's logits (measured 0.11 as bfloat16 weights, 0.15 under a
// bfloat16 dtype).
TEST(PrequantizedTest, WidenedWhereInt8DoesNotRun) {
  std::unique_ptr<LlamaModel> f32 = Load();
  ASSERT_TRUE(f32);
  const std::vector<at::Tensor> want = ChunkedLogits(*f32);
  const WeightsPrecision widened{"int8 as bfloat16", WeightFormat::kBfloat16,
                                 0.3, 0.85};
  for (const std::string& layout : kPrequantizedLayouts) {
    std::unique_ptr<LlamaModel> model =
        LoadWithWeights<LlamaModel>(PrequantizedDir(layout), "bfloat16");
    ASSERT_TRUE(model) << layout;
    EXPECT_EQ(model->linear_weights(), WeightFormat::kBfloat16);
    const std::vector<at::Tensor> got = ChunkedLogits(*model);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      ExpectLogitsWithinBound(want[i], got[i], widened,
                              layout + " chunk " + std::to_string(i));
    }
    auto bf16 = LlamaModel::Load(PrequantizedDir(layout),
                                 DeviceOptions{"cpu", "bfloat16", ""});
    ASSERT_TRUE(bf16.ok()) << bf16.status();
    EXPECT_EQ((*bf16)->linear_weights(), WeightFormat::kAsLoaded);
    const std::vector<at::Tensor> bf16_logits = ChunkedLogits(**bf16);
    ASSERT_EQ(bf16_logits.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      ExpectLogitsWithinBound(
          want[i], bf16_logits[i].to(at::kFloat), widened,
          layout + " dtype bfloat16 chunk " + std::to_string(i));
    }
  }
}

// A copy of a pre-quantized fixture, changed by `edit_config` (config.json)
// and `edit_tensors` (model.safetensors' tensors, by name), then loaded.
absl::Status LoadEdited(
    const std::string& layout, const std::string& name,
    const std::function<void(nlohmann::json&)>& edit_config,
    const std::function<void(std::map<std::string, at::Tensor>&)>&
        edit_tensors) {
  namespace fs = std::filesystem;
  // Per process: CTest runs this binary under several instruction sets at
  // once.
  const fs::path dir =
      fs::path(::testing::TempDir()) /
      ("prequantized_" + std::to_string(getpid()) + "_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  // Removed however this returns.
  struct Removed {
    fs::path dir;
    ~Removed() {
      std::error_code ignored;
      fs::remove_all(dir, ignored);
    }
  } removed{dir};
  const fs::path from = PrequantizedDir(layout);
  for (const char* file : {"tokenizer.json", "generation_config.json"}) {
    fs::copy_file(from / file, dir / file);
  }
  nlohmann::json config;
  std::ifstream(from / "config.json") >> config;
  edit_config(config);
  std::ofstream(dir / "config.json") << config.dump(2);
  auto stored = ReadSafetensorsFile((from / "model.safetensors").string());
  if (!stored.ok()) return stored.status();
  std::map<std::string, at::Tensor> tensors;
  for (const std::string& tensor : stored->Names()) {
    tensors[tensor] = stored->Get(tensor)->clone();
  }
  edit_tensors(tensors);
  TensorStore edited("edited");
  for (auto& [tensor, value] : tensors) {
    if (auto inserted = edited.Insert(tensor, value, "edited");
        !inserted.ok()) {
      return inserted;
    }
  }
  const std::string path = (dir / "model.safetensors").string();
  if (auto written = WriteSafetensorsFile(path, edited); !written.ok()) {
    return written;
  }
  return LlamaModel::Load(dir.string(), DeviceOptions{"cpu", "float32", ""})
      .status();
}

TEST(PrequantizedTest, MalformedCheckpointsFailNamingTheFieldOrTensor) {
  using Json = nlohmann::json;
  using Tensors = std::map<std::string, at::Tensor>;
  const std::string q = "model.layers.0.self_attn.q_proj.weight";
  auto no_tensor_edit = [](Tensors&) {};
  auto no_config_edit = [](Json&) {};
  auto weights_of = [](Json& c) -> Json& {
    return c["quantization_config"]["config_groups"]["group_0"]["weights"];
  };
  struct Case {
    std::string name, layout;
    std::function<void(Json&)> config;
    std::function<void(Tensors&)> tensors;
    std::vector<std::string> named;  // all in the message
  };
  const std::vector<Case> cases = {
      {"gptq",
       "compressed_tensors",
       [](Json& c) { c["quantization_config"]["quant_method"] = "gptq"; },
       no_tensor_edit,
       {"quantization_config.quant_method", "compressed-tensors",
        "bitsandbytes", "gptq"}},
      {"packed",
       "compressed_tensors",
       [](Json& c) { c["quantization_config"]["format"] = "pack-quantized"; },
       no_tensor_edit,
       {"quantization_config.format", "int-quantized"}},
      {"four_bits",
       "compressed_tensors",
       [&](Json& c) { weights_of(c)["num_bits"] = 4; },
       no_tensor_edit,
       {"group_0.weights.num_bits", "must be 8"}},
      {"groups",
       "compressed_tensors",
       [&](Json& c) { weights_of(c)["strategy"] = "group"; },
       no_tensor_edit,
       {"group_0.weights.strategy", "\"channel\""}},
      {"asymmetric",
       "compressed_tensors",
       [&](Json& c) { weights_of(c)["symmetric"] = false; },
       no_tensor_edit,
       {"group_0.weights.symmetric"}},
      {"four_bit_bnb",
       "bitsandbytes",
       [](Json& c) {
         c["quantization_config"]["load_in_8bit"] = false;
         c["quantization_config"]["load_in_4bit"] = true;
       },
       no_tensor_edit,
       {"quantization_config.load_in_8bit"}},
      {"no_config",
       "compressed_tensors",
       [](Json& c) { c.erase("quantization_config"); },
       no_tensor_edit,
       {q, "is int8", "quantization_config"}},
      {"no_scale",
       "compressed_tensors",
       no_config_edit,
       [&](Tensors& t) { t.erase(q + "_scale"); },
       {q + "_scale", "missing"}},
      {"no_scb",
       "bitsandbytes",
       no_config_edit,
       [](Tensors& t) { t.erase("model.layers.0.self_attn.q_proj.SCB"); },
       {"model.layers.0.self_attn.q_proj.SCB", "missing"}},
      {"scale_shape",
       "compressed_tensors",
       no_config_edit,
       [&](Tensors& t) {
         t[q + "_scale"] = at::ones({3, 2});
       },
       {q + "_scale", "[3, 2]", "one value"}},
      {"nan_scale",
       "bitsandbytes",
       no_config_edit,
       [](Tensors& t) {
         t["model.layers.1.mlp.up_proj.SCB"][2] = std::nanf("");
       },
       {"model.layers.1.mlp.up_proj.SCB", "non-finite"}},
      {"negative_scale",
       "compressed_tensors",
       no_config_edit,
       [&](Tensors& t) { t[q + "_scale"][0] = -1.0f; },
       {q + "_scale", "negative"}},
      {"zero_point",
       "compressed_tensors",
       no_config_edit,
       [&](Tensors& t) { t[q + "_zero_point"][1] = 3; },
       {q + "_zero_point", "symmetric"}},
      {"tiled",
       "bitsandbytes",
       no_config_edit,
       [&](Tensors& t) { t[q + "_format"] = at::tensor(2, at::kByte); },
       {q + "_format", "row-major"}},
      {"int8_norm",
       "bitsandbytes",
       no_config_edit,
       [](Tensors& t) {
         t["model.norm.weight"] = t["model.norm.weight"].to(at::kChar);
       },
       {"model.norm.weight", "only linear weights"}},
  };
  for (const Case& c : cases) {
    const absl::Status status =
        LoadEdited(c.layout, c.name, c.config, c.tensors);
    ASSERT_FALSE(status.ok()) << c.name;
    std::printf("%s: %s\n", c.name.c_str(),
                std::string(status.message()).c_str());
    for (const std::string& part : c.named) {
      EXPECT_NE(status.message().find(part), std::string::npos)
          << c.name << ": " << status.message();
    }
  }
  // The unedited copy loads: the edits are what fails. So does one scale
  // for a whole matrix (compressed-tensors' "tensor" strategy).
  EXPECT_TRUE(
      LoadEdited("bitsandbytes", "unedited", no_config_edit, no_tensor_edit)
          .ok());
  EXPECT_TRUE(LoadEdited(
                  "compressed_tensors", "per_tensor",
                  [&](Json& c) { weights_of(c)["strategy"] = "tensor"; },
                  [&](Tensors& t) {
                    t[q + "_scale"] = t[q + "_scale"].max().reshape({1});
                    t.erase(q + "_zero_point");
                  })
                  .ok());
}

// A block of W (rows [row0, row0 + n), columns [col0, col0 + k)) from
// pointers, in each format, at the row counts that pick each kernel: the
// same sums as Linear over that block's views (the same kernels), and near
// a float32 product over the widened block.
TEST(LinearBlockTest, EqualsLinearOverTheBlock) {
  at::manual_seed(3);
  const at::Tensor w = at::randn({96, 80});
  const at::Tensor bias = at::randn({96});
  const int64_t row0 = 17, n = 40, col0 = 9, k = 48;
  const std::vector<LinearWeight> formats = {LinearWeight(w),
                                             LinearWeight(w.to(at::kBFloat16)),
                                             QuantizedLinearWeight(w)};
  for (const LinearWeight& weight : formats) {
    const LinearWeight block = weight.Rows(row0, n).Columns(col0, k);
    const at::Tensor dense = block.Dense(at::kFloat);
    for (int64_t m : {1, 3, 12, 150}) {
      const at::Tensor x = at::randn({m, k});
      const at::Tensor b = bias.narrow(0, row0, n);
      at::Tensor y = at::full({m, n}, std::nanf(""));
      if (!LinearBlockInto(x.data_ptr<float>(), m, k, weight, row0, n, col0,
                           b.data_ptr<float>(), y.data_ptr<float>())) {
        EXPECT_EQ(ActiveIsa(), CpuIsa::kPortable) << "m " << m;
        EXPECT_TRUE(at::isnan(y).all().item<bool>());
        continue;
      }
      EXPECT_TRUE(at::equal(y, Linear(x, block, b)))
          << "m " << m << " " << weight.values.scalar_type();
      const at::Tensor want = at::linear(x, dense, b);
      EXPECT_LT((y - want).abs().max().item<float>(),
                0.02 * want.abs().max().item<float>())
          << "m " << m << " " << weight.values.scalar_type();
    }
  }
  // A block beyond W, or W on a type no kernel here reads: nothing written.
  float y = 0;
  const float x[48] = {};
  EXPECT_FALSE(LinearBlockInto(x, 1, k, formats[0], 90, n, col0, nullptr, &y));
  EXPECT_FALSE(LinearBlockInto(x, 1, k, LinearWeight(w.to(at::kHalf)), row0, 1,
                               col0, nullptr, &y));
}

// Stacked weights: one W whose row blocks are the parts (each part now a
// view of it), in every format; mixed formats refuse and leave the parts.
TEST(StackRowsTest, PartsBecomeViewsOfOneWeight) {
  at::manual_seed(4);
  const at::Tensor a = at::randn({24, 32}), b = at::randn({40, 32});
  for (int format = 0; format < 3; ++format) {
    auto make = [&](const at::Tensor& t) {
      if (format == 1) return LinearWeight(t.to(at::kBFloat16));
      return format == 2 ? QuantizedLinearWeight(t) : LinearWeight(t);
    };
    LinearWeight first = make(a), second = make(b);
    const LinearWeight first_copy = first, second_copy = second;
    const LinearWeight stacked = StackRows({&first, &second});
    ASSERT_TRUE(stacked.defined());
    EXPECT_EQ(stacked.size(0), 64);
    EXPECT_EQ(first.values.data_ptr(), stacked.values.data_ptr());
    EXPECT_TRUE(
        at::equal(first.Dense(at::kFloat), first_copy.Dense(at::kFloat)));
    EXPECT_TRUE(
        at::equal(second.Dense(at::kFloat), second_copy.Dense(at::kFloat)));
    const at::Tensor x = at::randn({5, 32});
    EXPECT_TRUE(
        at::equal(Linear(x, stacked).narrow(1, 24, 40), Linear(x, second_copy)))
        << "format " << format;
  }
  LinearWeight plain(a), quantized = QuantizedLinearWeight(b);
  EXPECT_FALSE(StackRows({&plain, &quantized}).defined());
  EXPECT_FALSE(plain.quantized());
  EXPECT_TRUE(quantized.quantized());
  EXPECT_EQ(quantized.size(0), 40);
}

}  // namespace
}  // namespace moh
