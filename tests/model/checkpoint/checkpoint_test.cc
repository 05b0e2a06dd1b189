// Tests of checkpoint loading (model/checkpoint.h and its readers) and of the
// safetensors writer; training containers: checkpoint_container_test.cc.
//
// The checkpoints are written at test time by
// tests/reference/ckpt_make_test_checkpoints.py (Debian's python3-torch) into a
// temporary directory; broken safetensors files are written byte by byte here
// and broken .bin files are made by patching good ones.

#include "model/checkpoint/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/checkpoint/safetensors_reader.h"
#include "model/checkpoint/safetensors_writer.h"
#include "model/checkpoint/torch_bin_reader.h"
#include "tests/model/checkpoint/checkpoint_test_util.h"

namespace moh {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using std::string_literals::operator""s;
using checkpoint_test::CheckpointTest;
using checkpoint_test::ExpectError;
using checkpoint_test::ExpectSameTensors;
using checkpoint_test::LoadOrDie;
using checkpoint_test::Patch;
using checkpoint_test::ReadFile;
using checkpoint_test::WriteFile;

// --- Layouts -----------------------------------------------------------------

TEST_F(CheckpointTest, AllLayoutsGiveTheSameTensors) {
  TensorStore reference = LoadOrDie(Generated("single_st"));
  EXPECT_EQ(reference.size(), 9u);
  EXPECT_EQ(reference.description(), Generated("single_st"));
  for (const char* layout :
       {"sharded_st", "single_bin", "sharded_bin", "zip64"}) {
    SCOPED_TRACE(layout);
    TensorStore store = LoadOrDie(Generated(layout));
    EXPECT_EQ(store.description(), Generated(layout));
    ExpectSameTensors(store, reference);
  }
  EXPECT_EQ(
      reference.Get("model.layers.0.self_attn.q_proj.weight")->scalar_type(),
      at::kBFloat16);
  EXPECT_EQ(reference.Get("model.layers.0.mlp.up_proj.weight")->scalar_type(),
            at::kHalf);
  EXPECT_EQ(reference.Get("golden.positions")->scalar_type(), at::kLong);
  EXPECT_EQ(reference.Get("golden.ids")->scalar_type(), at::kInt);
  EXPECT_EQ(reference.Get("golden.ids")->data_ptr<int32_t>()[2], 2147483647);
  EXPECT_EQ(reference.Get("golden.positions")->data_ptr<int64_t>()[0],
            -3 * (1LL << 40));
  // Safetensors does not align tensors: a misaligned one is copied (UBSan
  // found int64 elements read at a 4-byte boundary of the mapping).
  for (const char* name : {"golden.positions", "golden.ids"}) {
    const at::Tensor t = *reference.Get(name);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % t.element_size(), 0)
        << name;
  }
  EXPECT_EQ(reference.Get("scalar")->dim(), 0);
}

TEST_F(CheckpointTest, HalfPrecisionValuesAreExact) {
  TensorStore expected = LoadOrDie(Generated("expected_f32"));
  for (const char* layout :
       {"single_st", "sharded_st", "single_bin", "sharded_bin"}) {
    SCOPED_TRACE(layout);
    TensorStore store = LoadOrDie(Generated(layout));
    for (const char* name : {"model.layers.0.self_attn.q_proj.weight",
                             "model.layers.0.mlp.up_proj.weight",
                             "model.norm.weight", "lm_head.weight"}) {
      at::Tensor want = *expected.Get(name);
      absl::StatusOr<at::Tensor> got =
          store.Take(name, want.sizes(), at::kFloat);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(at::equal(*got, want)) << name;
    }
  }
}

