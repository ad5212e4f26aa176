// A token bucket for dedup I/O: keeps the bytes a dedup pass reads and
// writes under the volume policy's cap, so deduplication in business hours
// (or any time) leaves the shared LUN to the VMs.
//
// Scheduling is by reservation (GCRA): each Acquire books the next
// `bytes / rate` seconds of the bucket under the mutex and then sleeps,
// without the mutex, until its booking is due. Callers on several threads
// therefore queue fairly and no caller holds up another while it sleeps.
// Up to about 50 ms worth of the rate may go through at once (the burst);
// over any longer stretch the rate holds.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>

#include "util/clock.h"
#include "util/mutex.h"

namespace dede {

class RateLimiter {
 public:
  // Bursts: how far ahead of the steady rate a caller may get.
  static constexpr uint64_t kBurstNs = 50'000'000;

  // `clock`'s MonotonicNanos paces the bucket (nullptr: Clock::Real()).
  // `sleep_ns` is how the limiter waits (default: std::this_thread::
  // sleep_for); tests pass one that advances a ManualClock.
  RateLimiter(uint64_t bytes_per_s, Clock* clock, std::function<void(uint64_t)> sleep_ns = nullptr);
  RateLimiter(const RateLimiter&) = delete;
  RateLimiter& operator=(const RateLimiter&) = delete;

  // 0 = unlimited; takes effect for the next Acquire. Callers already
  // sleeping keep their booking; debt booked at the old rate is forgiven.
  void SetRate(uint64_t bytes_per_s) EXCLUDES(mu_);
  uint64_t rate() const EXCLUDES(mu_);

  // Longest single sleep of a wait that `cancel` may end.
  static constexpr uint64_t kCancelCheckNs = 50'000'000;

  // Charges `bytes` and waits as long as needed so that the long-run rate
  // stays at most the rate, with a burst of at most ~50 ms worth of the
  // rate (plus the one request that crosses it). Thread-safe; never holds
  // its mutex while sleeping. With `cancel`, the wait is slept in slices of
  // at most kCancelCheckNs and ends early once *cancel is true (shutdown
  // must not wait for a long debt): returns false then, true when the
  // booking was waited for in full. The charge stays booked either way.
  bool Acquire(uint64_t bytes, const std::atomic<bool>* cancel = nullptr) EXCLUDES(mu_);

  uint64_t bytes_charged() const EXCLUDES(mu_);
  uint64_t waited_ns() const EXCLUDES(mu_);

 private:
  Clock* const clock_;
  const std::function<void(uint64_t)> sleep_ns_;
  mutable Mutex mu_;
  uint64_t rate_ GUARDED_BY(mu_);
  // Theoretical arrival time: when the bucket will have drained every
  // booking made so far (monotonic ns). At or before now: the bucket is
  // idle.
  uint64_t tat_ns_ GUARDED_BY(mu_) = 0;
  uint64_t bytes_charged_ GUARDED_BY(mu_) = 0;
  uint64_t waited_ns_ GUARDED_BY(mu_) = 0;
};

}  // namespace dede
