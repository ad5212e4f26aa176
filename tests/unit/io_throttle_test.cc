// IoThrottle (agent/io_throttle.h): shutdown cancels a settle that is
// paying off a long rate-cap debt.
#include "agent/io_throttle.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <thread>

using namespace dede;

namespace {

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

TEST_CASE("io throttle: Cancel from another thread ends a settle that owes a minute",
          "[throttle]") {
  // 60 MB of debt at 1 MB/s would sleep ~60 s; shutdown cancels it after
  // 100 ms. Both ways of settling (one wait, and slices with `between`).
  for (bool with_between : {false, true}) {
    INFO("between: " << with_between);
    IoThrottle throttle(1'000'000, Clock::Real());
    throttle.Charge(60'000'000);
    int betweens = 0;
    const auto start = std::chrono::steady_clock::now();
    std::thread canceller([&throttle] {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      throttle.Cancel();
    });
    if (with_between) {
      throttle.Settle([&betweens] { betweens++; });
    } else {
      throttle.Settle();
    }
    const double seconds = SecondsSince(start);
    canceller.join();
    CHECK(throttle.cancelled());
    CHECK(seconds < 2.0);
    CHECK(betweens <= 1);
    CHECK(throttle.bytes() == 60'000'000);
  }
}

TEST_CASE("io throttle: after Cancel a settle drops its debt without sleeping", "[throttle]") {
  uint64_t slept = 0;
  ManualClock clock;
  IoThrottle throttle(1'000'000, &clock, [&](uint64_t ns) {
    slept += ns;
    clock.Advance(ns);
  });
  throttle.Cancel();
  throttle.Charge(60'000'000);
  throttle.Settle();
  throttle.Charge(60'000'000);
  throttle.Settle([] {});
  CHECK(slept == 0);
  CHECK(throttle.bytes() == 120'000'000);
}

// A settle paid its whole debt in one booking at the rate of its start:
// lifting or raising the cap meanwhile (dede policy set rate=..., SIGHUP)
// did not shorten it (a minute for 60 MB at 1 MB/s, the summary after a
// pass or a merge job). Slices read the rate afresh.
TEST_CASE("io throttle: a settle follows a rate change made while it sleeps", "[throttle]") {
  for (const uint64_t new_rate : {uint64_t{0}, uint64_t{100'000'000}}) {
    INFO("new rate " << new_rate);
    uint64_t slept = 0;
    ManualClock clock;
    IoThrottle* self = nullptr;
    IoThrottle throttle(1'000'000, &clock, [&](uint64_t ns) {
      slept += ns;
      clock.Advance(ns);
      if (slept >= 1'000'000'000ull) self->SetRate(new_rate);  // after 1 s of sleep
    });
    self = &throttle;
    throttle.Charge(60'000'000);
    throttle.Settle();
    INFO("slept " << slept / 1e9 << " s");
    CHECK(slept < 2'000'000'000ull);
    CHECK(slept >= 750'000'000ull);
  }
}
