// Many hosts on one LUN (issue 5): three simulated hosts, each with its own
// sanlock daemon, local lock directory and dedupd, share one volume formatted
// with --locks sanlock on a LUN that a real tgtd serves over iSCSI (the
// daemons reach the lease area through the file backing the LUN, as a real
// host would through the LUN's block device; a host in its own network
// namespace through a dede-lun-fuse bridge over its veth instead, so that
// cutting the veth cuts it off). VM disks are written through each host's
// NBD exports with qemu-img and qemu-io.
#include "tests/integration/multihost_cluster.h"
#include "tests/random_bytes.h"
#include "volume/format.h"
#include "volume/lock_manager.h"

using namespace dede;
using namespace dede::test;
using namespace dede::test::multihost;

TEST_CASE("cross-host dedup reaches the exact figure through merge requests in any order",
          "[multihost]") {
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
      nlohmann::json waited;
      while (true) {
        waited = c.Stats(1);
        physical = waited["physical_data_blocks"].get<uint64_t>();
        if (physical == exact_blocks || Since(t0) > 60) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
      }
      std::string logs;
      for (int h = 1; h <= kHosts; h++) logs += c.dedupd(h).Log();
      const uint64_t posted = LogSum(logs, R"((\d+) merge requests posted)");
      const uint64_t posts_busy = LogSum(logs, R"(\((\d+) posts busy\))");
      const uint64_t applied_timer = LogSum(logs, R"(merge requests: (\d+) applied)");
      const uint64_t applied_pass = LogSum(logs, R"(posts busy\), (\d+) applied)");
      const uint64_t busy_targets = LogSum(logs, R"((\d+) records of files busy)");
      // First, so that a shortened report (CI keeps the start) still says
      // where the blocks went.
      INFO("after " << Since(t0) << " s: " << physical << " physical blocks of " << exact_blocks
                    << "; merge requests posted " << posted << " (" << posts_busy
                    << " posts busy), applied " << applied_timer << " on timers and "
                    << applied_pass << " by passes; " << busy_targets
                    << " records of files busy skipped");
      INFO("dede stats: " << waited.dump());
      std::string drops_now;
      for (int h = 1; h <= kHosts; h++) {
        drops_now += " host " + std::to_string(h) + " " +
                     nlohmann::json::parse(c.DedeOk(h, {"status", "--control",
                                                        c.dedupd(h).control(), "--json"}))["drops"]
                         .dump();
      }
      INFO("reference drops:" << drops_now);
      INFO(logs);
      CHECK(physical == exact_blocks);
      CHECK(posted > 0);
      CHECK(applied_timer + applied_pass > 0);
      CHECK(LogSum(logs, R"((\d+) failed verification)") == 0);

      // dede status and dede report of every host tell the same story as
      // the logs and the volume. One more pass on the last host, with the
      // cluster idle, records the volume's figures in its history.
      c.Pass(order[2]);
      const nlohmann::json stats = c.Stats(1);
      uint64_t posted_reported = 0, applied_reported = 0;
      for (int h = 1; h <= kHosts; h++) {
        const nlohmann::json st = nlohmann::json::parse(
            c.DedeOk(h, {"status", "--control", c.dedupd(h).control(), "--json"}));
        INFO("host " << h << " status " << st.dump());
        CHECK(st["host_id"] == h);
        CHECK(st["lock_backend"] == "sanlock");
        CHECK(st["passes"]["completed"] == (h == order[2] ? 2 : 1));
        CHECK(st["passes"]["failed"] == 0);
        CHECK_FALSE(st["leases"].empty());
        bool serves_own_vm = false;
        for (const auto& e : st["exports"]) {
          if (e["name"] == "vm" + std::to_string(h) && e["clients"].get<int>() >= 1) {
            serves_own_vm = true;
          }
        }
        CHECK(serves_own_vm);
        const nlohmann::json rep = nlohmann::json::parse(
            c.DedeOk(h, {"report", "--history", c.dedupd(h).history(), "--json"}));
        INFO("host " << h << " report " << rep.dump());
        REQUIRE(rep["passes"].size() == (h == order[2] ? 2u : 1u));
        for (const auto& row : rep["passes"]) {
          CHECK(row["host_id"] == h);
          CHECK(row["trigger"] == "signal");
          CHECK(row["outcome"] == "completed");
          posted_reported += row["merge_requests_posted"].get<uint64_t>();
          applied_reported += row["merge_requests_applied"].get<uint64_t>();
        }
        CHECK(st["passes"]["merge_requests_applied"].get<uint64_t>() >=
              rep["passes"][0]["merge_requests_applied"].get<uint64_t>());
        if (h == order[2]) {
          // Taken right after that pass, with nothing else changing the
          // volume: exactly what dede stats says now.
          const nlohmann::json& last = rep["passes"].back();
          CHECK(last["volume_logical_bytes"] == stats["logical_bytes"]);
          CHECK(last["volume_physical_bytes"] == stats["physical_bytes"]);
          CHECK(last["volume_saved_bytes"] == stats["saved_bytes"]);
          CHECK(last["volume_physical_bytes"].get<uint64_t>() == exact_blocks * kBlk);
        }
      }
      const std::string logs_now = [&] {
        std::string all;
        for (int h = 1; h <= kHosts; h++) all += c.dedupd(h).Log();
        return all;
      }();
      CHECK(posted_reported == LogSum(logs_now, R"((\d+) merge requests posted)"));
      CHECK(applied_reported == LogSum(logs_now, R"(posts busy\), (\d+) applied)"));

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
      nlohmann::json end = c.Stats(order[1]);
      CHECK(end["physical_data_blocks"].get<uint64_t>() == exact_blocks);
      CHECK(end["pending_drops"].get<uint64_t>() == 0);  // every deferred drop applied
    }
  }
}

