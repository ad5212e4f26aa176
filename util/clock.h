// The clock is an interface so tests can inject time.
#pragma once

#include <cstdint>

namespace dede {

class Clock {
 public:
  virtual ~Clock() = default;
  // Wall-clock nanoseconds since the Unix epoch (stored on disk as mtime).
  virtual uint64_t NowNanos() = 0;
  // Monotonic nanoseconds, for durations.
  virtual uint64_t MonotonicNanos() = 0;
  static Clock* Real();
};

// A clock tests move by hand.
class ManualClock : public Clock {
 public:
  explicit ManualClock(uint64_t start = 1'000'000'000) : now_(start) {}
  uint64_t NowNanos() override { return now_; }
  uint64_t MonotonicNanos() override { return now_; }
  void Advance(uint64_t ns) { now_ += ns; }

 private:
  uint64_t now_;
};

}  // namespace dede
