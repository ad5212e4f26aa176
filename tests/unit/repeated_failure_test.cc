#include "util/repeated_failure.h"

#include <catch2/catch.hpp>

namespace dede {
namespace {

constexpr uint64_t kSecond = 1'000'000'000;

TEST_CASE(
    "a repeated failure is logged when it starts and changes then reminded at most once per period",
    "[util]") {
  ManualClock clock(100 * kSecond);
  RepeatedFailure f("volume flush point", &clock, 600 * kSecond);
  const Status eio = Status::IoError("fdatasync: Input/output error");

  CHECK(f.Note(Status::Ok()).empty());  // nothing failed: nothing to say
  CHECK_FALSE(f.snapshot().failing);

  bool is_failure = false;
  CHECK(f.Note(eio, &is_failure) == "volume flush point: " + eio.ToString());
  CHECK(is_failure);
  RepeatedFailure::Snapshot s = f.snapshot();
  CHECK(s.failing);
  CHECK(s.since_ns == 100 * kSecond);
  CHECK(s.in_a_row == 1);
  CHECK(s.error == eio.ToString());

  // One a second for nearly ten minutes: no line.
  for (int i = 0; i < 599; i++) {
    clock.Advance(kSecond);
    INFO("second " << i);
    CHECK(f.Note(eio).empty());
  }
  CHECK(f.snapshot().in_a_row == 600);
  clock.Advance(kSecond);
  const std::string reminder = f.Note(eio);
  CHECK(reminder ==
        "volume flush point still fails: 601 failures in a row, 600 since the last "
        "line like this: " +
            eio.ToString());
  clock.Advance(kSecond);
  CHECK(f.Note(eio).empty());

  // A different error is news at once.
  const Status nospace = Status::NoSpace("the volume is full");
  CHECK(f.Note(nospace) ==
        "volume flush point: " + nospace.ToString() + " (603 failures in a row)");
  CHECK(f.snapshot().since_ns == 100 * kSecond);  // the run of failures goes on

  // Recovery: one line, then silence; the figures reset but the total stays.
  clock.Advance(kSecond);
  CHECK(f.Note(Status::Ok(), &is_failure) ==
        "volume flush point works again after 603 failures in a row");
  CHECK_FALSE(is_failure);
  CHECK(f.Note(Status::Ok()).empty());
  s = f.snapshot();
  CHECK_FALSE(s.failing);
  CHECK(s.in_a_row == 0);
  CHECK(s.error.empty());
  CHECK(s.total == 603);

  // The same error again is a new run: logged as a start, with its own time.
  clock.Advance(5 * kSecond);
  CHECK(f.Note(eio) == "volume flush point: " + eio.ToString());
  CHECK(f.snapshot().since_ns == 707 * kSecond);
  CHECK(f.snapshot().total == 604);
}

}  // namespace
}  // namespace dede
