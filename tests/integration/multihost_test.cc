// Many hosts on one LUN (issue 5): three simulated hosts, each with its own
// sanlock daemon, local lock directory and dedupd, share one volume formatted
// with --locks sanlock on a LUN that a real tgtd serves over iSCSI (the
// daemons reach the lease area through the file backing the LUN, as a real
// host would through the LUN's block device). VM disks are written through
// each host's NBD exports with qemu-img and qemu-io.
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

using namespace dede;
using namespace dede::test;

namespace {

constexpr uint64_t kBlk = 4096;
constexpr int kHosts = 3;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A block whose content is named by `id` (0: zeros).
void FillBlock(uint64_t id, uint8_t* out) {
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

std::vector<uint8_t> Image(const std::vector<uint64_t>& ids) {
  std::vector<uint8_t> img(ids.size() * kBlk);
  for (size_t i = 0; i < ids.size(); i++) FillBlock(ids[i], img.data() + i * kBlk);
  return img;
}

void WriteFile(const std::string& path, const std::vector<uint8_t>& data) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  REQUIRE(f.good());
}

uint64_t CountMatches(const std::string& text, const std::regex& re, int group = 0) {
  uint64_t n = 0;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator();
       ++it) {
    n += group ? std::stoull((*it)[group]) : 1;
  }
  return n;
}

// Three hosts on one LUN, the volume formatted for sanlock, a dedupd per
// host started on demand.
class Cluster {
 public:
  explicit Cluster(uint64_t lun_bytes = 256ull << 20) : rig_(kHosts, lun_bytes) {
    for (int h = 1; h <= kHosts; h++) d_.emplace_back();
    d_.emplace_back();
  }

  ClusterRig& rig() { return rig_; }

  std::vector<std::string> HostEnv(int h) const {
    std::vector<std::string> env = const_cast<ClusterRig&>(rig_).host(h).Env();
    env.push_back("DEDE_HOST_ID=" + std::to_string(h));
    env.push_back("DEDE_LEASE_PATH=" + rig_.lun_path());
    env.push_back("DEDE_LEASE_IO_TIMEOUT=1");
    env.push_back("DEDE_LOCK_DIR=" + rig_.dir().path() + "/locks" + std::to_string(h));
    return env;
  }

  ProcessResult Dede(int h, const std::vector<std::string>& args, int timeout_s = 300) {
    std::vector<std::string> argv = {BinaryPath("dede")};
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
    return nlohmann::json::parse(DedeOk(h, {"stats", rig_.url(), "--json"}));
  }

  void Format() {
    DedeOk(1, {"format", rig_.url(), "--locks", "sanlock", "--lease-path", rig_.lun_path(),
               "--force"});
  }

  std::string Socket(int h) const { return rig_.dir().path() + "/nbd" + std::to_string(h); }

