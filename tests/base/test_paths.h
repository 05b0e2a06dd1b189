// Where the C++ tests find what they read, as the build configured it. Only
// test_paths.cc is compiled with these absolute paths, so every other test
// object is the same in any checkout: ccache shares it between clones (CI's
// fresh clone included), where a path compiled into each test made each one
// miss.
#pragma once

#include <string>

namespace moh::test_paths {

// make_fixtures' checkpoints and golden outputs (<build>/fixtures).
std::string FixturesDir();
// make_image_fixtures' images and Pillow's preprocessing of them.
std::string ImageFixturesDir();
// The shipped demo models (models/).
std::string ModelsDir();
// tests/testdata.
std::string TestdataDir();
// The independent Python reference (tests/reference).
std::string ReferenceDir();
// The python3 that has Debian's torch (the reference's interpreter).
std::string Python3();

}  // namespace moh::test_paths
