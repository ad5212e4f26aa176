#include "util/clock.h"

#include <time.h>

namespace dede {
namespace {
uint64_t Read(clockid_t id) {
  timespec ts{};
  clock_gettime(id, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(ts.tv_nsec);
}
class RealClock : public Clock {
 public:
  uint64_t NowNanos() override { return Read(CLOCK_REALTIME); }
  uint64_t MonotonicNanos() override { return Read(CLOCK_MONOTONIC); }
};
}  // namespace

Clock* Clock::Real() {
  static RealClock clock;
  return &clock;
}

}  // namespace dede
