#include "util/crc32c.h"

#include <isa-l/crc.h>

#include <climits>

namespace dede {

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n) {
  // ISA-L keeps the register un-inverted; invert in and out to chain the
  // standard CRC-32C.
  uint32_t reg = ~crc;
  auto* p = static_cast<unsigned char*>(const_cast<void*>(data));
  while (n > 0) {
    int chunk = n > static_cast<size_t>(INT_MAX) ? INT_MAX : static_cast<int>(n);
    reg = crc32_iscsi(p, chunk, reg);
    p += chunk;
    n -= static_cast<size_t>(chunk);
  }
  return ~reg;
}

}  // namespace dede
