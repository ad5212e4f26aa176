// A backing file that can hold one write or fail fsyncs (tests/tools/
// dede_hold_fuse.cc), mounted for the life of a HoldFuse object: the
// iSCSI tests' stuck target and the operations tests' failing device.
#pragma once

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "tests/integration/rig.h"

#ifndef DEDE_HOLD_FUSE
#error "DEDE_HOLD_FUSE (path of the dede-hold-fuse test tool) must be defined by the build"
#endif

namespace dede {
namespace test {

// Mounted for the life of this object.
class HoldFuse {
 public:
  HoldFuse(const std::string& backing, const std::string& mount_dir)
      : mount_dir_(mount_dir), log_(mount_dir + ".log") {
    std::filesystem::create_directories(mount_dir_);
    pid_ = dede::test::StartProcess({DEDE_HOLD_FUSE, backing, mount_dir_, "-f"}, {}, log_);
  }
  // Separate from the constructor, so that the destructor cleans up when
  // it fails.
  void WaitMounted() {
    REQUIRE(::access("/dev/fuse", R_OK | W_OK) == 0);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    for (;;) {
      struct stat st {};
      if (::stat(lun().c_str(), &st) == 0 && st.st_size > 0) break;
      INFO(Log());
      REQUIRE(ChildRunning(&pid_));
      REQUIRE(std::chrono::steady_clock::now() < deadline);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ~HoldFuse() {
    Release();
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      int status = 0;
      while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
    }
    ::umount2(mount_dir_.c_str(), MNT_DETACH);  // if the exit left it behind
  }
  std::string lun() const { return mount_dir_ + "/lun"; }
  void Hold(uint64_t offset) { Control("hold " + std::to_string(offset)); }
  // The next fsync of the lun waits for Release (then fails if FailFsyncs
  // armed a failure).
  void HoldFsync() { Control("hold-fsync"); }
  // Whether the armed hold has caught a write (within 10 s).
  bool WaitHeld() const {
    const auto t0 = std::chrono::steady_clock::now();
    while (State().rfind("state=held", 0) != 0) {
      if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(10)) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return true;
  }
  void Release() { Control("release"); }
  // The next `n` fsyncs of the lun fail with EIO.
  void FailFsyncs(uint64_t n) { Control("fail-fsync " + std::to_string(n)); }
  std::string State() const {
    std::ifstream f(mount_dir_ + "/ctl");
    std::string line;
    std::getline(f, line);
    return line;
  }
  std::string Log() const { return ReadWholeFileText(log_); }

 private:
  void Control(const std::string& cmd) {
    const int fd = ::open((mount_dir_ + "/ctl").c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) return;
    (void)!::write(fd, cmd.data(), cmd.size());
    ::close(fd);
  }
  std::string mount_dir_;
  std::string log_;
  int pid_ = -1;
};

}  // namespace test
}  // namespace dede