TEST_F(CheckpointTest, BinViewsSharingAStorage) {
  TensorStore views = LoadOrDie(Generated("views"));
  TensorStore expected = LoadOrDie(Generated("views_expected"));
  for (const std::string& name : expected.Names()) {
    at::Tensor got = *views.Get(name);
    EXPECT_EQ(got.scalar_type(), expected.Get(name)->scalar_type()) << name;
    EXPECT_TRUE(at::equal(got, *expected.Get(name))) << name;
  }
  at::Tensor base = *views.Get("base");
  at::Tensor row = *views.Get("row");
  EXPECT_FALSE(views.Get("transposed")->is_contiguous());
  // No copy at read time: the view points into the base tensor's bytes.
  EXPECT_EQ(static_cast<char*>(row.data_ptr()),
            static_cast<char*>(base.data_ptr()) + 2 * 6 * sizeof(float));
  EXPECT_EQ(views.Get("empty")->sizes().vec(), std::vector<int64_t>({0, 6}));
}

// The readers fed from memory (MappedFile::FromBytes: what the fuzzers use).
TEST_F(CheckpointTest, ReadersTakeBytesInMemory) {
  TensorStore reference = LoadOrDie(Generated("single_st"));
  const std::string st = Generated("single_st") + "/model.safetensors";
  absl::StatusOr<TensorStore> from_st =
      ReadSafetensors(MappedFile::FromBytes("in-memory.st", ReadFile(st)));
  ASSERT_TRUE(from_st.ok()) << from_st.status();
  EXPECT_EQ(from_st->description(), "in-memory.st");
  ExpectSameTensors(*from_st, reference);
  const std::string bin = Generated("single_bin") + "/pytorch_model.bin";
  absl::StatusOr<TensorStore> from_bin =
      ReadTorchBin(MappedFile::FromBytes("in-memory.bin", ReadFile(bin)));
  ASSERT_TRUE(from_bin.ok()) << from_bin.status();
  ExpectSameTensors(*from_bin, reference);
  ExpectError(ReadSafetensors(MappedFile::FromBytes("empty.st", "")).status(),
              absl::StatusCode::kInvalidArgument, {"empty.st", "truncated"});
}

TEST_F(CheckpointTest, PrefersSafetensorsOverBin) {
  const std::string dir = CopyOf("single_bin");
  fs::copy(Generated("single_st") + "/model.safetensors", dir);
  TensorStore store = LoadOrDie(dir);
  EXPECT_EQ(*store.SourceFile("lm_head.weight"), dir + "/model.safetensors");
}

TEST_F(CheckpointTest, NoCheckpointIsNotFound) {
  ExpectError(LoadCheckpoint(scratch_).status(), absl::StatusCode::kNotFound,
              {scratch_, "model.safetensors,", "model.safetensors.index.json",
               "pytorch_model.bin,", "pytorch_model.bin.index.json",
               "or a *.pth or *.pt file"});
  ExpectError(LoadCheckpoint(scratch_ + "/absent").status(),
              absl::StatusCode::kNotFound, {scratch_ + "/absent"});
}

// --- TensorStore
// ---------------------------------------------------------------

TEST_F(CheckpointTest, TakeConvertsAndNeverAliasesTheMapping) {
  for (const char* layout : {"single_st", "single_bin"}) {
    SCOPED_TRACE(layout);
    TensorStore store = LoadOrDie(Generated(layout));
    at::Tensor mapped = *store.Get("lm_head.weight");
    absl::StatusOr<at::Tensor> taken =
        store.Take("lm_head.weight", {16, 8}, at::kFloat);
    ASSERT_TRUE(taken.ok()) << taken.status();
    EXPECT_NE(taken->data_ptr(), mapped.data_ptr());
    EXPECT_TRUE(taken->is_contiguous());
    EXPECT_TRUE(at::equal(*taken, mapped));
    taken->add_(1.0f);  // Writable: the mapping itself is read-only.
    EXPECT_FALSE(at::equal(*taken, mapped));

    absl::StatusOr<at::Tensor> half =
        store.Take("model.layers.0.self_attn.q_proj.weight", {8, 8}, at::kHalf);
    ASSERT_TRUE(half.ok()) << half.status();
    EXPECT_EQ(half->scalar_type(), at::kHalf);
    absl::StatusOr<at::Tensor> ids = store.Take("golden.ids", {3}, at::kLong);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(ids->data_ptr<int64_t>()[1], -1);
  }
}

