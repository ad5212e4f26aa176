#include "agent/lockspace_guard.h"

#include <cstdlib>

#include "util/log.h"

namespace dede {

namespace {
int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

LockspaceGuard::LockspaceGuard(SanlockLockManager* locks, std::chrono::milliseconds fence_after,
                               std::chrono::milliseconds collect_every)
    : locks_(locks),
      fence_after_(fence_after),
      collect_every_(collect_every),
      last_ok_ns_(SteadyNs()) {
  // The lease may be old already (a restarted dedupd rejoins a lockspace
  // its host never left): start from its renewal, not from now.
  Result<uint64_t> age_ns = locks_->CheckLockspace();
  if (age_ns.ok()) {
    last_ok_ns_.store(SteadyNs() - static_cast<int64_t>(*age_ns));
  } else {
    // Older than the check allows (4 io_timeouts), or unreadable: count
    // from that age at least, not from now, which could put the fence
    // past the moment others may call us dead.
    LOG(kWarning) << "lockspace check at start: " << age_ns.status().ToString();
    last_ok_ns_.store(SteadyNs() - int64_t{4} * locks_->io_timeout_s() * 1'000'000'000);
  }
  checker_ = std::thread([this] { CheckLoop(); });
  watchdog_ = std::thread([this] { WatchLoop(); });
  collector_ = std::thread([this] { CollectLoop(); });
}

LockspaceGuard::~LockspaceGuard() {
  // The collector first, while the checker still records renewals (a
  // collection round may take seconds of lease I/O); then the checker.
  // The watchdog keeps watching while either finishes a call that may
  // hang in a stuck daemon.
  auto stop = [this](bool* flag, std::thread* t) {
    {
      std::lock_guard<std::mutex> l(mu_);
      *flag = true;
    }
    cv_.notify_all();
    t->join();
  };
  stop(&stop_collect_, &collector_);
  stop(&stop_, &checker_);
  stop(&stop_watch_, &watchdog_);
}

void LockspaceGuard::CheckLoop() {
  std::unique_lock<std::mutex> l(mu_);
  while (!stop_) {
    l.unlock();
    // Timed from the lease's last renewal, not from this check: the check
    // passes while the lease is up to 4 io_timeouts old, and others count
    // from the renewal too (DEAD at 8 io_timeouts + 60 s after it).
    Result<uint64_t> age_ns = locks_->CheckLockspace();
    if (age_ns.ok()) {
      const int64_t renewed = SteadyNs() - static_cast<int64_t>(*age_ns);
      if (renewed > last_ok_ns_.load()) last_ok_ns_.store(renewed);
    } else {
      LOG(kWarning) << "lockspace check: " << age_ns.status().ToString();
    }
    l.lock();
    cv_.wait_for(l, std::chrono::seconds(1), [this] { return stop_; });
  }
}

// On its own thread: collecting takes partition locks that lock operations
// of this process may hold while they wait for a dead host's lease.
void LockspaceGuard::CollectLoop() {
  std::unique_lock<std::mutex> l(mu_);
  while (!stop_collect_) {
    cv_.wait_for(l, collect_every_, [this] { return stop_collect_; });
    if (stop_collect_) break;
    l.unlock();
    Result<uint64_t> n = locks_->CollectStaleRecords();
    if (!n.ok()) {
      LOG(kWarning) << "collecting stale lock records: " << n.status().ToString();
    } else if (n.value() > 0) {
      LOG(kInfo) << "collected " << n.value()
                 << " lock records of dead processes of this host (marked dead for other hosts)";
    }
    l.lock();
  }
}

void LockspaceGuard::WatchLoop() {
  std::unique_lock<std::mutex> l(mu_);
  while (!stop_watch_) {
    cv_.wait_for(l, std::chrono::milliseconds(200), [this] { return stop_watch_; });
    if (stop_watch_) break;
    int64_t age_ns = SteadyNs() - last_ok_ns_.load();
    if (age_ns > std::chrono::duration_cast<std::chrono::nanoseconds>(fence_after_).count()) {
      LOG(kError) << "FENCED: this host's sanlock lease was last seen renewed "
                  << age_ns / 1000000 << " ms ago (limit " << fence_after_.count()
                  << " ms); exiting before other hosts may take over its leases";
      std::_Exit(kExitFenced);
    }
  }
}

}  // namespace dede
