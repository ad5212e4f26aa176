// The multi-host rig itself (cluster_rig.h): three simulated hosts (sanlock
// daemons) join a lockspace on a shared LUN, see each other LIVE, and see a
// crashed host FAIL then DEAD; and a host's daemon fences (SIGKILLs) its
// lease holders when its renewals fail or its lockspace is removed. The
// DEAD wait makes the first test slow (~76 s): sanlock 3.8.5 declares a
// host dead 8 io_timeouts + 60 s (its compiled-in watchdog fire timeout)
// after its last renewal, and io_timeout >= 1 s. That test is hidden
// from the suite ([.], for the suite's time): the multi-host test "a
// killed host and a fenced host lose no acknowledged data" waits for the
// same DEAD verdict through dedupd (it takes over the dead host's disks).
// Run it alone with
//   build/tests/dede_integration_tests "[cluster-rig-death]"
#include "tests/integration/cluster_rig.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "tests/integration/rig.h"

namespace dede::test {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kLockspaceOffset = 1ull << 20;  // 1 MiB: 4K sectors, 1 MiB align
constexpr uint64_t kResourceOffset = 2ull << 20;   // 2 MiB
constexpr int kIoTimeout = 1;                      // seconds
const std::string kLockspace = "dede_rig";

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string Describe(const std::map<uint64_t, std::string>& states) {
  std::string s;
  for (const auto& [id, state] : states) s += std::to_string(id) + "=" + state + " ";
  return s.empty() ? "(no hosts)" : s;
}

bool AllLive(const std::map<uint64_t, std::string>& states, int hosts) {
  for (int id = 1; id <= hosts; ++id) {
    auto it = states.find(static_cast<uint64_t>(id));
    if (it == states.end() || it->second != "LIVE") return false;
  }
  return true;
}

// Writes the lease area on the rig's LUN: the lockspace at 1 MiB and
// resource lease "res0" at 2 MiB, 4 KiB sectors and 1 MiB alignment. `-o`
// writes our io_timeout into the fresh delta leases; otherwise joining
// waits 2 x 10 s.
void InitLeaseArea(ClusterRig& rig) {
  const std::string sanlock = RequireProgram("sanlock");
  const std::vector<std::string> init_ls = {sanlock,
                                            "direct",
                                            "init",
                                            "-s",
                                            rig.LockspaceSpec(kLockspace, 0, kLockspaceOffset),
                                            "-Z",
                                            "4096",
                                            "-A",
                                            "1M",
                                            "-o",
                                            std::to_string(kIoTimeout)};
  const std::vector<std::string> init_res = {
      sanlock, "direct", "init", "-r", rig.ResourceSpec(kLockspace, "res0", kResourceOffset),
      "-Z",    "4096",   "-A",   "1M"};
  for (const auto& argv : {init_ls, init_res}) {
    ProcessResult r = RunProcess(argv, 30);
    INFO(DescribeRun(argv, r));
    REQUIRE(r.exit_code == 0);
  }
}

// Polls host `observer`'s view of `target` until it is `want`; returns the
// seconds since t0, or -1 after `limit_s`.
double WaitForState(ClusterRig& rig, int observer, uint64_t target, const std::string& want,
                    Clock::time_point t0, double limit_s, std::string* last) {
  while (Since(t0) < limit_s) {
    auto states = HostStates(rig.host(observer), kLockspace);
    *last = Describe(states);
    auto it = states.find(target);
    if (it != states.end() && it->second == want) return Since(t0);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return -1;
}

TEST_CASE("cluster rig: three sanlock hosts join a lockspace and see a killed host die",
          "[.][cluster-rig-death]") {
  const auto test_start = Clock::now();
  const std::string sanlock = RequireProgram("sanlock");
  ClusterRig rig(3);
  std::printf("[cluster-rig] rig (tgtd + 3 sanlock daemons) up in %.2f s; LUN %s served at %s\n",
              Since(test_start), rig.lun_path().c_str(), rig.url().c_str());
  for (int i = 1; i <= 3; ++i) {
    REQUIRE(rig.host(i).pid() > 0);
    ProcessResult status = rig.SanlockClient(i, {"status"});
    INFO(DescribeRun({"sanlock", "client", "status"}, status));
    REQUIRE(status.exit_code == 0);
    REQUIRE(status.out.find("daemon host" + std::to_string(i)) != std::string::npos);
  }

  InitLeaseArea(rig);
  const std::vector<std::string> read_res = {sanlock, "direct", "read_leader", "-r",
                                             rig.ResourceSpec(kLockspace, "res0", kResourceOffset)};
  ProcessResult r = RunProcess(read_res, 30);
  INFO(DescribeRun(read_res, r));
  REQUIRE(r.exit_code == 0);
  REQUIRE(r.out.find("resource_name res0") != std::string::npos);
  REQUIRE(r.out.find("sector_size 4096") != std::string::npos);

  // All three join at once (each join takes 2 io_timeouts + ~1 s).
  const auto join_start = Clock::now();
  std::vector<ProcessResult> joins(3);
  std::vector<std::vector<std::string>> join_args(3);
  {
    std::vector<std::thread> threads;
    for (int i = 1; i <= 3; ++i) {
      join_args[i - 1] = {"add_lockspace", "-s",
                          rig.LockspaceSpec(kLockspace, static_cast<uint64_t>(i), kLockspaceOffset),
                          "-o", std::to_string(kIoTimeout)};
      threads.emplace_back([&, i] { joins[i - 1] = rig.SanlockClient(i, join_args[i - 1], 60); });
    }
    for (auto& t : threads) t.join();
  }
  for (int i = 1; i <= 3; ++i) {
    INFO("host" << i << ": " << DescribeRun(join_args[i - 1], joins[i - 1]) << "\ndaemon log:\n"
                << rig.host(i).LogTail());
    REQUIRE(joins[i - 1].exit_code == 0);
  }
  const double joined_s = Since(join_start);
  std::printf("[cluster-rig] 3 hosts joined (add_lockspace, io_timeout %d) in %.2f s\n", kIoTimeout,
              joined_s);
  CHECK(joined_s < 10);

  // Every host sees all three LIVE (once it has watched each renew).
  const auto live_start = Clock::now();
  for (int i = 1; i <= 3; ++i) {
    std::map<uint64_t, std::string> states;
    while (Since(live_start) < 20) {
      states = HostStates(rig.host(i), kLockspace);
      if (AllLive(states, 3)) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    INFO("host" << i << " sees " << Describe(states) << "\ndaemon log:\n" << rig.host(i).LogTail());
    REQUIRE(AllLive(states, 3));
  }
  std::printf("[cluster-rig] all hosts LIVE to each other %.2f s after joining\n",
              Since(live_start));

  // host3 crashes. Measured on the project's machines: FAIL 8.6-10.6 s,
  // DEAD 68.6-70.6 s after the kill (8 x io_timeout + 60 s after host1
  // last saw host3's timestamp change; it looks every 2 io_timeouts).
  rig.host(3).Kill();
  const auto kill_time = Clock::now();
  std::string last;
  const double fail_s = WaitForState(rig, 1, 3, "FAIL", kill_time, 15, &last);
  INFO("host1 sees " << last << "\nhost1 log:\n" << rig.host(1).LogTail());
  REQUIRE(fail_s >= 0);
  std::printf("[cluster-rig] host1 sees host3 FAIL %.2f s after SIGKILL\n", fail_s);
  CHECK(fail_s >= 8 * kIoTimeout - 2);

  const double dead_s = WaitForState(rig, 1, 3, "DEAD", kill_time, 80, &last);
  INFO("host1 sees " << last << "\nhost1 log:\n" << rig.host(1).LogTail());
  REQUIRE(dead_s >= 0);
  std::printf("[cluster-rig] host1 sees host3 DEAD %.2f s after SIGKILL\n", dead_s);
  // Never before 8 io_timeouts + the 60 s fire timeout after the last
  // renewal (at most 2 io_timeouts before the kill): fencing relies on it.
  CHECK(dead_s >= 8 * kIoTimeout + 60 - 2 * kIoTimeout);

  // host2 agrees within a renewal or two (each daemon declares DEAD on its
  // own clock, after its own last look at host3's timestamp), and host1
  // and host2 are still LIVE.
  const double dead2_s = WaitForState(rig, 2, 3, "DEAD", kill_time, dead_s + 4 * kIoTimeout + 2,
                                      &last);
  INFO("host2 sees " << last << "\nhost2 log:\n" << rig.host(2).LogTail());
  REQUIRE(dead2_s >= 0);
  std::printf("[cluster-rig] host2 sees host3 DEAD %.2f s after SIGKILL\n", dead2_s);
  CHECK(dead2_s >= 8 * kIoTimeout + 60 - 2 * kIoTimeout);
  auto states2 = HostStates(rig.host(2), kLockspace);
  INFO("host2 sees " << Describe(states2));
  CHECK(states2[3] == "DEAD");
  CHECK(states2[1] == "LIVE");
  CHECK(states2[2] == "LIVE");
  std::printf("[cluster-rig] whole test %.2f s\n", Since(test_start));
}

}  // namespace
}  // namespace dede::test

namespace dede::test {
namespace {

// A process of host 1 holding a shared resource lease: `sanlock client
// command` registers, acquires and then execs the command (same pid).
int StartLeaseHolder(ClusterRig& rig, const std::string& log) {
  return StartProcess({RequireProgram("sanlock"), "client", "command", "-r",
                       rig.ResourceSpec(kLockspace, "res0", kResourceOffset, /*shared=*/true), "-c",
                       "/bin/sleep", "600"},
                      rig.host(1).Env(), log);
}

// Waits until host 1's daemon logged that `pid`'s acquire succeeded
// ("cmd_acquire CI,FD,PID result 0"). Not `sanlock client status`: it lists
// the lease while the acquire is still running; and `sanlock client
// command` prints "acquire done 0" to a buffered stdout that exec discards.
bool WaitHeld(ClusterRig& rig, int pid, std::string* log) {
  const std::string done = "," + std::to_string(pid) + " result 0";
  const auto t0 = Clock::now();
  while (Since(t0) < 15) {
    *log = rig.host(1).Log();
    if (log->find(done) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// Waits (up to limit_s) for our child `pid` to end; returns the wait
// status, or -1 if it is still running.
int WaitChild(int pid, double limit_s) {
  const auto t0 = Clock::now();
  while (Since(t0) < limit_s) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) return status;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return -1;
}

struct ChildGuard {  // SIGKILLs and reaps a child the test did not see end
  int pid = -1;
  ~ChildGuard() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
};

TEST_CASE("cluster rig: sanlock fences the lease holders of a host that stops renewing",
          "[cluster-rig]") {
  const auto test_start = Clock::now();
  const std::string sanlock = RequireProgram("sanlock");
  // -g 0: no SIGTERM grace period, SIGKILL as soon as renewals have failed
  // for 8 io_timeouts.
  ClusterRig rig(1, 64ull << 20, {"-g", "0"});
  InitLeaseArea(rig);
  const std::vector<std::string> join = {"add_lockspace", "-s",
                                         rig.LockspaceSpec(kLockspace, 1, kLockspaceOffset), "-o",
                                         std::to_string(kIoTimeout)};
  ProcessResult r = rig.SanlockClient(1, join);
  INFO(DescribeRun(join, r) << "\ndaemon log:\n" << rig.host(1).LogTail());
  REQUIRE(r.exit_code == 0);

  // 1. The daemon hangs (SIGSTOP) for longer than 8 io_timeouts: when it
  //    runs again it finds its lease expired and SIGKILLs the holder.
  ChildGuard holder{StartLeaseHolder(rig, rig.dir().file("holder1.log"))};
  std::string daemon_log;
  bool held = WaitHeld(rig, holder.pid, &daemon_log);
  INFO("daemon log:\n" << rig.host(1).LogTail());
  REQUIRE(held);
  rig.host(1).Stop();
  std::this_thread::sleep_for(std::chrono::seconds(8 * kIoTimeout + 2));
  const auto cont = Clock::now();
  rig.host(1).Continue();
  int ws = WaitChild(holder.pid, 10);
  INFO("holder wait status " << ws << "\ndaemon log:\n" << rig.host(1).LogTail());
  REQUIRE(ws != -1);
  holder.pid = -1;
  std::printf("[cluster-rig] lease holder killed %.2f s after SIGCONT of its stopped daemon\n",
              Since(cont));
  CHECK(WIFSIGNALED(ws));
  CHECK(WTERMSIG(ws) == SIGKILL);
  CHECK(Since(cont) < 5);

  // The failed lockspace is gone from the daemon; re-joining with the same
  // host name is quick (sanlock's fast re-acquire).
  const auto gone_start = Clock::now();
  do {
    r = rig.SanlockClient(1, {"gets"});
    if (r.out.find(kLockspace + ":") == std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  } while (Since(gone_start) < 10);
  INFO("gets: " << r.out);
  REQUIRE(r.out.find(kLockspace + ":") == std::string::npos);
  r = rig.SanlockClient(1, join);
  INFO(DescribeRun(join, r) << "\ndaemon log:\n" << rig.host(1).LogTail());
  REQUIRE(r.exit_code == 0);

  // 2. rem_lockspace of a lockspace in use SIGKILLs its holders at once.
  ChildGuard holder2{StartLeaseHolder(rig, rig.dir().file("holder2.log"))};
  held = WaitHeld(rig, holder2.pid, &daemon_log);
  INFO("daemon log:\n" << rig.host(1).LogTail());
  REQUIRE(held);
  const auto rem = Clock::now();
  ChildGuard remover{StartProcess({sanlock, "client", "rem_lockspace", "-s",
                                   rig.LockspaceSpec(kLockspace, 1, kLockspaceOffset)},
                                  rig.host(1).Env(), rig.dir().file("rem.log"))};
  ws = WaitChild(holder2.pid, 10);
  const double killed_s = Since(rem);
  REQUIRE(ws != -1);
  holder2.pid = -1;
  std::printf("[cluster-rig] rem_lockspace killed the lease holder %.2f s after it started\n",
              killed_s);
  CHECK(WIFSIGNALED(ws));
  CHECK(WTERMSIG(ws) == SIGKILL);
  CHECK(killed_s < 2);
  ws = WaitChild(remover.pid, 30);
  REQUIRE(ws != -1);
  remover.pid = -1;
  std::printf("[cluster-rig] rem_lockspace returned after %.2f s\n", Since(rem));
  CHECK(WIFEXITED(ws));
  CHECK(WEXITSTATUS(ws) == 0);

  // The rig's own API: Kill() leaves neither the daemon nor its helper.
  const int daemon_pid = rig.host(1).pid();
  rig.host(1).Kill();
  CHECK(::kill(daemon_pid, 0) != 0);
  CHECK_FALSE(rig.host(1).Running());
  std::printf("[cluster-rig] fencing test %.2f s\n", Since(test_start));
}

TEST_CASE("cluster rig: a host in its own network namespace loses the LUN when cut off",
          "[cluster-rig]") {
  const auto test_start = Clock::now();
  std::string ns_name, mount_dir;
  {
    ClusterRig rig(2, 64ull << 20, {"-g", "0"}, "", {2});
    HostNetns* ns = rig.netns(2);
    REQUIRE(ns != nullptr);
    REQUIRE(rig.netns(1) == nullptr);
    ns_name = ns->name();
    mount_dir = rig.lease_path(2).substr(0, rig.lease_path(2).rfind('/'));
    InitLeaseArea(rig);

    // The bridge's file is the LUN: what one side writes, the other reads.
    std::vector<char> block(4096, 'n');
    int fd = ::open(rig.lease_path(2).c_str(), O_RDWR | O_DIRECT);
    REQUIRE(fd >= 0);
    void* aligned = nullptr;
    REQUIRE(::posix_memalign(&aligned, 4096, 4096) == 0);
    std::memcpy(aligned, block.data(), 4096);
    REQUIRE(::pwrite(fd, aligned, 4096, 32ll << 20) == 4096);
    {
      std::ifstream lun(rig.lun_path(), std::ios::binary);
      lun.seekg(32ll << 20);
      std::vector<char> back(4096);
      lun.read(back.data(), 4096);
      CHECK(back == block);
    }

    // Host 2 joins through its bridge (O_DIRECT + AIO over the veth), host
    // 1 through the file; each sees the other LIVE.
    for (int h : {1, 2}) {
      const std::string spec = kLockspace + ":" + std::to_string(h) + ":" + rig.lease_path(h) +
                               ":" + std::to_string(kLockspaceOffset);
      const std::vector<std::string> join = {"add_lockspace", "-s", spec, "-o",
                                             std::to_string(kIoTimeout)};
      ProcessResult r = rig.SanlockClient(h, join);
      INFO(DescribeRun(join, r) << "\ndaemon log:\n" << rig.host(h).LogTail());
      REQUIRE(r.exit_code == 0);
    }
    std::string states;
    double live = WaitForState(rig, 1, 2, "LIVE", Clock::now(), 20, &states);
    INFO("host 1 sees " << states);
    INFO("host 2 daemon log:\n" << rig.host(2).LogTail() << "\nbridge:\n" << ns->BridgeLog());
    REQUIRE(live >= 0);

    // The cut: the bridge's I/O fails (EIO) within its 3 s timeout (plus
    // the requests of host 2's daemon queued before ours) instead of
    // hanging, and host 2's renewals fail.
    const auto cut = Clock::now();
    ns->CutOff();
    CHECK(ns->cut());
    ssize_t n = ::pread(fd, aligned, 4096, 32ll << 20);
    const int err = errno;
    const double t_eio = Since(cut);
    CHECK(n == -1);
    CHECK(err == EIO);
    CHECK(t_eio < 15);
    bool renewal_failed = false;
    while (Since(cut) < 15 && !renewal_failed) {
      renewal_failed = rig.host(2).Log().find("renewal error") != std::string::npos;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    INFO("host 2 daemon log:\n" << rig.host(2).LogTail() << "\nbridge:\n" << ns->BridgeLog());
    CHECK(renewal_failed);
    // Back up: the bridge logs in again on the next request.
    ns->Reconnect();
    n = -1;
    const auto up = Clock::now();
    while (Since(up) < 20 && n != 4096) n = ::pread(fd, aligned, 4096, 32ll << 20);
    CHECK(n == 4096);
    CHECK(std::memcmp(aligned, block.data(), 4096) == 0);
    ::close(fd);
    std::free(aligned);
    std::printf("[cluster-rig] netns host: I/O failed %.2f s after the cut\n", t_eio);
  }
  // Nothing left behind: namespace and mount are gone.
  ProcessResult r = RunProcess({RequireProgram("ip"), "netns", "list"}, 30);
  CHECK(r.out.find(ns_name) == std::string::npos);
  std::ifstream mounts("/proc/self/mountinfo");
  std::stringstream all;
  all << mounts.rdbuf();
  CHECK(all.str().find(mount_dir) == std::string::npos);
  std::printf("[cluster-rig] netns test %.2f s\n", Since(test_start));
}

}  // namespace
}  // namespace dede::test
