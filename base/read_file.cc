#include "base/read_file.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace moh {

absl::StatusOr<std::string> ReadSmallFile(const std::string& path,
                                          absl::string_view what) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  if (!in || text.str().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": cannot read ", path));
  }
  return text.str();
}

}  // namespace moh
