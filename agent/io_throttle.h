// IoThrottle: the volume policy's cap on dedup I/O, and its priority.
//
// A dedup pass charges every device read and write its threads issue
// (util/io_budget.h: the device backends call ChargeIo) to the throttle,
// which only adds them to a debt. The pass settles the debt, sleeping as
// long as the cap needs (util/rate_limiter.h), at points where it holds no
// volume lock: between log files, block-operation batches and every 1024
// index entries. So a VM's write never waits behind a throttled pass, and
// over any stretch longer than one batch the pass's I/O stays at the cap.
// BatchOpsFor sizes the pass's block-operation batches to ~100 ms of the cap
// so the debt stays small.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>

#include "agent/dedup_policy.h"
#include "util/clock.h"
#include "util/io_budget.h"
#include "util/rate_limiter.h"

namespace dede {

class IoThrottle : public IoBudget {
 public:
  // 0 = unlimited.
  explicit IoThrottle(uint64_t bytes_per_s, Clock* clock = nullptr,
                      std::function<void(uint64_t)> sleep_ns = nullptr);
  void SetRate(uint64_t bytes_per_s);
  uint64_t rate() const { return limiter_.rate(); }

  void Charge(uint64_t bytes) override;
  // Pays the debt (sleeps under a cap). Call without volume locks held.
  // With `between`, a long debt is paid in slices of ~250 ms of the cap and
  // `between` runs after each slice but the last (a dedup pass gives back
  // disks that clients wait for meanwhile).
  void Settle(const std::function<void()>& between = nullptr);
  // Shutdown: a Settle sleeping now returns within ~50 ms
  // (RateLimiter::kCancelCheckNs), and every later one returns at once,
  // its debt dropped. The I/O stays counted in bytes(). Not undone.
  void Cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }

  uint64_t bytes() const { return total_.load(std::memory_order_relaxed); }
  uint64_t waited_ns() const { return limiter_.waited_ns(); }

  // Block operations per batch so that one batch (~8 KiB read per
  // operation) is about 100 ms of the cap; `max` when unlimited.
  static size_t BatchOpsFor(uint64_t bytes_per_s, size_t max);

 private:
  RateLimiter limiter_;
  std::atomic<uint64_t> debt_{0};
  std::atomic<uint64_t> total_{0};
  std::atomic<bool> cancelled_{false};
};

// Runs the calling thread at the policy's priority until destroyed, then
// restores it: CPU niceness and the I/O priority class (ioprio_set(2); the
// kernel's I/O schedulers honour it for local block devices; an iSCSI
// volume reached through libiscsi is network traffic and only the CPU
// niceness applies). kIdle: nice 19 and the idle I/O class; kLow: nice 10,
// best-effort level 7; kNormal: unchanged.
class ScopedDedupPriority {
 public:
  explicit ScopedDedupPriority(DedupPriority p);
  ~ScopedDedupPriority();
  ScopedDedupPriority(const ScopedDedupPriority&) = delete;
  ScopedDedupPriority& operator=(const ScopedDedupPriority&) = delete;

 private:
  bool changed_ = false;
  int old_nice_ = 0;
  int old_ioprio_ = -1;
};

}  // namespace dede
