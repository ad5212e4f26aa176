// Crash safety of dedup passes.
//
// A seeded scene: files with many duplicate blocks (a small pool of
// contents, zero blocks, a few unique ones, one partial last block) are
// written through a WriteMonitor into their write logs, sometimes a first
// pass builds an index and more writes and trims follow, then Sync(). The
// device image at that point is the scene's snapshot; every trial starts
// from it with a new process (Volume::Open replays the journal) and runs a
// dedup pass that dies part-way:
//   * an injected write error (EIO or ENOSPC) after n device writes: the
//     pass fails with that error, the volume is poisoned, the host dies;
//   * the process dies after n device writes without noticing: from then on
//     its writes reach only a private overlay (so it runs on, consistently,
//     to the end of the pass) and its flushes do nothing;
// then the device crashes (unflushed writes kept with probability 0, 0.5
// or 1, torn at sector granularity) and a new process opens the volume.
// Then: fsck is clean; every file has exactly the bytes written and synced
// before the pass; and a forced pass succeeds and ends with exact dedup
// (physical data blocks of the regular files == distinct non-zero block
// contents, plus partial tails), every arena block shared with some file,
// the bytes unchanged and fsck clean. Sometimes that recovery pass dies
// too, and the recovery repeats.
//
// Reproduce one scene with DEDE_SEED=<n>; DEDE_TRIALS=<n> changes the
// number of crashes per scene; DEDE_DEBUG=1 traces every pass and the
// index files after each crash, and on a failure of exactness dumps the
// last pass's statistics and the duplicates left unshared.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "agent/dedup_pass.h"
#include "index/index_check.h"
#include "index/shard_format.h"
#include "index/shard_io.h"
#include "index/shard_map.h"
#include "kmod/writemon/write_log.h"
#include "kmod/writemon/write_monitor.h"
#include "tests/dedup_accounting.h"
#include "tests/index_entries.h"
#include "tests/process_device.h"
#include "tests/seeds.h"
#include "tests/temp_locks.h"
#include "util/coding.h"
#include "volume/fsck.h"
#include "volume/mem_device.h"
#include "volume/volume.h"

using namespace dede;
using dede::test::CountFromEnv;
using dede::test::SeedsFromEnv;
using dede::test::TempLocks;

namespace {

constexpr uint64_t kB = kBlockSize;
constexpr uint64_t kDevBytes = 48ull << 20;

void FillContent(uint64_t id, uint8_t* out) {
  if (id == 0) {
    std::fill(out, out + kB, 0);
    return;
  }
  uint64_t x = id * 0x9e3779b97f4a7c15ULL + 3;
  for (size_t i = 0; i < kB; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(out + i, &x, 8);
  }
}

using test::ProcessDevice;

struct MFile {
  std::string name;
  FileId id;
  std::vector<uint8_t> bytes;
  std::unique_ptr<File> file;  // open during the scene's setup only
};

// Lends the scene's open files to a pass (as dedupd lends its exports).
class SceneAccess : public FileAccess {
 public:
  explicit SceneAccess(std::vector<MFile>* files) : files_(files) {}
  Result<Handle> Get(const FileInfo& info) override {
    for (MFile& f : *files_) {
      if (f.id == info.id) return Handle{f.file.get()};
    }
    return Status::NotFound("not a file of the scene");
  }

 private:
  std::vector<MFile>* files_;
};

DedupOptions RandomOptions(std::mt19937_64& rng, bool force) {
  auto below = [&](uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng); };
  DedupOptions o;
  o.force = force;
  o.rewrite_fraction = below(3) == 0 ? 0.0 : 0.5;
  o.split_threshold_ms = below(3) == 0 ? 0 : 1000000;  // 0: every update "took too long"
  o.split_min_entries = 8;
  o.batch_ops = below(2) == 0 ? 16 + below(64) : 8192;  // small batches: more windows
  return o;
}

#define SFAIL(msg) FAIL("seed " << seed_ << " trial " << trial_ << " [" << what_ << "]: " << msg \
                                << "\n  reproduce: DEDE_SEED=" << seed_)

class DedupCrashScene {
 public:
  // `exact`: after recovery, a forced pass must end with exact dedup (else
  // it must only succeed and keep every byte).
  DedupCrashScene(uint64_t seed, bool exact)
      : seed_(seed), exact_(exact), rng_(seed), base_(kDevBytes) {}

