// Tests of release checkpoints that are training containers (torch.save of
// {"model": state_dict, "optimizer": ..., "args": argparse.Namespace, ...}):
// unwrapping (CheckpointOptions), the *.pth file of LoadCheckpoint, the saved
// arguments, and the restricted unpickler's refusals around them.
//
// The files are written by tests/reference/ckpt_make_test_checkpoints.py
// (save_containers: real torch.save output, plus hand-written data.pkl files
// in refused/).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <filesystem>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/checkpoint/checkpoint.h"
#include "model/checkpoint/torch_bin_reader.h"
#include "tests/model/checkpoint/checkpoint_test_util.h"

namespace moh {
namespace {

namespace fs = std::filesystem;
using checkpoint_test::CheckpointTest;
using checkpoint_test::ExpectError;
using checkpoint_test::ExpectSameTensors;
using checkpoint_test::LoadOrDie;
using ::testing::ElementsAre;
using ::testing::Pair;

constexpr char kVitPth[] = "moh_transnext_small_75.pth";

absl::StatusOr<TorchBinContents> ReadContents(
    const std::string& path, const CheckpointOptions& options = {}) {
  absl::StatusOr<std::shared_ptr<MappedFile>> file = MappedFile::Open(path);
  if (!file.ok()) return file.status();
  return ReadTorchBinContents(*file, options);
}

// --- Unwrapping
// ---------------------------------------------------------------

TEST_F(CheckpointTest, ContainerGivesItsModelStateDict) {
  const std::string path = Generated("vit_container") + "/" + kVitPth;
  absl::StatusOr<TensorStore> store = ReadTorchBinFile(path);
  ASSERT_TRUE(store.ok()) << store.status();
  // Only the model's tensors: none of the optimizer's (exp_avg, step, ...).
  ExpectSameTensors(*store, LoadOrDie(Generated("vit_expected")));
  EXPECT_EQ(store->Names(),
            std::vector<std::string>({"head.bias", "head.weight", "norm.bias",
                                      "norm.weight", "patch_embed.bias",
                                      "patch_embed.weight", "position_ids",
                                      "rel_bias"}));
  EXPECT_EQ(store->Get("rel_bias")->scalar_type(), at::kBFloat16);
  EXPECT_EQ(store->Get("position_ids")->scalar_type(), at::kLong);
  EXPECT_EQ(*store->SourceFile("head.weight"), path);
}

TEST_F(CheckpointTest, ContainerSavedArgsArePlainData) {
  absl::StatusOr<TorchBinContents> contents =
      ReadContents(Generated("vit_container") + "/" + kVitPth);
  ASSERT_TRUE(contents.ok()) << contents.status();
  EXPECT_EQ(contents->container_key, "model");
  EXPECT_THAT(
      contents->args.strings,
      ElementsAre(Pair("data_path", "/data/imagenet"),
                  Pair("model", "moh_transnext_small_75"),
                  Pair("output_dir", "results/moh_transnext_small_75")));
  // Floats (lr, drop_path, ...), bools and None are left out.
  EXPECT_THAT(contents->args.integers,
              ElementsAre(Pair("batch_size", 128), Pair("epochs", 300),
                          Pair("input_size", 224), Pair("local_rank", -1),
                          Pair("seed", int64_t{1} << 40)));
}

TEST_F(CheckpointTest, DitContainerServesTheKeyAskedFor) {
  const std::string dir = Generated("dit_container");
  ExpectSameTensors(LoadOrDie(dir), LoadOrDie(Generated("vit_expected")));
  absl::StatusOr<TensorStore> ema =
      LoadCheckpoint(dir, CheckpointOptions{{"ema", "model"}});
  ASSERT_TRUE(ema.ok()) << ema.status();
  ExpectSameTensors(*ema, LoadOrDie(Generated("dit_ema_expected")));
  EXPECT_EQ(ema->description(), dir);

  absl::StatusOr<TorchBinContents> contents = ReadContents(
      dir + "/0050000.pth", CheckpointOptions{{"absent", "ema", "model"}});
  ASSERT_TRUE(contents.ok()) << contents.status();
  EXPECT_EQ(contents->container_key, "ema");
  EXPECT_THAT(contents->args.strings, ElementsAre(Pair("model", "DiT-XL/2")));
  EXPECT_THAT(contents->args.integers,
              ElementsAre(Pair("image_size", 256), Pair("num_classes", 1000)));
}

TEST_F(CheckpointTest, PlainStateDictHasNoContainer) {
  // A state dict whose tensors are named "model" and "args" is no container.
  absl::StatusOr<TorchBinContents> contents =
      ReadContents(Generated("tensor_named_model") + "/pytorch_model.bin");
  ASSERT_TRUE(contents.ok()) << contents.status();
  EXPECT_EQ(contents->container_key, "");
  EXPECT_EQ(contents->tensors.Names(),
            std::vector<std::string>({"args", "model"}));
  EXPECT_TRUE(contents->args.strings.empty());
  EXPECT_TRUE(contents->args.integers.empty());
}

TEST_F(CheckpointTest, ContainerWithoutTheKeyListsTheKeysPresent) {
  const std::string path = Generated("vit_container") + "/" + kVitPth;
  ExpectError(
      ReadTorchBinFile(path, CheckpointOptions{{"state_dict", "ema"}}).status(),
      absl::StatusCode::kInvalidArgument,
      {path, "neither a state dict (entry 'model' is not a tensor)",
       "nor a training container with a dict under 'state_dict', "
       "'ema'",
       "(top-level keys: 'model', 'optimizer', 'lr_scheduler', "
       "'epoch', 'scaler', 'args', 'max_accuracy')"});
  const std::string other = Generated("no_state_dict") + "/checkpoint.pth";
  ExpectError(ReadTorchBinFile(other).status(),
              absl::StatusCode::kInvalidArgument,
              {other, "entry 'epoch' is not a tensor",
               "(top-level keys: 'epoch', 'weights', 7)"});
  const std::string model =
      Generated("model_not_state_dict") + "/checkpoint.pth";
  ExpectError(ReadTorchBinFile(model).status(),
              absl::StatusCode::kInvalidArgument,
              {model,
               "container entry 'model' is not a state dict: entry "
               "'step' is not a tensor"});
}

TEST_F(CheckpointTest, DdpPrefixIsStripped) {
  const std::string dir = Generated("ddp");
  ExpectSameTensors(LoadOrDie(dir), LoadOrDie(Generated("vit_expected")));
  CheckpointOptions keep;
  keep.strip_module_prefix = false;
  absl::StatusOr<TensorStore> kept = LoadCheckpoint(dir, keep);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_TRUE(kept->Contains("module.head.weight"));
}

// --- LoadCheckpoint and *.pth ------------------------------------------------

TEST_F(CheckpointTest, LoadCheckpointReadsTheOnePthFile) {
  const std::string dir = Generated("vit_container");
  TensorStore store = LoadOrDie(dir);
  EXPECT_EQ(store.description(), dir);
  EXPECT_EQ(*store.SourceFile("head.weight"), dir + "/" + kVitPth);
  ExpectSameTensors(store, LoadOrDie(Generated("vit_expected")));
}

TEST_F(CheckpointTest, LoadCheckpointReadsTheOnePtFile) {
  const std::string dir = CopyOf("vit_container");
  fs::rename(dir + "/" + kVitPth, dir + "/0000100.pt");
  TensorStore store = LoadOrDie(dir);
  EXPECT_EQ(*store.SourceFile("head.weight"), dir + "/0000100.pt");
}

TEST_F(CheckpointTest, LoadCheckpointPrefersTheUsualNamesOverPth) {
  const std::string dir = CopyOf("vit_container");
  fs::copy(Generated("single_bin") + "/pytorch_model.bin", dir);
  fs::create_directory(dir + "/directory.pth");  // Not a file: ignored.
  EXPECT_EQ(*LoadOrDie(dir).SourceFile("lm_head.weight"),
            dir + "/pytorch_model.bin");
}

TEST_F(CheckpointTest, LoadCheckpointRefusesSeveralPthFiles) {
  const std::string dir = CopyOf("vit_container");
  fs::copy(dir + "/" + kVitPth, dir + "/best.pth");
  fs::copy(dir + "/" + kVitPth, dir + "/checkpoint.pt");  // *.pt counts.
  fs::copy(dir + "/" + kVitPth, dir + "/notes.ptx");      // Not *.pt.
  ExpectError(LoadCheckpoint(dir).status(), absl::StatusCode::kInvalidArgument,
              {"checkpoint " + dir,
               std::string("3 *.pth/*.pt files (best.pth, checkpoint.pt, ") +
                   kVitPth + ")",
               "keep exactly one"});
}

// --- Refused pickles
// ----------------------------------------------------------

TEST_F(CheckpointTest, ContainerRefusals) {
  const std::map<std::string, std::string> kRefusals = {
      {"args_calls_system", "refusing to load global 'posix.system'"},
      {"os_system", "refusing to load global 'os.system'"},
      {"builtins_eval", "refusing to load global 'builtins.eval'"},
      // Protocol 2 names Python 3's builtins by their Python 2 module.
      {"eval", "refusing to load global '__builtin__.eval'"},
      {"counter", "refusing to load global 'collections.Counter'"},
      {"namespace_subclass", "refusing to load global '__main__.ArgsSubclass'"},
      {"argument_parser", "refusing to load global 'argparse.ArgumentParser'"},
      {"newobj_ordered_dict",
       "refusing NEWOBJ of 'collections.OrderedDict' (only argparse.Namespace "
       "is accepted)"},
      {"newobj_storage", "refusing NEWOBJ of 'torch.FloatStorage'"},
      {"newobj_rebuild_tensor",
       "refusing NEWOBJ of 'torch._utils._rebuild_tensor_v2'"},
      {"newobj_not_a_global", "refusing NEWOBJ of a non-global"},
      {"newobj_namespace_with_arguments",
       "NEWOBJ of argparse.Namespace with arguments"},
      {"reduce_namespace", "refusing to call 'argparse.Namespace'"},
      {"namespace_built_twice",
       "BUILD on an argparse.Namespace that already has a state"},
      {"namespace_list_state",
       "BUILD is only supported on a dict or an argparse.Namespace with a "
       "dict state"},
      {"namespace_too_deep", "value nested too deeply or inside itself"},
  };
  for (const auto& [name, message] : kRefusals) {
    SCOPED_TRACE(name);
    const std::string path = Generated("refused") + "/" + name + ".pth";
    ExpectError(ReadTorchBinFile(path).status(),
                absl::StatusCode::kInvalidArgument,
                {path + "/", "/data.pkl: " + message});
  }
  EXPECT_FALSE(fs::exists(Generated("evil_marker")));
  // Every refused file the generator writes is checked above.
  EXPECT_EQ(std::distance(fs::directory_iterator(Generated("refused")),
                          fs::directory_iterator()),
            static_cast<std::ptrdiff_t>(kRefusals.size()));
}

}  // namespace
}  // namespace moh
