// The local lock manager (volume/lock_manager.h, OpenLocalLockManager):
// OFD locks on one lock file, one open file description per manager, so
// two managers on one file exclude each other as two processes do.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <optional>
#include <string>
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

// Processes that must exclude each other must lock one file: the path
// follows nothing a process can be started with differently, except the
// sanlock daemon it talks to, which is what makes it one host or another.
TEST_CASE("local lock files: one per volume, and per sanlock daemon", "[locks]") {
  const std::string uuid = "0123abcd-0000-4000-8000-00000000beef";
  struct RunDirEnv {
    explicit RunDirEnv(const char* v) {
      if (const char* old = std::getenv("SANLOCK_RUN_DIR")) saved = old;
      if (v != nullptr) {
        ::setenv("SANLOCK_RUN_DIR", v, 1);
      } else {
        ::unsetenv("SANLOCK_RUN_DIR");
      }
    }
    ~RunDirEnv() {
      if (saved) {
        ::setenv("SANLOCK_RUN_DIR", saved->c_str(), 1);
      } else {
        ::unsetenv("SANLOCK_RUN_DIR");
      }
    }
    std::optional<std::string> saved;
  };
  const std::string plain = "/run/dede/" + uuid + ".lock";
  CHECK(LocalVolumeLockPath(uuid) == plain);
  {
    RunDirEnv env(nullptr);
    CHECK(SanlockHostLockPath(uuid) == plain);
  }
  {
    RunDirEnv env("");
    CHECK(SanlockHostLockPath(uuid) == plain);
  }
  {
    RunDirEnv env("/run/sanlock");
    CHECK(SanlockHostLockPath(uuid) == plain);
  }
  {
    // Another daemon's host: its own file, the directory escaped into one
    // file name (a '%' too, so two directories never share a name).
    RunDirEnv env("/tmp/no such dir/h%2F1");
    CHECK(SanlockHostLockPath(uuid) ==
          "/run/dede/" + uuid + "@%2Ftmp%2Fno such dir%2Fh%252F1.lock");
  }
  {
    RunDirEnv a("/tmp/a/b");
    const std::string one = SanlockHostLockPath(uuid);
    RunDirEnv b("/tmp/a%2Fb");
    CHECK(SanlockHostLockPath(uuid) != one);
  }
  {
    // The same daemon however its directory is spelled: resolved first.
    std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                ("dede-runlink-test-" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir / "real");
    std::filesystem::create_directory_symlink(dir / "real", dir / "link");
    std::string via_real, via_link;
    {
      RunDirEnv env((dir / "real").c_str());
      via_real = SanlockHostLockPath(uuid);
    }
    {
      RunDirEnv env((dir / "link").c_str());
      via_link = SanlockHostLockPath(uuid);
    }
    CHECK(via_real == via_link);
    CHECK(via_real != plain);
    std::filesystem::remove_all(dir);
  }
}
