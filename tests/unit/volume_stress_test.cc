// Three hosts on one in-memory volume, all at once: every host writes and
// trims its VM files, appends to and removes a log file, shares its blocks
// through one arena file that the hosts take turns to hold (as dedup passes
// do under a shard lock), and reaches a flush point every few milliseconds
// (where it hands groups over to hosts waiting for them). Few allocation
// groups, so the hosts keep meeting in them: copy-on-write breaks, deferred
// drops, goal allocations that miss and allocations that wait all happen
// many times a second. At the end every byte must be what the model says
// and fsck must find every count equal to its references. This is the
// unit-level twin of the multihost soak test (tests/integration), which
// does the same through dedupd, NBD and sanlock and takes minutes per run.
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/fsck_problems.h"
#include "tests/temp_locks.h"
#include "util/fingerprint.h"
#include "volume/fsck.h"
#include "volume/lock_manager.h"
#include "volume/mem_device.h"
#include "volume/volume.h"

using namespace dede;

namespace {

constexpr uint64_t kB = kBlockSize;
constexpr int kHosts = 3;
constexpr uint64_t kVmBlocks = 256;
constexpr int kPatterns = 8;

std::vector<uint8_t> Filled(uint8_t p, uint64_t blocks) { return std::vector<uint8_t>(blocks * kB, p); }

// One host: its volume, its two VM files (shared by its writer and its
// pass thread) and the model of their contents.
struct Host {
  uint32_t id = 0;
  std::shared_ptr<LockManager> locks;
  std::unique_ptr<Volume> vol;
  std::unique_ptr<File> vm[2];
  std::vector<uint8_t> model[2];  // pattern per block (0: zeros); the writer's only
  std::mutex failures_mu;
  std::vector<std::string> failures;
  uint64_t writes = 0, trims = 0, appends = 0, removes = 0, shared = 0, arena_turns = 0;

  void Fail(const std::string& what, const Status& st) {
    std::lock_guard<std::mutex> l(failures_mu);
    if (failures.size() < 20) failures.push_back("host " + std::to_string(id) + ": " + what + ": " + st.ToString());
  }
};

}  // namespace

