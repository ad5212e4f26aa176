// Small helpers shared by the benchmark tools: clocks, medians, aligned
// buffers and reproducible block contents.
#pragma once

#include <time.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

namespace dede::bench {

// Seconds on `clock` (CLOCK_MONOTONIC, CLOCK_PROCESS_CPUTIME_ID,
// CLOCK_THREAD_CPUTIME_ID...).
inline double ClockSeconds(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) / 1e9;
}

// Median of the samples (mean of the middle two for an even count); 0 if none.
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
// 4 KiB-aligned memory (O_DIRECT buffers); null when out of memory.
using AlignedBuf = std::unique_ptr<uint8_t, FreeDeleter>;
inline AlignedBuf NewAligned(size_t bytes) {
  return AlignedBuf(static_cast<uint8_t*>(std::aligned_alloc(4096, bytes)));
}

// splitmix64: a fixed, library-independent pseudo-random sequence.
struct Rng {
  uint64_t s;
  uint64_t Next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
};

// Block `i` of content set `set`: 4 KiB of pseudo-random bytes, distinct
// for every (set, i) (the first 16 bytes are the pair itself).
inline void FillBlock(uint8_t* p, uint64_t set, uint64_t i) {
  constexpr size_t kBytes = 4096;
  Rng r{set * 0x100000001b3ull ^ (i + 1) * 0x9e3779b97f4a7c15ull};
  for (size_t k = 16; k < kBytes; k += 8) {
    uint64_t v = r.Next();
    std::memcpy(p + k, &v, 8);
  }
  std::memcpy(p, &set, 8);
  std::memcpy(p + 8, &i, 8);
}

}  // namespace dede::bench
