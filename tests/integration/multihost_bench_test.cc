// Multi-host benchmarks (issue 5; docs/BENCHMARKS.md "Many hosts on one
// LUN"), hidden from the suite ([.]) and run by tools/bench/run-multihost-bench.
// They use the test cluster (multihost_cluster.h): a real tgtd, a sanlock
// daemon and a dedupd per simulated host, all on one 2-core machine, so
// only ratios inside one run mean anything. Each result is printed as one
// line "BENCH-JSON {...}" for the script to collect.
//
//   1. A dedup pass over iSCSI with 1, 2 and 3 hosts passing at once: the
//      same VMs (written by all three hosts, overlapping contents) on a
//      fresh volume per run; wall time until physical usage reaches the
//      exact-dedup figure; the lock statistics the passes logged (lease
//      acquire latency) and the index's shards before and after (splits
//      under contention: the hosts' dedupds run with --split-after).
//   2. VM writes on host 1 (fio --ioengine=nbd, random 4 KiB, time-based)
//      while hosts 2 and 3 run passes, against the same with hosts 2 and 3
//      idle, alternating.
//
// Environment: DEDE_BENCH_VM_MIB (size of each VM, default 16),
// DEDE_BENCH_REPS (alternations of part 2 and runs of part 1 per host
// count, default 2), DEDE_BENCH_SECONDS (fio runtime per phase, default 8),
// DEDE_BENCH_SPLIT_AFTER (dedupd --split-after in seconds, default 0.25),
// DEDE_BENCH_ISCSI_SESSIONS (parts 1 and 2: a comma-separated list of
// dedupd --iscsi-sessions values to compare in the same run, e.g. "1,4";
// default: dedupd's own default, reported as 0).
#include <algorithm>
#include <map>
#include <cstdio>
#include <cstdlib>

#include "tests/integration/multihost_cluster.h"

using namespace dede;
using namespace dede::test;
using namespace dede::test::multihost;

namespace {

double EnvNumber(const char* name, double dflt) {
  const char* v = std::getenv(name);
  return v && *v ? std::atof(v) : dflt;
}

// DEDE_BENCH_ISCSI_SESSIONS as a list; {0} (dedupd's default) if unset.
std::vector<int> SessionCounts() {
  std::vector<int> out;
  const char* v = std::getenv("DEDE_BENCH_ISCSI_SESSIONS");
  std::string list = v ? v : "";
  for (size_t at = 0; at < list.size();) {
    size_t comma = list.find(',', at);
    if (comma == std::string::npos) comma = list.size();
    const std::string item = list.substr(at, comma - at);
    if (!item.empty()) {
      const bool digits = item.find_first_not_of("0123456789") == std::string::npos;
      const int n = digits && item.size() < 4 ? std::atoi(item.c_str()) : 0;
      if (n < 1) FAIL("DEDE_BENCH_ISCSI_SESSIONS: '" << item << "' is not a session count");
      out.push_back(n);
    }
    at = comma + 1;
  }
  if (out.empty()) out.push_back(0);
  return out;
}

// dedupd's arguments for `sessions` (0: its default).
std::vector<std::string> WithSessions(std::vector<std::string> args, int sessions) {
  if (sessions > 0) {
    args.push_back("--iscsi-sessions");
    args.push_back(std::to_string(sessions));
  }
  return args;
}

void Emit(const nlohmann::json& j) {
  std::printf("BENCH-JSON %s\n", j.dump().c_str());
  std::fflush(stdout);
}

// The lock statistics of the passes logged since `from` (dedupd's
// "dedup pass N locks: A acquired, M ms mean, R lease retries").
struct LockTotals {
  uint64_t acquired = 0;
  double acquire_ms = 0;  // sum
  uint64_t retries = 0;
  uint64_t splits = 0;
  uint64_t waits = 0;
  // Work held back or left for later rather than waited for (issue 5),
  // and the waits that remain (all threads of each dedupd, pass time only).
  uint64_t parked_busy = 0;
  uint64_t gc_checks_busy = 0;
  uint64_t merge_held_back = 0;
  uint64_t lock_waits = 0;
  double lock_wait_ms = 0;
  uint64_t splits_deferred = 0;  // put off: a group of the upper half's arena blocks was busy
  // The waits of 100 ms or more, by the kind of lock waited for (the
  // volume's "waited N ms for <lock>" lines): count and ms.
  std::map<std::string, std::pair<uint64_t, double>> long_waits;
};

void AddLockStats(const std::string& log, LockTotals* t) {
  static const std::regex locks(
      R"(locks: (\d+) acquired, ([0-9.e+-]+) ms mean, (\d+) lease\s+retries)");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), locks);
       it != std::sregex_iterator(); ++it) {
    const uint64_t n = std::stoull((*it)[1]);
    t->acquired += n;
    t->acquire_ms += double(n) * std::stod((*it)[2]);
    t->retries += std::stoull((*it)[3]);
  }
  t->splits += LogSum(log, R"(\((\d+) split,)");
  t->waits += LogSum(log, R"(split, (\d+) waits\))");
  t->parked_busy += LogSum(log, R"((\d+) records parked \(allocation group busy)");
  t->gc_checks_busy += LogSum(log, R"((\d+) garbage checks left for later)");
  t->merge_held_back += LogSum(log, R"((\d+) held back \(allocation group busy)");
  t->splits_deferred += LogSum(log, R"((\d+) splits deferred \(group busy\))");
  static const std::regex waited(
      R"(volume: waited (\d+) ms for (allocation group|namespace|inode|index shard|recovery))");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), waited);
       it != std::sregex_iterator(); ++it) {
    auto& [n, ms] = t->long_waits[(*it)[2]];
    n++;
    ms += std::stod((*it)[1]);
  }
  static const std::regex waits(
      R"(waits: (\d+) for locks held by other processes or hosts, ([0-9.e+-]+) ms in all)");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), waits);
       it != std::sregex_iterator(); ++it) {
    t->lock_waits += std::stoull((*it)[1]);
    t->lock_wait_ms += std::stod((*it)[2]);
  }
}

