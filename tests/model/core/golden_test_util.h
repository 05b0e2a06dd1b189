// Reading the golden fixtures that tests/reference/make_*fixtures.py write
// (JSON files of nested number lists) in the model tests.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moh {

// The JSON file at `path`; a failed expectation names it when it is missing.
inline nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "missing " << path;
  std::stringstream s;
  s << in.rdbuf();
  return nlohmann::json::parse(s.str());
}

// A nested JSON list of numbers as a tensor of its shape (an empty list gives
// a 0 there) holding the numbers converted to `dtype`.
inline at::Tensor ToTensor(const nlohmann::json& nested,
                           at::ScalarType dtype = at::kFloat) {
  std::vector<int64_t> shape;
  const nlohmann::json* level = &nested;
  while (level->is_array()) {
    shape.push_back(level->size());
    if (level->empty()) break;
    level = &(*level)[0];
  }
  std::vector<double> flat;
  std::function<void(const nlohmann::json&)> walk =
      [&](const nlohmann::json& j) {
        if (j.is_array()) {
          for (const nlohmann::json& x : j) walk(x);
        } else {
          flat.push_back(j.get<double>());
        }
      };
  walk(nested);
  return at::tensor(flat, at::kDouble).view(shape).to(dtype);
}

// The largest absolute value of `a`.
inline double MaxAbs(const at::Tensor& a) {
  return a.abs().max().item<double>();
}

}  // namespace moh