TEST_CASE("volume stress: three hosts write, share, log and remove at once and fsck stays clean",
          "[volume][stress]") {
  MemDevice dev(64 << 20);
  FormatOptions fo;
  fo.group_refblocks = 4;  // 4096-block groups: a handful, so hosts meet in them
  REQUIRE(FormatVolume(&dev, fo, false).ok());
  const std::vector<std::shared_ptr<LockManager>> host_locks = dede::test::TempLockGroup(kHosts);
  Host hosts[kHosts];
  for (int h = 0; h < kHosts; h++) {
    Host& host = hosts[h];
    host.id = static_cast<uint32_t>(h + 1);
    host.locks = host_locks[h];
    OpenOptions oo;
    oo.host_id = host.id;
    oo.locks = host.locks;
    auto v = Volume::Open(&dev, oo);
    INFO(v.status().ToString());
    REQUIRE(v.ok());
    host.vol = std::move(v.value());
    for (int k = 0; k < 2; k++) {
      const std::string name = "vm" + std::to_string(host.id) + "-" + std::to_string(k);
      REQUIRE(host.vol->Create(name, kVmBlocks * kB).ok());
      auto f = host.vol->OpenFile(name);
      REQUIRE(f.ok());
      host.vm[k] = std::move(f.value());
      host.model[k].assign(kVmBlocks, 0);
    }
  }
  REQUIRE(hosts[0].vol->Create("arena", 0).ok());
  Fingerprint witness[kPatterns + 1];
  for (int p = 1; p <= kPatterns; p++) {
    witness[p] = ComputeFingerprint(fo.hash_algo, Filled(static_cast<uint8_t>(p), 1).data(), kB);
  }

  // The flush threads outlive the others: a thread that began waiting for
  // a lock another host caches just before `stop` gets it only at that
  // host's next flush point (as in dedupd, whose flush timer runs until
  // its exports have drained). Stopping them together made such a wait
  // run out its 60 s and fail the test on a loaded machine.
  std::atomic<bool> stop{false}, stop_flushing{false};
  const auto t0 = std::chrono::steady_clock::now();
  const double kSeconds = 8;
  std::vector<std::thread> threads, flushers;
  for (int h = 0; h < kHosts; h++) {
    Host* host = &hosts[h];
    // The VM writer: 1-8 block writes of one pattern, now and then a trim.
    threads.emplace_back([host, &stop] {
      std::mt19937_64 rng(100 + host->id);
      while (!stop) {
        const int k = static_cast<int>(rng() % 2);
        const uint64_t b = rng() % kVmBlocks;
        const uint64_t n = 1 + rng() % std::min<uint64_t>(8, kVmBlocks - b);
        if (rng() % 16 == 0) {
          Status st = host->vm[k]->Trim(b * kB, n * kB);
          if (!st.ok()) return host->Fail("trim", st);
          for (uint64_t i = b; i < b + n; i++) host->model[k][i] = 0;
          host->trims++;
          continue;
        }
        const uint8_t p = static_cast<uint8_t>(1 + rng() % kPatterns);
        Status st = host->vm[k]->Write(b * kB, Filled(p, n).data(), n * kB);
        if (!st.ok()) return host->Fail("write", st);
        for (uint64_t i = b; i < b + n; i++) host->model[k][i] = p;
        host->writes++;
      }
    });
    // The write log: grows by appends, removed and created afresh now and
    // then (a pass consumed it).
    threads.emplace_back([host, &stop] {
      std::mt19937_64 rng(200 + host->id);
      const std::string name = "log" + std::to_string(host->id);
      while (!stop) {
        Status st = host->vol->Create(name, 0).status();
        if (!st.ok()) return host->Fail("create log", st);
        auto f = host->vol->OpenFile(name);
        if (!f.ok()) return host->Fail("open log", f.status());
        uint64_t size = 0;
        for (int a = 0; a < 40 && !stop; a++) {
          const uint64_t n = 1 + rng() % 16;
          st = f.value()->Truncate(size + n * kB);
          if (st.ok()) st = f.value()->Write(size, Filled(static_cast<uint8_t>(0x40 + a), n).data(), n * kB);
          if (!st.ok()) return host->Fail("append log", st);
          size += n * kB;
          host->appends++;
        }
        f.value().reset();
        st = host->vol->Remove(name);
        if (!st.ok()) return host->Fail("remove log", st);
        host->removes++;
      }
    });
    // The pass: takes the arena when nobody else has it and shares blocks
    // of its VM files through it (clone a block into the pattern's arena
    // slot if that is a hole, else share the slot into the block).
    threads.emplace_back([host, &stop, &witness] {
      std::mt19937_64 rng(300 + host->id);
      while (!stop) {
        auto arena = host->vol->OpenFile("arena");
        if (!arena.ok()) {
          if (arena.status().code() != Status::Code::kLocked) return host->Fail("open arena", arena.status());
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
          continue;
        }
        host->arena_turns++;
        File* a = arena.value().get();
        if (a->size() < (kPatterns + 1) * kB) {
          Status st = a->Truncate((kPatterns + 1) * kB);
          if (!st.ok()) return host->Fail("size arena", st);
        }
        for (int round = 0; round < 4 && !stop; round++) {
          std::vector<Volume::BlockOp> ops;
          for (int o = 0; o < 32; o++) {
            const int k = static_cast<int>(rng() % 2);
            const uint64_t b = rng() % kVmBlocks;
            const int p = 1 + static_cast<int>(rng() % kPatterns);
            Volume::BlockOp op;
            auto refs = a->BlockRefCount(static_cast<uint64_t>(p));
            if (!refs.ok()) return host->Fail("arena refcount", refs.status());
            if (*refs == 0) {
              op.kind = Volume::BlockOp::Kind::kCloneIfHash;
              op.src = host->vm[k].get();
              op.src_index = b;
              op.dst = a;
              op.dst_index = static_cast<uint64_t>(p);
            } else {
              op.kind = Volume::BlockOp::Kind::kShare;
              op.src = a;
              op.src_index = static_cast<uint64_t>(p);
              op.dst = host->vm[k].get();
              op.dst_index = b;
            }
            op.witness = witness[p];
            ops.push_back(op);
          }
          Status st = host->vol->ApplyBlockOps(&ops, VerifyMode::kByteCompare);
          if (!st.ok()) return host->Fail("apply block ops", st);
          for (const auto& op : ops) {
            if (op.result.ok()) {
              host->shared += op.changed;
            } else if (op.result.code() != Status::Code::kMismatch) {
              return host->Fail("block op", op.result);
            }
          }
        }
        arena.value().reset();
        std::this_thread::sleep_for(std::chrono::milliseconds(1 + rng() % 5));
      }
    });
    // Flush points, as dedupd's sync interval makes them.
    flushers.emplace_back([host, &stop_flushing] {
      while (!stop_flushing) {
        Status st = host->vol->Sync();
        if (!st.ok()) return host->Fail("sync", st);
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    });
  }
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < kSeconds) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    bool failed = false;
    for (Host& host : hosts) {
      std::lock_guard<std::mutex> l(host.failures_mu);
      failed = failed || !host.failures.empty();
    }
    if (failed) break;
  }
  stop = true;
  for (auto& t : threads) t.join();
  stop_flushing = true;
  for (auto& t : flushers) t.join();

  for (Host& host : hosts) {
    INFO("host " << host.id << ": " << host.writes << " writes, " << host.trims << " trims, "
                 << host.appends << " log appends, " << host.removes << " log removes, "
                 << host.shared << " blocks shared in " << host.arena_turns << " arena turns");
    const Volume::WaitCounters waits = host.vol->wait_counters();
    INFO(waits.waits << " lock waits, " << waits.timeouts << " ran out of time");
    for (const std::string& f : host.failures) UNSCOPED_INFO(f);
    CHECK(host.failures.empty());
    CHECK(waits.timeouts == 0);
    CHECK(host.writes > 100);
    CHECK(host.removes > 0);
    CHECK(host.shared > 0);
    // Every block is what its host last wrote.
    for (int k = 0; k < 2; k++) {
      std::vector<uint8_t> got(kVmBlocks * kB);
      REQUIRE(host.vm[k]->Read(0, got.data(), got.size()).ok());
      uint64_t wrong = 0;
      for (uint64_t b = 0; b < kVmBlocks; b++) {
        if (got[b * kB] != host.model[k][b] || got[b * kB + kB - 1] != host.model[k][b]) wrong++;
      }
      CHECK(wrong == 0);
      host.vm[k].reset();
    }
  }
  for (int h = kHosts - 1; h >= 1; h--) hosts[h].vol.reset();
  const std::string problems = test::FsckProblems(hosts[0].vol.get());
  INFO(problems);
  CHECK(problems.empty());
  hosts[0].vol.reset();
}
