#include <catch2/catch.hpp>
#include <cstring>

#include "util/crc32c.h"

using namespace dede;

TEST_CASE("crc32c matches the standard check value", "[crc]") {
  const char* s = "123456789";
  REQUIRE(Crc32c(s, 9) == 0xE3069283u);
  // Chaining equals one pass.
  REQUIRE(Crc32cExtend(Crc32c(s, 4), s + 4, 5) == 0xE3069283u);
  REQUIRE(Crc32c("", 0) == 0u);
}
