// Deferred reference drops (docs/LOCKING.md "Deferred drops"): a host that
// gives up a reference to a block whose allocation group another host holds
// does not wait for that host. The drop goes into its own drop list in the
// same transaction and is applied at a later flush point.
//
// Three lock managers on one lock file play three hosts: host 1 and host 2
// open the volume; the "holder" takes allocation groups and never answers,
// like a host that is stuck or dead but whose leases have not expired yet.
// Without deferral, host 2's copy-on-write break would wait for the holder
// (a minute, then fail with kLocked).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/forwarding_device.h"
#include "tests/forwarding_locks.h"
#include "tests/fsck_problems.h"
#include "util/clock.h"
#include "volume/fsck.h"
#include "volume/journal.h"
#include "volume/lock_manager.h"
#include "volume/mem_device.h"
#include "volume/volume.h"

using namespace dede;

namespace {

constexpr uint64_t kB = kBlockSize;
constexpr uint64_t kShared = 4;  // blocks of "a" that "b" shares

LockId Group(uint64_t g) { return LockId{LockKind::kGroup, g}; }
LockId WantedGroup(uint64_t g) {
  return LockId{LockKind::kWanted, (uint64_t{static_cast<uint16_t>(LockKind::kGroup)} << 40) | g};
}

std::vector<uint8_t> Pattern(uint8_t seed, uint64_t blocks) {
  std::vector<uint8_t> v(blocks * kB);
  for (size_t i = 0; i < v.size(); i++) v[i] = static_cast<uint8_t>(seed + i * 7 + i / kB);
  return v;
}

uint64_t Pending(Volume* vol) {
  auto st = vol->Stats();
  REQUIRE(st.ok());
  return st->pending_drops;
}

// Hosts of one in-memory volume with local locks (one lock file, one lock
// manager per host), each opened on a device of the test's choosing.
struct LocalHosts {
  std::string lock_path =
      "/tmp/dede-hosts-" + std::to_string(getpid()) + "-" + std::to_string(rand());
  ManualClock clock;
  ~LocalHosts() { ::unlink(lock_path.c_str()); }
  std::shared_ptr<LockManager> NewLocks() {
    auto lm = OpenLocalLockManager(lock_path);
    REQUIRE(lm.ok());
    return std::shared_ptr<LockManager>(std::move(lm.value()));
  }
  // `oo` gives the options other than the host, its locks and the clock.
  Result<std::unique_ptr<Volume>> TryOpen(BlockDevice* dev, uint32_t host,
                                          std::shared_ptr<LockManager> lm, OpenOptions oo = {}) {
    oo.host_id = host;
    oo.locks = std::move(lm);
    oo.clock = &clock;
    return Volume::Open(dev, oo);
  }
  std::unique_ptr<Volume> Open(BlockDevice* dev, uint32_t host, std::shared_ptr<LockManager> lm,
                               OpenOptions oo = {}) {
    auto v = TryOpen(dev, host, std::move(lm), std::move(oo));
    INFO("open as host " << host << ": " << v.status().ToString());
    REQUIRE(v.ok());
    return std::move(v.value());
  }
};

// The volume, host 1's view, and the files: "a" holds kShared blocks of
// pattern X, "b" shares them (clone_block), so each has refcount 2.
struct Rig : LocalHosts {
  MemDevice base{64 << 20};
  std::shared_ptr<LockManager> lm1, lm2, holder;
  std::unique_ptr<Volume> v1;
  std::vector<uint8_t> x = Pattern(0x11, kShared);
  std::vector<uint8_t> y = Pattern(0x77, kShared);
  std::vector<LockId> held;

  // `journal_blocks`, `drop_blocks`: FormatOptions' (0, -1: automatic).
  explicit Rig(uint64_t journal_blocks = 0, int64_t drop_blocks = -1) {
    FormatOptions fo;
    fo.group_refblocks = 2;  // several small groups
    fo.journal_blocks = journal_blocks;
    fo.drop_blocks = drop_blocks;
    REQUIRE(FormatVolume(&base, fo, false).ok());
    lm1 = NewLocks();
    lm2 = NewLocks();
    holder = NewLocks();
    v1 = OpenAs(&base, 1, lm1);
    REQUIRE(v1->Create("a", 1 << 20).ok());
    REQUIRE(v1->Create("b", 1 << 20).ok());
    auto a = v1->OpenFile("a");
    auto b = v1->OpenFile("b");
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    REQUIRE(a.value()->Write(0, x.data(), x.size()).ok());
    for (uint64_t i = 0; i < kShared; i++) {
      REQUIRE(v1->CloneBlock(a.value().get(), i, b.value().get(), i).ok());
    }
    REQUIRE(v1->Sync().ok());
    auto st = v1->Stats();
    REQUIRE(st.ok());
    REQUIRE(st->shared_blocks == kShared);
  }
  std::unique_ptr<Volume> OpenAs(BlockDevice* dev, uint32_t host, std::shared_ptr<LockManager> lm) {
    return Open(dev, host, std::move(lm));
  }

  // The holder asks host 1 for its cached groups (host 1 hands them back
  // at its flush point) and takes group 0, where host 1 put the shared
  // blocks of an empty volume.
  void HoldGroupZero() {
    for (uint64_t g = 0; g < v1->superblock().group_count; g++) {
      REQUIRE(holder->Acquire(WantedGroup(g), LockMode::kShared, false).ok());
    }
    REQUIRE(v1->Sync().ok());
    for (uint64_t g = 0; g < v1->superblock().group_count; g++) {
      REQUIRE(holder->Release(WantedGroup(g)).ok());
    }
    REQUIRE(holder->Acquire(Group(0), LockMode::kExclusive, false).ok());
    held.push_back(Group(0));
  }
  void LetGo() {
    for (const LockId& id : held) REQUIRE(holder->Release(id).ok());
    held.clear();
  }

  // Host 2 overwrites b's shared blocks with pattern Y: a copy-on-write
  // break of every block, dropping its references to group 0's blocks.
  void CowBreakOn(Volume* v2) {
    auto b = v2->OpenFile("b");
    REQUIRE(b.ok());
    Status w = b.value()->Write(0, y.data(), y.size());
    INFO("host 2 writing b while group 0 is held elsewhere: " << w.ToString());
    REQUIRE(w.ok());
    REQUIRE(b.value()->Flush().ok());
  }

  // Host 2 dies: nothing unflushed survives and nothing more gets out
  // (its close cannot write); its locks go with its lock manager.
  void KillHost2(FaultDevice* d2, std::unique_ptr<Volume>* v2) {
    std::mt19937_64 rng(7);
    d2->Crash(rng, 0.0);
    d2->FailWritesAfter(0, EIO);
    v2->reset();
    lm2.reset();
  }

  void CheckContents(Volume* v) {
    std::vector<uint8_t> got(kShared * kB);
    auto a = v->OpenFile("a");
    REQUIRE(a.ok());
    REQUIRE(a.value()->Read(0, got.data(), got.size()).ok());
    CHECK(got == x);
    auto b = v->OpenFile("b");
    REQUIRE(b.ok());
    REQUIRE(b.value()->Read(0, got.data(), got.size()).ok());
    CHECK(got == y);
  }

  // Host 2 breaks b's sharing while group 0 is held elsewhere and dies
  // (its drops pending, in its journal); once the group is let go, host 3
  // opens, adopts them into its own journal (step two), and idles.
  std::unique_ptr<Volume> AdoptedOnHost3() {
    HoldGroupZero();
    FaultDevice d2(&base);
    auto v2 = OpenAs(&d2, 2, lm2);
    CowBreakOn(v2.get());
    KillHost2(&d2, &v2);
    LetGo();
    auto v3 = OpenAs(&base, 3, NewLocks());
    REQUIRE(v3->drop_counters().adopted == kShared);
    return v3;
  }

  // Both files as they should be, and nothing for fsck to find.
  void CheckContentsAndFsck(Volume* v) {
    CheckContents(v);
    std::string problems = test::FsckProblems(v);
    INFO("fsck:" << problems);
    CHECK(problems.empty());
  }
};

}  // namespace

