#include "agent/io_throttle.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace dede {

IoThrottle::IoThrottle(uint64_t bytes_per_s, Clock* clock, std::function<void(uint64_t)> sleep_ns)
    : limiter_(bytes_per_s, clock, std::move(sleep_ns)) {}

void IoThrottle::SetRate(uint64_t bytes_per_s) { limiter_.SetRate(bytes_per_s); }

void IoThrottle::Charge(uint64_t bytes) {
  debt_.fetch_add(bytes, std::memory_order_relaxed);
  total_.fetch_add(bytes, std::memory_order_relaxed);
}

void IoThrottle::Settle(const std::function<void()>& between) {
  uint64_t debt = debt_.exchange(0, std::memory_order_relaxed);
  if (cancelled_.load()) return;
  // Paid in slices of a quarter second at the cap, read afresh for each:
  // a rate changed meanwhile (dede policy set, SIGHUP) applies from the
  // next slice. Paid in one, a big debt (a volume summary, merges) was
  // slept out at the old rate whatever the new one (a minute at 1 MB/s
  // for 60 MB, after the cap was lifted).
  while (debt > 0) {
    const uint64_t rate = limiter_.rate();
    if (rate == 0) return;  // no cap (any more): nothing to wait for
    const uint64_t n = std::min(debt, std::max<uint64_t>(rate / 4, 1));
    if (!limiter_.Acquire(n, &cancelled_)) return;  // Cancel: the rest is dropped
    debt -= n;
    if (debt > 0 && between) between();
  }
}

size_t IoThrottle::BatchOpsFor(uint64_t bytes_per_s, size_t max) {
  if (bytes_per_s == 0) return max;
  const uint64_t ops = bytes_per_s / 10 / 8192;
  return static_cast<size_t>(std::clamp<uint64_t>(ops, 16, max));
}

namespace {
// <linux/ioprio.h> is not in every libc's headers: the ABI values.
constexpr int kIoprioWhoProcess = 1;
constexpr int kIoprioClassShift = 13;
constexpr int kIoprioClassBestEffort = 2;
constexpr int kIoprioClassIdle = 3;

int GetIoprio() { return static_cast<int>(::syscall(SYS_ioprio_get, kIoprioWhoProcess, 0)); }
void SetIoprio(int value) { (void)::syscall(SYS_ioprio_set, kIoprioWhoProcess, 0, value); }
}  // namespace

ScopedDedupPriority::ScopedDedupPriority(DedupPriority p) {
  if (p == DedupPriority::kNormal) return;
  // Thread-level: with which = PRIO_PROCESS and who = the thread id, Linux
  // changes only this thread (the pass runs on a worker shared with VMs'
  // requests, hence the restore).
  const pid_t tid = static_cast<pid_t>(::syscall(SYS_gettid));
  errno = 0;
  old_nice_ = ::getpriority(PRIO_PROCESS, static_cast<id_t>(tid));
  old_ioprio_ = GetIoprio();
  changed_ = true;
  const int nice = p == DedupPriority::kIdle ? 19 : 10;
  (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(tid), std::max(nice, old_nice_));
  SetIoprio(p == DedupPriority::kIdle ? (kIoprioClassIdle << kIoprioClassShift)
                                      : ((kIoprioClassBestEffort << kIoprioClassShift) | 7));
}

ScopedDedupPriority::~ScopedDedupPriority() {
  if (!changed_) return;
  const pid_t tid = static_cast<pid_t>(::syscall(SYS_gettid));
  // Lowering niceness back needs CAP_SYS_NICE (dedupd runs as root); an
  // unprivileged dedupd keeps the worker a bit nicer, which is harmless.
  (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(tid), old_nice_);
  if (old_ioprio_ >= 0) SetIoprio(old_ioprio_);
}

}  // namespace dede
