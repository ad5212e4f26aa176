#include "util/bytes.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <vector>

using dede::IsAllZero;

TEST_CASE("bytes: IsAllZero finds a set bit at any offset and any length", "[util]") {
  // Lengths around the 64-byte stride, from every alignment of a buffer.
  std::vector<uint8_t> buf(300 + 64, 0);
  for (size_t start = 0; start < 64; start += 7) {
    for (size_t len = 0; len <= 300; len++) {
      uint8_t* p = buf.data() + start;
      REQUIRE(IsAllZero(p, len));
      for (size_t at : {size_t{0}, len / 2, len == 0 ? size_t{0} : len - 1}) {
        if (len == 0) break;
        for (uint8_t bit : {uint8_t{1}, uint8_t{0x80}}) {
          p[at] = bit;
          INFO("start " << start << " len " << len << " byte " << at);
          REQUIRE(!IsAllZero(p, len));
          p[at] = 0;
        }
      }
      // A byte just past the range is not looked at.
      p[len] = 0xff;
      REQUIRE(IsAllZero(p, len));
      p[len] = 0;
    }
  }
  CHECK(IsAllZero(nullptr, 0));
}
