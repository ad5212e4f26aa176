// The multi-host test cluster (issue 5): three simulated hosts on one LUN
// served by a real tgtd, the volume formatted with --locks sanlock, a
// sanlock daemon per host (ClusterRig) and a dedupd per host started on
// demand; VM disks written through NBD with qemu-img and qemu-io. Shared by
// multihost_test.cc and the multi-host benchmarks (multihost_bench_test.cc).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tests/integration/cluster_rig.h"
#include "tests/integration/rig.h"

namespace dede {
namespace test {
namespace multihost {

constexpr uint64_t kBlk = 4096;
constexpr int kHosts = 3;
using Clock = std::chrono::steady_clock;

inline double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A block whose content is named by `id` (0: zeros).
inline void FillBlock(uint64_t id, uint8_t* out) {
  if (id == 0) {
    std::memset(out, 0, kBlk);
    return;
  }
  uint64_t x = id * 0x9e3779b97f4a7c15ull;
  for (uint64_t i = 0; i < kBlk; i += 8) {
    x ^= x >> 29;
    x *= 0xbf58476d1ce4e5b9ull;
    std::memcpy(out + i, &x, 8);
  }
}

inline std::vector<uint8_t> Image(const std::vector<uint64_t>& ids) {
  std::vector<uint8_t> img(ids.size() * kBlk);
  for (size_t i = 0; i < ids.size(); i++) FillBlock(ids[i], img.data() + i * kBlk);
  return img;
}

inline void WriteFile(const std::string& path, const std::vector<uint8_t>& data) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  REQUIRE(f.good());
}

inline uint64_t CountMatches(const std::string& text, const std::regex& re, int group = 0) {
  uint64_t n = 0;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator();
       ++it) {
    n += group ? std::stoull((*it)[group]) : 1;
  }
  return n;
}

// Three hosts on one LUN, the volume formatted for sanlock, a dedupd per
// host started on demand. The hosts in `netns_hosts` live in their own
// network namespace (HostNetns, cluster_rig.h): their commands, sanlock
// daemon and dedupd run in it and reach the LUN over its veth, so that
// rig().netns(h)->CutOff() cuts them off for real.
class Cluster {
 public:
  // `daemon_args`: extra arguments of every host's `sanlock daemon`.
  explicit Cluster(uint64_t lun_bytes = 256ull << 20, const std::vector<int>& netns_hosts = {},
                   const std::vector<std::string>& daemon_args = {})
      : rig_(kHosts, lun_bytes, daemon_args, "", netns_hosts) {
    for (int h = 1; h <= kHosts; h++) d_.emplace_back();
    d_.emplace_back();
  }

  ClusterRig& rig() { return rig_; }

  std::vector<std::string> HostEnv(int h) const {
    std::vector<std::string> env = const_cast<ClusterRig&>(rig_).host(h).Env();
    env.push_back("DEDE_HOST_ID=" + std::to_string(h));
    env.push_back("DEDE_LEASE_PATH=" + rig_.lease_path(h));
    env.push_back("DEDE_LEASE_IO_TIMEOUT=1");
    return env;
  }

  // How host h reaches the LUN over iSCSI (VOL of its commands).
  std::string Url(int h) const { return rig_.url(h); }

  ProcessResult Dede(int h, const std::vector<std::string>& args, int timeout_s = 300) {
    std::vector<std::string> argv = rig_.Enter(h);
    argv.push_back(BinaryPath("dede"));
    argv.insert(argv.end(), args.begin(), args.end());
    return RunProcess(argv, HostEnv(h), timeout_s);
  }
  std::string DedeOk(int h, const std::vector<std::string>& args, int timeout_s = 300) {
    ProcessResult r = Dede(h, args, timeout_s);
    INFO("as host " << h << ": " << DescribeRun(args, r));
    REQUIRE(r.exit_code == 0);
    return r.out;
  }
  nlohmann::json Stats(int h) {
    return nlohmann::json::parse(DedeOk(h, {"stats", Url(h), "--json"}));
  }

  void Format() {
    DedeOk(1, {"format", rig_.url(), "--locks", "sanlock", "--lease-path", rig_.lun_path(),
               "--force"});
  }

  std::string Socket(int h) const { return rig_.dir().path() + "/nbd" + std::to_string(h); }