  // Writes the files and their logs, maybe a first pass and more writes,
  // syncs, and keeps the device image.
  void Build() {
    what_ = "build";
    MemDevice dev(kDevBytes);
    REQUIRE(FormatVolume(&dev, FormatOptions{}, false).ok());
    auto locks = TempLocks();
    OpenOptions oo;
    oo.locks = locks;
    auto v = Volume::Open(&dev, oo);
    REQUIRE(v.ok());
    std::unique_ptr<Volume> vol = std::move(v.value());
    WriteMonitorOptions mo;
    mo.algo = vol->superblock().hash_algo;
    WriteMonitor monitor(mo);

    const uint64_t nfiles = 3 + Below(2);
    for (uint64_t i = 0; i < nfiles; i++) {
      MFile f;
      f.name = "vm" + std::to_string(i);
      const uint64_t blocks = 48 + Below(112);
      const uint64_t size = i == 0 ? blocks * kB - 1 - Below(kB - 1) : blocks * kB;
      auto id = vol->Create(f.name, size);
      REQUIRE(id.ok());
      f.id = *id;
      auto opened = vol->OpenFile(f.name);
      REQUIRE(opened.ok());
      f.file = std::move(*opened);
      f.bytes.assign(size, 0);
      monitor.AddFile(f.id, true);
      files_.push_back(std::move(f));
    }
    // Fill every file, in runs of blocks.
    for (MFile& f : files_) {
      const uint64_t whole = f.bytes.size() / kB;
      for (uint64_t b = 0; b < whole;) {
        const uint64_t n = std::min<uint64_t>(whole - b, 1 + Below(24));
        WriteRun(vol.get(), &monitor, f, b, n);
        b += n;
      }
      if (f.bytes.size() % kB != 0) {
        // The partial last block: its own bytes (never shared).
        std::vector<uint8_t> tail(f.bytes.size() % kB);
        for (auto& x : tail) x = uint8_t(Below(256));
        Write(vol.get(), &monitor, f, whole * kB, tail.data(), tail.size());
      }
    }
    FlushLogs(vol.get(), &monitor);
    if (Below(2) == 0) {
      // A first pass builds an index (shared entries, arenas, maybe split
      // shards or parked pending records); then the files change again.
      SceneAccess access(&files_);
      Result<DedupStats> st = RunDedupPass(vol.get(), &access, RandomOptions(rng_, Below(2) == 0));
      if (!st.ok()) SFAIL("first pass: " << st.status().ToString());
      first_pass_ = true;
      for (int k = 0; k < 20; k++) {
        MFile& f = files_[Below(files_.size())];
        const uint64_t whole = f.bytes.size() / kB;
        const uint64_t b = Below(whole);
        const uint64_t n = 1 + Below(std::min<uint64_t>(8, whole - b));
        if (Below(5) == 0) {
          const uint64_t off = b * kB + Below(kB);
          const uint64_t len = 1 + Below(n * kB);
          const uint64_t end = std::min<uint64_t>(off + len, f.bytes.size());
          REQUIRE(f.file->Trim(off, end - off).ok());
          monitor.OnInvalidate(f.id, off, end - off);
          std::fill(f.bytes.begin() + long(off), f.bytes.begin() + long(end), 0);
        } else {
          WriteRun(vol.get(), &monitor, f, b, n);
        }
      }
      FlushLogs(vol.get(), &monitor);
    }
    REQUIRE(vol->Sync().ok());
    snapshot_ = dev.bytes();
    for (MFile& f : files_) f.file.reset();
    vol.reset();
  }

  // One pass that dies part-way, a crash, recovery and the checks.
  void Trial(uint64_t trial) {
    trial_ = trial;
    what_ = "trial start";
    base_.bytes() = snapshot_;
    fdev_ = std::make_unique<FaultDevice>(&base_);
    // Trial 0 runs undisturbed and measures how much a pass writes.
    const int kind = trial == 0 ? 0 : 1 + int(Below(2));  // 1: EIO/ENOSPC, 2: silent death
    // Early deaths (half the time in the first half of the pass) are the
    // interesting ones: most of the pass is still to come.
    const uint64_t n = trial == 0 ? 0 : Below((Below(2) ? pass_writes_ / 2 : pass_writes_) + 1);
    const bool force = Below(3) == 0;
    uint64_t writes = 0;
    Status st = CrashingPass(kind, n, force, &writes);
    if (trial == 0) {
      if (!st.ok()) SFAIL("an undisturbed pass failed: " << st.ToString());
      pass_writes_ = writes;
      if (pass_writes_ < 10) SFAIL("the pass wrote only " << pass_writes_ << " times");
    }
    // Recovery, sometimes dying again in the recovery pass.
    for (int round = 0;; round++) {
      what_ += "; reopen";
      ReopenAndCheckBytes();
      if (round < 2 && Below(4) == 0) {
        const uint64_t m = Below(pass_writes_ + 1);
        Status st2 = CrashingPass(1 + int(Below(2)), m, true, &writes);
        (void)st2;
        continue;
      }
      break;
    }
    FinalPassAndExact();
  }

  bool first_pass() const { return first_pass_; }
  uint64_t failed_passes() const { return failed_passes_; }
  uint64_t pass_writes() const { return pass_writes_; }

