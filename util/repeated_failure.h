// A failure that repeats at every tick: a volume whose flush points all
// fail once its device lost a flush (the failure is sticky, see
// StickyFlushFailure), a job that fails the same way each second. Logging
// every occurrence floods the journal (86,400 lines a day at one a second)
// and buries the first, which is the one that says when it began.
//
// RepeatedFailure decides what to log: the first failure, a failure whose
// message differs from the last one logged, then a reminder at most once
// per `remind_every_ns` saying how many times it failed since, and one line
// when it stops failing. It also keeps the figures a status reply shows
// (failing or not, since when, how many times in a row, the error).
//
// Not thread-safe: its owner serialises Note and snapshot (dedupd: a
// mutex shared by the flush-point job and the status reply).
#pragma once

#include <cstdint>
#include <string>

#include "util/clock.h"
#include "util/status.h"

namespace dede {

class RepeatedFailure {
 public:
  struct Snapshot {
    bool failing = false;
    std::string error;      // the latest failure's message ("" when not failing)
    uint64_t since_ns = 0;  // wall clock of the first failure in this run of them
    uint64_t in_a_row = 0;  // failures since the last success
    uint64_t total = 0;     // failures ever
  };

  // `what` names the job in the lines ("volume flush point").
  RepeatedFailure(std::string what, Clock* clock,
                  uint64_t remind_every_ns = uint64_t{600} * 1'000'000'000);

  // Records one outcome; returns the line to log for it, or "" for none.
  // `*is_failure` (when given) says whether the line reports a failure
  // (log it as an error) or the recovery (log it as info).
  std::string Note(const Status& outcome, bool* is_failure = nullptr);

  Snapshot snapshot() const { return snap_; }

 private:
  std::string what_;
  Clock* clock_;
  uint64_t remind_every_ns_;
  Snapshot snap_;
  std::string logged_error_;        // the message last logged
  uint64_t logged_at_mono_ns_ = 0;  // when it was
  uint64_t logged_in_a_row_ = 0;    // in_a_row when it was
};

}  // namespace dede