TEST_CASE("all hosts write and dedup at once and no byte is wrong", "[multihost]") {
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
  // One thread per host, alternating its two VMs, for a minute (about 30
  // passes per host); the dedupds pass every 2 s and apply each other's
  // merge requests.
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
    // What the client saw first: CI keeps only the output's tail.
    INFO("host " << h << " VMs' last failed rounds: " << writers[(h - 1) * 2]->last_failure
                 << " | " << writers[(h - 1) * 2 + 1]->last_failure);
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
  // References given up while another host held the group were deferred,
  // not waited for; with the hosts idle, each applies its own at its flush
  // points (asking the holders for the groups) until none is left.
  auto t1 = Clock::now();
  uint64_t pending = 0;
  do {
    if (Since(t1) > 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    pending = c.Stats(1)["pending_drops"].get<uint64_t>();
  } while (pending > 0 && Since(t1) < 30);
  CHECK(pending == 0);
  // How often that happened (each pass logs the host's counters since its
  // start: the last pass's line of each host).
  uint64_t deferred = 0, applied = 0;
  for (int h = 1; h <= kHosts; h++) {
    const std::string log = c.dedupd(h).Log();
    const size_t at = log.rfind("reference drops: ");
    REQUIRE(at != std::string::npos);
    deferred += LogSum(log.substr(at), R"(reference drops: (\d+) deferred)");
    applied += LogSum(log.substr(at), R"((\d+) applied, \d+ pending)");
  }
  std::printf("multihost soak: %llu reference drops deferred (group held by another host), "
              "%llu applied\n",
              static_cast<unsigned long long>(deferred), static_cast<unsigned long long>(applied));
  // Increments are not waited for either (LOCKING "Increments without
  // waiting"): records parked and merge requests held back for that.
  std::string all_logs;
  for (int h = 1; h <= kHosts; h++) all_logs += c.dedupd(h).Log();
  std::printf("multihost soak: %llu records parked, %llu merge requests held back (allocation "
              "group held by another host)\n",
              static_cast<unsigned long long>(
                  LogSum(all_logs, R"((\d+) records parked \(allocation group busy)")),
              static_cast<unsigned long long>(
                  LogSum(all_logs, R"((\d+) held back \(allocation group busy)")));
  for (int h = 1; h <= kHosts; h++) c.Stop(h);
  c.FsckClean(1);
}

TEST_CASE("a killed host and a fenced host lose no acknowledged data", "[multihost]") {
  // Host 3 lives in its own network namespace (cluster_rig.h, HostNetns):
  // its sanlock daemon reaches the lease area through a dede-lun-fuse
  // bridge and its dedupd the LUN through libiscsi, both over one veth.
  Cluster c(256ull << 20, {3});
  c.Format();
  c.StartAll({"--fence-after", "10"});
  const uint64_t kBlocks = 1024;
  // Host 2: a VM with plenty of logged data, so that its pass takes a while.
  std::vector<uint64_t> ids;
  for (uint64_t i = 0; i < 8 * kBlocks; i++) ids.push_back(1 + i % 3000);
  const std::vector<uint8_t> big = Image(ids);
  c.CreateAndWrite(2, "big2", big);
  for (int h : {2, 3}) {
    c.DedeOk(h, {"create", c.Url(h), "vm" + std::to_string(h), "--size",
                 std::to_string(kBlocks * kBlk)});
  }
  PatternWriter w2("vm2", kBlocks, 2), w3("vm3", kBlocks, 3);
  REQUIRE(w2.Round(c.Uri(2, "vm2"), 50));
  REQUIRE(w3.Round(c.Uri(3, "vm3"), 50));
  // The VMs run: their hosts hold the disks all along (the writers' rounds
  // join the export), so nobody may take them before their host is dead.
  c.PowerOn(2, "vm2");
  c.PowerOn(3, "vm3");

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
  // pass; host 3 is cut off from the network (its veth goes down): its
  // processes keep running, but its lease renewals and its dedupd's iSCSI
  // I/O no longer reach the LUN.
  const uint64_t passes_before = Cluster::PassesDone(c.dedupd(2).Log());
  REQUIRE(::kill(c.dedupd(2).pid(), SIGUSR1) == 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  const auto t_strike = Clock::now();
  c.dedupd(2).Kill();
  c.rig().host(2).Kill();
  c.rig().netns(3)->CutOff();
  const bool pass_finished = Cluster::PassesDone(c.dedupd(2).Log()) > passes_before;

  // Host 3 must be fenced long before others may take over: its sanlock
  // daemon SIGKILLs dedupd once renewals have failed for 8 io_timeouts, or
  // dedupd's LockspaceGuard exits (75, "FENCED") when it cannot confirm
  // the lease for --fence-after 10 s, whichever comes first.
  const int dedupd3_pid = c.dedupd(3).pid();
  double t_fenced = -1;
  while (Since(t_strike) < 60) {
    if (!c.dedupd(3).Running()) {
      t_fenced = Since(t_strike);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const int ws3 = c.dedupd(3).wait_status();
  const std::string sanlock3 = c.rig().host(3).Log();
  const bool self_fenced = ws3 != -1 && WIFEXITED(ws3) && WEXITSTATUS(ws3) == 75 &&
                           c.dedupd(3).Log().find("FENCED") != std::string::npos;
  const bool killed_by_sanlock =
      ws3 != -1 && WIFSIGNALED(ws3) && WTERMSIG(ws3) == SIGKILL &&
      sanlock3.find("kill " + std::to_string(dedupd3_pid) + " sig 9") != std::string::npos;
  INFO("host 3 log:\n" << c.dedupd(3).Log());
  INFO("sanlock of host 3:\n" << c.rig().host(3).LogTail(4000));
  INFO("host 3's LUN bridge:\n" << c.rig().netns(3)->BridgeLog());
  INFO("dedupd of host 3 wait status " << ws3);
  REQUIRE(t_fenced > 0);
  CHECK((self_fenced || killed_by_sanlock));
  stop = true;
  t2.join();
  t3.join();
  const double last_ack3 = std::chrono::duration<double>(w3.last_ack - t_strike).count();

  // Host 1 takes over both hosts' VMs once sanlock declares them dead.
  std::string last_try;
  auto take_over = [&](const std::string& name) {
    while (Since(t_strike) < 200) {
      // dedupd itself retries a busy open for --open-wait (30 s).
      ProcessResult r =
          RunProcess({RequireProgram("qemu-io"), "-f", "raw", "-c", "read 0 4096", c.Uri(1, name)},
                     60);
      if (r.exit_code == 0 && r.err.empty()) return Since(t_strike);
      last_try = r.err;
      std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    return -1.0;
  };
  const double t_vm3 = take_over("vm3");
  const double t_vm2 = take_over("vm2");
  // big2 was held by host 2's pass when it died.
  const double t_big2 = take_over("big2");
  INFO("fenced (" << (self_fenced ? "FENCED exit 75" : "SIGKILL by sanlock") << ") after "
                   << t_fenced << " s, last ack on host 3 at " << last_ack3
                       << " s, vm3 taken over at " << t_vm3 << " s, vm2 at " << t_vm2
                       << " s; host 2's pass " << (pass_finished ? "had finished" : "was running"));
  INFO("last attempt: " << last_try);
  INFO("host 1 log:\n" << c.dedupd(1).Log());
  INFO("sanlock of host 1:\n" << c.rig().host(1).LogTail(4000));
  REQUIRE(t_vm3 > 0);
  REQUIRE(t_vm2 > 0);
  REQUIRE(t_big2 > 0);
  CHECK(t_fenced < t_vm3);
  CHECK(last_ack3 < t_vm3);
  std::printf("multihost failure: after host 3's network cut: host 3 fenced at %.1f s (%s), "
              "its last acknowledged write at %.1f s, vm3 taken over at %.1f s; vm2 (killed "
              "host) at %.1f s\n",
              t_fenced, self_fenced ? "FENCED exit 75" : "SIGKILL by its sanlock", last_ack3,
              t_vm3, t_vm2);

  // Acknowledged data intact on the host that took over.
  CHECK(w2.Mismatch(c.ReadBack(1, "vm2")) == "");
  CHECK(w3.Mismatch(c.ReadBack(1, "vm3")) == "");
  CHECK(c.ReadBack(1, "big2") == big);
  // Dedup completes there, consuming the dead hosts' logs.
  c.Pass(1);
  CHECK(c.dedupd(1).Log().find("dedup pass 1: ") != std::string::npos);
  CHECK(c.dedupd(1).Log().find("ERROR") == std::string::npos);
  c.Stop(1);
  // If fsck finds a leak: what every host did (fsck says what the block
  // holds: vm2/vm3 blocks repeat their pattern byte, big2's do not).
  INFO("host 1 log at the end:\n" << c.dedupd(1).Log());
  INFO("host 2 log (killed):\n" << c.dedupd(2).Log());
  INFO("host 3 log (fenced):\n" << c.dedupd(3).Log());
  c.FsckClean(1);
  // big2's 3000 distinct blocks, shared by host 1's pass (host 2's log).
  CHECK(c.Stats(1)["physical_data_blocks"].get<uint64_t>() < 3000 + 2 * kBlocks);
}

TEST_CASE("a host whose sanlock daemon hangs fences itself", "[multihost]") {
  // The LockspaceGuard's own path: the daemon that would SIGKILL dedupd is
  // itself hung (SIGSTOP), so nothing else stops dedupd; it must exit (75,
  // "FENCED") once its delta lease was last renewed --fence-after ago,
  // long before others may call the host dead (8 io_timeouts + 60 s after
  // that renewal). The network cut-off is the test above.
  Cluster c;
  c.Format();
  c.Start(1, {"--fence-after", "8"});  // io_timeout 1 s: the least dedupd takes (4 io + 4)
  c.DedeOk(1, {"create", c.Url(1), "vm1", "--size", "1M"});
  c.PowerOn(1, "vm1");
  const auto t_stop = Clock::now();
  c.rig().host(1).Stop();
  double t_fenced = -1;
  while (Since(t_stop) < 40) {
    if (!c.dedupd(1).Running()) {
      t_fenced = Since(t_stop);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  c.rig().host(1).Continue();
  const int ws = c.dedupd(1).wait_status();
  INFO("dedupd log:\n" << c.dedupd(1).Log() << "\nwait status " << ws);
  REQUIRE(t_fenced > 0);
  CHECK(WIFEXITED(ws));
  CHECK(WEXITSTATUS(ws) == 75);
  CHECK(c.dedupd(1).Log().find("FENCED") != std::string::npos);
  // The last renewal came before the stop, so the fence comes at most
  // --fence-after (8 s) after it, plus the guard's 0.2 s watch period. It
  // used to be timed from the last check that passed, which passes while
  // the lease is up to 4 io_timeouts old: at least 9 s here (renewals are
  // about 3 s apart), and with the default io_timeout (10 s) after others
  // could call the host dead.
  CHECK(t_fenced < 8.8);
  std::printf("multihost hung daemon: dedupd fenced itself %.1f s after its sanlock daemon "
              "stopped\n",
              t_fenced);
}

TEST_CASE("dedupd times its fence from the io_timeout its delta lease records", "[multihost]") {
  // Other hosts time a host's death from the io_timeout in its delta
  // lease, and a host's membership keeps the io_timeout of the process
  // that joined first: the lockspace stays joined when that process
  // exits. Here `dede create` joins with 1 s (DEDE_LEASE_IO_TIMEOUT, as in
  // every multihost test); dedupd, started after it without
  // --lease-io-timeout, used to assume sanlock's default 10 s: its default
  // fence came at 8 x 10 + 30 = 110 s after the last renewal, after
  // others could call the host dead (8 x 1 + 60 = 68 s).
  Cluster c;
  c.Format();
  c.DedeOk(1, {"create", c.Url(1), "vm1", "--size", "1M"});
  c.StartWithArgs(1, {});
  INFO("dedupd log:\n" << c.dedupd(1).Log());
  CHECK(c.dedupd(1).Log().find("fencing 38 s after the last lease renewal seen") !=
        std::string::npos);
  c.Stop(1);
  // Asking for another io_timeout changes nothing once joined: the lease's
  // is used, and the least --fence-after is 4 of them + 4 s (8 s here, 44 s
  // if it were 10).
  c.StartWithArgs(1, {"--lease-io-timeout", "10", "--fence-after", "8"});
  INFO("dedupd log (--lease-io-timeout 10 --fence-after 8):\n" << c.dedupd(1).Log());
  CHECK(c.dedupd(1).Log().find("fencing 8 s after the last lease renewal seen") !=
        std::string::npos);
  CHECK(c.dedupd(1).Log().find("runs with io_timeout 1 s") != std::string::npos);
  c.Stop(1);
}

namespace {

// Block `addr` of the file backing the LUN (what tgtd serves).
std::vector<uint8_t> LunBlock(Cluster& c, uint64_t addr) {
  std::vector<uint8_t> blk(kBlk);
  std::ifstream in(c.rig().lun_path(), std::ios::binary);
  in.seekg(std::streamoff(addr * kBlk));
  in.read(reinterpret_cast<char*>(blk.data()), kBlk);
  REQUIRE(in.good());
  return blk;
}

}  // namespace

TEST_CASE("fsck checks the sanlock lock table", "[multihost]") {
  Cluster c(4ull << 30);  // sparse; 4 GiB gives 64 lease slots, 62 partitions
  c.Format();
  c.DedeOk(1, {"create", c.rig().url(), "f", "--size", "1M"});
  c.FsckClean(2);

  // Damage one lock-table block on the LUN (the file tgtd serves).
  Result<Superblock> sb = DecodeSuperblock(LunBlock(c, 0).data(), 0);
  REQUIRE(sb.ok());
  const LeaseLayout layout = LeaseLayoutOf(*sb);
  REQUIRE(layout.partitions >= 12);
  auto overwrite = [&](uint64_t addr, uint8_t byte) {
    std::vector<uint8_t> blk(kBlk, byte);
    if (byte) std::memcpy(blk.data(), "DDLT", 4);  // right magic, wrong crc
    int fd = ::open(c.rig().lun_path().c_str(), O_WRONLY);
    REQUIRE(fd >= 0);
    REQUIRE(::pwrite(fd, blk.data(), kBlk, off_t(addr * kBlk)) == ssize_t(kBlk));
    REQUIRE(::fsync(fd) == 0);
    ::close(fd);
  };
  // A damaged block in a partition that holds one of fsck's own locks
  // stops fsck in the lock manager; in any other, fsck's scan reports it.
  // Either way fsck fails naming the block; the scan is seen at least once.
  int scanned = 0;
  for (uint32_t p = 0; p < 12; p++) {
    const uint64_t addr = layout.PartitionBlock(p, 1);
    overwrite(addr, 0x5a);
    ProcessResult r = c.Dede(1, {"fsck", c.rig().url()});
    const std::string said = r.out + r.err;
    INFO("partition " << p << ": " << said);
    CHECK(r.exit_code != 0);
    CHECK(said.find("lock table") != std::string::npos);
    CHECK(said.find("block " + std::to_string(addr)) != std::string::npos);
    if (said.find("lock table partition " + std::to_string(p)) != std::string::npos) scanned++;
    overwrite(addr, 0);  // an all-zero block is an empty one (what format writes)
  }
  CHECK(scanned > 0);
  c.FsckClean(1);

  // ---- fsck --repair rewrites a damaged block, but only once no other
  // process anywhere can hold a lock recorded in it (LOCKING.md,
  // "Repairing the lock table").
  // The partition of lock (kind, id) (FORMAT.md 1.1.1: splitmix64).
  auto partition_of = [&](uint16_t kind, uint64_t id) {
    uint64_t x = (uint64_t{kind} << 56) ^ id;
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return static_cast<uint32_t>((x ^ (x >> 31)) % layout.partitions);
  };
  auto damaged = [&](uint64_t addr) {
    return !DecodeLockTableBlock(LunBlock(c, addr).data(), addr, sb->uuid).ok();
  };
  auto t_repair = Clock::now();
  // Host 2's dedupd (idle) has the volume open and holds its host slot.
  c.Start(2);
  // Damage the partition of the inode lock the next `dede create` takes
  // (the smallest inode number not in use), unless fsck needs that
  // partition for its own locks (it then stops before its scan): create a
  // file to move on to the next inode number.
  uint64_t probe_ino = 0;
  uint64_t addr = 0;
  for (int attempt = 0; attempt < 8 && probe_ino == 0; attempt++) {
    std::set<uint64_t> inos;
    for (const auto& f : nlohmann::json::parse(c.DedeOk(1, {"ls", c.Url(1), "--all", "--json"}))) {
      inos.insert(f["ino"].get<uint64_t>());
    }
    uint64_t ino = 1;
    while (inos.count(ino)) ino++;
    const uint32_t p = partition_of(4 /* LockKind::kInode */, ino);
    addr = layout.PartitionBlock(p, 1);
    overwrite(addr, 0x5a);
    ProcessResult r = c.Dede(1, {"fsck", c.rig().url(), "--repair"});
    const std::string said = r.out + r.err;
    INFO("inode " << ino << ", partition " << p << ": " << said);
    if (said.find("lock table partition " + std::to_string(p) + " block " +
                  std::to_string(addr)) == std::string::npos) {
      overwrite(addr, 0);
      c.DedeOk(1, {"create", c.Url(1), "filler" + std::to_string(attempt), "--size", "4096"});
      continue;
    }
    // (a) refused while host 2 has the volume open: the block stays damaged.
    CHECK(r.exit_code != 0);
    CHECK(said.find("not repaired") != std::string::npos);
    CHECK(said.find("stop dedupd on every other host") != std::string::npos);
    CHECK(said.find("[repaired]") == std::string::npos);
    CHECK(damaged(addr));
    // The lock is in that partition: taking it fails.
    ProcessResult cr = c.Dede(1, {"create", c.Url(1), "probe", "--size", "4096"});
    INFO("create: " << cr.out << cr.err);
    CHECK(cr.exit_code != 0);
    CHECK((cr.out + cr.err).find("lock table") != std::string::npos);
    probe_ino = ino;
  }
  REQUIRE(probe_ino != 0);
  {
    int rc = c.dedupd(2).Stop();
    INFO("dedupd of host 2 log:\n" << c.dedupd(2).Log());
    CHECK(rc == 0);
  }
  // (b) nobody else has the volume open: repaired, and the lock is usable.
  {
    ProcessResult r = c.Dede(1, {"fsck", c.rig().url(), "--repair"});
    const std::string said = r.out + r.err;
    INFO(said);
    CHECK(r.exit_code == 0);
    CHECK(said.find("block " + std::to_string(addr) + ": ") != std::string::npos);
    CHECK(said.find("[repaired]") != std::string::npos);
    CHECK(!damaged(addr));
  }
  c.FsckClean(1);
  c.DedeOk(1, {"create", c.Url(1), "probe", "--size", "4096"});
  c.FsckClean(2);
  std::printf("multihost fsck --repair of a lock-table block: %.1f s\n", Since(t_repair));
}

namespace {

// Every record of the sanlock lock table, read from the file backing the
// LUN (what `ListRecords` sees, without a lock manager of our own).
std::vector<LockRecord> LockTableOf(Cluster& c) {
  Result<Superblock> sb = DecodeSuperblock(LunBlock(c, 0).data(), 0);
  REQUIRE(sb.ok());
  const LeaseLayout layout = LeaseLayoutOf(*sb);
  std::vector<LockRecord> all;
  for (uint32_t p = 0; p < layout.partitions; p++) {
    for (uint32_t k = 0; k < kLockTableBlocksPerPartition; k++) {
      const uint64_t addr = layout.PartitionBlock(p, k);
      Result<std::vector<LockRecord>> recs =
          DecodeLockTableBlock(LunBlock(c, addr).data(), addr, sb->uuid);
      if (!recs.ok()) continue;  // mid-rewrite: the caller polls again
      all.insert(all.end(), recs->begin(), recs->end());
    }
  }
  return all;
}

}  // namespace

TEST_CASE("a dede command killed on a live host leaves its locks marked dead, not erased",
          "[multihost]") {
  // A `dede` process killed while its journal still holds committed
  // changes (a group's reference counts, say) leaves its lock records; the
  // host's dedupd collects them. Erased, another host took such a group as
  // if it had been released cleanly: it replaced no dead holder's record,
  // so it skipped the dead-host scan and read stale home blocks, and a
  // later scan replayed the dead journal over its changes. Marked dead
  // (generation 0), every host takes them over as a dead holder's and
  // replays the journal first.
  Cluster c(512ull << 20);
  c.Format();
  c.Start(1);
  // A long import on host 1, killed once it holds a host slot of its own.
  std::vector<uint8_t> image(192ull << 20);
  std::mt19937_64 rng(33);
  dede::test::FillRandom(rng, image.data(), image.size());
  const std::string img = c.rig().dir().file("big.img");
  WriteFile(img, image);
  image.clear();
  std::vector<std::string> argv = c.rig().Enter(1);
  argv.insert(argv.end(), {BinaryPath("dede"), "import", c.Url(1), "big", img});
  const std::string import_log = c.rig().dir().file("import.log");
  const int import = StartProcess(argv, c.HostEnv(1), import_log);
  uint64_t dedupd_slot = 1;  // the import's is any other
  auto slot_records = [&](uint64_t generation) {
    std::set<uint64_t> slots;
    for (const LockRecord& r : LockTableOf(c)) {
      if (r.host == 1 && r.kind == static_cast<uint16_t>(LockKind::kHostSlot) &&
          r.id != dedupd_slot &&
          (generation == ~uint64_t{0} ? r.generation != kDeadProcessGeneration
                                      : r.generation == generation)) {
        slots.insert(r.id);
      }
    }
    return slots;
  };
  // Host 1's allocation-group records (dedupd, idle, holds none).
  auto group_records = [&](bool marked) {
    size_t n = 0;
    for (const LockRecord& r : LockTableOf(c)) {
      n += r.host == 1 && r.kind == static_cast<uint16_t>(LockKind::kGroup) &&
           (r.generation == kDeadProcessGeneration) == marked;
    }
    return n;
  };
  // Killed once it holds its slot and allocation groups: writing, with
  // committed transactions in its journal.
  std::set<uint64_t> taken;
  const auto t0 = Clock::now();
  while ((taken.empty() || group_records(false) == 0) && Since(t0) < 60) {
    taken = slot_records(~uint64_t{0});
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const std::vector<uint8_t> import_said = ReadWholeFile(import_log);
  INFO("import log:\n" << std::string(import_said.begin(), import_said.end()));
  REQUIRE(taken.size() == 1);
  REQUIRE(group_records(false) > 0);
  REQUIRE(::kill(import, SIGKILL) == 0);
  int status = 0;
  REQUIRE(::waitpid(import, &status, 0) == import);
  REQUIRE(WIFSIGNALED(status));  // killed mid-import, not finished
  // dedupd collects them within its 10 s round.
  while (Since(t0) < 90 &&
         c.dedupd(1).Log().find("lock records of dead processes") == std::string::npos) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  INFO("dedupd 1 log:\n" << c.dedupd(1).Log());
  REQUIRE(c.dedupd(1).Log().find("lock records of dead processes") != std::string::npos);
  std::set<uint64_t> marked;
  // (a busy partition waits for the next 10 s round)
  size_t groups_marked = 0;
  for (int i = 0; i < 300 && (marked.empty() || groups_marked == 0); i++) {
    marked = slot_records(kDeadProcessGeneration);
    groups_marked = group_records(true);
    if (marked.empty() || groups_marked == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  CHECK(marked == taken);
  CHECK(slot_records(~uint64_t{0}).empty());
  CHECK(groups_marked > 0);  // its groups: marked too, not erased

  // On a host that runs only dede commands (no dedupd), the next command's
  // open marks them: they used to keep every other host out until a
  // dedupd of this host ran.
  c.Stop(1);
  dedupd_slot = 0;  // none now
  argv[argv.size() - 2] = "big2";
  const std::string second_log = c.rig().dir().file("import2.log");
  const int second = StartProcess(argv, c.HostEnv(1), second_log);
  taken.clear();
  const auto t1 = Clock::now();
  while ((taken.empty() || group_records(false) == 0) && Since(t1) < 60) {
    taken = slot_records(~uint64_t{0});
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const std::vector<uint8_t> second_said = ReadWholeFile(second_log);
  INFO("second import log:\n" << std::string(second_said.begin(), second_said.end()));
  REQUIRE(taken.size() == 1);
  REQUIRE(group_records(false) > 0);
  REQUIRE(::kill(second, SIGKILL) == 0);
  REQUIRE(::waitpid(second, &status, 0) == second);
  REQUIRE(WIFSIGNALED(status));
  CHECK_FALSE(slot_records(kDeadProcessGeneration).count(*taken.begin()));  // still live
  c.DedeOk(1, {"create", c.Url(1), "after-kill", "--size", "1M"});
  // (The command may take the dead process's slot over itself: then the
  // slot's record goes with the command's own exit.)
  CHECK(slot_records(~uint64_t{0}).empty());
  CHECK(group_records(false) == 0);
  CHECK(group_records(true) > 0);

  // Another host opens the volume: its dead-host scan replays the killed
  // processes' journals, and the volume checks clean.
  c.FsckClean(2);
}