 private:
  uint64_t Below(uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng_); }

  void Write(Volume* vol, WriteMonitor* mon, MFile& f, uint64_t off, const uint8_t* data,
             size_t len) {
    (void)vol;
    REQUIRE(f.file->Write(off, data, len).ok());
    mon->OnWrite(f.id, off, data, len);
    std::memcpy(f.bytes.data() + off, data, len);
  }

  void WriteRun(Volume* vol, WriteMonitor* mon, MFile& f, uint64_t first, uint64_t n) {
    std::vector<uint8_t> buf(n * kB);
    for (uint64_t i = 0; i < n; i++) {
      const uint64_t r = Below(100);
      const uint64_t id = r < 8 ? 0 : r < 90 ? 1 + Below(24) : 1000000 + next_unique_++;
      FillContent(id, buf.data() + i * kB);
    }
    Write(vol, mon, f, first * kB, buf.data(), buf.size());
  }

  void FlushLogs(Volume* vol, WriteMonitor* mon) {
    for (FileId id : mon->DueFiles(true)) {
      MonitorBatch b = mon->Take(id);
      REQUIRE(AppendToWriteLog(vol, b).ok());
    }
  }

  // kind 0: no fault; 1: a write error after n writes; 2: the process dies
  // silently after n writes. The device then crashes. Returns the pass's
  // status; *writes: the device writes the pass made (before any fault).
  Status CrashingPass(int kind, uint64_t n, bool force, uint64_t* writes) {
    const int err = Below(2) ? EIO : ENOSPC;
    const double keep = std::vector<double>{0.0, 0.5, 1.0}[Below(3)];
    what_ += "; pass (force " + std::to_string(force) + ") " +
             (kind == 0   ? std::string("undisturbed")
              : kind == 1 ? std::string(err == EIO ? "EIO" : "ENOSPC") + " after " +
                                std::to_string(n) + " writes"
                          : "process death after " + std::to_string(n) + " writes") +
             ", crash keep " + std::to_string(keep);
    ProcessDevice pdev(fdev_.get());
    auto locks = TempLocks();
    OpenOptions oo;
    oo.locks = locks;
    auto v = Volume::Open(&pdev, oo);
    if (!v.ok()) SFAIL("open before the pass: " << v.status().ToString());
    std::unique_ptr<Volume> vol = std::move(v.value());
    auto access = std::make_unique<VolumeFileAccess>(vol.get());
    DedupOptions opts = RandomOptions(rng_, force);
    const uint64_t w0 = pdev.writes();
    if (kind == 1) fdev_->FailWritesAfter(n, err);
    if (kind == 2) pdev.DieAfter(n);
    Result<DedupStats> st = RunDedupPass(vol.get(), access.get(), opts);
    *writes = pdev.writes() - w0;
    if (std::getenv("DEDE_DEBUG")) fprintf(stderr, "trial %llu: %s -> %s (writes %llu of %llu)\n", (unsigned long long)trial_, what_.c_str(), st.ok() ? "ok" : st.status().ToString().c_str(), (unsigned long long)*writes, (unsigned long long)pass_writes_);
    if (kind == 1 && !st.ok()) {
      const Status::Code want = err == EIO ? Status::Code::kIoError : Status::Code::kNoSpace;
      if (st.status().code() != want) {
        SFAIL("the pass failed with '" << st.status().ToString() << "', not the injected "
                                       << (err == EIO ? "EIO" : "ENOSPC"));
      }
    }
    if (kind == 2 && !st.ok()) {
      // It never saw a fault: a dead process running on its overlay must
      // still complete its pass.
      SFAIL("a pass that saw no fault failed: " << st.status().ToString());
    }
    if (!st.ok()) failed_passes_++;
    // The process dies: nothing more of it reaches the disk.
    pdev.DieNow();
    access.reset();
    vol.reset();
    locks.reset();
    std::mt19937_64 crng(rng_());
    fdev_->Crash(crng, keep);
    fdev_->ClearFault();
    return st.ok() ? Status::Ok() : st.status();
  }

  std::unique_ptr<Volume> OpenClean(std::shared_ptr<LockManager>* locks) {
    *locks = TempLocks();
    OpenOptions oo;
    oo.locks = *locks;
    auto v = Volume::Open(fdev_.get(), oo);
    if (!v.ok()) SFAIL("reopen: " << v.status().ToString());
    return std::move(v.value());
  }

  void Fsck(Volume* vol, const char* when) {
    auto rep = CheckVolume(vol, false);
    if (!rep.ok()) SFAIL("fsck " << when << ": " << rep.status().ToString());
    if (!rep->clean()) {
      std::string problems;
      for (const auto& p : rep->problems) problems += p.where + ": " + p.what + "; ";
      SFAIL("fsck " << when << ": " << problems);
    }
  }

  void CheckBytes(Volume* vol, const char* when) {
    for (MFile& f : files_) {
      auto info = vol->Lookup(f.name);
      if (!info.ok()) SFAIL(when << ": " << f.name << ": " << info.status().ToString());
      if (!(info->id == f.id)) SFAIL(when << ": " << f.name << " is another file now");
      if (info->size != f.bytes.size()) {
        SFAIL(when << ": " << f.name << " has size " << info->size << ", expected "
                   << f.bytes.size());
      }
      auto file = vol->OpenFile(f.name);
      if (!file.ok()) SFAIL(when << ": open " << f.name << ": " << file.status().ToString());
      std::vector<uint8_t> got(f.bytes.size());
      Status rs = (*file)->Read(0, got.data(), got.size());
      if (!rs.ok()) SFAIL(when << ": read " << f.name << ": " << rs.ToString());
      if (got != f.bytes) {
        size_t at = 0;
        while (got[at] == f.bytes[at]) at++;
        SFAIL(when << ": " << f.name << " differs from the synced data at byte " << at
                   << " (block " << at / kB << ")");
      }
    }
  }

  void ReopenAndCheckBytes() {
    std::shared_ptr<LockManager> locks;
    std::unique_ptr<Volume> vol = OpenClean(&locks);
    Fsck(vol.get(), "after the crash");
    CheckBytes(vol.get(), "after the crash");
    if (std::getenv("DEDE_DEBUG")) {
      auto list = vol->List();
      REQUIRE(list.ok());
      for (const FileInfo& fi : *list) {
        if (fi.kind != FileKind::kRegular) {
          fprintf(stderr, "  after crash: %s size %llu mapped %llu\n", fi.name.c_str(),
                  (unsigned long long)fi.size, (unsigned long long)fi.mapped_blocks);
        }
      }
    }
    vol.reset();
  }

  void FinalPassAndExact() {
    what_ += "; final forced pass";
    std::shared_ptr<LockManager> locks;
    std::unique_ptr<Volume> vol = OpenClean(&locks);
    {
      VolumeFileAccess access(vol.get());
      DedupOptions o;
      o.force = true;
      Result<DedupStats> st = RunDedupPass(vol.get(), &access, o);
      if (!st.ok()) SFAIL("the forced pass after recovery failed: " << st.status().ToString());
      final_stats_ = *st;
    }
    CheckBytes(vol.get(), "after the forced pass");
    if (!exact_) {
      Fsck(vol.get(), "after the forced pass");
      vol.reset();
      return;
    }
    // Exact: one physical block per distinct non-zero whole-block content;
    // partial tails hold their own block (or none).
    std::set<std::string> distinct;
    uint64_t tails = 0;
    for (MFile& f : files_) {
      const uint64_t blocks = (f.bytes.size() + kB - 1) / kB;
      for (uint64_t b = 0; b < blocks; b++) {
        if ((b + 1) * kB > f.bytes.size()) {
          auto file = vol->OpenFile(f.name);
          REQUIRE(file.ok());
          auto refs = (*file)->BlockRefCount(b);
          REQUIRE(refs.ok());
          if (*refs > 1) SFAIL(f.name << ": the partial last block is shared");
          tails += *refs;
          continue;
        }
        std::string blk(reinterpret_cast<const char*>(f.bytes.data() + b * kB), kB);
        if (blk != std::string(kB, '\0')) distinct.insert(blk);
      }
    }
    auto stats = vol->Stats();
    REQUIRE(stats.ok());
    auto list = vol->List();
    REQUIRE(list.ok());
    ShardMap map = ResolveShardMap(*list);
    for (const IndexFile& a : map.arenas) {
      auto af = vol->OpenFile(a.name);
      REQUIRE(af.ok());
      for (uint64_t i = 0; i < a.size / kB; i++) {
        auto refs = (*af)->BlockRefCount(i);
        REQUIRE(refs.ok());
        if (*refs == 1) SFAIL(a.name << " block " << i << " is referenced by the arena only");
      }
    }
    const uint64_t physical = test::PhysicalDataBlocks(*stats, *list);
    if (physical != distinct.size() + tails) {
      if (std::getenv("DEDE_DEBUG")) Dump(vol.get(), *list);
      SFAIL("not exact after the forced pass: " << physical << " physical data blocks, "
                                                << distinct.size()
                                                << " distinct non-zero contents + " << tails
                                                << " partial tails");
    }
    Fsck(vol.get(), "after the forced pass");
    vol.reset();
  }

  void Dump(Volume* vol, const std::vector<FileInfo>& list) {
    const DedupStats& s = final_stats_;
    fprintf(stderr, "final pass: logs %llu records %llu unique_added %llu shared_new %llu hits %llu already %llu stale_rec %llu stale_ent %llu busy %llu gc_arena %llu gc_unique %llu swept %llu zero %llu rewritten %llu deferred %llu pend_applied %llu\n",
            (unsigned long long)s.logs_consumed, (unsigned long long)s.log_records,
            (unsigned long long)s.unique_added, (unsigned long long)s.shared_new,
            (unsigned long long)s.shared_hits, (unsigned long long)s.already_shared,
            (unsigned long long)s.stale_records, (unsigned long long)s.stale_entries,
            (unsigned long long)s.busy_targets, (unsigned long long)s.gc_arena_blocks,
            (unsigned long long)s.gc_unique_entries, (unsigned long long)s.arena_blocks_swept,
            (unsigned long long)s.zero_blocks_freed, (unsigned long long)s.shards_rewritten,
            (unsigned long long)s.shards_deferred, (unsigned long long)s.pending_records_applied);
    for (const FileInfo& fi : list) {
      fprintf(stderr, "  file %s kind %d size %llu mapped %llu\n", fi.name.c_str(), int(fi.kind),
              (unsigned long long)fi.size, (unsigned long long)fi.mapped_blocks);
    }
    std::map<std::string, std::vector<std::string>> where;
    for (MFile& f : files_) {
      auto file = vol->OpenFile(f.name);
      REQUIRE(file.ok());
      for (uint64_t b = 0; b < f.bytes.size() / kB; b++) {
        std::string blk(reinterpret_cast<const char*>(f.bytes.data() + b * kB), kB);
        auto refs = (*file)->BlockRefCount(b);
        if (blk == std::string(kB, '\0')) {
          if (*refs) fprintf(stderr, "  zero block mapped: %s:%llu refs %u\n", f.name.c_str(), (unsigned long long)b, *refs);
          continue;
        }
        where[blk].push_back(f.name + ":" + std::to_string(b) + "/r" + std::to_string(*refs));
      }
    }
    for (auto& [blk, v] : where) {
      bool single = false;
      for (auto& x : v) single |= x.size() > 3 && x.substr(x.size() - 3) == "/r1";
      if (!single || v.size() < 2) continue;
      std::string line;
      for (auto& x : v) line += x + " ";
      fprintf(stderr, "  unshared duplicate: %s\n", line.c_str());
    }
  }

  DedupStats final_stats_;
  uint64_t seed_;
  bool exact_;
  uint64_t trial_ = 0;
  std::string what_;
  std::mt19937_64 rng_;
  MemDevice base_;
  std::unique_ptr<FaultDevice> fdev_;
  std::vector<uint8_t> snapshot_;
  std::vector<MFile> files_;
  uint64_t next_unique_ = 0;
  bool first_pass_ = false;
  uint64_t pass_writes_ = 0;
  uint64_t failed_passes_ = 0;
};

}  // namespace

