// moh-convert: a MoH-ViT release checkpoint (moh_transnext_{base,small}_*.pth,
// a torch.save training container) to a model directory:
//   DIR/model.safetensors  the container's "model" state dict, dtypes as
//                          stored (a plain state dict is taken as it is);
//   DIR/config.json        {"model_type": "moh_transnext", "variant", the
//                          ImageNet-1k preprocessing (224 px, resize 256,
//                          mean/std) and the 1000 class names in index order}.
// The architecture is not written: the model loader derives it from
// "variant". With --config=FILE (a moh_transnext config.json: another
// resolution, a fine-tune's classes, a custom architecture) that file is
// written instead. Either way the weights are checked against the
// architecture (every tensor present with its shape, none left over) by
// building the model before anything is written. The container is read by
// the restricted reader
// (model/checkpoint/torch_bin_reader.h): nothing in it is run; a refused
// pickle fails with the reader's message. The class names are compiled in
// (tools/data/imagenet1k_labels.txt).
//
//   moh-convert --input=moh_transnext_small_75.pth --output_dir=DIR
//               [--variant=moh_transnext_small_75 | --config=config.json]
//               [--config_only]
//
// --variant defaults to the container's args.model. Exit status: 0 written;
// 1 the input cannot be read (or is refused) or the output cannot be written;
// 2 bad usage (a missing or bad flag value, an unknown variant). Unknown flags
// are reported by the flags library, which exits 1.
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <system_error>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/read_file.h"
#include "base/status_macros.h"
#include "model/checkpoint/mapped_file.h"
#include "model/checkpoint/safetensors_writer.h"
#include "model/checkpoint/torch_bin_reader.h"
#include "model/core/model_config.h"
#include "model/core/transnext_model.h"

ABSL_FLAG(std::string, input, "",
          "The release checkpoint: a torch.save file (*.pth), a training "
          "container or a state dict");
ABSL_FLAG(std::string, output_dir, "",
          "Directory to write model.safetensors and config.json into "
          "(created if absent; existing files are replaced)");
ABSL_FLAG(std::string, variant, "",
          "moh_transnext_base_75, moh_transnext_base_50, "
          "moh_transnext_small_80 or moh_transnext_small_75; default: the "
          "container's args.model");
ABSL_FLAG(std::string, config, "",
          "A moh_transnext config.json to write instead of the variant's "
          "(e.g. another resolution or a fine-tune's classes); excludes "
          "--variant");
ABSL_FLAG(bool, config_only, false,
          "Write config.json only (the input is still read and checked)");

