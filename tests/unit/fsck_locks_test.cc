// fsck and the other processes of a volume: what it may read before it
// holds a file's lock, what its early returns leave behind, and which
// generation an inode it clears gets (docs/ARCHITECTURE.md "fsck",
// docs/LOCKING.md rule 1, docs/FORMAT.md section 6).
//
// Two hosts of one in-memory volume (two lock managers on one lock file):
// host 1 runs fsck, host 2 plays the other process.
#include <catch2/catch.hpp>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tests/forwarding_device.h"
#include "tests/fsck_problems.h"
#include "tests/temp_locks.h"
#include "util/clock.h"
#include "volume/fsck.h"
#include "volume/mem_device.h"
#include "volume/volume.h"

using namespace dede;

namespace {

constexpr uint64_t kB = kBlockSize;

std::vector<uint8_t> Fill(uint8_t seed, uint64_t blocks) {
  std::vector<uint8_t> v(blocks * kB);
  for (size_t i = 0; i < v.size(); i++) v[i] = static_cast<uint8_t>(seed + i * 13 + i / kB);
  return v;
}

// Calls `hook` (once, when armed) when a read of block `addr` has read
// it, before returning: another process acting between fsck's read of a
// block and what fsck does next.
class HookDevice : public test::ForwardingDevice {
 public:
  explicit HookDevice(BlockDevice* base) : ForwardingDevice(base, "hook") {}
  void Arm(uint64_t addr, std::function<void()> hook) {
    addr_ = addr;
    hook_ = std::move(hook);
  }
  bool fired() const { return fired_; }
  Status Read(uint64_t offset, void* buf, size_t len) override {
    Status st = base()->Read(offset, buf, len);
    if (st.ok() && hook_ && offset <= addr_ * kB && addr_ * kB < offset + len) {
      auto h = std::move(hook_);
      hook_ = nullptr;
      fired_ = true;
      h();
    }
    return st;
  }

 private:
  uint64_t addr_ = 0;
  std::function<void()> hook_;
  bool fired_ = false;
};

struct TwoHosts {
  MemDevice base{64 << 20};
  std::vector<std::shared_ptr<LockManager>> locks = test::TempLockGroup(2);
  Superblock sb;

  TwoHosts() { REQUIRE(FormatVolume(&base, FormatOptions{}, false).ok()); }
  std::unique_ptr<Volume> Open(BlockDevice* dev, uint32_t host, Clock* clock = nullptr) {
    OpenOptions oo;
    oo.host_id = host;
    oo.locks = locks[host - 1];
    oo.clock = clock;
    auto v = Volume::Open(dev, oo);
    INFO("open as host " << host << ": " << v.status().ToString());
    REQUIRE(v.ok());
    sb = v.value()->superblock();
    return std::move(v.value());
  }
  // Creates `name` (1 MiB) with `blocks` blocks of data from block 0.
  FileId CreateWith(Volume* vol, const std::string& name, uint64_t blocks, uint8_t seed) {
    auto id = vol->Create(name, 1 << 20);
    REQUIRE(id.ok());
    auto f = vol->OpenFile(name);
    REQUIRE(f.ok());
    const std::vector<uint8_t> d = Fill(seed, blocks);
    REQUIRE(f.value()->Write(0, d.data(), d.size()).ok());
    return id.value();
  }
  uint64_t InodeAddr(uint64_t ino) const { return sb.inode_start + ino - 1; }
  Inode ReadInode(uint64_t ino) {
    std::vector<uint8_t> blk(kB);
    REQUIRE(base.Read(InodeAddr(ino) * kB, blk.data(), kB).ok());
    auto in = DecodeInode(blk.data(), sb.uuid, InodeAddr(ino));
    INFO(in.status().ToString());
    REQUIRE(in.ok());
    return in.value();
  }
  // Rewrites inode `ino` on the device (valid checksum) after `change`.
  void EditInode(uint64_t ino, const std::function<void(Inode*)>& change) {
    Inode in = ReadInode(ino);
    change(&in);
    std::vector<uint8_t> blk(kB);
    EncodeInode(in, 7, sb.uuid, InodeAddr(ino), blk.data());
    REQUIRE(base.Write(InodeAddr(ino) * kB, blk.data(), kB).ok());
  }
  // Blocks [first, first + n) as on the device.
  std::vector<uint8_t> Snapshot(uint64_t first, uint64_t n) {
    std::vector<uint8_t> v(n * kB);
    REQUIRE(base.Read(first * kB, v.data(), v.size()).ok());
    return v;
  }
};

// "a" (inode 1) maps 8 blocks but its inode says 4 blocks long: repair
// clears slots 4..7 of its leaf and sets its counter to 4. "b" (inode 2)
// maps 8 blocks. Returns their ids; no volume is open afterwards.
std::pair<FileId, FileId> TwoFilesOneDamaged(TwoHosts* h) {
  FileId a, b;
  {
    auto v = h->Open(&h->base, 1);
    a = h->CreateWith(v.get(), "a", 8, 0x21);
    b = h->CreateWith(v.get(), "b", 8, 0x42);
  }
  REQUIRE(a.ino < b.ino);  // fsck walks "a" first
  h->EditInode(a.ino, [](Inode* in) { in->size = 4 * kB; });
  return {a, b};
}

bool AllZero(const std::vector<uint8_t>& v) {
  for (uint8_t c : v) {
    if (c) return false;
  }
  return true;
}

// Host 2 punches block 0 of "a" (fsck let go of the file), then host 1's
// volume closes; block 0 must stay a hole.
void PunchSurvivesFsckVolume(std::unique_ptr<Volume>* v1, Volume* v2) {
  {
    auto fa = v2->OpenFile("a");
    INFO(fa.status().ToString());
    REQUIRE(fa.ok());
    REQUIRE(fa.value()->Punch(0).ok());
  }
  v1->reset();  // its close commits whatever it still held
  auto fa = v2->OpenFile("a");
  REQUIRE(fa.ok());
  std::vector<uint8_t> got(kB);
  REQUIRE(fa.value()->Read(0, got.data(), kB).ok());
  INFO("block 0 of 'a' after host 2 punched it and host 1's volume closed");
  CHECK(AllZero(got));
}

}  // namespace

