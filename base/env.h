// Reading settings from the environment.
#pragma once

#include <cstdint>
#include <cstdlib>

namespace moh {

// Environment variable `name` as an integer (std::atoll's reading); `unset`
// when it is not set.
inline int64_t EnvInt(const char* name, int64_t unset) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::atoll(value) : unset;
}

}  // namespace moh