TEST_CASE("volume drops: a copy-on-write break does not wait for a group another host holds",
          "[volume][drops]") {
  Rig r;
  r.HoldGroupZero();
  auto v2 = r.OpenAs(&r.base, 2, r.lm2);
  r.CowBreakOn(v2.get());
  // Deferred: the old blocks still count both references on disk.
  CHECK(Pending(v2.get()) == kShared);
  auto st = v2->Stats();
  REQUIRE(st.ok());
  CHECK(st->shared_blocks == kShared);
  // Host 2 asked the holder for the group (kWanted), without waiting.
  auto wanted = r.holder->IsHeldElsewhere(WantedGroup(0));
  REQUIRE(wanted.ok());
  CHECK(wanted.value());
  r.CheckContents(v2.get());

  // The holder lets go; host 2's next flush point applies the drops.
  r.LetGo();
  r.clock.Advance(1'000'000'000);
  REQUIRE(v2->Sync().ok());
  CHECK(Pending(v2.get()) == 0);
  st = v2->Stats();
  REQUIRE(st.ok());
  CHECK(st->shared_blocks == 0);
  wanted = r.holder->IsHeldElsewhere(WantedGroup(0));
  REQUIRE(wanted.ok());
  CHECK_FALSE(wanted.value());
  r.v1.reset();  // fsck wants the volume to itself
  r.CheckContentsAndFsck(v2.get());
}

TEST_CASE("volume drops: pending drops survive a crash and the slot's next owner applies them",
          "[volume][drops][crash]") {
  Rig r;
  r.HoldGroupZero();
  FaultDevice d2(&r.base);  // host 2's path to the disk
  auto v2 = r.OpenAs(&d2, 2, r.lm2);
  r.CowBreakOn(v2.get());  // flushed: the drops are durable
  REQUIRE(Pending(v2.get()) == kShared);
  r.KillHost2(&d2, &v2);
  r.LetGo();

  // Host 1 recovers host 2's journal; host 2's list stays with its slot,
  // and fsck counts its entries as the references they are.
  CHECK(Pending(r.v1.get()) == kShared);
  std::string problems = test::FsckProblems(r.v1.get());
  INFO("fsck with host 2's drops pending:" << problems);
  CHECK(problems.empty());
  r.CheckContents(r.v1.get());

  // Host 2 comes back and applies them.
  r.lm2 = r.NewLocks();
  v2 = r.OpenAs(&r.base, 2, r.lm2);
  r.clock.Advance(1'000'000'000);
  REQUIRE(r.v1->Sync().ok());  // no one wants host 1's groups: nothing to hand back
  REQUIRE(v2->Sync().ok());
  if (Pending(v2.get()) != 0) {
    // Host 1 cached group 0 during its fsck and recovery: host 2 announced
    // it wants it; host 1 hands it back at its flush point.
    REQUIRE(r.v1->Sync().ok());
    r.clock.Advance(1'000'000'000);
    REQUIRE(v2->Sync().ok());
  }
  CHECK(Pending(v2.get()) == 0);
  auto st = v2->Stats();
  REQUIRE(st.ok());
  CHECK(st->shared_blocks == 0);
  r.CheckContents(v2.get());
  r.v1.reset();
  problems = test::FsckProblems(v2.get());
  INFO("fsck after host 2 applied its drops:" << problems);
  CHECK(problems.empty());
}

TEST_CASE("volume drops: a crash before the flush loses the drop with the pointer change",
          "[volume][drops][crash]") {
  Rig r;
  r.HoldGroupZero();
  FaultDevice d2(&r.base);
  auto v2 = r.OpenAs(&d2, 2, r.lm2);
  {
    auto b = v2->OpenFile("b");
    REQUIRE(b.ok());
    REQUIRE(b.value()->Write(0, r.y.data(), r.y.size()).ok());  // not flushed
  }
  r.KillHost2(&d2, &v2);
  r.LetGo();
  // The close tried to checkpoint and failed: whatever reached the disk
  // is a prefix of host 2's journal. Either way the counts match the maps.
  r.v1.reset();
  r.lm2 = r.NewLocks();
  v2 = r.OpenAs(&r.base, 2, r.lm2);
  r.clock.Advance(1'000'000'000);
  REQUIRE(v2->Sync().ok());
  std::string problems = test::FsckProblems(v2.get());
  INFO("fsck:" << problems);
  CHECK(problems.empty());
  std::vector<uint8_t> got(kShared * kB);
  auto a = v2->OpenFile("a");
  REQUIRE(a.ok());
  REQUIRE(a.value()->Read(0, got.data(), got.size()).ok());
  CHECK(got == r.x);
  CHECK(Pending(v2.get()) == 0);
}

TEST_CASE("volume drops: fsck reports a damaged drop list and repair clears it",
          "[volume][drops][fsck]") {
  Rig r;
  r.HoldGroupZero();
  auto v2 = r.OpenAs(&r.base, 2, r.lm2);
  r.CowBreakOn(v2.get());
  REQUIRE(Pending(v2.get()) == kShared);
  v2.reset();  // host 2 goes away; the holder keeps group 0 meanwhile
  r.lm2.reset();
  r.LetGo();
  const Superblock sb = r.v1->superblock();
  const uint64_t addr = sb.DropListStart(2);
  std::vector<uint8_t> blk(kB);
  REQUIRE(r.base.Read(addr * kB, blk.data(), kB).ok());
  blk[100] ^= 0x40;  // inside the entries: the crc fails
  REQUIRE(r.base.Write(addr * kB, blk.data(), kB).ok());

  std::string problems = test::FsckProblems(r.v1.get());
  INFO("fsck:" << problems);
  CHECK(problems.find("drop list of host 2 block " + std::to_string(addr)) != std::string::npos);
  // Its entries are lost, so their blocks now count one reference too many.
  CHECK(problems.find("refcount 2 stored, 1 references found") != std::string::npos);
  auto rep = CheckVolume(r.v1.get(), true);
  REQUIRE(rep.ok());
  CHECK_FALSE(rep->clean());
  problems = test::FsckProblems(r.v1.get());
  INFO("fsck after repair:" << problems);
  CHECK(problems.empty());
  CHECK(Pending(r.v1.get()) == 0);
  // Host 2's slot opens again with an empty list.
  r.lm2 = r.NewLocks();
  v2 = r.OpenAs(&r.base, 2, r.lm2);
  CHECK(Pending(v2.get()) == 0);
}

namespace {

// Problems fsck may report after a crash between the two steps of an
// adoption: a block keeps one reference too many (a leak). Anything else,
// above all a count below its references (a drop applied twice, which
// would free a block still in use), fails.
void RequireOnlyLeaks(Volume* vol) {
  auto rep = CheckVolume(vol, false);
  REQUIRE(rep.ok());
  for (const auto& p : rep->problems) {
    INFO(p.where << ": " << p.what);
    unsigned long long stored = 0, found = 0;
    REQUIRE(std::sscanf(p.what.c_str(), "refcount %llu stored, %llu references found", &stored,
                        &found) == 2);
    CHECK(stored > found);
  }
}

// Applies every pending drop: host 1 hands back what it cached, `v` drains.
void DrainAll(Rig& r, Volume* v) {
  for (int round = 0; round < 4 && Pending(v) > 0; round++) {
    r.clock.Advance(1'000'000'000);
    REQUIRE(r.v1->Sync().ok());
    r.clock.Advance(1'000'000'000);
    REQUIRE(v->Sync().ok());
  }
  CHECK(Pending(v) == 0);
}

}  // namespace

TEST_CASE("volume drops: another host adopts and applies the drops of a host that does not return",
          "[volume][drops][crash]") {
  // Also with a drop list bigger than one transaction holds (600 blocks
  // against 32): adoption asks the journal for the blocks it touches, not
  // for the whole list (which the journal refuses).
  const bool big_list = GENERATE(false, true);
  CAPTURE(big_list);
  Rig r(big_list ? 668 : 0, big_list ? 600 : -1);
  r.HoldGroupZero();
  FaultDevice d2(&r.base);
  auto v2 = r.OpenAs(&d2, 2, r.lm2);
  r.CowBreakOn(v2.get());  // flushed: the drops are durable in host 2's list
  REQUIRE(v2->drop_counters().pending == kShared);
  r.KillHost2(&d2, &v2);
  r.LetGo();

  // Host 3 starts: it recovers host 2's journal and takes over its list.
  auto lm3 = r.NewLocks();
  auto v3 = r.OpenAs(&r.base, 3, lm3);
  CHECK(v3->drop_counters().adopted == kShared);
  CHECK(v3->drop_counters().pending == kShared);
  CHECK(Pending(v3.get()) == kShared);  // moved, not copied
  r.CheckContents(v3.get());
  DrainAll(r, v3.get());
  CHECK(v3->drop_counters().applied == kShared);
  auto st = v3->Stats();
  REQUIRE(st.ok());
  CHECK(st->shared_blocks == 0);
  r.CheckContents(v3.get());

  // Host 2's slot, opened again much later, has nothing left to apply.
  r.lm2 = r.NewLocks();
  v2 = r.OpenAs(&r.base, 2, r.lm2);
  CHECK(v2->drop_counters().pending == 0);
  v2.reset();
  r.v1.reset();
  std::string problems = test::FsckProblems(v3.get());
  INFO("fsck:" << problems);
  CHECK(problems.empty());
}

// fsck --repair recounts references from the drop lists on the disk. A
// live host's newest list may be only in its journal (an adoption's
// second step commits the adopter's list there): the recount missed
// those entries and lowered the counts, and the host's later drops took
// them to zero under blocks still mapped.
TEST_CASE(
    "volume drops: fsck --repair does not lower counts while a live host's journal holds "
    "transactions",
    "[volume][drops][crash]") {
  Rig r;
  auto v3 = r.AdoptedOnHost3();
  r.v1.reset();
  {
    auto v4 = r.OpenAs(&r.base, 4, r.NewLocks());
    Result<FsckReport> rep = CheckVolume(v4.get(), /*repair=*/true);
    REQUIRE(rep.ok());
    for (const FsckProblem& p : rep->problems) {
      INFO(p.where << ": " << p.what);
      // Reported, maybe, but never "repaired" downwards.
      if (p.what.find("references found") != std::string::npos) CHECK_FALSE(p.repaired);
    }
  }
  for (int round = 0; round < 4 && Pending(v3.get()) > 0; round++) {
    r.clock.Advance(61'000'000'000);
    REQUIRE(v3->Sync().ok());
  }
  CHECK(Pending(v3.get()) == 0);
  r.CheckContentsAndFsck(v3.get());
}

TEST_CASE("volume drops: a live host's list is never adopted and a free slot's is at a flush point",
          "[volume][drops]") {
  Rig r;
  r.HoldGroupZero();
  auto v2 = r.OpenAs(&r.base, 2, r.lm2);
  r.CowBreakOn(v2.get());
  REQUIRE(v2->drop_counters().pending == kShared);
  auto lm3 = r.NewLocks();
  auto v3 = r.OpenAs(&r.base, 3, lm3);
  r.clock.Advance(120'000'000'000);  // past the adoption interval
  REQUIRE(v3->Sync().ok());
  CHECK(v3->drop_counters().adopted == 0);
  CHECK(v2->drop_counters().pending == kShared);

  // Host 2 leaves cleanly while group 0 is still held: its close cannot
  // apply the drops, so they stay in its free slot; host 3's next due
  // flush point adopts them, and applies them once the group is free.
  v2.reset();
  r.lm2.reset();
  REQUIRE(v3->Sync().ok());
  CHECK(v3->drop_counters().adopted == 0);  // not due yet
  r.clock.Advance(61'000'000'000);
  REQUIRE(v3->Sync().ok());
  CHECK(v3->drop_counters().adopted == kShared);
  CHECK(Pending(v3.get()) == kShared);
  r.LetGo();
  DrainAll(r, v3.get());
  r.v1.reset();
  r.CheckContentsAndFsck(v3.get());
}

TEST_CASE("volume drops: a crash at any write of an adoption never applies a drop twice",
          "[volume][drops][crash]") {
  // Step (1) of an adoption is a commit and a checkpoint, step (2) a
  // commit: five writes in all. Fail each in turn (and none), crash
  // keeping none, half or all of the unsynced writes, recover, and apply
  // everything.
  size_t runs_adopted = 0, runs_failed = 0;
  for (uint64_t fail_after = 0; fail_after < 7; fail_after++) {
    for (double keep : {0.0, 0.5, 1.0}) {
      {
        INFO("writes allowed " << fail_after << ", keep " << keep);
        Rig r;
        r.HoldGroupZero();
        FaultDevice d2(&r.base);
        auto v2 = r.OpenAs(&d2, 2, r.lm2);
        r.CowBreakOn(v2.get());
        r.KillHost2(&d2, &v2);
        r.LetGo();
        // Host 1 recovers host 2's journal first, so host 3's writes are
        // the adoption's own.
        REQUIRE(r.v1->Sync().ok());

        FaultDevice d3(&r.base);
        d3.FailWritesAfter(fail_after, EIO);
        {
          auto lm3 = r.NewLocks();
          OpenOptions oo;
          oo.host_id = 3;
          oo.locks = lm3;
          oo.clock = &r.clock;
          auto v3 = Volume::Open(&d3, oo);
          if (v3.ok() && v3.value()->drop_counters().adopted == kShared) {
            runs_adopted++;
          } else {
            runs_failed++;
          }
          std::mt19937_64 rng(fail_after * 10 + static_cast<uint64_t>(keep * 2));
          d3.Crash(rng, keep);
          d3.FailWritesAfter(0, EIO);  // nothing more gets out
          if (v3.ok()) v3.value().reset();
        }
        // Host 3 is gone; host 4 recovers its journal, adopts what is left
        // anywhere and applies it.
        auto lm4 = r.NewLocks();
        auto v4 = r.OpenAs(&r.base, 4, lm4);
        r.clock.Advance(61'000'000'000);
        DrainAll(r, v4.get());
        r.CheckContents(v4.get());
        r.v1.reset();
        RequireOnlyLeaks(v4.get());
      }
    }
  }
  // Both outcomes happened: some runs got the adoption through, some died in it.
  CHECK(runs_adopted > 0);
  CHECK(runs_failed > 0);
}

// Step one of an adoption commits host h's shortened list to the
// adopter's journal and then checkpoints it home. When that checkpoint
// failed (the volume poisoned), kRecovery(h) was released all the same:
// h's next owner could then read its list from home, still holding the
// adopted entries, apply them, and later see the adopter's journal replay
// write the shortened list over its own, bringing back entries it had
// applied. A poisoned adopter now keeps kRecovery(h), like every lock of
// a poisoned volume, until its journal has been replayed.
TEST_CASE(
    "volume drops: an adopter whose first step fails to reach home keeps the slot's "
    "kRecovery",
    "[volume][drops][crash]") {
  Rig r;
  r.HoldGroupZero();
  FaultDevice d2(&r.base);
  auto v2 = r.OpenAs(&d2, 2, r.lm2);
  r.CowBreakOn(v2.get());
  r.KillHost2(&d2, &v2);
  r.LetGo();
  REQUIRE(r.v1->Sync().ok());  // host 1 replays host 2's journal first

  // Host 3 adopts at open: the commit of step one is written, its
  // checkpoint's first home write fails.
  FaultDevice d3(&r.base);
  d3.FailWritesAfter(1, EIO);
  auto lm3 = r.NewLocks();
  {
    OpenOptions oo;
    oo.host_id = 3;
    oo.locks = lm3;
    oo.clock = &r.clock;
    auto v3 = Volume::Open(&d3, oo);
    INFO(v3.status().ToString());
    REQUIRE_FALSE(v3.ok());
  }
  auto probe = r.NewLocks();
  const LockId rec{LockKind::kRecovery, 2};
  Status st = probe->Acquire(rec, LockMode::kExclusive, false);
  INFO(st.ToString());
  CHECK(st.code() == Status::Code::kLocked);
  if (st.ok()) REQUIRE(probe->Release(rec).ok());

  // Host 3's process is gone: host 4 replays its journal, adopts what is
  // left anywhere and applies it; nothing is applied twice.
  lm3.reset();
  std::mt19937_64 rng(3);
  d3.Crash(rng, 0.5);
  auto lm4 = r.NewLocks();
  auto v4 = r.OpenAs(&r.base, 4, lm4);
  r.clock.Advance(61'000'000'000);
  DrainAll(r, v4.get());
  r.CheckContents(v4.get());
  r.v1.reset();
  RequireOnlyLeaks(v4.get());
}

TEST_CASE("volume drops: usage is counted without waiting for a group held elsewhere",
          "[volume][drops]") {
  Rig r;
  r.HoldGroupZero();
  auto v2 = r.OpenAs(&r.base, 2, r.lm2);
  auto a = v2->OpenFile("a");
  REQUIRE(a.ok());
  const auto t0 = std::chrono::steady_clock::now();
  auto usage = a.value()->Usage();
  REQUIRE(usage.ok());
  // As written home before the holder took the group: all shared.
  CHECK(usage->shared_blocks == kShared);
  CHECK(usage->unique_blocks == 0);
  // Waiting would have taken the volume's lock wait (60 s) and then failed.
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
  auto wanted = r.holder->IsHeldElsewhere(WantedGroup(0));
  REQUIRE(wanted.ok());
  CHECK_FALSE(wanted.value());  // a reader does not even ask for the group

  // Once the group is free the reader takes it and counts exactly.
  r.LetGo();
  r.CowBreakOn(v2.get());  // b drops its references now, in its own group
  usage = a.value()->Usage();
  REQUIRE(usage.ok());
  CHECK(usage->shared_blocks == 0);
  CHECK(usage->unique_blocks == kShared);
  for (uint64_t i = 0; i < kShared; i++) {
    auto refs = a.value()->BlockRefCount(i);
    REQUIRE(refs.ok());
    CHECK(refs.value() == 1);
  }
  CHECK(Pending(v2.get()) == 0);
}

// The reserving hand-over (docs/LOCKING.md rule 4). A waiter (here the
// raw lock manager `holder`, playing host 3) announces a wait for group 0,
// where host 1 allocated a's blocks and which host 1 still caches. Host 1
// hands the group back at its next flush point. Its next allocating write,
// its next copy-on-write break of a block there and its next count read
// must then leave group 0 alone (allocate elsewhere, defer the drop, read
// the count from home) until the waiter has had it: taking it straight
// back, as before, starved a waiter that polls every few milliseconds
// while the holder allocates every few microseconds.
TEST_CASE("volume drops: a holder leaves a wanted group to the host waiting for it",
          "[volume][drops]") {
  Rig r;
  REQUIRE(r.v1->Create("c", 1 << 20).ok());
  std::vector<uint8_t> blk(kB, 0x5a);
  auto c = r.v1->OpenFile("c");
  REQUIRE(c.ok());
  REQUIRE(c.value()->Write(0, blk.data(), kB).ok());  // host 1 takes group 0
  REQUIRE(r.v1->Sync().ok());
  auto held = r.holder->IsHeldElsewhere(Group(0));
  REQUIRE(held.ok());
  REQUIRE(held.value());

  REQUIRE(r.holder->Acquire(WantedGroup(0), LockMode::kShared, false).ok());
  REQUIRE(r.v1->Sync().ok());  // the flush point hands everything back
  held = r.holder->IsHeldElsewhere(Group(0));
  REQUIRE(held.ok());
  REQUIRE_FALSE(held.value());

  // Allocation: a new block of c comes from another group.
  REQUIRE(c.value()->Write(kB, blk.data(), kB).ok());
  held = r.holder->IsHeldElsewhere(Group(0));
  REQUIRE(held.ok());
  CHECK_FALSE(held.value());
  // A copy-on-write break of b's shared blocks (their counts live in
  // group 0): the drops are deferred, not applied by taking the group.
  auto b = r.v1->OpenFile("b");
  REQUIRE(b.ok());
  REQUIRE(b.value()->Write(0, r.y.data(), r.y.size()).ok());
  // A count read (statistics) reads group 0's block from home.
  auto usage = b.value()->Usage();
  REQUIRE(usage.ok());
  REQUIRE(r.v1->Sync().ok());
  held = r.holder->IsHeldElsewhere(Group(0));
  REQUIRE(held.ok());
  CHECK_FALSE(held.value());
  CHECK(r.v1->drop_counters().yielded > 0);
  CHECK(r.v1->drop_counters().pending == kShared);

  // The waiter gets the group without a fight, lets it go, and host 1's
  // next flush point applies its drops (it announced them itself, so it
  // does not yield to its own announcement).
  REQUIRE(r.holder->Acquire(Group(0), LockMode::kExclusive, false).ok());
  REQUIRE(r.holder->Release(Group(0)).ok());
  REQUIRE(r.holder->Release(WantedGroup(0)).ok());
  r.clock.Advance(1'000'000'000);
  REQUIRE(r.v1->Sync().ok());
  CHECK(r.v1->drop_counters().pending == 0);
  b.value().reset();
  c.value().reset();
  r.CheckContentsAndFsck(r.v1.get());
}

// Two hosts with deferred drops in the same group both announce them.
// Neither may leave the group to the other (both would wait for ever):
// an announcer takes a free group it announced itself.
TEST_CASE("volume drops: two hosts with drops in one group do not leave it to each other",
          "[volume][drops]") {
  Rig r;
  r.HoldGroupZero();
  auto v2 = r.OpenAs(&r.base, 2, r.lm2);
  r.CowBreakOn(v2.get());  // host 2 defers kShared drops, announces group 0
  REQUIRE(Pending(v2.get()) == kShared);
  // Host 1 breaks a's sharing too: its drops land in group 0 as well.
  {
    auto a = r.v1->OpenFile("a");
    REQUIRE(a.ok());
    REQUIRE(a.value()->Write(0, r.y.data(), r.y.size()).ok());
  }
  REQUIRE(r.v1->Sync().ok());
  REQUIRE(r.v1->drop_counters().pending == kShared);

  r.LetGo();
  r.clock.Advance(1'000'000'000);
  REQUIRE(r.v1->Sync().ok());
  r.clock.Advance(1'000'000'000);
  REQUIRE(v2->Sync().ok());  // host 1's flush point handed the group over
  r.clock.Advance(1'000'000'000);
  REQUIRE(r.v1->Sync().ok());
  CHECK(r.v1->drop_counters().pending == 0);
  CHECK(v2->drop_counters().pending == 0);
  r.v1.reset();
  std::string problems = test::FsckProblems(v2.get());
  INFO("fsck:" << problems);
  CHECK(problems.empty());
  auto st = v2->Stats();
  REQUIRE(st.ok());
  CHECK(st->shared_blocks == 0);
}

TEST_CASE("volume: a quiet host's flush points write its journal home for other readers",
          "[volume][drops]") {
  // A host that holds its groups and goes idle: without a checkpoint, the
  // counts other processes read (dede stats, another host's Usage) are its
  // state as of its last busy moment, for as long as it stays idle.
  Rig r;
  auto a = r.v1->OpenFile("a");
  REQUIRE(a.ok());
  // Un-share a's blocks (copy-on-write), in host 1's cache and journal.
  const std::vector<uint8_t> z = Pattern(0x33, kShared);
  REQUIRE(a.value()->Write(0, z.data(), z.size()).ok());
  REQUIRE(r.v1->Sync().ok());  // committed (durable in the journal), not home
  auto shared_seen_by_reader = [&]() {
    OpenOptions oo;
    oo.read_only = true;
    oo.locks = r.NewLocks();
    auto ro = Volume::Open(&r.base, oo);
    REQUIRE(ro.ok());
    auto st = ro.value()->Stats();
    REQUIRE(st.ok());
    return st->shared_blocks;
  };
  CHECK(shared_seen_by_reader() == kShared);  // stale: the home blocks
  REQUIRE(r.v1->Sync().ok());  // quiet flush points: the journal goes home
  REQUIRE(r.v1->Sync().ok());
  CHECK(shared_seen_by_reader() == 0);
  a.value().reset();
}

namespace {

// At the first write after Arm() (in a copy-on-write write, the data write
// between looking at the old blocks and publishing the new ones), runs
// `hook`; from then on, the first read of a refcount block fails with EIO.
class HookDevice : public test::ForwardingDevice {
 public:
  explicit HookDevice(BlockDevice* base) : ForwardingDevice(base, "hook") {}
  void Arm(std::function<void()> hook) { hook_ = std::move(hook); }
  bool failed_read() const { return failed_read_; }
  Status Write(uint64_t offset, const void* buf, size_t len) override {
    if (hook_) {
      auto h = std::move(hook_);
      hook_ = nullptr;
      h();
      fail_refcount_read_ = true;
    }
    return base()->Write(offset, buf, len);
  }
  Status Read(uint64_t offset, void* buf, size_t len) override {
    RETURN_IF_ERROR(base()->Read(offset, buf, len));
    if (fail_refcount_read_ && len == kB &&
        PeekHeader(static_cast<const uint8_t*>(buf)).magic == kMagicRefcountBlock) {
      fail_refcount_read_ = false;
      failed_read_ = true;
      return Status::IoError("injected refcount block read error");
    }
    return Status::Ok();
  }

 private:
  std::function<void()> hook_;
  bool fail_refcount_read_ = false;
  bool failed_read_ = false;
};

}  // namespace

TEST_CASE("volume drops: a failed drop after a copy's pointer is published never commits",
          "[volume][drops]") {
  // Host 2 copies b's shared blocks while the holder has their group, so it
  // does not read their counts first. The holder lets go during the data
  // write; publishing then takes the group and reads its refcount block to
  // drop the old reference, after the new pointer is in the map, and that
  // read fails. The write fails, and the round must never commit: a drop
  // that failed after its pointer was published used to be undone by
  // giving the new block back, so the next commit left b naming a free
  // block, which the next allocation handed to another file.
  Rig r;
  r.HoldGroupZero();
  HookDevice hook(&r.base);
  auto v2 = r.OpenAs(&hook, 2, r.lm2);
  auto b = v2->OpenFile("b");
  REQUIRE(b.ok());
  hook.Arm([&] {
    r.LetGo();
    r.clock.Advance(1'000'000'000);
  });
  Status w = b.value()->Write(0, r.y.data(), r.y.size());
  INFO("host 2's write: " << w.ToString());
  REQUIRE(hook.failed_read());
  REQUIRE_FALSE(w.ok());
  // Refused from now on: nothing of the half-published round reaches the
  // disk, and no other write or commit carries on past it.
  CHECK_FALSE(v2->Sync().ok());
  CHECK_FALSE(b.value()->Write(0, r.y.data(), kB).ok());
  b.value().reset();
  v2.reset();
  r.lm2.reset();
  // Host 2's lock manager is gone (the process died); the next opener
  // replays what it committed, which is everything before this write.
  r.v1.reset();
  auto v3 = r.OpenAs(&r.base, 3, r.NewLocks());
  std::string problems = test::FsckProblems(v3.get());
  INFO("fsck:" << problems);
  CHECK(problems.empty());
  std::vector<uint8_t> got(kShared * kB);
  auto b3 = v3->OpenFile("b");
  REQUIRE(b3.ok());
  REQUIRE(b3.value()->Read(0, got.data(), got.size()).ok());
  CHECK(got == r.x);
}

namespace {

// Forwards to a lock manager and notes when a try for `watched` finds it
// held elsewhere (its holder is waiting for it).
class NotesLockedTry : public test::ForwardingLocks {
 public:
  NotesLockedTry(std::shared_ptr<LockManager> base, LockId watched)
      : ForwardingLocks(std::move(base)), watched_(watched) {}
  Status Acquire(LockId id, LockMode mode, bool wait) override {
    Status st = ForwardingLocks::Acquire(id, mode, wait);
    if (id == watched_ && st.code() == Status::Code::kLocked) found_locked = true;
    return st;
  }
  std::atomic<bool> found_locked{false};

 private:
  const LockId watched_;
};

}  // namespace

TEST_CASE("volume: a dead slot's journal is not replayed once a new owner has taken the slot",
          "[volume][drops][crash]") {
  // Host 3's scan sees host 2's slot free with transactions and waits for
  // kRecovery(2). Meanwhile host 2 comes back: it takes its slot and
  // kRecovery(2), replays, releases kRecovery(2) and commits to its journal
  // again. The scan must look at the slot again under kRecovery(2) and leave
  // a live journal alone (it used to replay it, racing its owner).
  Rig r;
  r.v1.reset();
  FaultDevice d2(&r.base);
  auto v2 = r.OpenAs(&d2, 2, r.lm2);
  const Superblock sb = v2->superblock();
  {
    auto a = v2->OpenFile("a");
    REQUIRE(a.ok());
    REQUIRE(a.value()->Write(0, r.y.data(), kB).ok());
    REQUIRE(a.value()->Flush().ok());
    // Host 2 dies: its file's close (a checkpoint) cannot reach the disk.
    std::mt19937_64 rng(7);
    d2.Crash(rng, 0.0);
    d2.FailWritesAfter(0, EIO);
  }
  v2.reset();
  r.lm2.reset();
  const LockId slot2{LockKind::kHostSlot, 2};
  const LockId rec2{LockKind::kRecovery, 2};
  auto pending = [&] {
    auto j = Journal::Open(&r.base, sb, 2);
    REQUIRE(j.ok());
    auto p = j.value()->HasTransactions();
    REQUIRE(p.ok());
    return p.value();
  };
  REQUIRE(pending());
  // "Host 2 coming back" holds kRecovery(2) while host 3 starts.
  REQUIRE(r.holder->Acquire(rec2, LockMode::kExclusive, false).ok());
  Status came_back;  // Catch's assertions are for the test's own thread
  auto lm3 = std::make_shared<NotesLockedTry>(r.NewLocks(), rec2);
  bool host3_waited = false;
  std::thread back([&] {
    // Host 2 comes back only once host 3 waits for kRecovery(2).
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!lm3->found_locked && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    host3_waited = lm3->found_locked;
    came_back = r.holder->Acquire(slot2, LockMode::kExclusive, false);
    if (came_back.ok()) came_back = r.holder->Release(rec2);
  });
  OpenOptions oo;
  oo.host_id = 3;
  oo.locks = lm3;
  oo.clock = &r.clock;
  auto v3 = Volume::Open(&r.base, oo);
  Status created = v3.ok() ? v3.value()->Create("c", 1 << 20).status() : v3.status();
  back.join();
  REQUIRE(host3_waited);
  INFO("host 2 coming back: " << came_back.ToString());
  REQUIRE(came_back.ok());
  INFO("host 3 opening and creating a file (so that its scan ran): " << created.ToString());
  REQUIRE(created.ok());
  CHECK(pending());  // host 2's, not host 3's, to replay
  REQUIRE(r.holder->Release(slot2).ok());
}

namespace {

// Forwards to a lock manager; while `fail` is set, asking whether a host
// slot is held elsewhere fails (a lease that cannot be read for a moment).
class SlotQueriesFail : public test::ForwardingLocks {
 public:
  using ForwardingLocks::ForwardingLocks;
  Result<bool> IsHeldElsewhere(LockId id) override {
    if (fail && id.kind == LockKind::kHostSlot) {
      return Status::IoError("injected: host slot lease unreadable");
    }
    return base()->IsHeldElsewhere(id);
  }
  Status Release(LockId id) override {
    if (on_release) on_release(id, false);
    return base()->Release(id);
  }
  Status ReleaseUnclean(LockId id) override {
    if (on_release) on_release(id, true);
    return base()->ReleaseUnclean(id);
  }
  std::atomic<bool> fail{false};
  std::function<void(LockId, bool unclean)> on_release;
};

class FlushCounter : public test::ForwardingDevice {
 public:
  explicit FlushCounter(BlockDevice* base) : ForwardingDevice(base, "count") {}
  Status Flush() override {
    flushes++;
    return base()->Flush();
  }
  std::atomic<uint64_t> flushes{0};
};

}  // namespace

// Adopting the drops of hosts that left is housekeeping at a flush point.
// Its failure used to fail the flush point before the device flush: a
// client's FLUSH failed, and an export closing on it handed its lock to
// the next host with its writes maybe still in the device's cache.
TEST_CASE("volume drops: a failed adoption neither fails a flush point nor skips its device flush",
          "[volume][drops]") {
  Rig r;
  auto locks = std::make_shared<SlotQueriesFail>(r.NewLocks());
  FlushCounter dev(&r.base);
  auto v3 = r.OpenAs(&dev, 3, locks);
  auto a = v3->OpenFile("a");
  REQUIRE(a.ok());
  REQUIRE(v3->Sync().ok());
  const std::vector<uint8_t> z = Pattern(0x33, 1);
  REQUIRE(a.value()->Write(8 * kB, z.data(), z.size()).ok());  // a block of a's own
  r.clock.Advance(120'000'000'000);                            // adoption due
  locks->fail = true;
  const uint64_t before = dev.flushes.load();
  Status st = v3->Sync();
  INFO(st.ToString());
  CHECK(st.ok());
  CHECK(dev.flushes.load() > before);
  // Tried again when next due, and then it works.
  locks->fail = false;
  r.clock.Advance(61'000'000'000);
  CHECK(v3->Sync().ok());
  a.value().reset();
  v3.reset();
}

namespace {

// Reads of [lo, hi) (bytes) fail with EIO while `fail` is set; counts the
// reads of that range and every flush.
class RangeReadsFail : public test::ForwardingDevice {
 public:
  RangeReadsFail(BlockDevice* base, uint64_t lo, uint64_t hi)
      : ForwardingDevice(base, "range-reads-fail"), lo_(lo), hi_(hi) {}
  Status Read(uint64_t offset, void* buf, size_t len) override {
    if (offset < hi_ && offset + len > lo_) {
      range_reads++;
      if (fail) return Status::IoError("injected: read of a refcount block failed");
    }
    return base()->Read(offset, buf, len);
  }
  Status Flush() override {
    flushes++;
    return base()->Flush();
  }
  std::atomic<bool> fail{false};
  std::atomic<uint64_t> range_reads{0}, flushes{0};

 private:
  const uint64_t lo_, hi_;
};

// Counts exclusive tries of one lock.
class CountingLocks : public test::ForwardingLocks {
 public:
  CountingLocks(std::shared_ptr<LockManager> base, LockId counted)
      : ForwardingLocks(std::move(base)), counted_(counted) {}
  Status Acquire(LockId id, LockMode mode, bool wait) override {
    if (id == counted_ && mode == LockMode::kExclusive) tries++;
    return base()->Acquire(id, mode, wait);
  }
  std::atomic<uint64_t> tries{0};

 private:
  const LockId counted_;
};

}  // namespace

// A deferred drop whose group's refcount block cannot be read used to fail
// every flush point before its device flush (Sync returned DrainDrops'
// error): each client FLUSH failed for a drop that can wait, and a close
// handed the file on with its writes maybe still in the device's cache.
TEST_CASE(
    "volume drops: a drop that cannot be applied neither fails a flush point nor skips its "
    "device flush",
    "[volume][drops]") {
  Rig r;
  r.HoldGroupZero();
  const Superblock& sb = r.v1->superblock();
  RangeReadsFail dev(&r.base, sb.GroupStart(0) * kB,
                     (sb.GroupStart(0) + sb.GroupRefBlocks(0)) * kB);
  auto v2 = r.OpenAs(&dev, 2, r.lm2);
  r.CowBreakOn(v2.get());
  REQUIRE(Pending(v2.get()) == kShared);
  // A write the next flush point must make durable (past the shared
  // blocks, allocated while group 0 is still held elsewhere).
  auto b = v2->OpenFile("b");
  REQUIRE(b.ok());
  const std::vector<uint8_t> z = Pattern(0x33, 1);
  REQUIRE(b.value()->Write(8 * kB, z.data(), z.size()).ok());
  r.LetGo();
  r.clock.Advance(1'000'000'000);  // the group is due again
  dev.fail = true;
  const uint64_t flushes = dev.flushes.load();
  Status st = v2->Sync();
  INFO(st.ToString());
  CHECK(st.ok());
  CHECK(dev.flushes.load() > flushes);
  CHECK(dev.range_reads.load() > 0);              // the drain did try
  CHECK(v2->drop_counters().pending == kShared);  // Stats would read the group
  // Not tried again at every flush point: the group waits like a busy one.
  const uint64_t reads = dev.range_reads.load();
  CHECK(v2->Sync().ok());
  CHECK(dev.range_reads.load() == reads);
  // Applied once the block reads again.
  dev.fail = false;
  r.clock.Advance(1'000'000'000);
  CHECK(v2->Sync().ok());
  CHECK(Pending(v2.get()) == 0);
  b.value().reset();
  v2.reset();
  r.CheckContentsAndFsck(r.v1.get());
}

// Group kIfDue skips: a group another host holds is tried at most once per
// busy interval at flush points. Without it, every FLUSH of a host with a
// pending drop there paid a lock-table try (a disk round trip on sanlock
// volumes) for a group whose holder had not answered yet.
TEST_CASE("volume drops: flush points do not try a group found busy lately again",
          "[volume][drops]") {
  Rig r;
  r.HoldGroupZero();
  auto locks = std::make_shared<CountingLocks>(r.lm2, Group(0));
  auto v2 = r.OpenAs(&r.base, 2, locks);
  r.CowBreakOn(v2.get());
  REQUIRE(Pending(v2.get()) == kShared);
  r.clock.Advance(1'000'000'000);
  uint64_t tries = locks->tries.load();
  REQUIRE(v2->Sync().ok());  // due: tried once, found busy
  CHECK(locks->tries.load() == tries + 1);
  tries = locks->tries.load();
  for (int i = 0; i < 5; i++) REQUIRE(v2->Sync().ok());
  CHECK(locks->tries.load() == tries);
  CHECK(Pending(v2.get()) == kShared);
  r.LetGo();
  r.clock.Advance(1'000'000'000);
  REQUIRE(v2->Sync().ok());
  CHECK(Pending(v2.get()) == 0);
  v2.reset();
  r.CheckContents(r.v1.get());
}

namespace {

// Lock-table queries of kWanted records, or releases of groups, fail while
// the matching flag is set.
class HandOverFails : public test::ForwardingLocks {
 public:
  using ForwardingLocks::ForwardingLocks;
  Result<bool> IsHeldElsewhere(LockId id) override {
    if (fail_queries && id.kind == LockKind::kWanted) {
      return Status::IoError("injected: lock table unreadable");
    }
    return base()->IsHeldElsewhere(id);
  }
  Status Release(LockId id) override {
    Status st = base()->Release(id);
    if (fail_releases && id.kind == LockKind::kGroup) {
      return Status::IoError("injected: release not written");
    }
    return st;
  }
  std::atomic<bool> fail_queries{false}, fail_releases{false};
};

}  // namespace

// A flush point hands its cached locks to processes that announced a wait
// only after its writes are durable. A failure there (a lock-table read or
// a release) used to fail the flush point all the same: a client's FLUSH
// reported an error for writes that were on the disk.
TEST_CASE("volume: a failed hand-over of cached locks does not fail the flush point before it",
          "[volume][drops]") {
  Rig r;
  auto locks = std::make_shared<HandOverFails>(r.NewLocks());
  FlushCounter dev(&r.base);
  auto v3 = r.OpenAs(&dev, 3, locks);
  auto a = v3->OpenFile("a");
  REQUIRE(a.ok());
  const std::vector<uint8_t> z = Pattern(0x33, 1);
  REQUIRE(a.value()->Write(8 * kB, z.data(), z.size()).ok());  // host 3 caches a group
  REQUIRE(v3->Sync().ok());
  const uint64_t groups = r.v1->superblock().group_count;
  for (uint64_t g = 0; g < groups; g++) {
    REQUIRE(r.holder->Acquire(WantedGroup(g), LockMode::kShared, false).ok());
  }
  REQUIRE(a.value()->Write(8 * kB, z.data(), z.size()).ok());  // in place: needs a flush
  SECTION("the wanted records cannot be read") {
    locks->fail_queries = true;
  }
  SECTION("a release fails") {
    locks->fail_releases = true;
  }
  const uint64_t before = dev.flushes.load();
  Status st = v3->Sync();
  INFO(st.ToString());
  CHECK(st.ok());
  CHECK(dev.flushes.load() > before);
  // Handed over once the lock table answers again.
  locks->fail_queries = false;
  locks->fail_releases = false;
  CHECK(v3->Sync().ok());
  for (const auto& [id, mode] : locks->Held()) {
    INFO(id.ToString());
    CHECK(id.kind != LockKind::kGroup);
  }
  for (uint64_t g = 0; g < groups; g++) REQUIRE(r.holder->Release(WantedGroup(g)).ok());
  a.value().reset();
  v3.reset();
}

// Every take of a group is followed by the dead-host scan (a dead host's
// journal may hold newer images of the group's blocks). A take whose scan
// failed used to keep the group cached: later uses saw it held, never
// scanned, and allocated from home counts that missed a dead host's
// durable allocations, so two files came to share a block with count 1.
TEST_CASE("volume: a group taken while the dead-host scan fails is given back, not used unscanned",
          "[volume][drops][crash]") {
  MemDevice base{64 << 20};
  FormatOptions fo;
  fo.group_refblocks = 64;  // one group: both hosts allocate from it
  REQUIRE(FormatVolume(&base, fo, false).ok());
  LocalHosts hosts;
  {
    auto v1 = hosts.Open(&base, 1, hosts.NewLocks());
    REQUIRE(v1->superblock().group_count == 1);
    REQUIRE(v1->Create("a", 1 << 20).ok());
    REQUIRE(v1->Create("b", 1 << 20).ok());
  }
  auto locks3 = std::make_shared<SlotQueriesFail>(hosts.NewLocks());
  std::vector<LockId> unclean, clean_after_fail;
  locks3->on_release = [&](LockId id, bool is_unclean) {
    if (is_unclean) unclean.push_back(id);
    if (!is_unclean && locks3->fail && id.kind == LockKind::kGroup) clean_after_fail.push_back(id);
  };
  auto v3 = hosts.Open(&base, 3, locks3);
  auto b3 = v3->OpenFile("b");
  REQUIRE(b3.ok());

  // Host 2 writes a's blocks durably (journal flushed, homes not yet
  // written) and dies.
  const std::vector<uint8_t> x = Pattern(0x11, kShared), y = Pattern(0x77, kShared);
  {
    FaultDevice d2(&base);
    auto lm2 = hosts.NewLocks();
    auto v2 = hosts.Open(&d2, 2, lm2);
    auto a2 = v2->OpenFile("a");
    REQUIRE(a2.ok());
    REQUIRE(a2.value()->Write(0, x.data(), x.size()).ok());
    REQUIRE(a2.value()->Flush().ok());
    std::mt19937_64 rng(7);
    d2.Crash(rng, 0.0);
    d2.FailWritesAfter(0, EIO);
    a2.value().reset();
    v2.reset();
    lm2.reset();
  }

  // Host 3 takes the group while its scan cannot read the host slots.
  locks3->fail = true;
  Status failed = b3.value()->Write(0, y.data(), y.size());
  INFO("write while the scan fails: " << failed.ToString());
  CHECK_FALSE(failed.ok());
  // Given back unclean: with sanlock a clean release erased the record
  // that told every other host a dead holder's journal comes first.
  CHECK(std::count(unclean.begin(), unclean.end(), Group(0)) == 1);
  CHECK(clean_after_fail.empty());
  locks3->fail = false;
  REQUIRE(b3.value()->Write(0, y.data(), y.size()).ok());
  REQUIRE(b3.value()->Flush().ok());
  b3.value().reset();
  v3.reset();

  auto v1 = hosts.Open(&base, 1, hosts.NewLocks());
  std::vector<uint8_t> got(kShared * kB);
  auto a = v1->OpenFile("a");
  REQUIRE(a.ok());
  REQUIRE(a.value()->Read(0, got.data(), got.size()).ok());
  CHECK(got == x);
  auto b = v1->OpenFile("b");
  REQUIRE(b.ok());
  REQUIRE(b.value()->Read(0, got.data(), got.size()).ok());
  CHECK(got == y);
  a.value().reset();
  b.value().reset();
  std::string problems = test::FsckProblems(v1.get());
  INFO("fsck:" << problems);
  CHECK(problems.empty());
  v1.reset();
}

// A pointer block a truncate freed stayed in its process's block cache
// (tagged with the truncated file) until that file closed. Once another
// host reused the address for a file of its own, this process read that
// file's map from its stale copy: zeros for written blocks, and a write
// would have committed the stale map over the other host's.
TEST_CASE("volume: a freed pointer block reused by another host is read from the device",
          "[volume][drops]") {
  MemDevice base{64 << 20};
  FormatOptions fo;
  fo.group_refblocks = 64;  // one group: both hosts allocate from it
  REQUIRE(FormatVolume(&base, fo, false).ok());
  LocalHosts hosts;
  auto lm1 = hosts.NewLocks();
  auto v1 = hosts.Open(&base, 1, lm1);
  REQUIRE(v1->superblock().group_count == 1);
  REQUIRE(v1->Create("f", 1 << 20).ok());
  REQUIRE(v1->Create("c", 1 << 20).ok());
  auto f = v1->OpenFile("f");
  REQUIRE(f.ok());
  const std::vector<uint8_t> old_data = Pattern(0x31, 1), new_data = Pattern(0x59, 1);
  REQUIRE(f.value()->Write(0, old_data.data(), kB).ok());
  REQUIRE(v1->Sync().ok());
  // Free f's one pointer block, keep f open, and hand the group over.
  REQUIRE(f.value()->Truncate(0).ok());
  auto asker = hosts.NewLocks();
  REQUIRE(asker->Acquire(WantedGroup(0), LockMode::kShared, false).ok());
  REQUIRE(v1->Sync().ok());
  REQUIRE(asker->Release(WantedGroup(0)).ok());
  {
    auto v2 = hosts.Open(&base, 2, hosts.NewLocks());
    auto c = v2->OpenFile("c");
    REQUIRE(c.ok());
    REQUIRE(c.value()->Write(0, new_data.data(), kB).ok());
    c.value().reset();
    REQUIRE(v2->Sync().ok());
  }
  auto c = v1->OpenFile("c");
  REQUIRE(c.ok());
  std::vector<uint8_t> got(kB);
  REQUIRE(c.value()->Read(0, got.data(), kB).ok());
  CHECK(got == new_data);
  c.value().reset();
  f.value().reset();
  std::string problems = test::FsckProblems(v1.get());
  INFO("fsck:" << problems);
  CHECK(problems.empty());
}

// A poisoned volume keeps its locks so that whoever takes them next
// replays its journal first. They used to go back cleanly when the lock
// manager was destroyed: with sanlock that erased their records, and
// another host took them as released cleanly, skipping the scan that
// replays this journal.
TEST_CASE("volume: a poisoned volume abandons its locks instead of releasing them",
          "[volume][drops][crash]") {
  MemDevice base{64 << 20};
  REQUIRE(FormatVolume(&base, FormatOptions{}, false).ok());
  LocalHosts hosts;
  {
    auto v1 = hosts.Open(&base, 1, hosts.NewLocks());
    REQUIRE(v1->Create("a", 1 << 20).ok());
  }
  auto locks = std::make_shared<SlotQueriesFail>(hosts.NewLocks());
  int abandoned = 0;
  std::vector<LockId> released;
  locks->on_release = [&](LockId id, bool) { released.push_back(id); };
  struct AbandonSpy : test::ForwardingLocks {
    using ForwardingLocks::ForwardingLocks;
    std::function<void()> on_abandon;
    void Abandon() override {
      on_abandon();
      ForwardingLocks::Abandon();
    }
  };
  auto spy = std::make_shared<AbandonSpy>(locks);
  spy->on_abandon = [&] {
    abandoned++;
    CHECK(!spy->Held().empty());  // the kept locks, not yet given back
  };
  FaultDevice dev(&base);
  {
    auto v2 = hosts.Open(&dev, 2, spy);
    auto a = v2->OpenFile("a");
    REQUIRE(a.ok());
    const std::vector<uint8_t> x = Pattern(0x21, 4);
    REQUIRE(a.value()->Write(0, x.data(), x.size()).ok());
    dev.FailWritesAfter(0, EIO);
    CHECK_FALSE(v2->Sync().ok());  // poisoned, with committed work unwritten
    released.clear();
    a.value().reset();
    CHECK(released.empty());  // the file's lock is kept
  }
  CHECK(abandoned == 1);
  CHECK(!locks->Held().empty());  // kept until the process (its lock manager) goes
  // Then another process takes them and replays host 2's journal.
  spy.reset();
  locks.reset();
  dev.ClearFault();
  auto v3 = hosts.Open(&base, 3, hosts.NewLocks());
  std::string problems = test::FsckProblems(v3.get());
  INFO("fsck:" << problems);
  CHECK(problems.empty());
}

// A dead host's dirty journal is replayed under its slot's kRecovery.
// With sanlock, a process that died replaying it leaves that lock's
// record live until a collector of its host marks it; the scan waited for
// it without a bound, holding the volume mutex (every file of the process
// froze, an open never returned).
TEST_CASE("volume: the wait for a slot's replayer is bounded by the lock wait",
          "[volume][drops][crash]") {
  MemDevice base{64 << 20};
  REQUIRE(FormatVolume(&base, FormatOptions{}, false).ok());
  LocalHosts hosts;
  {
    auto v1 = hosts.Open(&base, 1, hosts.NewLocks());
    REQUIRE(v1->Create("a", 1 << 20).ok());
  }
  {
    FaultDevice d2(&base);
    auto v2 = hosts.Open(&d2, 2, hosts.NewLocks());
    auto a2 = v2->OpenFile("a");
    REQUIRE(a2.ok());
    const std::vector<uint8_t> x = Pattern(0x11, 4);
    REQUIRE(a2.value()->Write(0, x.data(), x.size()).ok());
    REQUIRE(a2.value()->Flush().ok());  // in the journal, not yet home
    std::mt19937_64 rng(5);
    d2.Crash(rng, 0.0);
    d2.FailWritesAfter(0, EIO);
  }
  auto replayer = hosts.NewLocks();  // "replaying" host 2's journal, stuck
  const LockId rec{LockKind::kRecovery, 2};
  REQUIRE(replayer->Acquire(rec, LockMode::kExclusive, false).ok());
  OpenOptions oo;
  oo.lock_wait_s = 1;
  auto opening =
      std::async(std::launch::async, [&] { return hosts.TryOpen(&base, 3, hosts.NewLocks(), oo); });
  const bool returned = opening.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  REQUIRE(replayer->Release(rec).ok());  // lets an unbounded wait end too
  auto v3 = opening.get();
  CHECK(returned);
  INFO(v3.status().ToString());
  CHECK(v3.status().code() == Status::Code::kLocked);
  v3 = hosts.TryOpen(&base, 3, hosts.NewLocks());  // replays now
  REQUIRE(v3.ok());
  std::string problems = test::FsckProblems(v3.value().get());
  INFO("fsck:" << problems);
  CHECK(problems.empty());
}

// A free slot whose two journal headers are both damaged failed every
// open (the dead-host scan cannot find its tail), fsck's included, so the
// documented repair could not run; and that repair wrote fresh headers
// only, putting the tail back at sequence 1, position 0, where the ring's
// first lap still held the slot's old transactions: its next owner
// replayed them over current metadata.
TEST_CASE(
    "fsck: a free slot with damaged journal headers is passed over, reported and reset "
    "without replaying its old transactions",
    "[volume][crash]") {
  MemDevice base{64 << 20};
  REQUIRE(FormatVolume(&base, FormatOptions{}, false).ok());
  LocalHosts hosts;
  const std::vector<uint8_t> old_data = Pattern(0x21, 4), new_data = Pattern(0x43, 4);
  {
    // Host 2's journal fills its first lap with transactions: the file's
    // first content, then its second, each checkpointed at close.
    auto v2 = hosts.Open(&base, 2, hosts.NewLocks());
    REQUIRE(v2->Create("f", 1 << 20).ok());
    for (const auto* data : {&old_data, &new_data}) {
      auto f = v2->OpenFile("f");
      REQUIRE(f.ok());
      REQUIRE(f.value()->Write(0, data->data(), data->size()).ok());
      REQUIRE(f.value()->Flush().ok());
    }
  }
  // Another host removes the file after that, and creates another: host
  // 2's old transactions would bring back f's inode and block map over
  // the freed inode and counts.
  const std::vector<uint8_t> latest = Pattern(0x65, 4);
  const Superblock sb = [&] {
    auto v3 = hosts.Open(&base, 3, hosts.NewLocks());
    REQUIRE(v3->Remove("f").ok());
    REQUIRE(v3->Create("g", 1 << 20).ok());
    auto g = v3->OpenFile("g");
    REQUIRE(g.ok());
    REQUIRE(g.value()->Write(0, latest.data(), latest.size()).ok());
    REQUIRE(g.value()->Flush().ok());
    return v3->superblock();
  }();
  std::vector<uint8_t> garbage(2 * kB, 0x5a);
  REQUIRE(base.Write(sb.JournalStart(2) * kB, garbage.data(), garbage.size()).ok());

  auto refused = hosts.TryOpen(&base, 1, hosts.NewLocks());
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().ToString().find("journal of host 2") != std::string::npos);

  {
    auto v = hosts.Open(&base, 0, hosts.NewLocks(), [] {
      OpenOptions oo;
      oo.pass_damaged_journals = true;
      return oo;
    }());
    auto rep = CheckVolume(v.get(), /*repair=*/true);
    REQUIRE(rep.ok());
    bool reported = false;
    for (const auto& p : rep->problems) {
      INFO(p.where << ": " << p.what);
      CHECK(p.repaired);
      if (p.where == "journal of host 2") reported = true;
    }
    CHECK(reported);
  }

  // Host 2 opens its slot again: nothing old is replayed.
  auto v2 = hosts.Open(&base, 2, hosts.NewLocks());
  CHECK(v2->OpenFile("f").status().code() == Status::Code::kNotFound);
  auto g = v2->OpenFile("g");
  REQUIRE(g.ok());
  std::vector<uint8_t> got(latest.size());
  REQUIRE(g.value()->Read(0, got.data(), got.size()).ok());
  CHECK(got == latest);
  g.value().reset();
  std::string problems = test::FsckProblems(v2.get());
  INFO("fsck:" << problems);
  CHECK(problems.empty());
}

TEST_CASE("volume: a slot's drop list torn by a dead adopter is read after its journal's replay",
          "[volume][drops][crash]") {
  // Host 2 adopted drops from host 3's free slot (AdoptDropsOf, step one:
  // host 3's shortened list committed in host 2's journal) and died while
  // writing the list's home block. Host 3's open read its list before
  // replaying dead hosts' journals and failed on the torn block, every
  // time, until some other host replayed host 2's journal.
  Rig r;
  const Superblock sb = r.v1->superblock();
  REQUIRE(sb.drop_blocks > 0);
  const uint64_t home = sb.DropListStart(3);
  std::vector<uint8_t> image(kBlockSize);
  EncodeDropListBlock({}, 3, 9, sb.uuid, home, image.data());
  {
    auto j = Journal::Open(&r.base, sb, 2);
    REQUIRE(j.ok());
    REQUIRE(j.value()->Append({home}, {image.data()}).ok());
  }
  std::vector<uint8_t> torn(kBlockSize);
  REQUIRE(r.base.Read(home * kBlockSize, torn.data(), kBlockSize).ok());
  for (size_t i = 0; i < kBlockSize / 2; i++) torn[i] = static_cast<uint8_t>(0xA5 ^ i);
  REQUIRE(r.base.Write(home * kBlockSize, torn.data(), kBlockSize).ok());
  r.v1.reset();

  auto v3 = r.TryOpen(&r.base, 3, r.NewLocks());
  INFO(v3.status().ToString());
  REQUIRE(v3.ok());
  std::vector<uint8_t> now(kBlockSize);
  REQUIRE(r.base.Read(home * kBlockSize, now.data(), kBlockSize).ok());
  CHECK(now == image);
  std::string problems = test::FsckProblems(v3.value().get());
  INFO("fsck:" << problems);
  CHECK(problems.empty());
}

TEST_CASE("volume drops: fsck --repair does not lower counts for a live host's unreadable list",
          "[volume][drops][fsck]") {
  // Host 2 is alive with pending drops, its journal checkpointed, and one
  // of its list blocks damaged on disk. fsck skipped the block's entries,
  // found nothing in any journal, and lowered the counts; host 2 (its list
  // in memory) later drained them below the blocks' references.
  Rig r;
  r.HoldGroupZero();
  auto v2 = r.OpenAs(&r.base, 2, r.lm2);
  r.CowBreakOn(v2.get());
  REQUIRE(Pending(v2.get()) == kShared);
  // Host 2 hands back what it cached (checkpointing its journal first).
  const Superblock sb = v2->superblock();
  for (uint64_t g = 0; g < sb.group_count; g++) {
    REQUIRE(r.holder->Acquire(WantedGroup(g), LockMode::kShared, false).ok());
  }
  REQUIRE(v2->Sync().ok());
  for (uint64_t g = 0; g < sb.group_count; g++) {
    REQUIRE(r.holder->Release(WantedGroup(g)).ok());
  }
  r.LetGo();
  std::vector<uint8_t> blk(kBlockSize);
  const uint64_t list = sb.DropListStart(2);
  REQUIRE(r.base.Read(list * kBlockSize, blk.data(), kBlockSize).ok());
  blk[100] ^= 0x01;
  REQUIRE(r.base.Write(list * kBlockSize, blk.data(), kBlockSize).ok());

  Result<FsckReport> rep = CheckVolume(r.v1.get(), /*repair=*/true);
  REQUIRE(rep.ok());
  bool list_reported = false;
  for (const FsckProblem& p : rep->problems) {
    INFO(p.where << ": " << p.what);
    if (p.what.find("references found") != std::string::npos) CHECK_FALSE(p.repaired);
    list_reported = list_reported || p.where.find("drop list of host 2") != std::string::npos;
  }
  CHECK(list_reported);
  for (int round = 0; round < 4 && Pending(v2.get()) > 0; round++) {
    r.clock.Advance(61'000'000'000);
    REQUIRE(v2->Sync().ok());
  }
  CHECK(Pending(v2.get()) == 0);
  v2.reset();  // fsck wants the volume to itself
  RequireOnlyLeaks(r.v1.get());
}

TEST_CASE(
    "volume drops: fsck --repair does not rebuild a damaged refcount block while drops "
    "may be pending in a journal",
    "[volume][drops][fsck]") {
  // As "fsck --repair does not lower counts while a live host's journal
  // holds transactions", with group 0's refcount block damaged: the
  // rebuild set every count to what the disk showed, below the drops host
  // 3 had adopted into its journal, which it then applied.
  Rig r;
  auto v3 = r.AdoptedOnHost3();
  const Superblock sb = v3->superblock();
  r.v1.reset();
  std::vector<uint8_t> blk(kBlockSize);
  const uint64_t rb = sb.GroupStart(0);
  REQUIRE(r.base.Read(rb * kBlockSize, blk.data(), kBlockSize).ok());
  std::vector<uint8_t> good = blk;
  blk[300] ^= 0x10;
  REQUIRE(r.base.Write(rb * kBlockSize, blk.data(), kBlockSize).ok());
  {
    auto v4 = r.OpenAs(&r.base, 4, r.NewLocks());
    Result<FsckReport> rep = CheckVolume(v4.get(), /*repair=*/true);
    REQUIRE(rep.ok());
    bool reported = false;
    for (const FsckProblem& p : rep->problems) {
      INFO(p.where << ": " << p.what);
      if (p.where.find("refcount block") != std::string::npos) {
        reported = true;
        CHECK_FALSE(p.repaired);
      }
    }
    CHECK(reported);
  }
  // Left as it was (damaged); put back as it was before the damage, as a
  // later repair would once host 3 has checkpointed.
  std::vector<uint8_t> now(kBlockSize);
  REQUIRE(r.base.Read(rb * kBlockSize, now.data(), kBlockSize).ok());
  CHECK(now == blk);
  REQUIRE(r.base.Write(rb * kBlockSize, good.data(), kBlockSize).ok());
  for (int round = 0; round < 4 && Pending(v3.get()) > 0; round++) {
    r.clock.Advance(61'000'000'000);
    REQUIRE(v3->Sync().ok());
  }
  CHECK(Pending(v3.get()) == 0);
  r.CheckContentsAndFsck(v3.get());
}

TEST_CASE(
    "volume drops: fsck --repair opens a volume whose free slot has a damaged journal and "
    "pending drops",
    "[volume][drops][fsck]") {
  // The open adopted the free slot's drops, which replays its journal
  // first: the damaged journal failed the open, and so the repair meant
  // to reset that journal.
  Rig r;
  r.HoldGroupZero();
  auto v2 = r.OpenAs(&r.base, 2, r.lm2);
  r.CowBreakOn(v2.get());
  const Superblock sb = v2->superblock();
  v2.reset();  // a clean close: the drops stay in slot 2's list (group 0 held)
  r.lm2.reset();
  std::vector<uint8_t> junk(2 * kBlockSize, 0x5a);
  REQUIRE(r.base.Write(sb.JournalStart(2) * kBlockSize, junk.data(), junk.size()).ok());
  r.LetGo();
  r.v1.reset();
  OpenOptions oo;
  oo.pass_damaged_journals = true;
  auto v = r.TryOpen(&r.base, 0, r.NewLocks(), oo);
  INFO(v.status().ToString());
  REQUIRE(v.ok());
  Result<FsckReport> rep = CheckVolume(v.value().get(), /*repair=*/true);
  REQUIRE(rep.ok());
  bool reset = false;
  for (const FsckProblem& p : rep->problems) {
    INFO(p.where << ": " << p.what);
    if (p.where == "journal of host 2") reset = p.repaired;
  }
  CHECK(reset);
}

namespace {

// Runs `hook` once, before the first read that starts at block `addr`.
class ReadHookDevice : public test::ForwardingDevice {
 public:
  explicit ReadHookDevice(BlockDevice* base) : ForwardingDevice(base, "read-hook") {}
  void Arm(uint64_t addr, std::function<void()> hook) {
    addr_ = addr;
    hook_ = std::move(hook);
  }
  bool fired() const { return fired_; }
  Status Read(uint64_t offset, void* buf, size_t len) override {
    if (hook_ && offset == addr_ * kB) {
      auto h = std::move(hook_);
      hook_ = nullptr;
      fired_ = true;
      h();
    }
    return base()->Read(offset, buf, len);
  }

 private:
  uint64_t addr_ = 0;
  std::function<void()> hook_;
  bool fired_ = false;
};

}  // namespace

TEST_CASE("volume drops: fsck's recount is not raced by a live host adopting drops",
          "[volume][drops][fsck]") {
  // fsck read the journals (host 3's empty), then the lists. Host 3, live
  // and needing no group lock to adopt, moved slot 2's entries in between:
  // step one put slot 2's shortened list home, step two put them in host
  // 3's journal only. fsck saw them in no list, lowered the counts, and
  // host 3 later applied them below the blocks' references.
  Rig r;
  r.HoldGroupZero();
  auto v2 = r.OpenAs(&r.base, 2, r.lm2);
  // Hosts 3 and 4 start while slot 2 is live: nothing to adopt yet.
  auto v3 = r.OpenAs(&r.base, 3, r.NewLocks());
  ReadHookDevice hook(&r.base);
  auto v4 = r.OpenAs(&hook, 4, r.NewLocks());
  r.CowBreakOn(v2.get());
  const Superblock sb = v2->superblock();
  v2.reset();  // a clean close: the drops stay in slot 2's list (group 0 held)
  r.lm2.reset();
  r.LetGo();
  r.v1.reset();
  Status adopted_during_fsck;
  hook.Arm(sb.DropListStart(2), [&] {
    r.clock.Advance(61'000'000'000);  // host 3's adoption is due
    adopted_during_fsck = v3->Sync();
  });
  Result<FsckReport> rep = CheckVolume(v4.get(), /*repair=*/true);
  REQUIRE(rep.ok());
  REQUIRE(hook.fired());
  INFO("host 3's flush point during fsck: " << adopted_during_fsck.ToString());
  for (const FsckProblem& p : rep->problems) {
    INFO(p.where << ": " << p.what);
    if (p.what.find("references found") != std::string::npos) CHECK_FALSE(p.repaired);
  }
  v4.reset();
  // Host 3 adopts (now, or at its next due flush point) and applies.
  for (int round = 0; round < 6 && (v3->drop_counters().adopted == 0 || Pending(v3.get()) > 0);
       round++) {
    r.clock.Advance(61'000'000'000);
    REQUIRE(v3->Sync().ok());
  }
  CHECK(v3->drop_counters().adopted == kShared);
  CHECK(Pending(v3.get()) == 0);
  r.CheckContentsAndFsck(v3.get());
}

TEST_CASE("volume: an allocation that fails after part of its run gives that part back",
          "[volume][drops]") {
  // Host 2's write needs 8 blocks; group 0 has 3 free, every other group
  // is held elsewhere. The last resort took group 0's 3 (reserved, pinning
  // the group), then its wait for group 1 timed out: the 3 stayed reserved
  // for good, group 0 was never handed over again, and the blocks leaked.
  Rig r;
  OpenOptions oo;
  oo.lock_wait_s = 1;
  auto v2 = r.Open(&r.base, 2, r.lm2, oo);
  const Superblock sb = v2->superblock();
  REQUIRE(sb.group_count >= 2);
  // The holder takes every group but 0 (host 1 hands its cached ones back).
  for (uint64_t g = 0; g < sb.group_count; g++) {
    REQUIRE(r.holder->Acquire(WantedGroup(g), LockMode::kShared, false).ok());
  }
  REQUIRE(r.v1->Sync().ok());
  for (uint64_t g = 0; g < sb.group_count; g++) {
    REQUIRE(r.holder->Release(WantedGroup(g)).ok());
  }
  for (uint64_t g = 1; g < sb.group_count; g++) {
    REQUIRE(r.holder->Acquire(Group(g), LockMode::kExclusive, false).ok());
    r.held.push_back(Group(g));
  }
  // Fill group 0 one block at a time.
  const uint64_t fill_blocks = sb.GroupDataBlocks(0) + 64;
  REQUIRE(v2->Create("fill", fill_blocks * kB).ok());
  auto fill = v2->OpenFile("fill");
  REQUIRE(fill.ok());
  const std::vector<uint8_t> blk = Pattern(0x3c, 1);
  uint64_t written = 0;
  while (written < fill_blocks && (*fill)->Write(written * kB, blk.data(), kB).ok()) written++;
  REQUIRE(written > 8);
  REQUIRE(written < fill_blocks);  // group 0 is full
  for (uint64_t i = 0; i < 3; i++) REQUIRE((*fill)->Punch(i).ok());
  REQUIRE(v2->Sync().ok());
  REQUIRE(v2->Sync().ok());  // the punched blocks are free to use again
  REQUIRE(v2->reservation_counters().reserved_now == 0);
  const std::vector<uint8_t> eight = Pattern(0x5d, 8);
  Status st = (*fill)->Write(written * kB, eight.data(), eight.size());
  INFO(st.ToString());
  CHECK_FALSE(st.ok());
  CHECK(v2->reservation_counters().reserved_now == 0);
  // Group 0 is handed over when asked for, as any group without
  // reservations.
  REQUIRE(r.holder->Acquire(WantedGroup(0), LockMode::kShared, false).ok());
  REQUIRE(v2->Sync().ok());
  REQUIRE(r.holder->Release(WantedGroup(0)).ok());
  Status taken = r.holder->Acquire(Group(0), LockMode::kExclusive, false);
  INFO(taken.ToString());
  CHECK(taken.ok());
  if (taken.ok()) r.held.push_back(Group(0));
  r.LetGo();
  fill->reset();
  v2.reset();
  r.v1.reset();
  auto v3 = r.OpenAs(&r.base, 3, r.NewLocks());
  std::string problems = test::FsckProblems(v3.get());
  INFO("fsck:" << problems);
  CHECK(problems.empty());
}

TEST_CASE("volume drops: an adoption at a flush point replays a dead earlier adopter first",
          "[volume][drops][crash]") {
  // Host 3 adopted part of free slot 2's list (its own list had room for
  // 37 of 60): step one, slot 2's shortened list, was committed in host
  // 3's journal, and host 3 died before its checkpoint put it home. Host
  // 4, open all along, adopted at a flush point from slot 2's home list
  // (all 60), without replaying host 3's journal first; that replay,
  // later, wrote the shortened list (23) back, and those 23 were adopted
  // and applied a second time: counts below their references.
  Rig r(0, /*drop_blocks=*/1);
  constexpr uint64_t kOwn = 470;   // host 3's own pending drops (a write keeps 32 free)
  constexpr uint64_t kSlot2 = 60;  // slot 2's
  constexpr uint64_t kBlocks = kOwn + kSlot2;
  {
    REQUIRE(r.v1->Create("c", kBlocks * kB).ok());
    REQUIRE(r.v1->Create("d", kBlocks * kB).ok());
    auto c = r.v1->OpenFile("c");
    auto d = r.v1->OpenFile("d");
    REQUIRE(c.ok());
    REQUIRE(d.ok());
    const std::vector<uint8_t> data = Pattern(0x21, kBlocks);
    REQUIRE((*c)->Write(0, data.data(), data.size()).ok());
    for (uint64_t i = 0; i < kBlocks; i++) {
      REQUIRE(r.v1->CloneBlock(c->get(), i, d->get(), i).ok());
    }
    REQUIRE(r.v1->Sync().ok());
  }
  r.HoldGroupZero();
  auto cow_break = [](Volume* v, uint64_t first, uint64_t n) {
    auto d = v->OpenFile("d");
    REQUIRE(d.ok());
    const std::vector<uint8_t> y = Pattern(0x77, n);
    for (uint64_t i = 0; i < n; i += 16) {
      const uint64_t k = std::min<uint64_t>(16, n - i);
      Status w = (*d)->Write((first + i) * kB, y.data() + i * kB, k * kB);
      INFO("blocks " << first + i << ".." << first + i + k - 1 << ": " << w.ToString());
      REQUIRE(w.ok());
    }
    REQUIRE((*d)->Flush().ok());
  };
  auto lm3 = r.NewLocks();
  auto v3 = r.OpenAs(&r.base, 3, lm3);
  cow_break(v3.get(), 0, kOwn);
  REQUIRE(Pending(v3.get()) == kOwn);
  FaultDevice d2(&r.base);
  auto v2 = r.OpenAs(&d2, 2, r.lm2);
  cow_break(v2.get(), kOwn, kSlot2);
  auto v4 = r.OpenAs(&r.base, 4, r.NewLocks());  // slots 2 and 3 are live: nothing to adopt
  v3.reset();  // a clean close: its drops stay in slot 3's list (group 0 held)
  lm3.reset();
  r.KillHost2(&d2, &v2);
  REQUIRE(r.v1->Sync().ok());  // host 1 replays host 2's journal

  // Host 3 comes back, adopts 4 of slot 2's 17 at open (its list has room
  // for 4), commits step one, and dies at the checkpoint's first home write.
  FaultDevice d3(&r.base);
  d3.FailWritesAfter(1, EIO);
  lm3 = r.NewLocks();
  {
    OpenOptions oo;
    oo.host_id = 3;
    oo.locks = lm3;
    oo.clock = &r.clock;
    auto again = Volume::Open(&d3, oo);
    INFO(again.status().ToString());
    REQUIRE_FALSE(again.ok());
  }
  lm3.reset();
  std::mt19937_64 rng(5);
  d3.Crash(rng, 1.0);

  // Host 4's adoption is due at its next flush point; then everything is
  // applied (the group is let go) and nothing may be applied twice.
  r.clock.Advance(61'000'000'000);
  REQUIRE(v4->Sync().ok());
  r.LetGo();
  for (int round = 0; round < 8; round++) {
    r.clock.Advance(61'000'000'000);
    REQUIRE(r.v1->Sync().ok());
    REQUIRE(v4->Sync().ok());
  }
  r.v1.reset();
  RequireOnlyLeaks(v4.get());
  auto c = v4->OpenFile("c");
  REQUIRE(c.ok());
  std::vector<uint8_t> got(kBlocks * kB);
  REQUIRE((*c)->Read(0, got.data(), got.size()).ok());
  CHECK(got == Pattern(0x21, kBlocks));
}

TEST_CASE("volume drops: an adoption at a flush point never waits for a replay elsewhere",
          "[volume][drops]") {
  // The adoption's scan of dead hosts' journals (holding kRecovery(h),
  // under the volume mutex) waited up to lock_wait for a live slot's
  // replay: every file of the process stalled, and a fsck --repair taking
  // every slot's kRecovery in turn could wait on it while it waited on
  // fsck. It puts the adoption off instead.
  Rig r;
  r.HoldGroupZero();
  auto v2 = r.OpenAs(&r.base, 2, r.lm2);
  r.CowBreakOn(v2.get());
  v2.reset();  // a clean close: the drops stay in slot 2's list (group 0 held)
  r.lm2.reset();
  // Slot 5 is live and replaying its journal (its owner holds kRecovery).
  REQUIRE(r.holder->Acquire(LockId{LockKind::kRecovery, 5}, LockMode::kExclusive, false).ok());
  REQUIRE(r.holder->Acquire(LockId{LockKind::kHostSlot, 5}, LockMode::kExclusive, false).ok());
  r.clock.Advance(61'000'000'000);  // host 1's adoption is due
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE(r.v1->Sync().ok());
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(took < 5.0);
  CHECK(r.v1->drop_counters().adopted == 0);
  // The replay ends; a later flush point adopts.
  REQUIRE(r.holder->Release(LockId{LockKind::kRecovery, 5}).ok());
  REQUIRE(r.holder->Release(LockId{LockKind::kHostSlot, 5}).ok());
  r.clock.Advance(61'000'000'000);
  REQUIRE(r.v1->Sync().ok());
  CHECK(r.v1->drop_counters().adopted == kShared);
  r.LetGo();
  DrainAll(r, r.v1.get());
  r.CheckContentsAndFsck(r.v1.get());
}