TEST_F(CheckpointTest, TakeTransposedViewIsContiguousCopy) {
  TensorStore views = LoadOrDie(Generated("views"));
  absl::StatusOr<at::Tensor> t = views.Take("transposed", {6, 4}, at::kFloat);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->is_contiguous());
  EXPECT_TRUE(at::equal(*t, views.Get("base")->t()));
}

TEST_F(CheckpointTest, MissingTensorIsNotFound) {
  const std::string dir = Generated("sharded_st");
  TensorStore store = LoadOrDie(dir);
  ExpectError(store.Get("model.layers.7.mlp.down_proj.weight").status(),
              absl::StatusCode::kNotFound,
              {"checkpoint " + dir +
               ": tensor "
               "'model.layers.7.mlp.down_proj.weight' is missing"});
  ExpectError(store.Take("nope", {1}, at::kFloat).status(),
              absl::StatusCode::kNotFound, {dir, "'nope'"});
}

TEST_F(CheckpointTest, WrongShapeNamesFileAndTensor) {
  TensorStore store = LoadOrDie(Generated("sharded_bin"));
  const std::string file = *store.SourceFile("lm_head.weight");
  EXPECT_THAT(file, HasSubstr("pytorch_model-0000"));
  ExpectError(store.Take("lm_head.weight", {8, 16}, at::kFloat).status(),
              absl::StatusCode::kInvalidArgument,
              {file + ": tensor 'lm_head.weight' has shape [16, 8], expected "
                      "[8, 16]"});
}

TEST_F(CheckpointTest, CheckAllTakenListsExtraTensors) {
  const std::string dir = Generated("single_st");
  TensorStore store = LoadOrDie(dir);
  for (const std::string& name : store.Names()) {
    if (name == "scalar" || name == "golden.ids") continue;
    ASSERT_TRUE(store.Take(name, store.Get(name)->sizes(), at::kFloat).ok());
  }
  const std::string file = dir + "/model.safetensors";
  ExpectError(store.CheckAllTaken(), absl::StatusCode::kInvalidArgument,
              {"unexpected tensor 'golden.ids' in " + file,
               "unexpected tensor 'scalar' in " + file});
  ASSERT_TRUE(store.Take("scalar", {}, at::kFloat).ok());
  ASSERT_TRUE(store.Take("golden.ids", {3}, at::kInt).ok());
  EXPECT_TRUE(store.CheckAllTaken().ok());
}

TEST_F(CheckpointTest, InsertRejectsDuplicates) {
  TensorStore store("test");
  ASSERT_TRUE(store.Insert("w", at::zeros({2}), "a.safetensors").ok());
  ExpectError(store.Insert("w", at::zeros({2}), "b.safetensors"),
              absl::StatusCode::kInvalidArgument,
              {"'w'", "a.safetensors", "b.safetensors"});
  TensorStore moved = std::move(store);
  EXPECT_TRUE(moved.Contains("w"));
  EXPECT_EQ(moved.Names(), std::vector<std::string>({"w"}));
}

// --- Safetensors writer
// --------------------------------------------------------

// The JSON header of a .safetensors file and where its data starts.
nlohmann::json HeaderOf(const std::string& bytes, size_t* data_start) {
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) {
    length = (length << 8) | static_cast<uint8_t>(bytes[i]);
  }
  *data_start = 8 + length;
  return nlohmann::json::parse(bytes.substr(8, length));
}

