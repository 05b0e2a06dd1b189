#include "tests/base/test_paths.h"

namespace moh::test_paths {

std::string FixturesDir() { return MOH_FIXTURES_DIR; }
std::string ImageFixturesDir() { return MOH_IMAGE_FIXTURES_DIR; }
std::string ModelsDir() { return MOH_MODELS_DIR; }
std::string TestdataDir() { return MOH_TESTDATA_DIR; }
std::string ReferenceDir() { return MOH_REFERENCE_DIR; }
std::string Python3() { return MOH_PYTHON3; }

}  // namespace moh::test_paths
