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
  checker_ = std::thread([this] { CheckLoop(); });
  watchdog_ = std::thread([this] { WatchLoop(); });
  collector_ = std::thread([this] { CollectLoop(); });
}

LockspaceGuard::~LockspaceGuard() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  // The watchdog keeps watching while the checker finishes a call that
  // may hang in a stuck daemon.
  checker_.join();
  collector_.join();
  watchdog_.join();
}

void LockspaceGuard::CheckLoop() {
  std::unique_lock<std::mutex> l(mu_);
  while (!stop_) {
    l.unlock();
    Status st = locks_->CheckLockspace();
    if (st.ok()) {
      last_ok_ns_.store(SteadyNs());
    } else {
      LOG(kWarning) << "lockspace check: " << st.ToString();
    }
    l.lock();
    cv_.wait_for(l, std::chrono::seconds(1), [this] { return stop_; });
  }
}

// On its own thread: collecting takes partition locks that lock operations
// of this process may hold while they wait for a dead host's lease.
void LockspaceGuard::CollectLoop() {
  std::unique_lock<std::mutex> l(mu_);
  while (!stop_) {
    cv_.wait_for(l, collect_every_, [this] { return stop_; });
    if (stop_) break;
    l.unlock();
    Result<uint64_t> n = locks_->CollectStaleRecords();
    if (!n.ok()) {
      LOG(kWarning) << "collecting stale lock records: " << n.status().ToString();
    } else if (n.value() > 0) {
      LOG(kInfo) << "removed " << n.value() << " stale lock records of this host";
    }
    l.lock();
  }
}

void LockspaceGuard::WatchLoop() {
  std::unique_lock<std::mutex> l(mu_);
  while (!stop_) {
    cv_.wait_for(l, std::chrono::milliseconds(200), [this] { return stop_; });
    int64_t age_ns = SteadyNs() - last_ok_ns_.load();
    if (age_ns > std::chrono::duration_cast<std::chrono::nanoseconds>(fence_after_).count()) {
      LOG(kError) << "FENCED: this host's sanlock lockspace has not been confirmed live for "
                  << age_ns / 1000000 << " ms (limit " << fence_after_.count()
                  << " ms); exiting before other hosts may take over its leases";
      std::_Exit(kExitFenced);
    }
  }
}

}  // namespace dede