// What the passes held back or left for later instead of waiting for
// another host, and the waits that remain.
nlohmann::json HeldBackAndWaits(const LockTotals& t) {
  nlohmann::json long_waits = nlohmann::json::object();
  for (const auto& [lock, w] : t.long_waits) long_waits[lock] = {{"waits", w.first}, {"ms", w.second}};
  return {{"records_parked_busy", t.parked_busy},
          {"gc_checks_busy", t.gc_checks_busy},
          {"merge_requests_held_back", t.merge_held_back},
          {"splits_deferred_busy", t.splits_deferred},
          {"lock_waits", t.lock_waits},
          {"lock_wait_ms", t.lock_wait_ms},
          {"long_waits_by_lock", long_waits}};
}

// Index update concurrency: the spans during which passes held shard
// locks (dedupd's "dedup pass N shard updates: ... spans ms: a-b c-d ..."
// lines; wall clock, all hosts on this machine's clock). `at_once_mean` is
// the mean number of shard updates in progress while at least one was;
// `at_once_max` the most at any instant. With one shard both are at most
// 1 (its lock serialises the updates); more shards let them rise.
nlohmann::json UpdateConcurrency(const std::string& logs) {
  static const std::regex line(R"(shard updates: [0-9.e+-]+ s under shard locks, spans ms:([ 0-9-]*))");
  static const std::regex span(R"((\d+)-(\d+))");
  std::vector<std::pair<uint64_t, int>> edges;  // (ms, +1 start / -1 end)
  double sum_ms = 0;
  uint64_t spans = 0;
  for (auto it = std::sregex_iterator(logs.begin(), logs.end(), line);
       it != std::sregex_iterator(); ++it) {
    const std::string list = (*it)[1];
    for (auto s = std::sregex_iterator(list.begin(), list.end(), span);
         s != std::sregex_iterator(); ++s) {
      const uint64_t a = std::stoull((*s)[1]), b = std::stoull((*s)[2]);
      if (b <= a) continue;  // shorter than the log's 1 ms resolution
      edges.push_back({a, +1});
      edges.push_back({b, -1});
      sum_ms += double(b - a);
      spans++;
    }
  }
  // Ends before starts at the same instant: touching spans do not overlap.
  std::sort(edges.begin(), edges.end(), [](const auto& x, const auto& y) {
    return x.first != y.first ? x.first < y.first : x.second < y.second;
  });
  int now = 0, most = 0;
  uint64_t busy_ms = 0, last = 0;
  for (const auto& [t, d] : edges) {
    if (now > 0) busy_ms += t - last;
    now += d;
    most = std::max(most, now);
    last = t;
  }
  return {{"shard_updates", spans},
          {"shard_update_seconds", sum_ms / 1e3},
          {"index_busy_seconds", double(busy_ms) / 1e3},
          {"updates_at_once_mean", busy_ms ? sum_ms / double(busy_ms) : 0.0},
          {"updates_at_once_max", most}};
}

