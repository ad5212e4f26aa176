// The local lock manager (volume/lock_manager.h, OpenLocalLockManager):
// OFD locks on one lock file, one open file description per manager, so
// two managers on one file exclude each other as two processes do.
#include <catch2/catch.hpp>
#include <chrono>
#include <future>
#include <thread>

#include "tests/temp_locks.h"
#include "volume/lock_manager.h"

using namespace dede;
using namespace std::chrono_literals;

namespace {
const LockId kX{LockKind::kRecovery, 5};
const LockId kY{LockKind::kInode, 9};
}  // namespace

TEST_CASE("local locks: a blocked wait does not hold up the process's other lock calls",
          "[locks]") {
  // Acquire(wait) used to block in F_OFD_SETLKW under the manager's mutex:
  // every other Acquire, Release or IsHeldElsewhere of the process waited
  // for the other process to let go.
  auto locks = test::TempLockGroup(2);
  LockManager* here = locks[0].get();
  LockManager* other = locks[1].get();
  REQUIRE(other->Acquire(kX, LockMode::kExclusive, false).ok());
  auto waiter = std::async(std::launch::async,
                           [&] { return here->Acquire(kX, LockMode::kExclusive, true); });
  // Once the waiter has registered, the id it waits for counts as taken by
  // this process already (kInvalid; kLocked before that).
  Status again;
  for (int i = 0; i < 500; i++) {
    again = here->Acquire(kX, LockMode::kExclusive, false);
    if (again.code() != Status::Code::kLocked) break;
    std::this_thread::sleep_for(10ms);
  }
  CHECK(again.code() == Status::Code::kInvalid);
  std::this_thread::sleep_for(100ms);  // in F_OFD_SETLKW by now, most likely
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(here->Acquire(kY, LockMode::kExclusive, false).ok());
  auto elsewhere = here->IsHeldElsewhere(kX);
  REQUIRE(elsewhere.ok());
  CHECK(*elsewhere);
  CHECK(here->Release(kY).ok());
  CHECK(here->Acquire(kX, LockMode::kExclusive, false).code() == Status::Code::kInvalid);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(s < 1.0);
  CHECK(waiter.wait_for(0ms) == std::future_status::timeout);  // still waiting
  REQUIRE(other->Release(kX).ok());
  REQUIRE(waiter.wait_for(5s) == std::future_status::ready);
  CHECK(waiter.get().ok());
  auto held = other->IsHeldElsewhere(kX);
  REQUIRE(held.ok());
  CHECK(*held);
  CHECK(here->Release(kX).ok());
}
