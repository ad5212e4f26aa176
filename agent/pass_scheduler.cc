#include "agent/pass_scheduler.h"

#include <algorithm>

namespace dede {

const char* PassTriggerName(PassTrigger t) {
  switch (t) {
    case PassTrigger::kWindow:
      return "window";
    case PassTrigger::kInterval:
      return "interval";
    case PassTrigger::kSignal:
      return "signal";
    case PassTrigger::kNow:
      return "now";
  }
  return "?";
}

PassScheduler::PassScheduler(Clock* clock, Options opts)
    : clock_(clock != nullptr ? clock : Clock::Real()), opts_(opts) {
  MutexLock l(&mu_);
  last_end_mono_ = clock_->MonotonicNanos();  // the first interval pass comes one interval in
}

void PassScheduler::SetPolicy(const DedupPolicy& p) {
  MutexLock l(&mu_);
  policy_ = p;
  has_policy_ = true;
}

bool PassScheduler::has_policy() const {
  MutexLock l(&mu_);
  return has_policy_;
}

DedupPolicy PassScheduler::policy() const {
  MutexLock l(&mu_);
  return policy_;
}

bool PassScheduler::InWindowLocked(uint64_t now) const {
  return has_policy_ && dede::InWindow(policy_, now);
}

bool PassScheduler::InWindow() const {
  MutexLock l(&mu_);
  return InWindowLocked(clock_->NowNanos());
}

std::string PassScheduler::CurrentWindow() const {
  MutexLock l(&mu_);
  if (!has_policy_) return "";
  return CurrentWindowText(policy_, clock_->NowNanos());
}

std::optional<uint64_t> PassScheduler::NextChange() const {
  MutexLock l(&mu_);
  if (!has_policy_) return std::nullopt;
  return NextWindowChange(policy_, clock_->NowNanos());
}

bool PassScheduler::Request(PassTrigger t) {
  MutexLock l(&mu_);
  if (!has_policy_) return false;
  requested_ = t;
  return true;
}

std::optional<PassTrigger> PassScheduler::Due() {
  MutexLock l(&mu_);
  if (running_ || !has_policy_) return std::nullopt;
  if (requested_) {
    const PassTrigger t = *requested_;
    requested_.reset();
    return t;
  }
  const uint64_t since_last = clock_->MonotonicNanos() - last_end_mono_;
  auto elapsed = [since_last](double seconds) {
    return since_last >= static_cast<uint64_t>(seconds * 1e9);
  };
  // Checked where a pass would be due, not before: the window bookkeeping
  // below must follow the clock while the backoff lasts.
  const bool backing_off = failures_ > 0 && !elapsed(FailureBackoffLocked());
  if (policy_.windows.empty()) {
    was_in_window_ = false;
    if (opts_.interval_s > 0 && elapsed(opts_.interval_s) && !backing_off) {
      return PassTrigger::kInterval;
    }
    return std::nullopt;
  }
  if (!InWindowLocked(clock_->NowNanos())) {
    was_in_window_ = false;
    return std::nullopt;
  }
  if (!was_in_window_) {
    // A window opened (or dedupd started inside one): pass at once.
    was_in_window_ = true;
    window_pass_done_ = false;
  }
  if ((!window_pass_done_ || elapsed(opts_.window_interval_s)) && !backing_off) {
    return PassTrigger::kWindow;
  }
  return std::nullopt;
}

void PassScheduler::PassStarted(PassTrigger t) {
  MutexLock l(&mu_);
  running_ = t;
  if (t == PassTrigger::kWindow) window_pass_done_ = true;
}

void PassScheduler::PassEnded(Outcome outcome) {
  MutexLock l(&mu_);
  running_.reset();
  last_end_mono_ = clock_->MonotonicNanos();
  if (outcome == Outcome::kFailed) {
    failures_++;
  } else {
    failures_ = 0;
  }
}

uint32_t PassScheduler::failures_in_a_row() const {
  MutexLock l(&mu_);
  return failures_;
}

double PassScheduler::failure_backoff_s() const {
  MutexLock l(&mu_);
  return FailureBackoffLocked();
}

double PassScheduler::FailureBackoffLocked() const {
  if (failures_ == 0) return 0;
  double backoff = opts_.failure_backoff_s;
  for (uint32_t i = 1; i < failures_ && backoff < opts_.max_failure_backoff_s; i++) backoff *= 2;
  return std::min(backoff, opts_.max_failure_backoff_s);
}

bool PassScheduler::ShouldStop() {
  MutexLock l(&mu_);
  if (!running_ || policy_.windows.empty()) return false;
  if (*running_ != PassTrigger::kWindow && *running_ != PassTrigger::kInterval) return false;
  return !InWindowLocked(clock_->NowNanos());
}

bool PassScheduler::running() const {
  MutexLock l(&mu_);
  return running_.has_value();
}

std::optional<PassTrigger> PassScheduler::running_trigger() const {
  MutexLock l(&mu_);
  return running_;
}

}  // namespace dede
