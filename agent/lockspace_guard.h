// LockspaceGuard: dedupd's fence on a sanlock volume (docs/LOCKING.md,
// "Fencing").
//
// sanlock SIGKILLs a registered process when its host can no longer renew
// the lockspace, well before other hosts may treat the host as dead. That
// needs a working daemon. If the daemon itself hangs or dies, nobody would
// stop us, so the guard checks every second, on the LUN itself, that this
// host's delta lease is still ours and freshly renewed
// (SanlockLockManager::CheckLockspace) and, once the last renewal it saw is
// `fence_after` old, ends the process at once
// (std::_Exit: no flush, no further volume I/O). Acknowledged writes are
// safe: flushed data and committed journal transactions are on the LUN,
// and whoever takes the host's locks next replays its journal.
//
// It also clears this host's stale lock records now and then
// (SanlockLockManager::CollectStaleRecords: records of processes of this
// host that died).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "volume/sanlock_lock_manager.h"

namespace dede {

class LockspaceGuard {
 public:
  static constexpr int kExitFenced = 75;

  LockspaceGuard(SanlockLockManager* locks, std::chrono::milliseconds fence_after,
                 std::chrono::milliseconds collect_every = std::chrono::seconds(10));
  ~LockspaceGuard();
  LockspaceGuard(const LockspaceGuard&) = delete;
  LockspaceGuard& operator=(const LockspaceGuard&) = delete;

 private:
  void CheckLoop();
  void WatchLoop();
  void CollectLoop();

  SanlockLockManager* locks_;
  const std::chrono::milliseconds fence_after_;
  const std::chrono::milliseconds collect_every_;
  // Steady-clock nanoseconds of the lease's last renewal seen (at start: the
  // join); read by WatchLoop.
  std::atomic<int64_t> last_ok_ns_;
  std::mutex mu_;
  std::condition_variable cv_;
  // Guarded by mu_; set in this order by the destructor.
  bool stop_collect_ = false;  // the collector
  bool stop_ = false;          // the checker, once the collector has ended
  bool stop_watch_ = false;    // the watchdog, once both have ended
  std::thread checker_, watchdog_, collector_;
};

}  // namespace dede
