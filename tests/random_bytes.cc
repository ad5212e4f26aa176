#include "tests/random_bytes.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace dede::test {

void FillRandom(std::mt19937_64& rng, void* dst, size_t n) {
  auto* p = static_cast<uint8_t*>(dst);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t v = rng();
    std::memcpy(p + i, &v, std::min<size_t>(8, n - i));
  }
}

}  // namespace dede::test