  DedupdProcess& Start(int h, const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = {"--lease-path", rig_.lun_path(), "--lease-io-timeout", "1",
                                     "--merge-interval", "1", "--sync-interval", "0.5"};
    args.insert(args.end(), extra.begin(), extra.end());
    d_[h] = std::make_unique<DedupdProcess>(rig_.url(), h, Socket(h), args, HostEnv(h));
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

  static uint64_t PassesDone(const std::string& log) {
    static const std::regex re(R"(dedup pass \d+: )");
    return CountMatches(log, re);
  }
  // SIGUSR1, then waits until dedupd logged one more finished pass.
  void Pass(int h) {
    const uint64_t before = PassesDone(d_[h]->Log());
    REQUIRE(::kill(d_[h]->pid(), SIGUSR1) == 0);
    auto t0 = Clock::now();
    while (PassesDone(d_[h]->Log()) <= before) {
      INFO("host " << h << " log:\n" << d_[h]->Log());
      INFO("sanlock of host " << h << ":\n" << rig_.host(h).LogTail(6000));
      REQUIRE(d_[h]->Running());
      REQUIRE(Since(t0) < 180);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  void CreateAndWrite(int h, const std::string& name, const std::vector<uint8_t>& content) {
    DedeOk(h, {"create", rig_.url(), name, "--size", std::to_string(content.size())});
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
  static uint64_t CountOf(const std::string& text, const std::string& what) {
    uint64_t n = 0;
    for (size_t p = text.find(what); p != std::string::npos; p = text.find(what, p + 1)) n++;
    return n;
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
    ProcessResult r = Dede(h, {"fsck", rig_.url()});
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

uint64_t LogSum(const std::string& log, const char* pattern) {
  return CountMatches(log, std::regex(pattern), 1);
}

}  // namespace

TEST_CASE("cross-host dedup reaches the exact figure through merge requests in any order",
          "[.][multihost-cross]") {
  // Contents overlap across hosts: host 1 has ids 1..256, host 2 ids
  // 129..384, host 3 ids 1..64 and 300..491; every 16th block of every VM
  // is one common block (id 7777).
  std::vector<std::vector<uint64_t>> ids(kHosts + 1);
  auto add_range = [](std::vector<uint64_t>* v, uint64_t a, uint64_t b) {
    for (uint64_t i = a; i <= b; i++) v->push_back(i);
  };
  add_range(&ids[1], 1, 256);
  add_range(&ids[2], 129, 384);
  add_range(&ids[3], 1, 64);
  add_range(&ids[3], 300, 491);
  std::set<uint64_t> distinct;
  for (int h = 1; h <= kHosts; h++) {
    for (size_t i = 0; i < ids[h].size(); i += 16) ids[h][i] = 7777;
    distinct.insert(ids[h].begin(), ids[h].end());
  }
  const uint64_t exact_blocks = distinct.size();

  for (const std::vector<int>& order : {std::vector<int>{1, 2, 3}, std::vector<int>{3, 1, 2}}) {
    DYNAMIC_SECTION("pass order " << order[0] << order[1] << order[2]) {
      Cluster c;
      c.Format();
      c.StartAll();
      std::vector<std::vector<uint8_t>> images(kHosts + 1);
      for (int h = 1; h <= kHosts; h++) {
        images[h] = Image(ids[h]);
        c.CreateAndWrite(h, "vm" + std::to_string(h), images[h]);
        c.PowerOn(h, "vm" + std::to_string(h));  // the VM runs: its host holds the file
      }
      for (int h : order) c.Pass(h);

      // The hosts holding the indexed files apply the merge requests on
      // their timer (--merge-interval 1); wait for the exact figure.
      auto t0 = Clock::now();
      uint64_t physical = 0;
      while (true) {
        nlohmann::json s = c.Stats(1);
        physical = s["physical_data_blocks"].get<uint64_t>();
        if (physical == exact_blocks || Since(t0) > 60) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
      }
      std::string logs;
      for (int h = 1; h <= kHosts; h++) logs += c.dedupd(h).Log();
      INFO(logs);
      const uint64_t posted = LogSum(logs, R"((\d+) merge requests posted)");
      const uint64_t applied_timer = LogSum(logs, R"(merge requests: (\d+) applied)");
      const uint64_t applied_pass = LogSum(logs, R"(posts busy\), (\d+) applied)");
      CHECK(physical == exact_blocks);
      CHECK(posted > 0);
      CHECK(applied_timer + applied_pass > 0);
      CHECK(LogSum(logs, R"((\d+) failed verification)") == 0);

      // Every file reads back byte-exact on whichever host opens it later:
      // the VMs stop, host order[0] stops, the next host serves its file...
      for (int h = 1; h <= kHosts; h++) c.PowerOff("vm" + std::to_string(h));
      c.Stop(order[0]);
      CHECK(c.ReadBack(order[1], "vm" + std::to_string(order[0])) == images[order[0]]);
      c.Stop(order[1]);
      for (int h = 1; h <= kHosts; h++) {
        CHECK(c.ReadBack(order[2], "vm" + std::to_string(h)) == images[h]);
      }
      c.Stop(order[2]);
      c.FsckClean(order[0]);
      CHECK(c.Stats(order[1])["physical_data_blocks"].get<uint64_t>() == exact_blocks);
    }
  }
}

namespace {

// qemu-io rounds of pattern writes on one export; the model keeps, per
// block, every pattern it may hold: one after an acknowledged round, the
// old and new ones after a round that failed part-way.
struct PatternWriter {
  std::string name;
  std::vector<std::set<uint8_t>> may;  // per block
  std::mt19937_64 rng;
  Clock::time_point last_ack{};

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

}  // namespace

TEST_CASE("all hosts write and dedup at once and no byte is wrong", "[.][multihost-soak]") {
  Cluster c;
  c.Format();
  c.StartAll({"--dedup-interval", "2"});
  const uint64_t kBlocks = 512;  // 2 MiB per VM, two VMs per host
  std::vector<std::unique_ptr<PatternWriter>> writers;
  for (int h = 1; h <= kHosts; h++) {
    for (int v = 0; v < 2; v++) {
      const std::string name = "vm" + std::to_string(h) + "-" + std::to_string(v);
      c.DedeOk(h, {"create", c.rig().url(), name, "--size", std::to_string(kBlocks * kBlk)});
      writers.push_back(std::make_unique<PatternWriter>(name, kBlocks, 100 * h + v));
    }
  }
  // One thread per host, alternating its two VMs, for a minute; the
  // dedupds pass every 2 s and apply each other's merge requests.
  const double kSeconds = 60;
  std::vector<std::thread> threads;
  std::vector<int> failures(kHosts + 1, 0), rounds(kHosts + 1, 0);
  auto t0 = Clock::now();
  for (int h = 1; h <= kHosts; h++) {
    threads.emplace_back([&, h] {
      while (Since(t0) < kSeconds) {
        for (int v = 0; v < 2; v++) {
          PatternWriter& w = *writers[(h - 1) * 2 + v];
          if (!w.Round(c.Uri(h, w.name), 40)) failures[h]++;
          rounds[h]++;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int h = 1; h <= kHosts; h++) {
    INFO("host " << h << " log:\n" << c.dedupd(h).Log());
    CHECK(failures[h] == 0);
    CHECK(rounds[h] > 4);
    CHECK(c.dedupd(h).Running());
  }
  // A last pass everywhere, then every byte through NBD, on its own host.
  for (int h = 1; h <= kHosts; h++) c.Pass(h);
  std::string logs;
  for (int h = 1; h <= kHosts; h++) logs += c.dedupd(h).Log();
  INFO(logs);
  // Eight patterns: eight distinct contents, everything else shared again.
  CHECK(LogSum(logs, R"((\d+) new shared)") >= 1);
  CHECK(LogSum(logs, R"((\d+) shared again)") > 100);
  CHECK(LogSum(logs, R"(dedup pass \d+: [^\n]*error)") == 0);
  for (int h = 1; h <= kHosts; h++) {
    for (int v = 0; v < 2; v++) {
      PatternWriter& w = *writers[(h - 1) * 2 + v];
      CHECK(w.Mismatch(c.ReadBack(h, w.name)) == "");
    }
  }
  for (int h = 1; h <= kHosts; h++) c.Stop(h);
  c.FsckClean(1);
}

TEST_CASE("a killed host and a fenced host lose no acknowledged data", "[multihost]") {
  Cluster c;
  c.Format();
  c.StartAll({"--fence-after", "10"});
  const uint64_t kBlocks = 1024;
  // Host 2: a VM with plenty of logged data, so that its pass takes a while.
  std::vector<uint64_t> ids;
  for (uint64_t i = 0; i < 8 * kBlocks; i++) ids.push_back(1 + i % 3000);
  const std::vector<uint8_t> big = Image(ids);
  c.CreateAndWrite(2, "big2", big);
  for (int h : {2, 3}) {
    c.DedeOk(h, {"create", c.rig().url(), "vm" + std::to_string(h), "--size",
                 std::to_string(kBlocks * kBlk)});
  }
  PatternWriter w2("vm2", kBlocks, 2), w3("vm3", kBlocks, 3);
  REQUIRE(w2.Round(c.Uri(2, "vm2"), 50));
  REQUIRE(w3.Round(c.Uri(3, "vm3"), 50));

  // Writers keep going on hosts 2 and 3 while we strike.
  std::atomic<bool> stop{false};
  std::thread t2([&] {
    while (!stop && w2.Round(c.Uri(2, "vm2"), 20)) {
    }
  });
  std::thread t3([&] {
    while (!stop && w3.Round(c.Uri(3, "vm3"), 20)) {
    }
  });
  std::this_thread::sleep_for(std::chrono::seconds(2));

  // Host 2 dies (dedupd and sanlock daemon, SIGKILL) just after starting a
  // pass; host 3's sanlock daemon hangs (SIGSTOP): it renews nothing any
  // more, like a host cut off from the LUN, while its dedupd still has its
  // iSCSI path.
  const uint64_t passes_before = Cluster::PassesDone(c.dedupd(2).Log());
  REQUIRE(::kill(c.dedupd(2).pid(), SIGUSR1) == 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  const auto t_strike = Clock::now();
  c.dedupd(2).Kill();
  c.rig().host(2).Kill();
  c.rig().host(3).Stop();
  const bool pass_finished = Cluster::PassesDone(c.dedupd(2).Log()) > passes_before;

  // Host 3 must fence itself (exit 75) long before others may take over.
  double t_fenced = -1;
  while (Since(t_strike) < 60) {
    if (!c.dedupd(3).Running()) {
      t_fenced = Since(t_strike);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  INFO("host 3 log:\n" << c.dedupd(3).Log());
  REQUIRE(t_fenced > 0);
  CHECK(c.dedupd(3).Log().find("FENCED") != std::string::npos);
  stop = true;
  t2.join();
  t3.join();
  const double last_ack3 = std::chrono::duration<double>(w3.last_ack - t_strike).count();

  // Host 1 takes over both hosts' VMs once sanlock declares them dead.
  std::string last_try;
  auto take_over = [&](const std::string& name) {
    while (Since(t_strike) < 200) {
      ProcessResult r =
          RunProcess({RequireProgram("qemu-io"), "-f", "raw", "-c", "read 0 4096", c.Uri(1, name)},
                     30);
      if (r.exit_code == 0 && r.err.empty()) return Since(t_strike);
      last_try = r.err;
      std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    return -1.0;
  };
  const double t_vm3 = take_over("vm3");
  const double t_vm2 = take_over("vm2");
  INFO("fenced after " << t_fenced << " s, last ack on host 3 at " << last_ack3
                       << " s, vm3 taken over at " << t_vm3 << " s, vm2 at " << t_vm2
                       << " s; host 2's pass " << (pass_finished ? "had finished" : "was running"));
  INFO("last attempt: " << last_try);
  INFO("host 1 log:\n" << c.dedupd(1).Log());
  INFO("sanlock of host 1:\n" << c.rig().host(1).LogTail(4000));
  REQUIRE(t_vm3 > 0);
  REQUIRE(t_vm2 > 0);
  CHECK(t_fenced < t_vm3);
  CHECK(last_ack3 < t_vm3);
  std::printf("multihost failure: host 3 fenced %.1f s after its daemon hung; vm3 taken over "
              "at %.1f s, vm2 (killed host) at %.1f s\n",
              t_fenced, t_vm3, t_vm2);

  // Acknowledged data intact on the host that took over.
  CHECK(w2.Mismatch(c.ReadBack(1, "vm2")) == "");
  CHECK(w3.Mismatch(c.ReadBack(1, "vm3")) == "");
  CHECK(c.ReadBack(1, "big2") == big);
  // Dedup completes there, consuming the dead hosts' logs.
  c.Pass(1);
  CHECK(c.dedupd(1).Log().find("dedup pass 1: ") != std::string::npos);
  CHECK(c.dedupd(1).Log().find("ERROR") == std::string::npos);
  c.Stop(1);
  c.FsckClean(1);
  // big2's 3000 distinct blocks, shared by host 1's pass (host 2's log).
  CHECK(c.Stats(1)["physical_data_blocks"].get<uint64_t>() < 3000 + 2 * kBlocks);
}