// Data safety only: no byte written and synced before the pass is lost or
// changed by any crash, fsck is clean, and recovery passes succeed.
TEST_CASE("dedup crash: a pass dying part-way loses no synced data", "[dedup][crash][seeded]") {
  const uint64_t seed =
      GENERATE(from_range(SeedsFromEnv({301, 302, 303, 304, 305, 306, 307, 308})));
  INFO("seed " << seed << " (reproduce with DEDE_SEED=" << seed << ")");
  DedupCrashScene scene(seed, /*exact=*/false);
  scene.Build();
  const uint64_t trials = CountFromEnv("DEDE_TRIALS", 10);
  for (uint64_t t = 0; t < trials; t++) scene.Trial(t);
  // The trials must have killed passes part-way.
  if (trials >= 8) CHECK(scene.failed_passes() > 0);
}

// And the index survives: after recovery a forced pass deduplicates
// everything (what the pass that died had shared, and what it had not).
TEST_CASE("dedup crash: recovery after a pass died part-way ends with exact dedup",
          "[dedup][crash][seeded]") {
  const uint64_t seed =
      GENERATE(from_range(SeedsFromEnv({201, 202, 203, 204, 205, 206, 207, 208})));
  INFO("seed " << seed << " (reproduce with DEDE_SEED=" << seed << ")");
  DedupCrashScene scene(seed, /*exact=*/true);
  scene.Build();
  const uint64_t trials = CountFromEnv("DEDE_TRIALS", 10);
  for (uint64_t t = 0; t < trials; t++) scene.Trial(t);
  if (trials >= 8) CHECK(scene.failed_passes() > 0);
}