TEST_F(CheckpointTest, WriterRoundTripsThroughTheReader) {
  // Mixed dtypes, a scalar, misaligned int64 in the source file; views
  // (non-contiguous, sharing a storage) and an empty tensor.
  for (const char* layout : {"single_st", "views"}) {
    SCOPED_TRACE(layout);
    TensorStore original = LoadOrDie(Generated(layout));
    const std::string path = scratch_ + "/" + layout + ".safetensors";
    ASSERT_TRUE(WriteSafetensorsFile(path, original).ok());
    EXPECT_FALSE(fs::exists(path + ".tmp"));
    absl::StatusOr<TensorStore> read = ReadSafetensorsFile(path);
    ASSERT_TRUE(read.ok()) << read.status();
    ExpectSameTensors(*read, original);

    size_t data_start = 0;
    const nlohmann::json header = HeaderOf(ReadFile(path), &data_start);
    EXPECT_EQ(data_start % 8, 0u);
    EXPECT_EQ(header["__metadata__"], nlohmann::json({{"format", "pt"}}));
    for (const std::string& name : original.Names()) {
      const uint64_t begin = header[name]["data_offsets"][0];
      EXPECT_EQ(begin % original.Get(name)->element_size(), 0u) << name;
    }
  }
}

TEST_F(CheckpointTest, WriterWritesAnEmptyStore) {
  const std::string path = scratch_ + "/empty.safetensors";
  ASSERT_TRUE(WriteSafetensorsFile(path, TensorStore("empty")).ok());
  absl::StatusOr<TensorStore> read = ReadSafetensorsFile(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->size(), 0u);
}

TEST_F(CheckpointTest, WriterRefusesWhatTheReaderCannotRead) {
  const std::string path = scratch_ + "/model.safetensors";
  TensorStore doubles("test");
  ASSERT_TRUE(doubles.Insert("ok", at::zeros({2}), "x").ok());
  ASSERT_TRUE(doubles.Insert("d", at::zeros({2}, at::kDouble), "x").ok());
  ExpectError(WriteSafetensorsFile(path, doubles),
              absl::StatusCode::kInvalidArgument,
              {path, "tensor 'd'", "unsupported dtype Double",
               "(supported: F32, F16, BF16, I64, I32, I8, U8)"});
  TensorStore reserved("test");
  ASSERT_TRUE(reserved.Insert("__metadata__", at::zeros({2}), "x").ok());
  ExpectError(WriteSafetensorsFile(path, reserved),
              absl::StatusCode::kInvalidArgument, {path, "'__metadata__'"});
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  const std::string absent = scratch_ + "/absent/model.safetensors";
  ExpectError(WriteSafetensorsFile(absent, TensorStore("none")),
              absl::StatusCode::kNotFound, {"cannot write " + absent});
}

// --- Broken safetensors
// --------------------------------------------------------

constexpr char kGoodEntry[] =
    R"("w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]})";
const std::string& SixteenBytes() {
  static const auto* bytes = new std::string(16, '\0');
  return *bytes;
}

// Expects reading the safetensors file at `path` to fail with
// INVALID_ARGUMENT and a message that names the file and contains every
// fragment.
void ExpectRefused(const std::string& path,
                   std::initializer_list<std::string> fragments) {
  const absl::Status status = ReadSafetensorsFile(path).status();
  ExpectError(status, absl::StatusCode::kInvalidArgument, fragments);
  EXPECT_THAT(std::string(status.message()), HasSubstr(path));
}

TEST_F(CheckpointTest, SafetensorsGoodHandWrittenFile) {
  const std::string path =
      WriteSafetensors(std::string("{") + R"("__metadata__":{"format":"pt"},)" +
                           kGoodEntry + "}",
                       SixteenBytes());
  absl::StatusOr<TensorStore> store = ReadSafetensorsFile(path);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(store->Names(), std::vector<std::string>({"w"}));
  EXPECT_EQ(store->description(), path);
}

