// CRC-32C (Castagnoli), hardware accelerated through ISA-L's crc32_iscsi.
// Standard parameterisation: Crc32c("123456789") == 0xE3069283.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dede {

// Extend `crc` (the value of a previous call, or 0 to start) with data.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);
inline uint32_t Crc32c(const void* data, size_t n) { return Crc32cExtend(0, data, n); }

}  // namespace dede
