// Names of enum values from a table in declaration order, so that a name
// function is one line and cannot miss a value silently (a table shorter than
// the enum answers "unknown").
#pragma once

#include <cstddef>

namespace moh {

template <typename Enum, size_t N>
const char* EnumName(Enum value, const char* const (&names)[N]) {
  const auto index = static_cast<size_t>(value);
  return index < N ? names[index] : "unknown";
}

}  // namespace moh