namespace {

// Two 16-block files written alike (block b holds content 1 + b) through a
// write monitor, their logs flushed: the next pass shares every block.
struct TwinFiles {
  static constexpr uint64_t kBlocks = 16;
  TwinFiles() : dev(kDevBytes), files(2), blk(kB) {
    REQUIRE(FormatVolume(&dev, FormatOptions{}, false).ok());
    OpenOptions oo;
    oo.locks = TempLocks();
    auto v = Volume::Open(&dev, oo);
    REQUIRE(v.ok());
    vol = std::move(v.value());
    WriteMonitorOptions mo;
    mo.algo = vol->superblock().hash_algo;
    monitor = std::make_unique<WriteMonitor>(mo);
    for (size_t i = 0; i < files.size(); i++) {
      MFile& f = files[i];
      f.name = "vm" + std::to_string(i);
      auto id = vol->Create(f.name, kBlocks * kB);
      REQUIRE(id.ok());
      f.id = *id;
      auto opened = vol->OpenFile(f.name);
      REQUIRE(opened.ok());
      f.file = std::move(*opened);
      monitor->AddFile(f.id, true);
      for (uint64_t b = 0; b < kBlocks; b++) Write(f, b, 1 + b);
    }
    FlushLogs();
  }
  // Block `b` of `f` gets content number `content` (FillContent).
  void Write(MFile& f, uint64_t b, uint64_t content) {
    FillContent(content, blk.data());
    REQUIRE(f.file->Write(b * kB, blk.data(), kB).ok());
    monitor->OnWrite(f.id, b * kB, blk.data(), kB);
  }
  void FlushLogs() {
    for (FileId id : monitor->DueFiles(true)) {
      MonitorBatch b = monitor->Take(id);
      REQUIRE(AppendToWriteLog(vol.get(), b).ok());
    }
  }
  Result<DedupStats> Pass(bool force = false) {
    SceneAccess access(&files);
    DedupOptions opts;
    opts.force = force;
    return RunDedupPass(vol.get(), &access, opts);
  }

  MemDevice dev;
  std::unique_ptr<Volume> vol;
  std::unique_ptr<WriteMonitor> monitor;
  std::vector<MFile> files;
  std::vector<uint8_t> blk;
};

}  // namespace

TEST_CASE("dedup: arena references no entry names are swept by the next pass that rewrites "
          "their shard, forced or not",
          "[dedup][crash]") {
  // A pass that dies after making its new shard version durable but before
  // punching what that version no longer names (garbage collected shared
  // blocks, or the blocks a split moved to the upper arena) leaves arena
  // references that no entry names: the arena's alone, never freed. Only a
  // forced pass or a damaged shard used to sweep them; now a pass that
  // rewrites the shard notices the arena maps more blocks than it accounts
  // for and sweeps too. The dead pass is played by cloning file blocks
  // into unnamed arena slots.
  TwinFiles t;
  Volume* vol = t.vol.get();
  REQUIRE(t.Pass().ok());
  auto arenas = [&] {
    auto list = vol->List();
    REQUIRE(list.ok());
    return ResolveShardMap(*list).arenas;
  };
  REQUIRE(arenas().size() == 1);
  const std::string arena_name = arenas()[0].name;
  auto arena_only = [&] {
    auto af = vol->OpenFile(arena_name);
    REQUIRE(af.ok());
    uint64_t n = 0;
    for (uint64_t i = 0; i < (*af)->size() / kB; i++) {
      auto refs = (*af)->BlockRefCount(i);
      REQUIRE(refs.ok());
      n += *refs == 1;
    }
    return n;
  };
  REQUIRE(arena_only() == 0);
  // The dead pass's leftovers: references past the arena's end to blocks
  // the files then rewrite, so the arena holds them alone.
  t.Write(t.files[0], 3, 1000);
  t.Write(t.files[0], 4, 1001);
  {
    auto af = vol->OpenFile(arena_name);
    REQUIRE(af.ok());
    const uint64_t end = (*af)->size() / kB;
    REQUIRE((*af)->Truncate((end + 2) * kB).ok());
    REQUIRE(vol->CloneBlock(t.files[0].file.get(), 3, af->get(), end).ok());
    REQUIRE(vol->CloneBlock(t.files[0].file.get(), 4, af->get(), end + 1).ok());
  }
  t.Write(t.files[0], 3, 1002);
  t.Write(t.files[0], 4, 1003);
  REQUIRE(arena_only() == 2);
  // New duplicates in the same (only) shard: a normal, unforced pass
  // rewrites it.
  t.Write(t.files[0], 7, 500);
  t.Write(t.files[1], 7, 500);
  t.FlushLogs();
  auto st = t.Pass(/*force=*/false);
  REQUIRE(st.ok());
  CHECK(st->shards_rewritten >= 1);
  CHECK(st->arena_blocks_swept == 2);
  CHECK(arena_only() == 0);
  for (MFile& f : t.files) f.file.reset();
  auto rep = CheckVolume(vol, false);
  REQUIRE(rep.ok());
  for (auto& p : rep->problems) INFO(p.where << ": " << p.what);
  CHECK(rep->clean());
}

TEST_CASE("index repair leaves alone a version that a pass completed after the check saw it empty",
          "[dedup][index]") {
  // `dede check --repair` checks the index without the ranges' locks. A
  // version a pass is writing is empty until its first chunk, so the check
  // files it as incomplete; if the pass then finishes (retiring the old
  // version), a repair acting on the check's findings removed the live
  // version and the range's arena with it. The repair now looks again
  // under the range's lock.
  TwinFiles t;
  Volume* vol = t.vol.get();
  REQUIRE(t.Pass().ok());
  auto live = [&] {
    auto m = LoadShardMap(vol);
    REQUIRE(m.ok());
    REQUIRE(m->live.size() == 1);
    return m->live[0];
  };
  const ShardSlot v1 = live();
  REQUIRE(v1.version >= 1);
  // More duplicates for the next pass; and the next version's file, empty,
  // as a pass writing it leaves it for a while.
  t.Write(t.files[0], 5, 700);
  t.Write(t.files[1], 9, 700);
  t.FlushLogs();
  const std::string next = ShardFileName(v1.range, v1.version + 1);
  REQUIRE(vol->Create(next, 0, FileKind::kIndexShard).ok());
  Status pass_status;
  auto report = CheckIndex(vol, /*repair=*/true, [&] {
    // Between the check and the repair: the pass finishes that version.
    pass_status = t.Pass().status();
  });
  REQUIRE(pass_status.ok());
  REQUIRE(report.ok());
  bool saw_empty_version = false;
  for (const IndexProblem& p : report->problems) {
    INFO(p.where << ": " << p.what << (p.repaired ? " (repaired)" : ""));
    if (p.file == next) {
      saw_empty_version = true;
      CHECK_FALSE(p.repaired);
    }
  }
  CHECK(saw_empty_version);
  const ShardSlot v2 = live();
  CHECK(v2.version == v1.version + 1);
  CHECK(v2.name == next);
  auto again = CheckIndex(vol, false);
  REQUIRE(again.ok());
  for (const IndexProblem& p : again->problems) INFO(p.where << ": " << p.what);
  CHECK(again->clean());
}

