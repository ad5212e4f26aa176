// The dedup I/O token bucket (util/rate_limiter.h): long-run rate, bursts,
// rate changes, and threads, on a clock the tests move by hand.
#include "util/rate_limiter.h"

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <thread>
#include <vector>

using namespace dede;

namespace {

constexpr uint64_t kNsPerSec = 1'000'000'000;

// A limiter whose sleeps advance a ManualClock and are recorded.
struct ManualLimiter {
  ManualClock clock{5 * kNsPerSec};
  std::vector<uint64_t> sleeps;
  RateLimiter limiter;
  explicit ManualLimiter(uint64_t rate)
      : limiter(rate, &clock, [this](uint64_t ns) {
          sleeps.push_back(ns);
          clock.Advance(ns);
        }) {}
};

}  // namespace

TEST_CASE("rate limiter: N bytes in many chunks take N over rate", "[ratelimit]") {
  const uint64_t rate = 10'000'000;  // 10 MB/s
  for (uint64_t chunk :
       {uint64_t(4096), uint64_t(65536), uint64_t(1'000'000), uint64_t(3'333'333)}) {
    ManualLimiter m(rate);
    const uint64_t start = m.clock.NowNanos();
    const uint64_t total = 200'000'000;  // 20 s worth
    uint64_t sent = 0;
    while (sent < total) {
      const uint64_t n = std::min(chunk, total - sent);
      m.limiter.Acquire(n);
      sent += n;
    }
    const double seconds = double(m.clock.NowNanos() - start) / 1e9;
    INFO("chunk " << chunk << ": " << seconds << " s");
    CHECK(seconds >= 20.0 * 0.98);
    CHECK(seconds <= 20.0 * 1.02);
    CHECK(m.limiter.bytes_charged() == total);
    CHECK(m.limiter.waited_ns() == m.clock.NowNanos() - start);
  }
}

TEST_CASE("rate limiter: unlimited never sleeps", "[ratelimit]") {
  ManualLimiter m(0);
  for (int i = 0; i < 1000; i++) m.limiter.Acquire(1 << 20);
  CHECK(m.sleeps.empty());
  CHECK(m.limiter.waited_ns() == 0);
  CHECK(m.limiter.bytes_charged() == 1000ull << 20);
  // Zero-byte charges never sleep either, limited or not.
  ManualLimiter z(1);
  for (int i = 0; i < 10; i++) z.limiter.Acquire(0);
  CHECK(z.sleeps.empty());
}

