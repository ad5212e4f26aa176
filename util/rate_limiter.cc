#include "util/rate_limiter.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <thread>

namespace dede {

namespace {

constexpr uint64_t kNsPerSec = 1'000'000'000;

// bytes / rate in ns, rounded up, saturating (a huge charge at a tiny rate
// must not wrap into a short wait).
uint64_t CostNs(uint64_t bytes, uint64_t rate) {
  const unsigned __int128 ns =
      (static_cast<unsigned __int128>(bytes) * kNsPerSec + rate - 1) / rate;
  return ns > std::numeric_limits<uint64_t>::max() ? std::numeric_limits<uint64_t>::max()
                                                   : static_cast<uint64_t>(ns);
}

uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  return a > std::numeric_limits<uint64_t>::max() - b ? std::numeric_limits<uint64_t>::max()
                                                      : a + b;
}

}  // namespace

RateLimiter::RateLimiter(uint64_t bytes_per_s, Clock* clock, std::function<void(uint64_t)> sleep_ns)
    : clock_(clock != nullptr ? clock : Clock::Real()),
      sleep_ns_(
          sleep_ns
              ? std::move(sleep_ns)
              : [](uint64_t ns) { std::this_thread::sleep_for(std::chrono::nanoseconds(ns)); }),
      rate_(bytes_per_s) {}

void RateLimiter::SetRate(uint64_t bytes_per_s) {
  const uint64_t now = clock_->MonotonicNanos();
  MutexLock l(&mu_);
  rate_ = bytes_per_s;
  // Bookings made at the old rate say nothing about the new one.
  tat_ns_ = std::min(tat_ns_, now);
}

uint64_t RateLimiter::rate() const {
  MutexLock l(&mu_);
  return rate_;
}

bool RateLimiter::Acquire(uint64_t bytes, const std::atomic<bool>* cancel) {
  const uint64_t now = clock_->MonotonicNanos();
  uint64_t wait = 0;
  {
    MutexLock l(&mu_);
    bytes_charged_ += bytes;
    if (rate_ == 0 || bytes == 0) return true;
    // An idle bucket starts from now: idle time does not accumulate
    // credit beyond the burst.
    const uint64_t tat = SaturatingAdd(std::max(tat_ns_, now), CostNs(bytes, rate_));
    tat_ns_ = tat;
    // Due when the booking ends no more than one burst ahead of now.
    if (tat > now + kBurstNs) wait = tat - kBurstNs - now;
    waited_ns_ = SaturatingAdd(waited_ns_, wait);
  }
  if (cancel == nullptr) {
    if (wait > 0) sleep_ns_(wait);
    return true;
  }
  while (wait > 0) {
    if (cancel->load()) return false;
    const uint64_t slice = std::min(wait, kCancelCheckNs);
    sleep_ns_(slice);
    wait -= slice;
  }
  return true;
}

uint64_t RateLimiter::bytes_charged() const {
  MutexLock l(&mu_);
  return bytes_charged_;
}

uint64_t RateLimiter::waited_ns() const {
  MutexLock l(&mu_);
  return waited_ns_;
}

}  // namespace dede