namespace moh {

// tools/data/imagenet1k_labels.txt, embedded by tools/embed_text.cmake.
extern const char kImageNet1kLabels[];
extern const size_t kImageNet1kLabels_size;

namespace {

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
constexpr const char* kVariants[] = {
    "moh_transnext_base_75", "moh_transnext_base_50", "moh_transnext_small_80",
    "moh_transnext_small_75"};
constexpr int kImageSize = 224;

bool IsVariant(const std::string& name) {
  for (const char* variant : kVariants) {
    if (name == variant) return true;
  }
  return false;
}

std::string AllowedVariants() {
  return absl::StrCat("allowed: ", absl::StrJoin(kVariants, ", "));
}

int Fail(int status, const std::string& message) {
  absl::FPrintF(stderr, "moh-convert: %s\n", message);
  return status;
}

// The variant: --variant, else the container's args.model. Empty after
// printing the error.
std::string ResolveVariant(const std::string& input, const SavedArgs& args) {
  const std::string flag = absl::GetFlag(FLAGS_variant);
  auto saved = args.strings.find("model");
  if (!flag.empty()) {
    if (saved != args.strings.end() && saved->second != flag) {
      absl::FPrintF(stderr,
                    "moh-convert: warning: --variant=%s differs from %s's "
                    "args.model '%s'; writing %s\n",
                    flag, input, saved->second, flag);
    }
    return flag;
  }
  if (saved == args.strings.end()) {
    Fail(kExitUsage, absl::StrCat("--variant is required: ", input,
                                  " saves no args.model naming one (",
                                  AllowedVariants(), ")"));
    return "";
  }
  if (!IsVariant(saved->second)) {
    Fail(kExitUsage,
         absl::StrCat(input, ": its args.model '", saved->second,
                      "' is not a MoH-ViT variant; pass --variant (",
                      AllowedVariants(), ")"));
    return "";
  }
  return saved->second;
}

nlohmann::ordered_json Config(const std::string& variant,
                              const std::vector<std::string>& labels) {
  nlohmann::ordered_json config;
  config["model_type"] = "moh_transnext";
  config["variant"] = variant;
  config["image_size"] = kImageSize;
  config["pretrain_size"] = kImageSize;
  config["resize_size"] = 256;
  config["num_channels"] = 3;
  config["labels"] = labels;
  config["image_mean"] = {0.485, 0.456, 0.406};
  config["image_std"] = {0.229, 0.224, 0.225};
  return config;
}

// Writes `text` to `path` through "<path>.tmp" and a rename.
absl::Status WriteTextFile(const std::string& path, const std::string& text) {
  const std::string temporary = path + ".tmp";
  std::FILE* file = std::fopen(temporary.c_str(), "wb");
  if (file == nullptr) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot write ", temporary));
  }
  bool ok = std::fwrite(text.data(), 1, text.size(), file) == text.size();
  int err = errno;
  if (std::fclose(file) != 0 && ok) {
    ok = false;
    err = errno;
  }
  if (!ok) {
    std::remove(temporary.c_str());
    return absl::ErrnoToStatus(err, absl::StrCat("cannot write ", temporary));
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(temporary.c_str());
    return absl::ErrnoToStatus(
        err, absl::StrCat("cannot rename ", temporary, " to ", path));
  }
  return absl::OkStatus();
}

// Builds the model of `config` from a copy of `tensors` on the CPU: every
// tensor it needs present with its shape, none left over.
absl::Status CheckWeights(const TensorStore& tensors,
                          const TransNextConfig& config) {
  TensorStore copy(tensors.description());
  for (const std::string& name : tensors.Names()) {
    MOH_ASSIGN_OR_RETURN(at::Tensor t, tensors.Get(name));
    MOH_RETURN_IF_ERROR(copy.Insert(name, t, tensors.description()));
  }
  return TransNextModel::FromStore(copy, config,
                                   at::TensorOptions().dtype(at::kFloat))
      .status();
}

int Run() {
  const std::string input = absl::GetFlag(FLAGS_input);
  const std::string output_dir = absl::GetFlag(FLAGS_output_dir);
  const std::string flag_variant = absl::GetFlag(FLAGS_variant);
  const std::string config_flag = absl::GetFlag(FLAGS_config);
  if (input.empty()) return Fail(kExitUsage, "--input is required");
  if (!flag_variant.empty() && !config_flag.empty()) {
    return Fail(kExitUsage, "--variant and --config exclude each other");
  }
  if (output_dir.empty()) return Fail(kExitUsage, "--output_dir is required");
  if (!flag_variant.empty() && !IsVariant(flag_variant)) {
    return Fail(kExitUsage, absl::StrCat("--variant='", flag_variant,
                                         "' is not a MoH-ViT variant (",
                                         AllowedVariants(), ")"));
  }
  const std::vector<std::string> labels = absl::StrSplit(
      absl::string_view(kImageNet1kLabels, kImageNet1kLabels_size), '\n',
      absl::SkipEmpty());
  if (labels.size() != 1000) {
    return Fail(kExitFailure,
                absl::StrCat("the embedded ImageNet-1k class list has ",
                             labels.size(), " names, not 1000 (a bad build)"));
  }

  absl::StatusOr<std::shared_ptr<MappedFile>> file = MappedFile::Open(input);
  absl::StatusOr<TorchBinContents> contents =
      file.ok() ? ReadTorchBinContents(*file) : file.status();
  if (!contents.ok()) {
    return Fail(kExitFailure, std::string(contents.status().message()));
  }
  std::string config_text, described;
  if (!config_flag.empty()) {
    absl::StatusOr<std::string> text = ReadSmallFile(config_flag, "--config");
    if (!text.ok())
      return Fail(kExitUsage, std::string(text.status().message()));
    config_text = *std::move(text);
    described = "from " + config_flag;
  } else {
    const std::string variant = ResolveVariant(input, contents->args);
    if (variant.empty()) return kExitUsage;
    auto input_size = contents->args.integers.find("input_size");
    if (input_size != contents->args.integers.end() &&
        input_size->second != kImageSize) {
      return Fail(
          kExitFailure,
          absl::StrCat(input, ": args.input_size is ", input_size->second,
                       "; the variants' config is ", kImageSize,
                       " pixels: pass --config with this resolution"));
    }
    config_text = Config(variant, labels).dump(2) + "\n";
    described = "variant " + variant;
  }
  // The weights must build the model the config describes.
  absl::StatusOr<ModelConfig> config = ParseModelConfig(
      config_text, config_flag.empty() ? "config.json" : config_flag);
  if (!config.ok())
    return Fail(kExitUsage, std::string(config.status().message()));
  if (config->family != ModelFamily::kTransNext) {
    return Fail(kExitUsage, absl::StrCat("--config=", config_flag,
                                         ": model_type must be moh_transnext"));
  }
  if (absl::Status fits = CheckWeights(contents->tensors, config->transnext);
      !fits.ok()) {
    return Fail(kExitFailure, absl::StrCat(input, ": the weights do not fit ",
                                           described, ": ", fits.message()));
  }

  std::error_code error;
  std::filesystem::create_directories(output_dir, error);
  if (error) {
    return Fail(kExitFailure, absl::StrCat("cannot create --output_dir ",
                                           output_dir, ": ", error.message()));
  }
  const std::filesystem::path dir(output_dir);
  if (!absl::GetFlag(FLAGS_config_only)) {
    const std::string weights = (dir / "model.safetensors").string();
    const absl::Status written =
        WriteSafetensorsFile(weights, contents->tensors);
    if (!written.ok()) {
      return Fail(kExitFailure, std::string(written.message()));
    }
    absl::PrintF("moh-convert: wrote %s: %d tensors from %s%s\n", weights,
                 contents->tensors.size(), input,
                 contents->container_key.empty()
                     ? ""
                     : absl::StrCat("'s '", contents->container_key, "'"));
  }
  const std::string config_path = (dir / "config.json").string();
  const absl::Status written = WriteTextFile(config_path, config_text);
  if (!written.ok()) return Fail(kExitFailure, std::string(written.message()));
  absl::PrintF("moh-convert: wrote %s: %s\n", config_path, described);
  return 0;
}

}  // namespace
}  // namespace moh

int main(int argc, char** argv) {
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view path) {
    return absl::StrContains(path, "moh_convert_main");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "Converts a MoH-ViT release checkpoint (a torch.save training "
      "container) into model.safetensors and config.json.\n"
      "usage: moh-convert --input=FILE.pth --output_dir=DIR "
      "[--variant=NAME] [--config_only]");
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    return moh::Fail(
        moh::kExitUsage,
        absl::StrCat("unexpected argument '", positional[1],
                     "' (flags are --input=FILE.pth --output_dir=DIR ...)"));
  }
  return moh::Run();
}