TEST_CASE("index repair acts only on the file it checked, not on a new one of the same name",
          "[dedup][index]") {
  // A pass may remove a file and create another of the same name between
  // the check and the repair (a pending file, a version it restarts); the
  // repair matches the file id the check saw.
  TwinFiles t;
  Volume* vol = t.vol.get();
  REQUIRE(t.Pass().ok());
  auto m = LoadShardMap(vol);
  REQUIRE(m.ok());
  REQUIRE(m->live.size() == 1);
  const std::string next = ShardFileName(m->live[0].range, m->live[0].version + 1);
  REQUIRE(vol->Create(next, 0, FileKind::kIndexShard).ok());  // a dead update's leftover
  auto report = CheckIndex(vol, /*repair=*/true, [&] {
    REQUIRE(vol->Remove(next).ok());
    REQUIRE(vol->Create(next, 0, FileKind::kIndexShard).ok());
  });
  REQUIRE(report.ok());
  bool seen = false;
  for (const IndexProblem& p : report->problems) {
    if (p.file != next) continue;
    seen = true;
    CHECK_FALSE(p.repaired);
  }
  CHECK(seen);
  CHECK(vol->Lookup(next).ok());
  // Checked now, it goes.
  report = CheckIndex(vol, /*repair=*/true);
  REQUIRE(report.ok());
  CHECK(vol->Lookup(next).status().code() == Status::Code::kNotFound);
}

// Entries of every live shard version.
static uint64_t LiveShardEntries(Volume* vol) {
  uint64_t n = 0;
  test::ForEachLiveShard(vol,
                         [&](const ShardSlot&, ShardReader* r) { n += r->header().entry_count; });
  return n;
}

// The holder of a range's lock deletes what its map calls stale. The map
// took a version file held open elsewhere as complete without reading its
// header; but inside a locked range the only other openers are readers
// (every host's map load opens every version), and they open a dead
// update's headerless leftover as readily as a live version. Taken as the
// newest complete version, the leftover made the live one "stale": the
// pass deleted it, then dropped the leftover as corrupt, and the shard's
// entries were gone.
TEST_CASE(
    "dedup: a dead update's leftover held open by a reader does not make the live version "
    "stale",
    "[dedup][crash]") {
  TwinFiles t;
  Volume* vol = t.vol.get();
  REQUIRE(t.Pass().ok());
  auto m = LoadShardMap(vol);
  REQUIRE(m.ok());
  REQUIRE(m->live.size() == 1);
  const ShardSlot v1 = m->live[0];
  auto entries = [vol] { return LiveShardEntries(vol); };
  const uint64_t before = entries();
  REQUIRE(before >= 8);
  // A rewrite that died before its header: entries written, block 0 not.
  const std::string next = ShardFileName(v1.range, v1.version + 1);
  REQUIRE(vol->Create(next, 3 * kB, FileKind::kIndexShard).ok());
  {
    auto f = vol->OpenFile(next);
    REQUIRE(f.ok());
    std::vector<uint8_t> junk(2 * kB, 0x6b);
    REQUIRE((*f)->Write(kB, junk.data(), junk.size()).ok());
  }
  // A reader holds it for a moment (another host's map load, dede stats),
  // past the pass's first map load under the range's lock.
  t.Write(t.files[0], 11, 900);
  t.Write(t.files[1], 12, 900);
  t.FlushLogs();
  auto reader = vol->OpenFile(next);
  REQUIRE(reader.ok());
  std::atomic<std::chrono::steady_clock::time_point::rep> released{0};
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    reader->reset();
    released = std::chrono::steady_clock::now().time_since_epoch().count();
  });
  auto st = t.Pass();
  const auto pass_end = std::chrono::steady_clock::now().time_since_epoch().count();
  release.join();
  REQUIRE(st.ok());
  // The pass waited for the reader instead of deciding without the header.
  CHECK(pass_end >= released);
  CHECK(st->incomplete_versions_removed == 1);
  // The live version still has the first pass's entries, and the new pair.
  CHECK(entries() >= before);
  for (MFile& f : t.files) f.file.reset();
  auto rep = CheckVolume(vol, false);
  REQUIRE(rep.ok());
  for (auto& p : rep->problems) INFO(p.where << ": " << p.what);
  CHECK(rep->clean());
}

// A split of `parent` that died: its lower half complete (no entries),
// its upper half without a header (an update that died before it). The
// upper half's name.
static std::string MakeDeadSplit(Volume* vol, const ShardSlot& parent) {
  const ShardRange lower = parent.range.Lower(), upper = parent.range.Upper();
  const std::string name = ShardFileName(lower, parent.version + 1);
  REQUIRE(vol->Create(name, 0, FileKind::kIndexShard).ok());
  auto f = vol->OpenFile(name);
  REQUIRE(f.ok());
  ShardHeader proto;
  proto.range = lower;
  proto.version = parent.version + 1;
  proto.algo = vol->superblock().hash_algo;
  ShardWriter w(vol, f->get(), proto);
  REQUIRE(w.Finish(0, 0).ok());
  const std::string upper_name = ShardFileName(upper, parent.version + 1);
  REQUIRE(vol->Create(upper_name, 2 * kB, FileKind::kIndexShard).ok());
  return upper_name;
}

