#include "util/bytes.h"

#include <cstring>

namespace dede {

bool IsAllZero(const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  size_t i = 0;
  // An OR of eight words per stride, no branch inside it: vectorized.
  for (; i + 64 <= n; i += 64) {
    uint64_t w[8];
    std::memcpy(w, b + i, sizeof w);
    if ((w[0] | w[1] | w[2] | w[3] | w[4] | w[5] | w[6] | w[7]) != 0) return false;
  }
  for (; i < n; i++) {
    if (b[i] != 0) return false;
  }
  return true;
}

}  // namespace dede