TEST_CASE("rate limiter: bursts are bounded by about 50 ms of the rate", "[ratelimit]") {
  const uint64_t rate = 100'000'000;  // 100 MB/s: 5 MB of burst
  ManualLimiter m(rate);
  // After a long idle time, only one burst passes without waiting:
  // idleness does not bank credit.
  m.clock.Advance(3600 * kNsPerSec);
  uint64_t free_bytes = 0;
  while (m.sleeps.empty()) {
    m.limiter.Acquire(100'000);
    if (m.sleeps.empty()) free_bytes += 100'000;
  }
  CHECK(free_bytes <= rate / 20);
  CHECK(free_bytes >= rate / 20 - 100'000);
  // Over any stretch, bytes granted <= rate x time + one burst + one request.
  ManualLimiter w(rate);
  const uint64_t start = w.clock.NowNanos();
  uint64_t granted = 0;
  for (int i = 0; i < 5000; i++) {
    const uint64_t n = 1000 + (i * 7919) % 400'000;
    w.limiter.Acquire(n);
    granted += n;
    const double elapsed = double(w.clock.NowNanos() - start) / 1e9;
    REQUIRE(double(granted) <= double(rate) * elapsed + rate / 20.0 + 400'000.0);
  }
}

TEST_CASE("rate limiter: SetRate changes the pace from the next call", "[ratelimit]") {
  ManualLimiter m(1'000'000);  // 1 MB/s
  uint64_t start = m.clock.NowNanos();
  for (int i = 0; i < 100; i++) m.limiter.Acquire(100'000);  // 10 MB: ~10 s
  double seconds = double(m.clock.NowNanos() - start) / 1e9;
  CHECK(seconds == Approx(10.0).epsilon(0.02));

  m.limiter.SetRate(10'000'000);  // 10 MB/s
  CHECK(m.limiter.rate() == 10'000'000);
  start = m.clock.NowNanos();
  for (int i = 0; i < 1000; i++) m.limiter.Acquire(100'000);  // 100 MB: ~10 s
  seconds = double(m.clock.NowNanos() - start) / 1e9;
  CHECK(seconds == Approx(10.0).epsilon(0.02));

  m.limiter.SetRate(0);
  const size_t sleeps = m.sleeps.size();
  for (int i = 0; i < 1000; i++) m.limiter.Acquire(100'000'000);
  CHECK(m.sleeps.size() == sleeps);

  // Back from unlimited: the huge unlimited charges are no debt.
  m.limiter.SetRate(1'000'000);
  start = m.clock.NowNanos();
  m.limiter.Acquire(1'000'000);
  seconds = double(m.clock.NowNanos() - start) / 1e9;
  CHECK(seconds <= 1.0);
  CHECK(seconds >= 0.9);
}

TEST_CASE("rate limiter: a huge charge at a tiny rate waits long instead of wrapping",
          "[ratelimit]") {
  ManualLimiter m(1);
  m.limiter.Acquire(uint64_t(1) << 62);
  REQUIRE(m.sleeps.size() == 1);
  CHECK(m.sleeps[0] > (uint64_t(1) << 62));
}

TEST_CASE("rate limiter: threads share the rate on the real clock", "[ratelimit]") {
  // 4 threads x 25 x 20 KB = 2 MB at 20 MB/s: at least ~50 ms after the
  // burst. Only the lower bound is checked: a loaded machine may be slower.
  RateLimiter limiter(20'000'000, Clock::Real());
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; t++) {
    threads.emplace_back([&limiter] {
      for (int i = 0; i < 25; i++) limiter.Acquire(20'000);
    });
  }
  for (auto& th : threads) th.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(limiter.bytes_charged() == 2'000'000);
  CHECK(seconds >= 0.1 - 0.05 - 0.005);
  CHECK(limiter.waited_ns() > 0);
}

TEST_CASE("rate limiter: a wait given a cancel flag ends within one slice of its setting",
          "[ratelimit]") {
  // 60 MB at 1 MB/s: a minute's wait, cancelled after about 200 ms of it.
  ManualClock clock(5 * kNsPerSec);
  std::atomic<bool> cancel{false};
  std::vector<uint64_t> sleeps;
  uint64_t slept = 0;
  RateLimiter limiter(1'000'000, &clock, [&](uint64_t ns) {
    sleeps.push_back(ns);
    slept += ns;
    clock.Advance(ns);
    if (slept >= 200'000'000) cancel = true;
  });
  CHECK_FALSE(limiter.Acquire(60'000'000, &cancel));
  CHECK(slept >= 200'000'000);
  CHECK(slept <= 200'000'000 + RateLimiter::kCancelCheckNs);
  for (uint64_t ns : sleeps) CHECK(ns <= RateLimiter::kCancelCheckNs);
  // Already set: no sleep at all, and the bytes are still charged.
  sleeps.clear();
  CHECK_FALSE(limiter.Acquire(1'000'000, &cancel));
  CHECK(sleeps.empty());
  CHECK(limiter.bytes_charged() == 61'000'000);
  // Not set: the whole booking is waited for, in slices.
  RateLimiter full(1'000'000, &clock, [&](uint64_t ns) {
    sleeps.push_back(ns);
    clock.Advance(ns);
  });
  std::atomic<bool> never{false};
  const uint64_t start = clock.MonotonicNanos();
  CHECK(full.Acquire(2'000'000, &never));
  CHECK(clock.MonotonicNanos() - start == 2 * kNsPerSec - RateLimiter::kBurstNs);
}