  DedupdProcess& Start(int h, const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = {"--lease-io-timeout", "1", "--merge-interval", "1",
                                     "--sync-interval", "0.5"};
    args.insert(args.end(), extra.begin(), extra.end());
    return StartWithArgs(h, args);
  }
  // Host h's dedupd with only --lease-path and `args` (no io_timeout of
  // its own: it joins with its sanlock daemon's).
  DedupdProcess& StartWithArgs(int h, const std::vector<std::string>& args) {
    std::vector<std::string> all = {"--lease-path", rig_.lease_path(h)};
    all.insert(all.end(), args.begin(), args.end());
    d_[h] = std::make_unique<DedupdProcess>(Url(h), h, Socket(h), all, HostEnv(h), rig_.Enter(h));
    return *d_[h];
  }
  // One after the other: a child of the rig is killed when the thread that
  // started it exits, so no helper threads here.
  void StartAll(const std::vector<std::string>& extra = {}) {
    for (int h = 1; h <= kHosts; h++) Start(h, extra);
  }
  DedupdProcess& dedupd(int h) { return *d_[h]; }
  bool Has(int h) const { return d_[h] != nullptr; }
  void Stop(int h) {
    int rc = d_[h]->Stop();
    INFO("dedupd of host " << h << " log:\n" << d_[h]->Log());
    REQUIRE(rc == 0);
  }
  std::string Uri(int h, const std::string& name) const {
    return "nbd+unix:///" + name + "?socket=" + Socket(h);
  }