// A split that died: its lower half complete, its upper half without a
// header, the parent still live. The upper half is under its own lock
// (ShardLockId(lo)), not the parent's, which is the lower half's. A
// reader holding the upper half open while the parent's lock holder
// loaded its map made the upper half count as complete: the split looked
// finished, the parent stale, and the pass deleted it with its entries.
TEST_CASE(
    "dedup: a dead split's upper half held open by a reader does not make the live parent "
    "stale",
    "[dedup][crash]") {
  TwinFiles t;
  Volume* vol = t.vol.get();
  REQUIRE(t.Pass().ok());
  auto m = LoadShardMap(vol);
  REQUIRE(m.ok());
  REQUIRE(m->live.size() == 1);
  const ShardSlot parent = m->live[0];
  REQUIRE(parent.range.depth == 0);
  auto entries = [vol] { return LiveShardEntries(vol); };
  const uint64_t before = entries();
  REQUIRE(before >= 8);
  const ShardRange lower = parent.range.Lower(), upper = parent.range.Upper();
  REQUIRE(ShardLockId(lower) == ShardLockId(parent.range));
  REQUIRE(ShardLockId(upper) != ShardLockId(parent.range));
  const std::string upper_name = MakeDeadSplit(vol, parent);
  {
    auto half = LoadShardMap(vol);
    REQUIRE(half.ok());
    REQUIRE(half->live.size() == 1);  // half-finished: the parent is live
    REQUIRE(half->live[0].name == parent.name);
  }
  auto reader = vol->OpenFile(upper_name);
  REQUIRE(reader.ok());
  std::atomic<std::chrono::steady_clock::time_point::rep> released{0};
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    reader->reset();
    released = std::chrono::steady_clock::now().time_since_epoch().count();
  });
  auto st = t.Pass(true);
  const auto pass_end = std::chrono::steady_clock::now().time_since_epoch().count();
  release.join();
  REQUIRE(st.ok());
  // The pass waited for the reader instead of deciding without the header.
  CHECK(pass_end >= released);
  CHECK(st->incomplete_versions_removed == 1);  // the upper half
  auto after = LoadShardMap(vol);
  REQUIRE(after.ok());
  REQUIRE(after->live.size() == 1);
  CHECK(after->live[0].range == parent.range);
  CHECK(after->live[0].version >= parent.version);
  CHECK(entries() == before);
  for (MFile& f : t.files) f.file.reset();
  auto rep = CheckVolume(vol, false);
  REQUIRE(rep.ok());
  for (auto& p : rep->problems) INFO(p.where << ": " << p.what);
  CHECK(rep->clean());
}

// The same dead split, met by `dede fsck --repair` (CheckIndex) while a
// reader holds the upper half: the repair loaded the map without the
// range's lock semantics, took the held half as complete, and removed the
// live parent version as stale, with its entries.
TEST_CASE(
    "index repair: a dead split's upper half held open by a reader does not make the live "
    "parent stale",
    "[dedup][crash]") {
  TwinFiles t;
  Volume* vol = t.vol.get();
  REQUIRE(t.Pass().ok());
  auto m = LoadShardMap(vol);
  REQUIRE(m.ok());
  REQUIRE(m->live.size() == 1);
  const ShardSlot parent = m->live[0];
  auto entries = [vol] { return LiveShardEntries(vol); };
  const uint64_t before = entries();
  REQUIRE(before >= 8);
  const std::string upper_name = MakeDeadSplit(vol, parent);
  auto reader = vol->OpenFile(upper_name);
  REQUIRE(reader.ok());
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    reader->reset();
  });
  Result<IndexCheckReport> rep = CheckIndex(vol, /*repair=*/true);
  release.join();
  REQUIRE(rep.ok());
  auto after = LoadShardMap(vol);
  REQUIRE(after.ok());
  REQUIRE(after->live.size() == 1);
  CHECK(after->live[0].name == parent.name);
  CHECK(entries() == before);
}

// A pass that defers a shard appends its records to the shard's pending
// file. After a torn frame (a crash between the file's extension and the
// frame's write), readers stop at it, and passes went on appending behind
// it: every record parked after that was lost too. The pass now cuts the
// file at the bad frame before it appends.
TEST_CASE("dedup: records parked after a torn pending frame are not lost behind it",
          "[dedup][crash]") {
  TwinFiles t;
  Volume* vol = t.vol.get();
  REQUIRE(t.Pass().ok());
  auto defer_pass = [&] {
    SceneAccess access(&t.files);
    DedupOptions opts;
    opts.rewrite_fraction = 1.0;  // a few records: park them
    auto st = RunDedupPass(vol, &access, opts);
    REQUIRE(st.ok());
    CHECK(st->shards_deferred == 1);
    return *st;
  };
  // Pair A, parked.
  t.Write(t.files[0], 13, 800);
  t.Write(t.files[1], 14, 800);
  t.FlushLogs();
  CHECK(defer_pass().pending_records_written == 2);
  // A torn frame after it: the file extended by a block that never got
  // its frame.
  auto m = LoadShardMap(vol);
  REQUIRE(m.ok());
  REQUIRE(m->pending.size() == 1);
  {
    auto pf = vol->OpenFile(m->pending[0].name);
    REQUIRE(pf.ok());
    REQUIRE((*pf)->Truncate((*pf)->size() + kB).ok());
  }
  // Pair B, parked too.
  t.Write(t.files[0], 15, 801);
  t.Write(t.files[1], 10, 801);
  t.FlushLogs();
  CHECK(defer_pass().pending_records_written == 2);
  // A forced pass applies both pairs.
  auto st = t.Pass(/*force=*/true);
  REQUIRE(st.ok());
  CHECK(st->pending_records_applied == 4);
  for (MFile& f : t.files) f.file.reset();
  auto rep = CheckVolume(vol, false);
  REQUIRE(rep.ok());
  for (auto& p : rep->problems) INFO(p.where << ": " << p.what);
  CHECK(rep->clean());
}

namespace {

// Makes the block at `index` of `f` (a shard header or a pending frame
// header: the crc at byte 8, FileBlockCrc) claim major version 2, as a
// newer dede would write it.
void MakeNewerMajor(Volume* vol, File* f, uint64_t index) {
  std::vector<uint8_t> blk(kB);
  REQUIRE(f->Read(index * kB, blk.data(), kB).ok());
  EncodeU16(blk.data() + 4, kShardMajor + 1);
  EncodeU32(blk.data() + 8, FileBlockCrc(blk.data(), 8, vol->superblock().uuid, f->id(), index));
  REQUIRE(f->Write(index * kB, blk.data(), kB).ok());
}

}  // namespace