TEST_F(CheckpointTest, SafetensorsTruncatedLength) {
  const std::string path = scratch_ + "/model.safetensors";
  WriteFile(path, "\x10\0\0"s);
  ExpectRefused(path, {"truncated"});
}

TEST_F(CheckpointTest, SafetensorsHeaderLengthOutOfRange) {
  const std::string path =
      WriteSafetensors(std::string("{") + kGoodEntry + "}", SixteenBytes());
  std::string bytes = ReadFile(path);
  bytes[0] = '\xff';  // Longer than the file.
  WriteFile(path, bytes);
  ExpectRefused(path, {"header length 255 exceeds"});
  bytes[5] = '\x01';  // 2^40 bytes: beyond the 100 MB limit too.
  WriteFile(path, bytes);
  ExpectRefused(path, {"100 MB"});
}

TEST_F(CheckpointTest, SafetensorsTruncatedData) {
  const std::string good = Generated("single_st") + "/model.safetensors";
  const std::string path = scratch_ + "/model.safetensors";
  const std::string bytes = ReadFile(good);
  WriteFile(path, bytes.substr(0, bytes.size() - 3));
  ExpectRefused(path, {"out of range of the data area"});
}

TEST_F(CheckpointTest, SafetensorsBadJsonHeader) {
  const std::string path = WriteSafetensors(R"({"w": {"dtype": )", "");
  ExpectRefused(path, {"header is not valid JSON"});
  WriteSafetensors("[1, 2]", "");
  ExpectRefused(path, {"header is not a JSON object"});
}

TEST_F(CheckpointTest, SafetensorsWrongFieldTypes) {
  for (const char* entry : {
           R"("w":[])",
           R"("w":{"shape":[2,2],"data_offsets":[0,16]})",
           R"("w":{"dtype":5,"shape":[2,2],"data_offsets":[0,16]})",
           R"("w":{"dtype":"F32","shape":"2x2","data_offsets":[0,16]})",
           R"("w":{"dtype":"F32","shape":[2,-2],"data_offsets":[0,16]})",
           R"("w":{"dtype":"F32","shape":[2,2.0],"data_offsets":[0,16]})",
           R"("w":{"dtype":"F32","shape":[2,2],"data_offsets":[0]})",
           R"("w":{"dtype":"F32","shape":[2,2],"data_offsets":[-4,12]})",
           R"("w":{"dtype":"F32","shape":[2,2],"data_offsets":"0-16"})",
           R"("w":{"dtype":"F32","shape":[2,2]})",
       }) {
    SCOPED_TRACE(entry);
    const std::string path =
        WriteSafetensors(std::string("{") + entry + "}", SixteenBytes());
    ExpectRefused(path, {"tensor 'w'"});
  }
}

// Found by fuzzing: the refused shape was printed with dump(), which
// recurses; 100000 nested arrays overflowed the stack.
TEST_F(CheckpointTest, SafetensorsDeeplyNestedShapeIsNotPrinted) {
  const std::string path = WriteSafetensors(
      R"({"w":{"dtype":"F32","shape":)" + std::string(100000, '[') +
          std::string(100000, ']') + R"(,"data_offsets":[0,0]}})",
      "");
  ExpectRefused(path, {"tensor 'w'", "got a nested array or object"});
}

TEST_F(CheckpointTest, SafetensorsOffsetsOutOfRange) {
  const std::string path = WriteSafetensors(
      R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[8,24]}})",
      SixteenBytes());
  ExpectRefused(path, {"tensor 'w'", "[8, 24] out of range"});
  WriteSafetensors(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[9,8]}})",
                   SixteenBytes());
  ExpectRefused(path, {"tensor 'w'"});
}

TEST_F(CheckpointTest, SafetensorsSizeMismatch) {
  const std::string path = WriteSafetensors(
      R"({"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,16]}})",
      SixteenBytes());
  ExpectRefused(path, {"tensor 'w'", "span 16 bytes", "need 8"});
  WriteSafetensors(
      R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,16]}})",
      SixteenBytes());
  ExpectRefused(path, {"tensor 'w'"});
}

