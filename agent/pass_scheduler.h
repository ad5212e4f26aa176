// PassScheduler: when dedupd runs dedup passes, under the volume's policy.
//
// Write monitoring and log flushing always run; index updates, sharing and
// GC (dedup passes, and applying merge requests) run only inside a policy
// window, or when an administrator asks (`dede dedup --now`, SIGUSR1).
//
//  * A volume without windows: a pass every `interval_s` (0: only on
//    request), as before policies existed.
//  * With windows: a pass starts at a window's start (the first tick inside
//    it), and again every `window_interval_s` after the previous one ended
//    while the window lasts. When the window ends, the running pass is told
//    to stop (DedupOptions::stop): it parks what it has not merged and
//    ends; the first pass of the next window resumes from there.
//  * A requested pass runs whatever the time and is not stopped by a
//    window's end (the administrator asked for it).
//  * A failed pass delays the next scheduled one (window or interval) by a
//    backoff that doubles with every failure in a row, from
//    `failure_backoff_s` up to `max_failure_backoff_s`, if that is longer
//    than the interval; a pass that does not fail ends it. Without it, a
//    pass that fails at once (a damaged shard, a lost path) with
//    --window-interval 0 was retried at every tick, for as long as the
//    window lasted. Requested passes are not delayed.
//  * Until the first SetPolicy (dedupd could not read the volume's policy
//    yet: both slots damaged, a newer format), nothing runs: no scheduled
//    pass, no merge requests (InWindow is false), and requests are
//    refused. Running without the policy would run uncapped, at any time.
//
// A pure decision object: it reads the injected Clock and is driven by
// dedupd's timer (Tick); nothing here sleeps or does I/O. Thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "agent/dedup_policy.h"
#include "util/clock.h"
#include "util/mutex.h"

namespace dede {

enum class PassTrigger {
  kWindow,    // a policy window is open
  kInterval,  // no windows: --dedup-interval elapsed
  kSignal,    // SIGUSR1
  kNow,       // dede dedup --now (control socket)
};
const char* PassTriggerName(PassTrigger t);  // "window", "interval", "signal", "now"

class PassScheduler {
 public:
  struct Options {
    double interval_s = 0;           // no windows: seconds between passes; 0 = only on request
    double window_interval_s = 600;  // inside a window: seconds from a pass's end to the next
    double failure_backoff_s = 2;    // after one failed pass; doubles with each one more
    double max_failure_backoff_s = 300;  // the backoff stops doubling here
  };
  enum class Outcome {
    kSucceeded,  // completed or stopped (at a window's end, a shutdown)
    kFailed,
  };
  PassScheduler(Clock* clock, Options opts);

  void SetPolicy(const DedupPolicy& p) EXCLUDES(mu_);
  DedupPolicy policy() const EXCLUDES(mu_);
  // A policy was set: dedup work may run (under it).
  bool has_policy() const EXCLUDES(mu_);

  // Dedup work (passes, merge requests) may run now under the windows.
  bool InWindow() const EXCLUDES(mu_);
  // The window open now, as text ("" when none is, or there are none).
  std::string CurrentWindow() const EXCLUDES(mu_);
  // Epoch ns of the next window opening or closing; nullopt if none.
  std::optional<uint64_t> NextChange() const EXCLUDES(mu_);

  // An administrator asked for a pass; the next Due() returns it. False
  // (and nothing is recorded) while there is no policy.
  bool Request(PassTrigger t) EXCLUDES(mu_);
  // Called on every timer tick with no pass running: the pass to start
  // now, if any.
  std::optional<PassTrigger> Due() EXCLUDES(mu_);
  void PassStarted(PassTrigger t) EXCLUDES(mu_);
  // The running pass ended (however: completed, stopped, cancelled, failed).
  void PassEnded(Outcome outcome = Outcome::kSucceeded) EXCLUDES(mu_);
  // Passes that failed in a row, up to the last one that ended.
  uint32_t failures_in_a_row() const EXCLUDES(mu_);
  // How long after the last pass ended the next scheduled one waits at
  // least because of those failures; 0 when the last pass did not fail.
  double failure_backoff_s() const EXCLUDES(mu_);
  // Called on every tick while a pass runs: true when it must stop now
  // (its window closed).
  bool ShouldStop() EXCLUDES(mu_);
  bool running() const EXCLUDES(mu_);
  std::optional<PassTrigger> running_trigger() const EXCLUDES(mu_);

 private:
  bool InWindowLocked(uint64_t now) const REQUIRES(mu_);
  double FailureBackoffLocked() const REQUIRES(mu_);
  Clock* const clock_;
  const Options opts_;
  mutable Mutex mu_;
  DedupPolicy policy_ GUARDED_BY(mu_);
  bool has_policy_ GUARDED_BY(mu_) = false;
  std::optional<PassTrigger> requested_ GUARDED_BY(mu_);
  std::optional<PassTrigger> running_ GUARDED_BY(mu_);
  // Monotonic ns the last pass ended (at first: when the scheduler began).
  uint64_t last_end_mono_ GUARDED_BY(mu_) = 0;
  bool was_in_window_ GUARDED_BY(mu_) = false;
  bool window_pass_done_ GUARDED_BY(mu_) = false;  // this window already had a pass
  uint32_t failures_ GUARDED_BY(mu_) = 0;          // passes failed in a row
};

}  // namespace dede