// Finding A, kLocked: fsck repaired "a" (only in its running transaction),
// then met "b" open on host 2 and returned kLocked, releasing "a"'s lock
// without a checkpoint. Host 2 opened "a" from the stale home blocks and
// punched block 0; host 1's close then wrote fsck's old leaf and inode over
// that: the punched pointer came back (its drop still pending). Now fsck
// takes every file's lock before it reads or changes any: a busy file
// stops it before any repair.
TEST_CASE("fsck: a file in use stops fsck before it repairs anything", "[volume][fsck]") {
  TwoHosts h;
  const auto [a, b] = TwoFilesOneDamaged(&h);
  auto v1 = h.Open(&h.base, 1);
  auto v2 = h.Open(&h.base, 2);
  const Inode before = h.ReadInode(a.ino);
  REQUIRE(before.depth == 1);  // one leaf: the root
  const std::vector<uint8_t> inode_before = h.Snapshot(h.InodeAddr(a.ino), 1);
  const std::vector<uint8_t> leaf_before = h.Snapshot(before.root, 1);
  {
    auto fb = v2->OpenFile("b");
    REQUIRE(fb.ok());
    auto rep = CheckVolume(v1.get(), /*repair=*/true);
    INFO(rep.status().ToString());
    REQUIRE_FALSE(rep.ok());
    REQUIRE(rep.status().code() == Status::Code::kLocked);
  }
  // Nothing was repaired: not on the device, and not held back for later.
  CHECK(h.Snapshot(h.InodeAddr(a.ino), 1) == inode_before);
  CHECK(h.Snapshot(before.root, 1) == leaf_before);
  PunchSurvivesFsckVolume(&v1, v2.get());
  v2.reset();
  // The damage is still there for a later fsck, which repairs it.
  auto v = h.Open(&h.base, 1);
  const std::string found = test::FsckProblems(v.get());
  CHECK(found.find("mapped beyond the end of the file") != std::string::npos);
  REQUIRE(CheckVolume(v.get(), /*repair=*/true).ok());
  CHECK(test::FsckProblems(v.get()) == "");
}

// Finding A, other early returns: fsck repaired "a", then stopped at "b"
// (a pointer block of a newer format: kUnsupported), and released "a"'s
// lock with the repair only in its running transaction. Now it
// checkpoints before it lets a file go (LOCKING.md rule 1).
TEST_CASE("fsck: an early return after a repair checkpoints before releasing the files",
          "[volume][fsck]") {
  TwoHosts h;
  const auto [a, b] = TwoFilesOneDamaged(&h);
  {
    const Inode ib = h.ReadInode(b.ino);
    std::vector<uint8_t> blk = h.Snapshot(ib.root, 1);
    BlockHeader hd = PeekHeader(blk.data());
    hd.major = kFormatMajor + 1;
    SealBlock(blk.data(), hd, h.sb.uuid);
    REQUIRE(h.base.Write(ib.root * kB, blk.data(), kB).ok());
  }
  auto v1 = h.Open(&h.base, 1);
  auto v2 = h.Open(&h.base, 2);
  auto rep = CheckVolume(v1.get(), /*repair=*/true);
  INFO(rep.status().ToString());
  REQUIRE_FALSE(rep.ok());
  REQUIRE(rep.status().code() == Status::Code::kUnsupported);
  // "a"'s repair is home before its lock went.
  CHECK(h.ReadInode(a.ino).mapped_blocks == 4);
  PunchSurvivesFsckVolume(&v1, v2.get());
}

