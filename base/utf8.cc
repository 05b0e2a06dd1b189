#include "base/utf8.h"

namespace moh {

int NextUtf8(std::string_view s) {
  const auto b = static_cast<unsigned char>(s[0]);
  int n = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b < 0x80) return 1;
  if (b >= 0xC2 && b <= 0xDF) {
    n = 2;
  } else if (b >= 0xE0 && b <= 0xEF) {
    n = 3;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    n = 4;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    return -1;
  }
  for (int i = 1; i < n; ++i) {
    if (static_cast<size_t>(i) >= s.size()) return 0;
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < (i == 1 ? lo : 0x80) || c > (i == 1 ? hi : 0xBF)) return -i;
  }
  return n;
}

size_t AppendLossyUtf8(std::string_view s, bool final, std::string* out) {
  size_t i = 0;
  while (i < s.size()) {
    const int n = NextUtf8(s.substr(i));
    if (n > 0) {
      out->append(s.substr(i, n));
      i += n;
    } else if (n < 0) {
      out->append(kReplacementChar);
      i += -n;
    } else if (final) {
      out->append(kReplacementChar);
      i = s.size();
    } else {
      break;
    }
  }
  return i;
}

bool IsValidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const int n = NextUtf8(s.substr(i));
    if (n <= 0) return false;
    i += n;
  }
  return true;
}

std::string LossyUtf8(absl::string_view text) {
  const std::string_view s(text.data(), text.size());
  if (IsValidUtf8(s)) return std::string(s);
  std::string out;
  AppendLossyUtf8(s, /*final=*/true, &out);
  return out;
}

}  // namespace moh
