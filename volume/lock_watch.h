// WatchAndTake: taking a lock another holder has, without asking for it
// over and over.
//
// With the sanlock backend a try (Acquire without waiting) is a paxos
// round on the LUN and slows the holder's own release; a look
// (IsHeldElsewhere) is one read of the lock table. So a waiter tries once,
// then only looks, with a backoff, and tries again when the lock looks
// free. The volume's bounded waits (VolumeImpl::WaitLock) and a dedup
// pass's wait for another pass's shard (agent/dedup_pass.cc) both wait
// this way; what they do between looks differs and is `between`.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>

#include "util/status.h"
#include "volume/lock_manager.h"

namespace dede {

struct LockWatch {
  using Clock = std::chrono::steady_clock;
  // The wait ends with kLocked once this passes (checked after a failed
  // try and between looks).
  Clock::time_point deadline = Clock::time_point::max();
  // No try before this (looks only): leaves the lock to processes that
  // waited before us for a while.
  Clock::time_point first_try{};
  // Looks back off from 2 ms to this.
  std::chrono::milliseconds max_poll{20};
  // Called before every look; an error ends the wait with that error
  // (cancellation). May do work that must go on while we wait.
  std::function<Status()> between;

  // Out: tries made, and looks that found the lock free (a holder that
  // never lets go, or races lost to others).
  uint64_t tries = 0;
  uint64_t seen_free = 0;
};

// Takes `id` in `mode` without blocking in the lock manager. Returns what
// the last try returned unless it was kLocked; kLocked when the deadline
// passed first; `between`'s error if it gave one.
Status WatchAndTake(LockManager* lm, LockId id, LockMode mode, LockWatch* watch);

}  // namespace dede