std::vector<uint64_t> VmIds(int h, int v, uint64_t blocks) {
  // Three quarters of every VM come from one pool shared by all (the OS
  // image), the rest is the VM's own.
  std::vector<uint64_t> ids(blocks);
  const uint64_t pool = blocks;
  for (uint64_t i = 0; i < blocks; i++) {
    ids[i] = (i % 4 != 3) ? 1 + (i * 7 + uint64_t(h) * 131 + uint64_t(v) * 17) % pool
                          : 1000000 * uint64_t(h) + 1000 * uint64_t(v) + i;
  }
  return ids;
}

}  // namespace

TEST_CASE("bench: dedup pass over iSCSI with 1, 2 and 3 hosts", "[.][bench-multihost]") {
  const uint64_t vm_blocks = uint64_t(EnvNumber("DEDE_BENCH_VM_MIB", 16) * 256);
  const int reps = int(EnvNumber("DEDE_BENCH_REPS", 2));
  const std::string split_after = std::to_string(EnvNumber("DEDE_BENCH_SPLIT_AFTER", 0.25));
  std::set<uint64_t> distinct;
  std::vector<std::vector<uint8_t>> images;
  for (int h = 1; h <= kHosts; h++) {
    for (int v = 0; v < 2; v++) {
      std::vector<uint64_t> ids = VmIds(h, v, vm_blocks);
      distinct.insert(ids.begin(), ids.end());
      images.push_back(Image(ids));
    }
  }
  const uint64_t exact = distinct.size();
  const double logical_mib = double(images.size() * vm_blocks) / 256;

  const std::vector<int> session_counts = SessionCounts();
  for (int rep = 0; rep < reps; rep++) {
    // 1, 2, 3 then 3, 2, 1: drift in the machine's load hits both ends;
    // the session counts alternate the same way inside each.
    std::vector<int> counts = rep % 2 ? std::vector<int>{3, 2, 1} : std::vector<int>{1, 2, 3};
    std::vector<int> sessions_order = session_counts;
    if (rep % 2) std::reverse(sessions_order.begin(), sessions_order.end());
    for (int k : counts) {
      for (int sessions : sessions_order) {
        Cluster c(1ull << 30);
        c.Format();
        c.StartAll(WithSessions({"--split-after", split_after, "--log-flush-interval", "3600"},
                                sessions));
        for (int h = 1; h <= kHosts; h++) {
          for (int v = 0; v < 2; v++) {
            c.CreateAndWrite(h, "vm" + std::to_string(h) + "-" + std::to_string(v),
                             images[size_t((h - 1) * 2 + v)]);
          }
        }
        const uint64_t shards_before = c.Stats(1)["index_shards"].get<uint64_t>();
        std::vector<size_t> log_from(kHosts + 1);
        for (int h = 1; h <= kHosts; h++) log_from[h] = c.dedupd(h).Log().size();

        // Rounds of k simultaneous passes until the exact figure.
        auto t0 = Clock::now();
        int rounds = 0;
        uint64_t physical = 0;
        while (rounds < 10) {
          rounds++;
          std::vector<int> passing;
          for (int h = 1; h <= k; h++) passing.push_back(h);
          c.PassTogether(passing, 900 - Since(t0));
          physical = c.Stats(1)["physical_data_blocks"].get<uint64_t>();
          if (physical == exact) break;
        }
        const double seconds = Since(t0);
        LockTotals locks;
        std::string logs;
        for (int h = 1; h <= kHosts; h++) {
          const std::string log = c.dedupd(h).Log().substr(log_from[h]);
          AddLockStats(log, &locks);
          logs += log;
        }
        INFO(logs);
        CHECK(physical == exact);
        CHECK(LogSum(logs, R"(dedup pass \d+: [^\n]*error)") == 0);
        const uint64_t shards_after = c.Stats(1)["index_shards"].get<uint64_t>();
        Emit({{"bench", "multihost_pass"},
              {"hosts_passing", k},
              {"iscsi_sessions", sessions},
              {"rep", rep},
              {"logical_mib", logical_mib},
              {"seconds", seconds},
              {"mib_per_s", logical_mib / seconds},
              {"rounds", rounds},
              {"physical_blocks", physical},
              {"exact_blocks", exact},
              {"lock_acquires", locks.acquired},
              {"lock_acquire_mean_ms", locks.acquired ? locks.acquire_ms / double(locks.acquired) : 0},
              {"lease_retries", locks.retries},
              {"shards_before", shards_before},
              {"shards_after", shards_after},
              {"shards_split", locks.splits},
              {"shard_waits", locks.waits},
              {"index_updates", UpdateConcurrency(logs)},
              {"held_back_and_waits", HeldBackAndWaits(locks)}});
        for (int h = 1; h <= kHosts; h++) c.Stop(h);
      }
    }
  }
}