// docs/FORMAT.md section 9: a newer major version is refused, not taken
// for damage. A shard version a newer dede wrote looked incomplete (its
// header does not decode here): the next pass removed it, and fsck
// --repair called it damage and removed it too.
TEST_CASE("dedup: a shard version of a newer format version is left alone by passes and fsck",
          "[dedup][crash]") {
  TwinFiles t;
  Volume* vol = t.vol.get();
  REQUIRE(t.Pass().ok());
  auto m = LoadShardMap(vol);
  REQUIRE(m.ok());
  REQUIRE(m->live.size() == 1);
  const ShardSlot s = m->live[0];
  {
    auto f = vol->OpenFile(s.name);
    REQUIRE(f.ok());
    MakeNewerMajor(vol, f->get(), 0);
  }
  auto newer = LoadShardMap(vol);
  REQUIRE(newer.ok());
  CHECK(newer->incomplete.empty());
  CHECK(newer->IsNewer(s.name));
  REQUIRE(newer->live.size() == 1);
  CHECK(newer->live[0].name == s.name);
  // New records for the range, and a forced pass.
  t.Write(t.files[0], 3, 700);
  t.Write(t.files[1], 4, 700);
  t.FlushLogs();
  auto st = t.Pass(/*force=*/true);
  REQUIRE(st.ok());
  CHECK(st->newer_format_left_alone >= 1);
  CHECK(st->incomplete_versions_removed == 0);
  CHECK(st->shards_rewritten == 0);
  auto now = vol->Lookup(s.name);
  REQUIRE(now.ok());
  CHECK(now->id == s.id);
  // fsck: not damage, and --repair leaves it.
  for (MFile& f : t.files) f.file.reset();
  auto ix = CheckIndex(vol, /*repair=*/true);
  REQUIRE(ix.ok());
  for (auto& p : ix->problems) INFO(p.where << ": " << p.what);
  CHECK(ix->clean());
  CHECK(ix->newer == std::vector<std::string>{s.name});
  auto still = vol->Lookup(s.name);
  REQUIRE(still.ok());
  CHECK(still->id == s.id);
}

// A pending frame of a newer format version: the reader stops at it (the
// records before it are applied), but a rewrite retired the whole file
// with it, and fsck --repair cut it off as damage.
TEST_CASE("dedup: a pending file with a frame of a newer format version is left alone",
          "[dedup][crash]") {
  TwinFiles t;
  Volume* vol = t.vol.get();
  REQUIRE(t.Pass().ok());
  {
    SceneAccess access(&t.files);
    DedupOptions opts;
    opts.rewrite_fraction = 1.0;  // a few records: park them
    t.Write(t.files[0], 13, 800);
    t.Write(t.files[1], 14, 800);
    t.FlushLogs();
    auto st = RunDedupPass(vol, &access, opts);
    REQUIRE(st.ok());
    REQUIRE(st->pending_records_written == 2);
  }
  auto m = LoadShardMap(vol);
  REQUIRE(m.ok());
  REQUIRE(m->pending.size() == 1);
  const std::string pname = m->pending[0].name;
  uint64_t size = 0;
  {
    // A second frame, as a newer dede would park it.
    auto pf = vol->OpenFile(pname);
    REQUIRE(pf.ok());
    const uint64_t at = (*pf)->size() / kB;
    PendingRecord r;
    r.fp[0] = 0x42;
    r.file = t.files[0].id;
    REQUIRE(AppendPendingFrame(pf->get(), {r}, vol->superblock().hash_algo, vol->superblock().uuid)
                .ok());
    MakeNewerMajor(vol, pf->get(), at);
    size = (*pf)->size();
    auto newer =
        PendingHasNewerFrame(pf->get(), vol->superblock().hash_algo, vol->superblock().uuid);
    REQUIRE(newer.ok());
    CHECK(*newer);
  }
  auto st = t.Pass(/*force=*/true);
  REQUIRE(st.ok());
  CHECK(st->newer_format_left_alone >= 1);
  {
    auto pf = vol->OpenFile(pname);
    REQUIRE(pf.ok());
    CHECK((*pf)->size() == size);
  }
  for (MFile& f : t.files) f.file.reset();
  auto ix = CheckIndex(vol, /*repair=*/true);
  REQUIRE(ix.ok());
  for (auto& p : ix->problems) INFO(p.where << ": " << p.what);
  CHECK(ix->clean());
  CHECK(ix->newer == std::vector<std::string>{pname});
  auto pf = vol->OpenFile(pname);
  REQUIRE(pf.ok());
  CHECK((*pf)->size() == size);
}

// fsck read a whole pending file into one buffer: a damaged inode
// claiming a terabyte (here a sparse tail) made it allocate that much.
TEST_CASE("fsck reads a pending file whose size runs far past its frames frame by frame",
          "[dedup][crash]") {
  TwinFiles t;
  Volume* vol = t.vol.get();
  REQUIRE(t.Pass().ok());
  {
    SceneAccess access(&t.files);
    DedupOptions opts;
    opts.rewrite_fraction = 1.0;  // a few records: park them
    t.Write(t.files[0], 13, 800);
    t.Write(t.files[1], 14, 800);
    t.FlushLogs();
    auto st = RunDedupPass(vol, &access, opts);
    REQUIRE(st.ok());
    REQUIRE(st->pending_records_written == 2);
  }
  auto m = LoadShardMap(vol);
  REQUIRE(m.ok());
  REQUIRE(m->pending.size() == 1);
  const std::string pname = m->pending[0].name;
  uint64_t frames_end = 0;
  {
    auto pf = vol->OpenFile(pname);
    REQUIRE(pf.ok());
    frames_end = (*pf)->size();
    REQUIRE((*pf)->Truncate(uint64_t{1} << 40).ok());
  }
  for (MFile& f : t.files) f.file.reset();
  const auto t0 = std::chrono::steady_clock::now();
  auto ix = CheckIndex(vol, /*repair=*/false);
  REQUIRE(ix.ok());
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  REQUIRE(ix->problems.size() == 1);
  CHECK(ix->problems[0].kind == IndexProblem::Kind::kPendingDamaged);
  CHECK(ix->problems[0].where == pname + " block " + std::to_string(frames_end / kB));
}