  // Passes that ran to their end: dedupd logs "dedup pass N: ..." when the
  // pass itself returns, then sums up the volume for the pass history,
  // updates the counters `dede status` shows and logs the reference drops
  // as the very last thing. Counting the first line let a test read
  // `dede status` while the pass still showed as running (seen under load).
  static uint64_t PassesDone(const std::string& log) {
    static const std::regex re(R"(reference drops: \d+ deferred)");
    return CountMatches(log, re);
  }
  // SIGUSR1, then waits until dedupd logged one more finished pass.
  void Pass(int h) { PassTogether({h}); }
  // SIGUSR1 to every host of `hosts` at the same instant, then waits until
  // each has logged one more finished pass, within limit_s seconds.
  void PassTogether(const std::vector<int>& hosts, double limit_s = 180) {
    std::map<int, uint64_t> before;
    for (int h : hosts) before[h] = PassesDone(d_[h]->Log());
    for (int h : hosts) REQUIRE(::kill(d_[h]->pid(), SIGUSR1) == 0);
    auto t0 = Clock::now();
    for (int h : hosts) {
      while (PassesDone(d_[h]->Log()) <= before[h]) {
        const bool running = d_[h]->Running();
        if (!running || Since(t0) >= limit_s) {
          INFO("host " << h << " log:\n" << d_[h]->Log());
          INFO("sanlock of host " << h << ":\n" << rig_.host(h).LogTail(6000));
          REQUIRE(running);
          REQUIRE(Since(t0) < limit_s);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
  }

  void CreateAndWrite(int h, const std::string& name, const std::vector<uint8_t>& content) {
    DedeOk(h, {"create", Url(h), name, "--size", std::to_string(content.size())});
    const std::string img = rig_.dir().file(name + ".img");
    WriteFile(img, content);
    std::vector<std::string> argv = {RequireProgram("qemu-img"), "convert", "-n", "-f", "raw",
                                     "-O", "raw", img, Uri(h, name)};
    ProcessResult r = RunProcess(argv, 300);
    INFO(DescribeRun(argv, r));
    INFO("dedupd of host " << h << ":\n" << (d_[h] ? d_[h]->Log() : "(not running)"));
    REQUIRE(r.exit_code == 0);
  }

  // A client that keeps `name` open on host h (a running VM holds its
  // disk's lock) until PowerOff.
  void PowerOn(int h, const std::string& name) {
    const std::string log = rig_.dir().file("vm-" + name + ".log");
    const std::string opened = "export '" + name + "' opened";
    const uint64_t before = CountOf(d_[h]->Log(), opened);
    int pid = StartProcess({RequireProgram("qemu-io"), "-f", "raw", "-c", "read 0 4096", "-c",
                            "sleep 3600000", Uri(h, name)},
                           {}, log);
    vms_[name] = pid;
    auto t0 = Clock::now();
    while (CountOf(d_[h]->Log(), opened) <= before) {
      INFO(name << " on host " << h << ": " << ReadText(log) << "\n" << d_[h]->Log());
      int status = 0;
      REQUIRE(::waitpid(pid, &status, WNOHANG) == 0);
      REQUIRE(Since(t0) < 30);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  void PowerOff(const std::string& name) {
    auto it = vms_.find(name);
    REQUIRE(it != vms_.end());
    ::kill(it->second, SIGKILL);
    ::waitpid(it->second, nullptr, 0);
    vms_.erase(it);
  }
  static std::string ReadText(const std::string& path) {
    std::vector<uint8_t> b = ReadWholeFile(path);
    return std::string(b.begin(), b.end());
  }

  std::vector<uint8_t> ReadBack(int h, const std::string& name) {
    const std::string out = rig_.dir().file(name + ".back");
    ::unlink(out.c_str());
    std::vector<std::string> argv = {RequireProgram("qemu-img"), "convert", "-f", "raw", "-O",
                                     "raw", Uri(h, name), out};
    ProcessResult r = RunProcess(argv, 300);
    INFO(DescribeRun(argv, r));
    REQUIRE(r.exit_code == 0);
    return ReadWholeFile(out);
  }

  void FsckClean(int h) {
    ProcessResult r = Dede(h, {"fsck", Url(h)});
    INFO(DescribeRun({"fsck"}, r));
    REQUIRE(r.exit_code == 0);
    REQUIRE(r.out.find("clean") != std::string::npos);
  }

 private:
  ClusterRig rig_;
  std::vector<std::unique_ptr<DedupdProcess>> d_;
  std::map<std::string, int> vms_;  // name -> pid of the client holding it

 public:
  ~Cluster() {
    for (auto& [name, pid] : vms_) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
};

inline uint64_t LogSum(const std::string& log, const char* pattern) {
  return CountMatches(log, std::regex(pattern), 1);
}


// qemu-io rounds of pattern writes on one export; the model keeps, per
// block, every pattern it may hold: one after an acknowledged round, the
// old and new ones after a round that failed part-way.
struct PatternWriter {
  std::string name;
  std::vector<std::set<uint8_t>> may;  // per block
  std::mt19937_64 rng;
  Clock::time_point last_ack{};
  std::string last_failure;  // what the last failed round's qemu-io said

  PatternWriter(std::string n, uint64_t blocks, uint64_t seed)
      : name(std::move(n)), may(blocks, std::set<uint8_t>{0}), rng(seed) {}

  // Runs one round of `ops` writes (and verifying reads of exact blocks).
  bool Round(const std::string& uri, int ops) {
    std::vector<std::string> argv = {RequireProgram("qemu-io"), "-f", "raw"};
    std::vector<std::pair<uint64_t, uint8_t>> writes;
    for (int i = 0; i < ops; i++) {
      const uint64_t b = rng() % may.size();
      const uint64_t n = 1 + rng() % std::min<uint64_t>(8, may.size() - b);
      const uint8_t p = static_cast<uint8_t>(1 + rng() % 8);
      argv.insert(argv.end(), {"-c", "write -P " + std::to_string(p) + " " +
                                         std::to_string(b * kBlk) + " " +
                                         std::to_string(n * kBlk)});
      for (uint64_t k = b; k < b + n; k++) writes.push_back({k, p});
    }
    argv.push_back(uri);
    ProcessResult r = RunProcess(argv, 120);
    const bool ok = r.exit_code == 0 && r.err.find("error") == std::string::npos &&
                    r.out.find("failed") == std::string::npos;
    if (ok) {
      for (auto [k, p] : writes) may[k] = {p};
      last_ack = Clock::now();
    } else {
      for (auto [k, p] : writes) may[k].insert(p);
      auto tail = [](const std::string& t) {
        return t.size() > 600 ? "..." + t.substr(t.size() - 600) : t;
      };
      last_failure = name + ": qemu-io exit " + std::to_string(r.exit_code) +
                     (r.signal ? " signal " + std::to_string(r.signal) : "") + "; stderr: " + tail(r.err) +
                     "; stdout: " + tail(r.out);
    }
    return ok;
  }

  // Every block of `data` is uniform with a pattern the model allows.
  std::string Mismatch(const std::vector<uint8_t>& data) const {
    if (data.size() != may.size() * kBlk) return "size " + std::to_string(data.size());
    for (uint64_t b = 0; b < may.size(); b++) {
      const uint8_t* p = data.data() + b * kBlk;
      for (uint64_t i = 0; i < kBlk; i++) {
        if (p[i] != p[0]) return name + ": block " + std::to_string(b) + " is not uniform";
      }
      if (!may[b].count(p[0])) {
        return name + ": block " + std::to_string(b) + " holds pattern " + std::to_string(p[0]);
      }
    }
    return "";
  }
};


}  // namespace multihost
}  // namespace test
}  // namespace dede
