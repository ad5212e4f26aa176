#include "util/repeated_failure.h"

#include <utility>

namespace dede {

RepeatedFailure::RepeatedFailure(std::string what, Clock* clock, uint64_t remind_every_ns)
    : what_(std::move(what)), clock_(clock), remind_every_ns_(remind_every_ns) {}

std::string RepeatedFailure::Note(const Status& outcome, bool* is_failure) {
  if (is_failure != nullptr) *is_failure = !outcome.ok();
  if (outcome.ok()) {
    if (!snap_.failing) return "";
    const uint64_t n = snap_.in_a_row;
    snap_.failing = false;
    snap_.error.clear();
    snap_.in_a_row = 0;
    logged_error_.clear();
    return what_ + " works again after " + std::to_string(n) + " failure" + (n == 1 ? "" : "s") +
           " in a row";
  }
  const uint64_t mono = clock_->MonotonicNanos();
  if (!snap_.failing) {
    snap_.failing = true;
    snap_.since_ns = clock_->NowNanos();
  }
  snap_.in_a_row++;
  snap_.total++;
  snap_.error = outcome.ToString();
  if (snap_.in_a_row == 1 || snap_.error != logged_error_) {
    logged_error_ = snap_.error;
    logged_at_mono_ns_ = mono;
    logged_in_a_row_ = snap_.in_a_row;
    return what_ + ": " + snap_.error +
           (snap_.in_a_row == 1 ? ""
                                : " (" + std::to_string(snap_.in_a_row) + " failures in a row)");
  }
  if (mono - logged_at_mono_ns_ < remind_every_ns_) return "";
  const uint64_t since_logged = snap_.in_a_row - logged_in_a_row_;
  logged_at_mono_ns_ = mono;
  logged_in_a_row_ = snap_.in_a_row;
  return what_ + " still fails: " + std::to_string(snap_.in_a_row) + " failures in a row, " +
         std::to_string(since_logged) + " since the last line like this: " + snap_.error;
}

}  // namespace dede
