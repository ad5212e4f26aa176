// Page-aligned I/O buffers, recycled through a process-wide pool.
//
// dedupd moves every NBD payload through a buffer. Fresh large allocations
// cost an mmap, page faults and an munmap (with TLB shootdowns) per request,
// and unaligned buffers force the O_DIRECT path device to bounce every
// request through a copy. IoBytes is a std::vector whose storage is 4 KiB
// aligned, comes from per-size-class free lists (powers of two from 4 KiB),
// and is not zero-filled on resize.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace dede {

inline constexpr size_t kIoAlign = 4096;

// Raw pool interface: `bytes` is rounded up to the size class.
void* IoPoolAllocate(size_t bytes);
void IoPoolFree(void* p, size_t bytes);
// Bytes held in free lists now (for tests and status).
size_t IoPoolCachedBytes();

template <typename T>
class IoAllocator {
 public:
  using value_type = T;
  IoAllocator() noexcept = default;
  template <typename U>
  IoAllocator(const IoAllocator<U>&) noexcept {}
  T* allocate(size_t n) { return static_cast<T*>(IoPoolAllocate(n * sizeof(T))); }
  void deallocate(T* p, size_t n) noexcept { IoPoolFree(p, n * sizeof(T)); }
  // Default-initialise: resize() leaves bytes as they are (I/O fills them).
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  template <typename U>
  bool operator==(const IoAllocator<U>&) const noexcept {
    return true;
  }
  template <typename U>
  bool operator!=(const IoAllocator<U>&) const noexcept {
    return false;
  }
};

using IoBytes = std::vector<uint8_t, IoAllocator<uint8_t>>;

}  // namespace dede