TEST_F(CheckpointTest, SafetensorsOverlap) {
  const std::string path = WriteSafetensors(
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
      SixteenBytes());
  ExpectRefused(path, {"tensor 'b'", "overlaps tensor 'a'"});
}

TEST_F(CheckpointTest, SafetensorsUnsupportedDtype) {
  const std::string path = WriteSafetensors(
      R"({"w":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}})",
      SixteenBytes());
  ExpectError(ReadSafetensorsFile(path).status(),
              absl::StatusCode::kInvalidArgument,
              {"unsupported dtype 'F64' for tensor 'w' in " + path +
               " (supported: F32, F16, BF16, I64, I32, I8, U8)"});
}

TEST_F(CheckpointTest, SafetensorsBadMetadataAndDuplicates) {
  const std::string path = WriteSafetensors(
      std::string("{") + R"("__metadata__":{"epoch":3},)" + kGoodEntry + "}",
      SixteenBytes());
  ExpectRefused(path, {"__metadata__"});
  WriteSafetensors(std::string("{") + kGoodEntry + "," + kGoodEntry + "}",
                   SixteenBytes());
  ExpectRefused(path, {"tensor 'w' appears twice"});
}

// --- Broken sharded checkpoints (both formats)
// ---------------------------------

struct ShardedLayout {
  const char* dir;
  const char* index;
};
constexpr ShardedLayout kShardedLayouts[] = {
    {"sharded_st", "model.safetensors.index.json"},
    {"sharded_bin", "pytorch_model.bin.index.json"},
};

nlohmann::json ReadIndex(const std::string& path) {
  return nlohmann::json::parse(ReadFile(path));
}

TEST_F(CheckpointTest, ShardedMissingShard) {
  for (const ShardedLayout& layout : kShardedLayouts) {
    SCOPED_TRACE(layout.dir);
    const std::string dir = CopyOf(layout.dir);
    nlohmann::json index = ReadIndex(dir + "/" + layout.index);
    const std::string tensor = index["weight_map"].begin().key();
    const std::string shard = index["weight_map"][tensor];
    fs::remove(dir + "/" + shard);
    ExpectError(LoadCheckpoint(dir).status(), absl::StatusCode::kNotFound,
                {dir + "/" + shard, "'" + tensor + "'", layout.index});
  }
}

TEST_F(CheckpointTest, ShardedIndexNamesAbsentTensor) {
  for (const ShardedLayout& layout : kShardedLayouts) {
    SCOPED_TRACE(layout.dir);
    const std::string dir = CopyOf(layout.dir);
    const std::string index_path = dir + "/" + layout.index;
    nlohmann::json index = ReadIndex(index_path);
    const std::string shard = index["weight_map"]["lm_head.weight"];
    index["weight_map"]["model.ghost.weight"] = shard;
    WriteFile(index_path, index.dump());
    ExpectError(LoadCheckpoint(dir).status(),
                absl::StatusCode::kInvalidArgument,
                {"'model.ghost.weight'", dir + "/" + shard, index_path});
  }
}

TEST_F(CheckpointTest, ShardedShardHoldsUnlistedTensor) {
  for (const ShardedLayout& layout : kShardedLayouts) {
    SCOPED_TRACE(layout.dir);
    const std::string dir = CopyOf(layout.dir);
    const std::string index_path = dir + "/" + layout.index;
    nlohmann::json index = ReadIndex(index_path);
    const std::string shard = index["weight_map"]["model.norm.weight"];
    index["weight_map"].erase("model.norm.weight");
    WriteFile(index_path, index.dump());
    ExpectError(LoadCheckpoint(dir).status(),
                absl::StatusCode::kInvalidArgument,
                {dir + "/" + shard, "'model.norm.weight'", index_path});
  }
}