TEST_CASE("bench: VM writes on one host while the others run dedup passes",
          "[.][bench-multihost]") {
  const uint64_t vm_blocks = uint64_t(EnvNumber("DEDE_BENCH_VM_MIB", 16) * 256);
  const int reps = int(EnvNumber("DEDE_BENCH_REPS", 2));
  const int seconds = int(EnvNumber("DEDE_BENCH_SECONDS", 8));
  const uint64_t target_mib = 64;
  // Each session count gets its own cluster; idle and passing phases
  // alternate inside it.
  for (int sessions : SessionCounts()) {
    Cluster c(1ull << 30);
    c.Format();
    c.StartAll(WithSessions({"--log-flush-interval", "3600"}, sessions));
    // Host 1's VM, allocated once and held open like a running VM.
    c.CreateAndWrite(1, "target", Image(std::vector<uint64_t>(target_mib * 256, 5)));
    c.PowerOn(1, "target");
    const std::string fio = RequireProgram("fio");

    uint64_t generation = 0;
    for (int rep = 0; rep < reps; rep++) {
      for (bool passes : {false, true}) {
        std::vector<uint64_t> passes_before(kHosts + 1);
        if (passes) {
          // Fresh data on hosts 2 and 3 so their passes have work, then passes
          // back to back for the whole phase.
          for (int h = 2; h <= kHosts; h++) {
            generation++;
            const std::string name = "load" + std::to_string(h) + "-" + std::to_string(generation);
            std::vector<uint64_t> ids = VmIds(h, int(generation), vm_blocks);
            for (uint64_t& id : ids) id += generation * 10000000;
            c.CreateAndWrite(h, name, Image(ids));
            passes_before[h] = Cluster::PassesDone(c.dedupd(h).Log());
          }
        }
        std::atomic<bool> stop{false};
        std::atomic<int> passes_run{0};
        // Passes each host was asked for (a pass finishes before the next ask).
        std::vector<uint64_t> expect(kHosts + 1, 0);
        std::thread driver;
        if (passes) {
          // Not from a thread that starts children (they die with it): this
          // thread only signals.
          driver = std::thread([&] {
            std::vector<uint64_t> seen = passes_before;
            for (int h = 2; h <= kHosts; h++) {
              expect[h] = seen[h] + 1;
              ::kill(c.dedupd(h).pid(), SIGUSR1);
            }
            while (!stop) {
              for (int h = 2; h <= kHosts; h++) {
                const uint64_t now = Cluster::PassesDone(c.dedupd(h).Log());
                if (now > seen[h]) {
                  passes_run += int(now - seen[h]);
                  seen[h] = now;
                  expect[h] = now + 1;
                  ::kill(c.dedupd(h).pid(), SIGUSR1);
                }
              }
              std::this_thread::sleep_for(std::chrono::milliseconds(50));
            }
          });
        }
        // Host 1's waits for locks other hosts held (its VM's writes: groups
        // handed over to passes, the namespace), from its status.
        auto host1_waits = [&]() {
          return nlohmann::json::parse(c.DedeOk(1, {"status", "--control", c.dedupd(1).control(),
                                                    "--json"}))["lock_waits"];
        };
        const nlohmann::json waits_before = host1_waits();
        const std::string out = c.rig().dir().file("fio-" + std::to_string(rep) +
                                                   (passes ? "-passes" : "-idle") + ".json");
        std::vector<std::string> argv = {fio, "--name=vmwrite", "--ioengine=nbd",
                                         "--uri=" + c.Uri(1, "target"), "--rw=randwrite",
                                         "--bs=4k", "--iodepth=16", "--size=" +
                                         std::to_string(target_mib) + "M",
                                         "--time_based", "--runtime=" + std::to_string(seconds),
                                         "--randseed=" + std::to_string(rep + 1),
                                         "--output-format=json", "--output=" + out};
        ProcessResult r = RunProcess(argv, seconds + 120);
        stop = true;
        if (driver.joinable()) driver.join();
        // The last passes asked for finish before the next phase starts.
        for (int h = 2; h <= kHosts && passes; h++) {
          auto t0 = Clock::now();
          while (Cluster::PassesDone(c.dedupd(h).Log()) < expect[h]) {
            REQUIRE(Since(t0) < 600);
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
          }
        }
        INFO(DescribeRun(argv, r));
        REQUIRE(r.exit_code == 0);
        std::vector<uint8_t> raw = ReadWholeFile(out);
        nlohmann::json j = nlohmann::json::parse(std::string(raw.begin(), raw.end()));
        const double bw_kib = j["jobs"][0]["write"]["bw"].get<double>();
        const double iops = j["jobs"][0]["write"]["iops"].get<double>();
        if (passes) CHECK(passes_run > 0);
        const nlohmann::json waits_after = host1_waits();
        Emit({{"bench", "multihost_vm_writes"},
              {"iscsi_sessions", sessions},
              {"rep", rep},
              {"others_passing", passes},
              {"passes_finished_during", passes_run.load()},
              {"seconds", seconds},
              {"write_mib_per_s", bw_kib / 1024},
              {"write_iops", iops},
              {"host1_lock_waits",
               waits_after["waits"].get<uint64_t>() - waits_before["waits"].get<uint64_t>()},
              {"host1_lock_wait_s",
               waits_after["wait_s"].get<double>() - waits_before["wait_s"].get<double>()}});
      }
    }
    c.PowerOff("target");
    for (int h = 1; h <= kHosts; h++) c.Stop(h);
    c.FsckClean(1);
  }
}

