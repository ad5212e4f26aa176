// Small helpers shared by the benchmark tools: clocks and medians.
#pragma once

#include <time.h>

#include <algorithm>
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

}  // namespace dede::bench
