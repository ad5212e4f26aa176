// Byte-range helpers shared by every layer.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dede {

// True when all `n` bytes at `p` are zero (`n` may be 0: true). Reads
// 64-byte strides the compiler vectorizes: listings and fsck test every
// inode block of a table this way, exports and analysis every data block.
bool IsAllZero(const void* p, size_t n);

}  // namespace dede