TEST_CASE("bench: index shards split as hosts update the index at once", "[.][bench-multihost]") {
  const uint64_t vm_blocks = uint64_t(EnvNumber("DEDE_BENCH_VM_MIB", 16) * 256);
  const int rounds = int(EnvNumber("DEDE_BENCH_SPLIT_ROUNDS", 6));
  const std::string split_after = std::to_string(EnvNumber("DEDE_BENCH_SPLIT_AFTER", 0.25));
  Cluster c(2ull << 30);
  c.Format();
  c.StartAll({"--split-after", split_after, "--log-flush-interval", "3600"});
  std::set<uint64_t> distinct;
  std::vector<std::string> running;
  for (int round = 1; round <= rounds; round++) {
    // Every host brings a new VM (its own blocks plus the shared pool) and
    // keeps it running, as DeDe's hosts do: each host's pass merges the
    // logs of the VMs it holds, so all three update the index at once
    // (with the VMs off, the first pass to start would take every log and
    // the others would find nothing to do), and entries naming another
    // host's VM become merge requests.
    for (int h = 1; h <= kHosts; h++) {
      std::vector<uint64_t> ids = VmIds(h, 100 + round, vm_blocks);
      distinct.insert(ids.begin(), ids.end());
      const std::string name = "r" + std::to_string(round) + "-" + std::to_string(h);
      c.CreateAndWrite(h, name, Image(ids));
      c.PowerOn(h, name);
      running.push_back(name);
    }
    std::vector<size_t> from(kHosts + 1);
    for (int h = 1; h <= kHosts; h++) from[h] = c.dedupd(h).Log().size();
    const uint64_t shards_before = c.Stats(1)["index_shards"].get<uint64_t>();
    auto t0 = Clock::now();
    c.PassTogether({1, 2, 3}, 900);
    const double wall = Since(t0);
    LockTotals locks;
    double pass_seconds = 0;
    std::string logs;
    for (int h = 1; h <= kHosts; h++) {
      const std::string log = c.dedupd(h).Log().substr(from[h]);
      AddLockStats(log, &locks);
      static const std::regex took(R"(waits\) in ([0-9.e+-]+) s)");
      for (auto it = std::sregex_iterator(log.begin(), log.end(), took);
           it != std::sregex_iterator(); ++it) {
        pass_seconds += std::stod((*it)[1]);
      }
      logs += log;
    }
    INFO(logs);
    CHECK(LogSum(logs, R"(dedup pass \d+: [^\n]*error)") == 0);
    Emit({{"bench", "multihost_split"},
          {"round", round},
          {"shards_before", shards_before},
          {"shards_after", c.Stats(1)["index_shards"].get<uint64_t>()},
          {"shards_split", locks.splits},
          {"shard_waits", locks.waits},
          {"wall_seconds", wall},
          {"pass_seconds_sum", pass_seconds},
          // Passes in progress at once, on average over the round.
          {"pass_overlap", pass_seconds / wall},
          {"lock_acquire_mean_ms", locks.acquired ? locks.acquire_ms / double(locks.acquired) : 0},
          {"lease_retries", locks.retries},
          {"index_updates", UpdateConcurrency(logs)},
          {"held_back_and_waits", HeldBackAndWaits(locks)}});
  }
  for (const std::string& name : running) c.PowerOff(name);
  for (int h = 1; h <= kHosts; h++) c.Stop(h);
  c.FsckClean(1);
}
