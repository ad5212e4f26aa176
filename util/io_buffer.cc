#include "util/io_buffer.h"

#include <array>
#include <cstdlib>
#include <mutex>

namespace dede {
namespace {

constexpr int kClasses = 14;  // 4 KiB .. 32 MiB
constexpr size_t kMinClass = 4096;
// Free buffers kept per process; beyond it they go back to the system.
constexpr size_t kMaxCached = size_t{128} << 20;

int ClassOf(size_t bytes) {
  size_t c = kMinClass;
  int i = 0;
  while (c < bytes) {
    c <<= 1;
    i++;
  }
  return i;
}

struct Pool {
  std::mutex mu;
  std::array<std::vector<void*>, kClasses> free;  // guarded by mu
  size_t cached = 0;                              // guarded by mu
};

Pool& ThePool() {
  static Pool* pool = new Pool;  // never destroyed: buffers may be freed at exit
  return *pool;
}

}  // namespace

void* IoPoolAllocate(size_t bytes) {
  if (bytes == 0) bytes = 1;
  int c = ClassOf(bytes);
  if (c < kClasses) {
    Pool& pool = ThePool();
    std::lock_guard<std::mutex> l(pool.mu);
    auto& list = pool.free[static_cast<size_t>(c)];
    if (!list.empty()) {
      void* p = list.back();
      list.pop_back();
      pool.cached -= kMinClass << c;
      return p;
    }
  }
  size_t size = c < kClasses ? kMinClass << c : (bytes + kIoAlign - 1) / kIoAlign * kIoAlign;
  void* p = std::aligned_alloc(kIoAlign, size);
  if (!p) throw std::bad_alloc();
  return p;
}

void IoPoolFree(void* p, size_t bytes) {
  if (!p) return;
  if (bytes == 0) bytes = 1;
  int c = ClassOf(bytes);
  if (c < kClasses) {
    Pool& pool = ThePool();
    std::lock_guard<std::mutex> l(pool.mu);
    size_t size = kMinClass << c;
    if (pool.cached + size <= kMaxCached) {
      pool.free[static_cast<size_t>(c)].push_back(p);
      pool.cached += size;
      return;
    }
  }
  std::free(p);
}

size_t IoPoolCachedBytes() {
  Pool& pool = ThePool();
  std::lock_guard<std::mutex> l(pool.mu);
  return pool.cached;
}

}  // namespace dede
