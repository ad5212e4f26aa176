// Local lock managers for unit tests, each set on a lock file of its own
// (a volume's locks live beside its device; an in-memory device has none).
#pragma once

#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "volume/lock_manager.h"

namespace dede::test {

// `n` lock managers on one fresh lock file. Each has an open file
// description of its own, so they exclude each other as hosts do. The file
// is removed at once: the open descriptions keep their locks working.
inline std::vector<std::shared_ptr<LockManager>> TempLockGroup(size_t n) {
  static std::atomic<uint64_t> seq{0};
  const std::string path =
      "/tmp/dede-test-locks-" + std::to_string(getpid()) + "-" + std::to_string(seq++);
  std::vector<std::shared_ptr<LockManager>> out;
  for (size_t i = 0; i < n; i++) {
    Result<std::unique_ptr<LockManager>> lm = OpenLocalLockManager(path);
    if (!lm.ok()) ::unlink(path.c_str());
    REQUIRE(lm.ok());
    out.push_back(std::shared_ptr<LockManager>(std::move(lm.value())));
  }
  ::unlink(path.c_str());
  return out;
}

// One lock manager on a fresh lock file: a single host's.
inline std::shared_ptr<LockManager> TempLocks() { return TempLockGroup(1)[0]; }

}  // namespace dede::test