TEST_F(CheckpointTest, ShardedTensorListedForAnotherShard) {
  for (const ShardedLayout& layout : kShardedLayouts) {
    SCOPED_TRACE(layout.dir);
    const std::string dir = CopyOf(layout.dir);
    const std::string index_path = dir + "/" + layout.index;
    nlohmann::json index = ReadIndex(index_path);
    auto& map = index["weight_map"];
    const std::string first = map["golden.ids"];
    const std::string other = map["scalar"];
    ASSERT_NE(first, other);
    map["golden.ids"] = other;
    WriteFile(index_path, index.dump());
    ExpectError(LoadCheckpoint(dir).status(),
                absl::StatusCode::kInvalidArgument,
                {"'golden.ids'", index_path});
  }
}

TEST_F(CheckpointTest, ShardedNameEscapingTheDirectory) {
  for (const ShardedLayout& layout : kShardedLayouts) {
    SCOPED_TRACE(layout.dir);
    const std::string dir = CopyOf(layout.dir);
    const std::string index_path = dir + "/" + layout.index;
    const std::string original = ReadFile(index_path);
    for (const char* shard :
         {"../single_st/model.safetensors", "/etc/passwd", "..", ""}) {
      nlohmann::json index = nlohmann::json::parse(original);
      index["weight_map"]["lm_head.weight"] = shard;
      WriteFile(index_path, index.dump());
      ExpectError(LoadCheckpoint(dir).status(),
                  absl::StatusCode::kInvalidArgument,
                  {index_path, "'lm_head.weight'", std::string("'") + shard});
    }
  }
}

TEST_F(CheckpointTest, ShardedBadIndexJson) {
  for (const ShardedLayout& layout : kShardedLayouts) {
    SCOPED_TRACE(layout.dir);
    const std::string dir = CopyOf(layout.dir);
    const std::string index_path = dir + "/" + layout.index;
    WriteFile(index_path, R"({"weight_map": {"a": )");
    ExpectError(LoadCheckpoint(dir).status(),
                absl::StatusCode::kInvalidArgument,
                {index_path, "not a valid JSON object"});
    WriteFile(index_path, R"({"metadata": {}})");
    ExpectError(LoadCheckpoint(dir).status(),
                absl::StatusCode::kInvalidArgument, {index_path, "weight_map"});
    WriteFile(index_path, R"({"weight_map": {"a": 3}})");
    ExpectError(LoadCheckpoint(dir).status(),
                absl::StatusCode::kInvalidArgument, {index_path, "'a'"});
  }
}

// --- Broken .bin
// ---------------------------------------------------------------

TEST_F(CheckpointTest, BinTruncatedAtEveryLength) {
  const std::string good =
      ReadFile(Generated("one_tensor") + "/pytorch_model.bin");
  const std::string path = scratch_ + "/pytorch_model.bin";
  for (size_t length = 0; length < good.size(); ++length) {
    WriteFile(path, good.substr(0, length));
    absl::Status status = ReadTorchBinFile(path).status();
    ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument)
        << length << ": " << status;
    ASSERT_THAT(std::string(status.message()), HasSubstr(path));
  }
  WriteFile(path, good);
  EXPECT_TRUE(ReadTorchBinFile(path).ok());
}

TEST_F(CheckpointTest, BinCorruptBytesNeverCrash) {
  const std::string good = ReadFile(Generated("views") + "/pytorch_model.bin");
  const std::string path = scratch_ + "/pytorch_model.bin";
  for (size_t i = 0; i < good.size(); ++i) {
    {
      std::string bad = good;
      bad[i] ^= '\xff';
      WriteFile(path, bad);
      absl::StatusOr<TensorStore> store = ReadTorchBinFile(path);
      if (!store.ok()) {
        ASSERT_THAT(std::string(store.status().message()), HasSubstr(path));
        continue;
      }
      for (const std::string& name : store->Names()) {  // Touch every byte.
        at::Tensor t = *store->Get(name);
        (void)t.to(at::kDouble).sum().item<double>();
      }
    }
  }
}

