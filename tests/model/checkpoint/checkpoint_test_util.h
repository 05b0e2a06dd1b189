// Shared by the checkpoint tests (checkpoint_test.cc,
// checkpoint_container_test.cc): file helpers and a fixture over the
// checkpoints tests/reference/ckpt_make_test_checkpoints.py writes (Debian's
// python3-torch) into a temporary directory, once per test binary.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <sstream>
#include <string>
#include <vector>

#include "model/checkpoint/checkpoint.h"
#include "tests/base/test_paths.h"

namespace moh {
namespace checkpoint_test {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

inline void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), bytes.size());
  ASSERT_TRUE(out.good()) << path;
}

// Replaces the only occurrence of `from` in `bytes` with `to` (same length).
inline std::string Patch(std::string bytes, const std::string& from,
                         const std::string& to) {
  EXPECT_EQ(from.size(), to.size());
  const size_t at = bytes.find(from);
  EXPECT_NE(at, std::string::npos) << "pattern not found";
  EXPECT_EQ(bytes.find(from, at + 1), std::string::npos) << "pattern repeats";
  if (at != std::string::npos) bytes.replace(at, from.size(), to);
  return bytes;
}

// Expects `status` to have `code` and a message containing every fragment.
inline void ExpectError(const absl::Status& status, absl::StatusCode code,
                        std::initializer_list<std::string> fragments) {
  EXPECT_EQ(status.code(), code) << status;
  for (const std::string& fragment : fragments) {
    EXPECT_THAT(std::string(status.message()), HasSubstr(fragment));
  }
}

class CheckpointTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new std::string(::testing::TempDir() + "moh_checkpoint_test_" +
                            std::to_string(::getpid()));
    fs::remove_all(*root_);
    fs::create_directories(*root_);
    const std::string command = test_paths::Python3() + " " +
                                test_paths::ReferenceDir() +
                                "/ckpt_make_test_checkpoints.py " + *root_;
    generated_ = std::system(command.c_str()) == 0;
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
  }
  void SetUp() override {
    ASSERT_TRUE(generated_) << "ckpt_make_test_checkpoints.py failed";
    scratch_ = *root_ + "/scratch_" +
               ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::create_directories(scratch_);
  }

  // A directory written by the generator script.
  static std::string Generated(const std::string& name) {
    return *root_ + "/" + name;
  }
  // A copy of a generated directory, to be broken by the test.
  std::string CopyOf(const std::string& name) {
    const std::string copy = scratch_ + "/" + name;
    fs::copy(Generated(name), copy, fs::copy_options::recursive);
    return copy;
  }
  // Writes a .safetensors file: 8-byte little-endian length, header, data.
  std::string WriteSafetensors(const std::string& header,
                               const std::string& data,
                               const std::string& name = "model.safetensors") {
    std::string bytes;
    for (int i = 0; i < 8; ++i) {
      bytes.push_back(static_cast<char>((header.size() >> (8 * i)) & 0xFF));
    }
    const std::string path = scratch_ + "/" + name;
    WriteFile(path, bytes + header + data);
    return path;
  }

  static inline std::string* root_ = nullptr;
  static inline bool generated_ = false;
  std::string scratch_;
};

inline TensorStore LoadOrDie(const std::string& dir) {
  absl::StatusOr<TensorStore> store = LoadCheckpoint(dir);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? std::move(store).value() : TensorStore();
}

inline void ExpectSameTensors(const TensorStore& actual,
                              const TensorStore& expected) {
  ASSERT_EQ(actual.Names(), expected.Names()) << actual.description();
  for (const std::string& name : expected.Names()) {
    at::Tensor a = *actual.Get(name);
    at::Tensor e = *expected.Get(name);
    EXPECT_EQ(a.scalar_type(), e.scalar_type()) << name;
    EXPECT_TRUE(at::equal(a, e)) << actual.description() << ": " << name;
  }
}

}  // namespace checkpoint_test
}  // namespace moh