// Finding B: fsck read "a"'s inode before it took the file's lock. Host 2,
// which had "a" open, grew it and turned dedup off and closed it in
// between; fsck then wrote its stale copy back (old size and flags) with
// the counter it fixed. Now it reads every inode under the file's lock.
TEST_CASE("fsck: an inode changed before fsck took its lock is not written back stale",
          "[volume][fsck]") {
  TwoHosts h;
  FileId a;
  {
    auto v = h.Open(&h.base, 1);
    a = h.CreateWith(v.get(), "a", 4, 0x33);
  }
  h.EditInode(a.ino, [](Inode* in) { in->mapped_blocks = 9; });  // for repair to fix
  HookDevice dev(&h.base);
  auto v1 = h.Open(&dev, 1);
  auto v2 = h.Open(&h.base, 2);
  auto fa = v2->OpenFile("a");
  REQUIRE(fa.ok());
  dev.Arm(h.InodeAddr(a.ino), [&] {
    REQUIRE(fa.value()->Truncate(2 << 20).ok());
    REQUIRE(fa.value()->SetDedup(false).ok());
    fa.value().reset();  // closed: checkpointed, lock released
  });
  auto rep = CheckVolume(v1.get(), /*repair=*/true);
  INFO(rep.status().ToString());
  REQUIRE(rep.ok());
  REQUIRE(dev.fired());
  const Inode in = h.ReadInode(a.ino);
  CHECK(in.size == uint64_t{2} << 20);
  CHECK((in.flags & kInodeDedupOff) != 0);
  CHECK(in.mapped_blocks == 4);
  CHECK(test::FsckProblems(v1.get()) == "");
}

// Finding C: a damaged inode that repair clears got generation 1, so the
// next create there made (ino, 2), which an earlier incarnation may have
// had: its write log, merge requests or index entries would attach to the
// new file. The cleared inode now gets one no incarnation had, with
// or without a plausible generation in the damaged block and with a wall
// clock that is set or not (a test clock at 1 s after the epoch).
TEST_CASE("fsck: a cleared inode's next incarnation has a new generation", "[volume][fsck]") {
  const bool real_clock = GENERATE(true, false);
  const bool garbage = GENERATE(false, true);  // else one flipped name byte
  INFO((real_clock ? "wall clock" : "clock at 1 s")
       << ", " << (garbage ? "garbage block" : "bit flip"));
  ManualClock manual;
  Clock* clock = real_clock ? nullptr : &manual;
  TwoHosts h;
  FileId old;
  {
    auto v = h.Open(&h.base, 1, clock);
    for (int i = 0; i < 3; i++) {
      old = h.CreateWith(v.get(), "a", 2, 0x55);
      if (i < 2) REQUIRE(v->Remove("a").ok());
    }
  }
  REQUIRE(old.generation >= 3);
  uint64_t last = old.generation;
  for (int round = 0; round < 2; round++) {
    INFO("clearing " << round + 1);
    std::vector<uint8_t> blk = h.Snapshot(h.InodeAddr(old.ino), 1);
    if (garbage) {
      for (size_t i = 0; i < kB; i++) blk[i] = static_cast<uint8_t>(i * 7 + 1 + round);
    } else {
      blk[128] ^= 0x01;  // the name: the checksum fails
    }
    REQUIRE(h.base.Write(h.InodeAddr(old.ino) * kB, blk.data(), kB).ok());
    auto v = h.Open(&h.base, 1, clock);
    auto rep = CheckVolume(v.get(), /*repair=*/true);
    INFO(rep.status().ToString());
    REQUIRE(rep.ok());
    REQUIRE_FALSE(rep->clean());
    auto id = v->Create("c" + std::to_string(round), 1 << 20);
    REQUIRE(id.ok());
    REQUIRE(id->ino == old.ino);
    CHECK(id->generation > old.generation);
    if (garbage && !real_clock) {
      // Nothing tells what it was: a random one far above any count of
      // creates, unequal to the last with overwhelming probability.
      CHECK(id->generation != last);
    } else {
      CHECK(id->generation > last);
    }
    last = id->generation;
    CHECK(test::FsckProblems(v.get()) == "");
  }
}