TEST_F(CheckpointTest, BinUnknownOpcode) {
  const std::string path = scratch_ + "/pytorch_model.bin";
  WriteFile(path,
            Patch(ReadFile(Generated("one_tensor") + "/pytorch_model.bin"),
                  "\x80\x02}q\x00"s, "\x80\x02\xf0q\x00"s));
  ExpectError(ReadTorchBinFile(path).status(),
              absl::StatusCode::kInvalidArgument,
              {path + "/pytorch_model/data.pkl: unsupported pickle opcode "
                      "0xf0 at offset 2"});
}

TEST_F(CheckpointTest, BinRefusesOtherGlobals) {
  const std::string path = Generated("evil") + "/pytorch_model.bin";
  ExpectError(ReadTorchBinFile(path).status(),
              absl::StatusCode::kInvalidArgument,
              {path, "archive/data.pkl",
               "refusing to load global 'posix.system' (only tensors are "
               "read)"});
  EXPECT_FALSE(fs::exists(Generated("evil_marker")));
  // The same refusal for a patched torch checkpoint (same-length names).
  const std::string patched = scratch_ + "/pytorch_model.bin";
  WriteFile(patched,
            Patch(ReadFile(Generated("one_tensor") + "/pytorch_model.bin"),
                  "torch._utils\n_rebuild_tensor_v2",
                  "torch._utils\n_rebuild_parameter"));
  ExpectError(ReadTorchBinFile(patched).status(),
              absl::StatusCode::kInvalidArgument,
              {patched, "'torch._utils._rebuild_parameter'"});
}

TEST_F(CheckpointTest, BinStorageOutOfRange) {
  const std::string good =
      ReadFile(Generated("one_tensor") + "/pytorch_model.bin");
  const std::string path = scratch_ + "/pytorch_model.bin";
  // Shape [3, 4] -> [9, 4] over a storage of 12 floats.
  WriteFile(path, Patch(good, "K\x03K\x04\x86"s, "K\x09K\x04\x86"s));
  ExpectError(ReadTorchBinFile(path).status(),
              absl::StatusCode::kInvalidArgument,
              {path, "tensor 'w'", "exceeds its storage"});
  // Storage offset 0 -> 5.
  WriteFile(path, Patch(good, "K\x00K\x03K\x04\x86"s, "K\x05K\x03K\x04\x86"s));
  ExpectError(ReadTorchBinFile(path).status(),
              absl::StatusCode::kInvalidArgument,
              {path, "tensor 'w'", "exceeds its storage"});
  // Storage claims 99 elements: more than its zip entry holds.
  WriteFile(path, Patch(good, "K\x0ct"s, "Kct"s));
  ExpectError(ReadTorchBinFile(path).status(),
              absl::StatusCode::kInvalidArgument,
              {path, "does not fit its entry"});
}

TEST_F(CheckpointTest, BinCompressedEntry) {
  const std::string path = Generated("compressed") + "/pytorch_model.bin";
  ExpectError(ReadTorchBinFile(path).status(),
              absl::StatusCode::kInvalidArgument, {path, "compressed"});
}

TEST_F(CheckpointTest, BinByteOrder) {
  absl::StatusOr<TensorStore> little =
      ReadTorchBinFile(Generated("little_endian") + "/pytorch_model.bin");
  ASSERT_TRUE(little.ok()) << little.status();
  EXPECT_EQ(little->Get("w")->data_ptr<float>()[11], 11.0f);
  const std::string big = Generated("big_endian") + "/pytorch_model.bin";
  ExpectError(ReadTorchBinFile(big).status(),
              absl::StatusCode::kInvalidArgument, {big, "little-endian"});
}

}  // namespace
}  // namespace moh
