// What the fuzz targets share: a check that aborts (libFuzzer then saves the
// input as a crash) with a message saying which contract broke.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "absl/status/status.h"

// Aborts with `what` when `condition` is false.
#define MOH_FUZZ_CHECK(condition, what)                                    \
  do {                                                                     \
    if (!(condition)) {                                                    \
      std::fprintf(stderr, "%s:%d: fuzz check failed: %s: %s\n", __FILE__, \
                   __LINE__, #condition, std::string(what).c_str());       \
      std::abort();                                                        \
    }                                                                      \
  } while (0)

namespace moh {
namespace fuzz {

inline std::string_view AsText(const uint8_t* data, size_t size) {
  return std::string_view(reinterpret_cast<const char*>(data), size);
}

// Parsers of untrusted bytes answer a bad input with INVALID_ARGUMENT only.
inline void CheckInvalidArgument(const absl::Status& status) {
  MOH_FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument,
                 status.ToString());
}

// True when `text` is well-formed UTF-8 (no surrogates, shortest forms).
inline bool IsValidUtf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto c = static_cast<unsigned char>(text[i]);
    size_t n;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n > text.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      const auto cc = static_cast<unsigned char>(text[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += n;
  }
  return true;
}

}  // namespace fuzz
}  // namespace moh
