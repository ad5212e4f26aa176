#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/forwarding_device.h"
#include "tests/forwarding_locks.h"
#include "tests/fsck_problems.h"
#include "tests/temp_locks.h"
#include "util/clock.h"
#include "volume/fsck.h"
#include "volume/journal.h"
#include "volume/mem_device.h"
#include "volume/volume.h"

using namespace dede;
using dede::test::TempLocks;

namespace {
std::vector<uint8_t> Pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937 r(seed);
  for (auto& b : v) b = static_cast<uint8_t>(r());
  return v;
}

// A fresh volume on `dev` holding one file, "f" (1 MiB), with `data` at
// offset 0, closed again; and where the file's metadata lives, for tests
// that then damage or inspect it on the device.
struct OneFileVolume {
  Superblock sb;
  uint64_t ino = 0;
  uint64_t inode_addr = 0;  // the inode's block
  Inode inode;              // as on the device after the close
};

OneFileVolume FormatWithOneFile(BlockDevice* dev, const OpenOptions& oo,
                                const std::vector<uint8_t>& data) {
  REQUIRE(FormatVolume(dev, FormatOptions{}, false).ok());
  OneFileVolume out;
  {
    auto vol = Volume::Open(dev, oo);
    REQUIRE(vol.ok());
    REQUIRE(vol.value()->Create("f", 1 << 20).ok());
    auto f = vol.value()->OpenFile("f");
    REQUIRE(f.ok());
    REQUIRE(f.value()->Write(0, data.data(), data.size()).ok());
    out.ino = f.value()->id().ino;
    out.sb = vol.value()->superblock();
  }
  out.inode_addr = out.sb.inode_start + out.ino - 1;
  std::vector<uint8_t> blk(kBlockSize);
  REQUIRE(dev->Read(out.inode_addr * kBlockSize, blk.data(), kBlockSize).ok());
  auto in = DecodeInode(blk.data(), out.sb.uuid, out.inode_addr);
  REQUIRE(in.ok());
  out.inode = *in;
  return out;
}
// A 64 MiB volume, open, for files far bigger than it (thin disks).
struct ThinVolume {
  ThinVolume() : dev(64 << 20) {
    OpenOptions oo;
    oo.locks = TempLocks();
    FormatWithOneFile(&dev, oo, {});
    auto v = Volume::Open(&dev, oo);
    REQUIRE(v.ok());
    vol = std::move(v.value());
  }
  static constexpr uint64_t kSize = uint64_t{16} << 40;  // a 16 TiB disk
  MemDevice dev;
  std::unique_ptr<Volume> vol;
};
}  // namespace

TEST_CASE("volume: create, write, read, share, reopen", "[volume]") {
  MemDevice dev(64 << 20);
  REQUIRE(FormatVolume(&dev, FormatOptions{}, false).ok());
  auto locks = TempLocks();
  OpenOptions oo;
  oo.locks = locks;
  std::vector<uint8_t> a = Pattern(3 * kBlockSize + 100, 1);
  {
    auto vol = Volume::Open(&dev, oo);
    REQUIRE(vol.ok());
    REQUIRE(vol.value()->Create("a", 1 << 20).ok());
    REQUIRE(vol.value()->Create("b", 1 << 20).ok());
    REQUIRE(vol.value()->Create("a", 1).status().code() == Status::Code::kExists);
    auto fa = vol.value()->OpenFile("a");
    REQUIRE(fa.ok());
    auto fb = vol.value()->OpenFile("b");
    REQUIRE(fb.ok());
    REQUIRE(fa.value()->Write(10, a.data(), a.size()).ok());
    std::vector<uint8_t> r(a.size());
    REQUIRE(fa.value()->Read(10, r.data(), r.size()).ok());
    REQUIRE(r == a);
    // Copy block 1 of a into b block 5 through the normal path, then share.
    std::vector<uint8_t> blk(kBlockSize);
    REQUIRE(fa.value()->Read(kBlockSize, blk.data(), kBlockSize).ok());
    REQUIRE(fb.value()->Write(5 * kBlockSize, blk.data(), kBlockSize).ok());
    REQUIRE(vol.value()->CompareAndShare(fa.value().get(), 1, fb.value().get(), 5,
                                         VerifyMode::kByteCompare).ok());
    REQUIRE(fa.value()->BlockRefCount(1).value() == 2);
    REQUIRE(fb.value()->BlockRefCount(5).value() == 2);
    // Mismatch leaves things alone.
    REQUIRE(vol.value()->CompareAndShare(fa.value().get(), 0, fb.value().get(), 5,
                                         VerifyMode::kByteCompare).code() ==
            Status::Code::kMismatch);
    // COW: writing a's block 1 does not change b.
    std::vector<uint8_t> x = Pattern(kBlockSize, 9);
    REQUIRE(fa.value()->Write(kBlockSize, x.data(), kBlockSize).ok());
    std::vector<uint8_t> rb(kBlockSize);
    REQUIRE(fb.value()->Read(5 * kBlockSize, rb.data(), kBlockSize).ok());
    REQUIRE(rb == blk);
    REQUIRE(fb.value()->BlockRefCount(5).value() == 1);
    REQUIRE(vol.value()->Sync().ok());
    auto st = vol.value()->Stats();
    REQUIRE(st.ok());
    CHECK(st->files == 2);
    CHECK(st->logical_blocks == 5);
  }
  auto vol = Volume::Open(&dev, oo);
  REQUIRE(vol.ok());
  auto fb = vol.value()->OpenFile("b");
  REQUIRE(fb.ok());
  std::vector<uint8_t> rb(kBlockSize);
  REQUIRE(fb.value()->Read(5 * kBlockSize, rb.data(), kBlockSize).ok());
  std::vector<uint8_t> expect(a.begin() + kBlockSize - 10, a.begin() + 2 * kBlockSize - 10);
  REQUIRE(rb == expect);
  fb.value().reset();
  REQUIRE(vol.value()->Remove("b").ok());
  REQUIRE(vol.value()->Lookup("b").status().code() == Status::Code::kNotFound);
}

TEST_CASE("volume: RemoveOpen removes a file its caller holds, never another volume's",
          "[volume]") {
  MemDevice dev(64 << 20);
  REQUIRE(FormatVolume(&dev, FormatOptions{}, false).ok());
  OpenOptions oo;
  oo.locks = TempLocks();
  auto vol = Volume::Open(&dev, oo);
  REQUIRE(vol.ok());
  Volume* v = vol.value().get();
  REQUIRE(v->Create("a", 3 * kBlockSize).ok());
  auto fa = v->OpenFile("a");
  REQUIRE(fa.ok());
  const std::vector<uint8_t> data = Pattern(3 * kBlockSize, 4);
  REQUIRE(fa.value()->Write(0, data.data(), data.size()).ok());
  const FileId id = fa.value()->id();

  SECTION("the file goes, with its blocks, and its name is free") {
    REQUIRE(v->RemoveOpen(std::move(fa.value())).ok());
    CHECK(v->Lookup("a").status().code() == Status::Code::kNotFound);
    auto st = v->Stats();
    REQUIRE(st.ok());
    CHECK(st->files == 0);
    CHECK(st->logical_blocks == 0);
    auto again = v->Create("a", 0);
    REQUIRE(again.ok());
    CHECK(again->ino == id.ino);
    CHECK(again->generation > id.generation);
    auto rep = CheckVolume(v, false);
    REQUIRE(rep.ok());
    CHECK(rep->clean());
  }
  SECTION("a file of another volume is refused and closed, and stays") {
    MemDevice other_dev(64 << 20);
    REQUIRE(FormatVolume(&other_dev, FormatOptions{}, false).ok());
    OpenOptions other_oo;
    other_oo.locks = TempLocks();
    auto other = Volume::Open(&other_dev, other_oo);
    REQUIRE(other.ok());
    Status st = other.value()->RemoveOpen(std::move(fa.value()));
    CHECK(st.code() == Status::Code::kInvalid);
    // Closed all the same: it opens again, with its data.
    auto reopened = v->OpenFile("a");
    REQUIRE(reopened.ok());
    std::vector<uint8_t> back(data.size());
    REQUIRE(reopened.value()->Read(0, back.data(), back.size()).ok());
    CHECK(back == data);
  }
}

TEST_CASE("volume: an in-place write is prepared only for whole blocks the file owns alone, "
          "and holds off a share until it is written",
          "[volume]") {
  MemDevice dev(64 << 20);
  REQUIRE(FormatVolume(&dev, FormatOptions{}, false).ok());
  OpenOptions oo;
  oo.locks = TempLocks();
  auto vol = Volume::Open(&dev, oo);
  REQUIRE(vol.ok());
  Volume* v = vol.value().get();
  constexpr uint64_t kB = kBlockSize;
  REQUIRE(v->Create("a", 8 * kB).ok());
  REQUIRE(v->Create("b", 8 * kB).ok());
  auto fa = v->OpenFile("a");
  auto fb = v->OpenFile("b");
  REQUIRE(fa.ok());
  REQUIRE(fb.ok());
  File* a = fa.value().get();
  File* b = fb.value().get();
  const std::vector<uint8_t> old = Pattern(4 * kB, 5);
  REQUIRE(a->Write(0, old.data(), old.size()).ok());  // blocks 0..3; 4..7 are holes
  REQUIRE(b->Write(0, old.data(), old.size()).ok());

  auto prepared = [&](uint64_t offset, size_t len) {
    auto w = a->PrepareInPlaceWrite(offset, len);
    REQUIRE(w.ok());
    return w.value() != nullptr;
  };
  CHECK(prepared(0, 4 * kB));
  CHECK_FALSE(prepared(4 * kB, kB));        // a hole: needs a block
  CHECK_FALSE(prepared(3 * kB, 2 * kB));    // ends in a hole
  CHECK_FALSE(prepared(100, kB));           // partial blocks
  CHECK_FALSE(prepared(0, kB / 2));
  CHECK(a->PrepareInPlaceWrite(7 * kB, 2 * kB).status().code() == Status::Code::kInvalid);
  REQUIRE(v->CompareAndShare(b, 1, a, 1, VerifyMode::kByteCompare).ok());
  CHECK_FALSE(prepared(kB, kB));            // shared now: a write copies it
  CHECK_FALSE(prepared(0, 2 * kB));

  // Prepared, block 2 cannot be shared until the write is done; the share
  // then finds the new content and refuses.
  auto w = a->PrepareInPlaceWrite(2 * kB, kB);
  REQUIRE(w.ok());
  REQUIRE(w.value() != nullptr);
  std::atomic<bool> share_done{false};
  Status share_st;
  std::thread share([&] {
    share_st = v->CompareAndShare(b, 2, a, 2, VerifyMode::kByteCompare);
    share_done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  CHECK_FALSE(share_done.load());
  const std::vector<uint8_t> fresh = Pattern(kB, 6);
  CHECK(w.value()->Write(fresh.data()).ok());
  CHECK(w.value()->Write(fresh.data()).code() == Status::Code::kInvalid);  // once only
  w.value().reset();
  share.join();
  CHECK(share_st.code() == Status::Code::kMismatch);
  std::vector<uint8_t> back(kB);
  REQUIRE(a->Read(2 * kB, back.data(), kB).ok());
  CHECK(back == fresh);
  CHECK(a->BlockRefCount(2).value() == 1);
  fa.value().reset();
  fb.value().reset();
  auto rep = CheckVolume(v, false);
  REQUIRE(rep.ok());
  CHECK(rep->clean());
}

TEST_CASE("volume: fsck is clean after use and finds a broken refcount", "[volume][fsck]") {
  MemDevice dev(64 << 20);
  REQUIRE(FormatVolume(&dev, FormatOptions{}, false).ok());
  OpenOptions oo;
  oo.locks = TempLocks();
  auto vol = Volume::Open(&dev, oo);
  REQUIRE(vol.ok());
  REQUIRE(vol.value()->Create("a", 4 << 20).ok());
  {
    auto fa = vol.value()->OpenFile("a");
    REQUIRE(fa.ok());
    std::vector<uint8_t> d = Pattern(3 << 20, 3);
    REQUIRE(fa.value()->Write(4096, d.data(), d.size()).ok());
    REQUIRE(vol.value()->CloneBlock(fa.value().get(), 2, fa.value().get(), 900).ok());
    REQUIRE(fa.value()->Trim(8192 + 100, 40000).ok());
  }
  auto rep = CheckVolume(vol.value().get(), false);
  REQUIRE(rep.ok());
  for (auto& p : rep->problems) INFO(p.where << ": " << p.what);
  REQUIRE(rep->clean());
  REQUIRE(rep->files == 1);
  // Break the refcount of one data block behind fsck's back.
  const Superblock sb = vol.value()->superblock();
  vol.value().reset();
  uint64_t rb = sb.GroupStart(0);
  std::vector<uint8_t> blk(kBlockSize);
  REQUIRE(dev.Read(rb * kBlockSize, blk.data(), kBlockSize).ok());
  // Find a slot with refcount 1 and make it 7.
  uint32_t slot = 0;
  while (GetRef(blk.data(), slot) != 1) slot++;
  SetRef(blk.data(), slot, 7);
  BlockHeader h = PeekHeader(blk.data());
  SealBlock(blk.data(), h, sb.uuid);
  REQUIRE(dev.Write(rb * kBlockSize, blk.data(), kBlockSize).ok());
  vol = Volume::Open(&dev, oo);
  REQUIRE(vol.ok());
  rep = CheckVolume(vol.value().get(), false);
  REQUIRE(rep.ok());
  REQUIRE(rep->problems.size() == 1);
  REQUIRE(rep->problems[0].what.find("refcount 7 stored, 1 references found") != std::string::npos);
  rep = CheckVolume(vol.value().get(), true);
  REQUIRE(rep.ok());
  REQUIRE(rep->problems.size() == 1);
  REQUIRE(rep->problems[0].repaired);
  rep = CheckVolume(vol.value().get(), false);
  REQUIRE(rep.ok());
  REQUIRE(rep->clean());
}

TEST_CASE("volume: fsck says what a leaked block holds", "[volume][fsck]") {
  MemDevice dev(64 << 20);
  REQUIRE(FormatVolume(&dev, FormatOptions{}, false).ok());
  OpenOptions oo;
  oo.locks = TempLocks();
  Superblock sb;
  {
    auto vol = Volume::Open(&dev, oo);
    REQUIRE(vol.ok());
    REQUIRE(vol.value()->Create("a", 1 << 20).ok());
    auto fa = vol.value()->OpenFile("a");
    REQUIRE(fa.ok());
    std::vector<uint8_t> d = Pattern(1 << 20, 5);
    REQUIRE(fa.value()->Write(0, d.data(), d.size()).ok());
    sb = vol.value()->superblock();
  }
  // Two free blocks of group 0 get a count of 1 behind fsck's back: one
  // holds a sealed pointer block, the other file data.
  const uint64_t rb = sb.GroupStart(0);
  std::vector<uint8_t> counts(kBlockSize);
  REQUIRE(dev.Read(rb * kBlockSize, counts.data(), kBlockSize).ok());
  std::vector<uint32_t> free_slots;
  for (uint32_t s = 0; s < kRefsPerBlock && free_slots.size() < 2; s++) {
    if (GetRef(counts.data(), s) == 0) free_slots.push_back(s);
  }
  REQUIRE(free_slots.size() == 2);
  for (uint32_t s : free_slots) SetRef(counts.data(), s, 1);
  SealBlock(counts.data(), PeekHeader(counts.data()), sb.uuid);
  REQUIRE(dev.Write(rb * kBlockSize, counts.data(), kBlockSize).ok());
  const uint64_t meta = sb.GroupDataStart(0) + free_slots[0];
  const uint64_t data = sb.GroupDataStart(0) + free_slots[1];
  std::vector<uint8_t> blk(kBlockSize, 0);
  BlockHeader h;
  h.magic = kMagicPointerBlock;
  h.flags = 2;
  h.seq = 9;
  h.addr = meta;
  SealBlock(blk.data(), h, sb.uuid);
  REQUIRE(dev.Write(meta * kBlockSize, blk.data(), kBlockSize).ok());
  blk = Pattern(kBlockSize, 77);
  REQUIRE(dev.Write(data * kBlockSize, blk.data(), kBlockSize).ok());

  auto vol = Volume::Open(&dev, oo);
  REQUIRE(vol.ok());
  auto rep = CheckVolume(vol.value().get(), false);
  REQUIRE(rep.ok());
  std::map<std::string, std::string> what;
  for (auto& p : rep->problems) what[p.where] = p.what;
  REQUIRE(what.size() == 2);
  INFO(what["block " + std::to_string(meta)]);
  CHECK(what["block " + std::to_string(meta)] ==
        "refcount 1 stored, 0 references found (leaked; holds a \"DDPP\" block (flags 2, seq 9, "
        "stamped for block " + std::to_string(meta) + "))");
  std::string starts = "refcount 1 stored, 0 references found (leaked; holds data (starts";
  for (size_t i = 0; i < 16; i++) {
    char hex[4];
    std::snprintf(hex, sizeof hex, " %02x", blk[i]);
    starts += hex;
  }
  CHECK(what["block " + std::to_string(data)] == starts + "))");

  // A block repeating one byte (a guest's fill pattern) says which byte.
  blk.assign(kBlockSize, 0x5a);
  REQUIRE(dev.Write(data * kBlockSize, blk.data(), kBlockSize).ok());
  rep = CheckVolume(vol.value().get(), false);
  REQUIRE(rep.ok());
  what.clear();
  for (auto& p : rep->problems) what[p.where] = p.what;
  CHECK(what["block " + std::to_string(data)] ==
        "refcount 1 stored, 0 references found (leaked; holds data (every byte 0x5a))");
}

namespace {
// Counts the device reads that reach the wrapped device: all of them, or,
// once Watch() names byte ranges, those that touch one of the ranges.
class ReadCountingDevice : public test::ForwardingDevice {
 public:
  explicit ReadCountingDevice(BlockDevice* base) : ForwardingDevice(base, "counting") {}
  // Blocks [first, first + n) (before any read is counted).
  void Watch(uint64_t first, uint64_t n) {
    watched_.emplace_back(first * kBlockSize, (first + n) * kBlockSize);
  }
  Status Read(uint64_t offset, void* buf, size_t len) override {
    bool counted = watched_.empty();
    for (const auto& [b, e] : watched_) counted = counted || (offset < e && offset + len > b);
    if (counted) {
      reads_++;
      bytes_read_ += len;
    }
    return ForwardingDevice::Read(offset, buf, len);
  }
  uint64_t reads() const { return reads_; }
  uint64_t bytes_read() const { return bytes_read_; }
  void Reset() { reads_ = bytes_read_ = 0; }

 private:
  std::atomic<uint64_t> reads_{0};
  std::atomic<uint64_t> bytes_read_{0};
  std::vector<std::pair<uint64_t, uint64_t>> watched_;  // byte ranges [begin, end)
};
}  // namespace

// Several NBD requests in flight reach the volume in any order. A file
// allocated in arrival order would be laid out as a permutation of its
// 64 KiB pieces, and every later 1 MiB read or write of it would be 16
// device requests instead of one (docs/BENCHMARKS.md, "NBD data path").
// The allocator places block i of a file at its anchor + i when free.
TEST_CASE("volume: a file first written out of order is laid out in file order", "[volume]") {
  MemDevice mem(64 << 20);
  REQUIRE(FormatVolume(&mem, FormatOptions{}, false).ok());
  ReadCountingDevice dev(&mem);
  OpenOptions oo;
  oo.locks = TempLocks();
  auto vol = Volume::Open(&dev, oo);
  REQUIRE(vol.ok());
  constexpr uint64_t kPiece = 16 * kBlockSize;  // 64 KiB
  constexpr uint64_t kPieces = 32;              // a 2 MiB file
  for (const char* name : {"other", "vm"}) {
    REQUIRE(vol.value()->Create(name, kPieces * kPiece).ok());
  }
  const std::vector<uint8_t> data = Pattern(kPieces * kPiece, 9);
  {
    // Another file takes blocks first, so "vm" does not start at the
    // group's first block by chance.
    auto other = vol.value()->OpenFile("other");
    REQUIRE(other.ok());
    REQUIRE(other.value()->Write(0, data.data(), kPiece).ok());
  }
  auto f = vol.value()->OpenFile("vm");
  REQUIRE(f.ok());
  // Pieces in the order 1 0 3 2 5 4 ...: each pair swapped, like two
  // workers that took their requests in the other order.
  for (uint64_t p = 0; p < kPieces; p++) {
    const uint64_t piece = p ^ 1;
    REQUIRE(f.value()->Write(piece * kPiece, data.data() + piece * kPiece, kPiece).ok());
  }
  const uint64_t before = dev.reads();
  std::vector<uint8_t> got(data.size());
  REQUIRE(f.value()->Read(0, got.data(), got.size()).ok());
  CHECK(got == data);
  // One read for the whole file (metadata is cached by then).
  CHECK(dev.reads() - before == 1);
}

TEST_CASE("volume: a write or trim whose range wraps around 2^64 is refused, not applied",
          "[volume]") {
  // offset + len used to wrap in the end-of-file check: 8 KiB at 2^64-4 KiB
  // did nothing and reported success, 4 KiB there mapped a block far past
  // the file's end (leaked when the file went).
  MemDevice dev(64 << 20);
  REQUIRE(FormatVolume(&dev, FormatOptions{}, false).ok());
  OpenOptions oo;
  oo.locks = TempLocks();
  auto vol = Volume::Open(&dev, oo);
  REQUIRE(vol.ok());
  REQUIRE(vol.value()->Create("a", 1 << 20).ok());
  {
    auto fa = vol.value()->OpenFile("a");
    REQUIRE(fa.ok());
    const std::vector<uint8_t> d = Pattern(2 * kBlockSize, 9);
    const uint64_t near_end = UINT64_MAX - kBlockSize + 1;
    CHECK(fa.value()->Write(near_end, d.data(), 2 * kBlockSize).code() == Status::Code::kInvalid);
    CHECK(fa.value()->Write(near_end, d.data(), kBlockSize).code() == Status::Code::kInvalid);
    CHECK(fa.value()->Write(near_end + 100, d.data(), 100).code() == Status::Code::kInvalid);
    CHECK(fa.value()->Trim(near_end, 2 * kBlockSize).code() == Status::Code::kInvalid);
    CHECK(fa.value()->Write((1 << 20) - kBlockSize, d.data(), 2 * kBlockSize).code() ==
          Status::Code::kInvalid);
    REQUIRE(fa.value()->Write((1 << 20) - kBlockSize, d.data(), kBlockSize).ok());
  }
  REQUIRE(vol.value()->Sync().ok());
  auto st = vol.value()->Stats();
  REQUIRE(st.ok());
  auto rep = CheckVolume(vol.value().get(), false);
  REQUIRE(rep.ok());
  for (auto& p : rep->problems) INFO(p.where << ": " << p.what);
  CHECK(rep->clean());
  auto info = vol.value()->Lookup("a");
  REQUIRE(info.ok());
  CHECK(info->mapped_blocks == 1);
}

TEST_CASE("volume: names no file can have are refused, before anything is written", "[volume]") {
  MemDevice dev(64 << 20);
  OpenOptions oo;
  oo.locks = TempLocks();
  FormatWithOneFile(&dev, oo, Pattern(kBlockSize, 13));
  auto vol = Volume::Open(&dev, oo);
  REQUIRE(vol.ok());
  // "." and "..": export names go in URIs (nbd+unix:///NAME), where a
  // client resolving dot segments asks for another export.
  for (const std::string& bad : {std::string(), std::string("a/b"), std::string("a\0b", 3),
                                 std::string("."), std::string(".."), std::string(256, 'n')}) {
    INFO("name '" << bad << "'");
    CHECK(ValidateFileName(bad).code() == Status::Code::kInvalid);
    CHECK(vol.value()->Create(bad, kBlockSize).status().code() == Status::Code::kInvalid);
  }
  for (const std::string& good :
       {std::string("..."), std::string(".x"), std::string("-x"), std::string(255, 'n')}) {
    INFO("name '" << good << "'");
    CHECK(ValidateFileName(good).ok());
    CHECK(vol.value()->Create(good, kBlockSize).ok());
  }
}

TEST_CASE("volume: sizes past 1 EiB are refused, and a block index near 2^52 is never whole",
          "[volume]") {
  // A size near 2^64 made the block count round up to 0: growing a file to
  // it punched every block, and rm of such a file leaked. (index + 1) *
  // 4096 wrapped to 0 for index 2^52 - 1 (which the log and merge-request
  // decoders accept), passing the "whole block inside the file" check.
  MemDevice dev(64 << 20);
  OpenOptions oo;
  oo.locks = TempLocks();
  const std::vector<uint8_t> d = Pattern(4 * kBlockSize, 12);
  FormatWithOneFile(&dev, oo, d);
  auto vol = Volume::Open(&dev, oo);
  REQUIRE(vol.ok());
  CHECK(vol.value()->Create("huge", UINT64_MAX - 100).status().code() == Status::Code::kInvalid);
  CHECK(vol.value()->Create("huge", kMaxFileBytes + 1).status().code() == Status::Code::kInvalid);
  REQUIRE(vol.value()->Create("big", kMaxFileBytes).ok());
  REQUIRE(vol.value()->Create("g", 1 << 20).ok());
  auto f = vol.value()->OpenFile("f");
  REQUIRE(f.ok());
  auto g = vol.value()->OpenFile("g");
  REQUIRE(g.ok());
  CHECK(f.value()->Truncate(UINT64_MAX - kBlockSize + 2).code() == Status::Code::kInvalid);
  const uint64_t wrapping = (uint64_t{1} << 52) - 1;
  CHECK(vol.value()->CloneBlock(f.value().get(), wrapping, g.value().get(), 0).code() ==
        Status::Code::kInvalid);
  CHECK(vol.value()->CloneBlock(f.value().get(), 0, g.value().get(), wrapping).code() ==
        Status::Code::kInvalid);
  std::vector<uint8_t> got(d.size());
  REQUIRE(f.value()->Read(0, got.data(), got.size()).ok());
  CHECK(got == d);
  f.value().reset();
  g.value().reset();
  auto rep = CheckVolume(vol.value().get(), false);
  REQUIRE(rep.ok());
  for (auto& p : rep->problems) INFO(p.where << ": " << p.what);
  CHECK(rep->clean());
}

TEST_CASE("volume: removing or shrinking a huge thin file walks its mapped blocks only",
          "[volume]") {
  // Truncation looked up every block index from the end down, holes
  // included: removing a thin 16 TiB disk with a few blocks written took
  // four billion lookups under the volume's mutex.
  ThinVolume tv;
  Volume* vol = tv.vol.get();
  constexpr uint64_t kSize = ThinVolume::kSize;
  const std::vector<uint8_t> d = Pattern(kBlockSize, 13);
  const std::vector<uint64_t> at = {0, 1, 600, uint64_t{1} << 30, kSize / kBlockSize - 1};
  for (const char* name : {"shrunk", "removed"}) {
    REQUIRE(vol->Create(name, kSize).ok());
    auto f = vol->OpenFile(name);
    REQUIRE(f.ok());
    for (uint64_t b : at) REQUIRE(f.value()->Write(b * kBlockSize, d.data(), d.size()).ok());
  }
  {
    auto f = vol->OpenFile("shrunk");
    REQUIRE(f.ok());
    REQUIRE(f.value()->Truncate(700 * kBlockSize).ok());
    auto info = f.value()->Info();
    REQUIRE(info.ok());
    CHECK(info->mapped_blocks == 3);
    std::vector<uint8_t> got(kBlockSize);
    REQUIRE(f.value()->Read(600 * kBlockSize, got.data(), got.size()).ok());
    CHECK(got == d);
  }
  REQUIRE(vol->Remove("removed").ok());
  auto rep = CheckVolume(vol, false);
  REQUIRE(rep.ok());
  for (auto& p : rep->problems) INFO(p.where << ": " << p.what);
  CHECK(rep->clean());
  auto st = vol->Stats();
  REQUIRE(st.ok());
  CHECK(st->logical_blocks == 3);
}

TEST_CASE("volume: a trim of a huge thin range punches its mapped blocks only", "[volume]") {
  // A trim punched every block index of its range, holes included, each
  // under the volume's mutex and the file's lock: a guest's fstrim of a
  // thin 16 TiB disk took four billion lookups while the disk's READs
  // waited. It now walks the mapped blocks from the end down (and lets
  // the file's lock go every kTrimBlocksPerHold of them).
  ThinVolume tv;
  Volume* vol = tv.vol.get();
  constexpr uint64_t kSize = ThinVolume::kSize;
  constexpr uint64_t kLast = kSize / kBlockSize - 1;
  REQUIRE(vol->Create("thin", kSize).ok());
  auto f = vol->OpenFile("thin");
  REQUIRE(f.ok());
  const std::vector<uint8_t> d = Pattern(kBlockSize, 17);
  // A run of 3000 blocks (several holds of the file's lock), and blocks
  // far apart; the first and last blocks stay outside the trim.
  std::vector<uint64_t> mapped = {0, uint64_t{1} << 30, kLast};
  for (uint64_t b = 5000; b < 8000; b++) mapped.push_back(b);
  const std::vector<uint8_t> run = Pattern(3000 * kBlockSize, 18);
  REQUIRE(f.value()->Write(5000 * kBlockSize, run.data(), run.size()).ok());
  for (uint64_t b : {uint64_t{0}, uint64_t{1} << 30, kLast}) {
    REQUIRE(f.value()->Write(b * kBlockSize, d.data(), d.size()).ok());
  }
  // From the middle of block 0 to the middle of the last block: both edge
  // blocks are zeroed in part, every whole block between is punched.
  REQUIRE(f.value()->Trim(kBlockSize / 2, kSize - kBlockSize).ok());
  auto info = f.value()->Info();
  REQUIRE(info.ok());
  CHECK(info->mapped_blocks == 2);
  std::vector<uint8_t> got(kBlockSize), want = d;
  REQUIRE(f.value()->Read(0, got.data(), got.size()).ok());
  std::fill(want.begin() + kBlockSize / 2, want.end(), 0);
  CHECK(got == want);
  REQUIRE(f.value()->Read(kLast * kBlockSize, got.data(), got.size()).ok());
  want = d;
  std::fill(want.begin(), want.begin() + kBlockSize / 2, 0);
  CHECK(got == want);
  for (uint64_t b : {uint64_t{5000}, uint64_t{6500}, uint64_t{7999}, uint64_t{1} << 30}) {
    REQUIRE(f.value()->Read(b * kBlockSize, got.data(), got.size()).ok());
    CHECK(std::all_of(got.begin(), got.end(), [](uint8_t c) { return c == 0; }));
  }
  // A trim past the end is refused.
  CHECK(f.value()->Trim(kSize - kBlockSize, 2 * kBlockSize).code() == Status::Code::kInvalid);
  f.value().reset();
  auto rep = CheckVolume(vol, false);
  REQUIRE(rep.ok());
  for (auto& p : rep->problems) INFO(p.where << ": " << p.what);
  CHECK(rep->clean());
}

TEST_CASE("volume: every walk of a block map checks each pointer block's level", "[volume]") {
  // Only lookups of one block checked that a pointer block has the level
  // its parent implies; the walks of truncation, trims, usage and stats
  // took whatever the checksum vouched for (a block sealed for its
  // address, not for its place in this tree).
  ThinVolume tv;
  Volume* vol = tv.vol.get();
  REQUIRE(vol->Create("thin", ThinVolume::kSize).ok());
  const std::vector<uint8_t> d = Pattern(kBlockSize, 19);
  uint64_t ino = 0;
  {
    auto f = vol->OpenFile("thin");
    REQUIRE(f.ok());
    ino = (*f)->id().ino;
    for (uint64_t b : {uint64_t{0}, uint64_t{1} << 30}) {
      REQUIRE((*f)->Write(b * kBlockSize, d.data(), d.size()).ok());
    }
  }
  const Superblock sb = vol->superblock();
  tv.vol.reset();
  std::vector<uint8_t> blk(kBlockSize);
  REQUIRE(tv.dev.Read((sb.inode_start + ino - 1) * kBlockSize, blk.data(), kBlockSize).ok());
  auto in = DecodeInode(blk.data(), sb.uuid, sb.inode_start + ino - 1);
  REQUIRE(in.ok());
  REQUIRE(in->depth >= 2);
  // The root, resealed one level lower.
  REQUIRE(tv.dev.Read(in->root * kBlockSize, blk.data(), kBlockSize).ok());
  BlockHeader h = PeekHeader(blk.data());
  REQUIRE(h.flags == in->depth);
  h.flags = in->depth - 1;
  SealBlock(blk.data(), h, sb.uuid);
  REQUIRE(tv.dev.Write(in->root * kBlockSize, blk.data(), kBlockSize).ok());
  OpenOptions oo;
  oo.locks = TempLocks();
  auto reopened = Volume::Open(&tv.dev, oo);
  REQUIRE(reopened.ok());
  auto f = (*reopened)->OpenFile("thin");
  REQUIRE(f.ok());
  auto usage = (*f)->Usage();
  CHECK(usage.status().code() == Status::Code::kCorruption);
  Status trim = (*f)->Trim(0, ThinVolume::kSize);
  INFO("trim: " << trim.ToString());
  CHECK(trim.code() == Status::Code::kCorruption);
  CHECK((*reopened)->Stats().status().code() == Status::Code::kCorruption);
}

TEST_CASE("volume: a write whose new blocks scatter over many refcount blocks, on the "
          "smallest journal",
          "[volume]") {
  // Free space fragmented (one free block per refcount block, as dedup's
  // punches leave it): each new block of a write dirties a refcount block
  // of its own. WriteData sized its rounds for a contiguous allocation, so
  // one round of this 40-block write dirtied ~46 blocks in one transaction
  // on a journal whose transactions hold 32: with a few committed
  // transactions already in the ring, the commit overflowed ("journal
  // overflow (internal error)") and poisoned the volume. Rounds are now
  // sized for the worst case and make room for the refcount blocks they
  // really dirty (PublishCost).
  FormatOptions fo;
  fo.journal_blocks = 70;  // the least format takes: 32 blocks per transaction
  const uint64_t kScatter = 40;  // free blocks, one per refcount block
  const uint64_t kClones = GENERATE(range(0, 9));
  MemDevice dev((kScatter + 8) * kRefsPerBlock * kBlockSize + (24 << 20));
  REQUIRE(FormatVolume(&dev, fo, false).ok());
  OpenOptions oo;
  oo.locks = TempLocks();
  auto opened = Volume::Open(&dev, oo);
  REQUIRE(opened.ok());
  Volume* vol = opened.value().get();
  auto st = vol->Stats();
  REQUIRE(st.ok());
  // A file over every free block: written until the volume is full.
  const uint64_t fill_blocks = st->free_blocks;
  REQUIRE(vol->Create("fill", fill_blocks * kBlockSize).ok());
  REQUIRE(vol->Create("new", kScatter * kBlockSize).ok());
  const std::vector<uint8_t> data = Pattern(kScatter * kBlockSize, 5);
  {
    auto fill = vol->OpenFile("fill");
    REQUIRE(fill.ok());
    const std::vector<uint8_t> chunk = Pattern(256 * kBlockSize, 4);
    uint64_t b = 0;
    for (uint64_t n = 256; n > 0; n /= 2) {
      while (b + n <= fill_blocks) {
        Status w = fill.value()->Write(b * kBlockSize, chunk.data(), n * kBlockSize);
        if (w.code() == Status::Code::kNoSpace) break;
        REQUIRE(w.ok());
        b += n;
      }
    }
    REQUIRE(vol->Sync().ok());
    st = vol->Stats();
    REQUIRE(st.ok());
    REQUIRE(st->free_blocks == 0);
    REQUIRE(b > (kScatter + 4) * kRefsPerBlock);
    // One free block per refcount block.
    // (A few more for the new file's block map.)
    for (uint64_t i = 0; i < kScatter + 4; i++) {
      REQUIRE(fill.value()->Trim((1 + i * kRefsPerBlock) * kBlockSize, kBlockSize).ok());
    }
    // Quiet flush points write the journal home: its ring is empty. Then
    // committed transactions stay in the ring (clones of blocks in distinct
    // refcount blocks, each its own transaction), so a transaction that
    // outgrows its limit no longer fits beside them.
    REQUIRE(vol->Create("clones", 64 * kBlockSize).ok());
    auto clones = vol->OpenFile("clones");
    REQUIRE(clones.ok());
    auto target = vol->OpenFile("new");  // (a close checkpoints: none from here on)
    REQUIRE(target.ok());
    for (int i = 0; i < 3; i++) REQUIRE(vol->Sync().ok());
    for (uint64_t i = 0; i < kClones; i++) {
      REQUIRE(vol->CloneBlock(fill.value().get(), 2 + i * kRefsPerBlock, clones.value().get(), i)
                  .ok());
    }
    Status w = target.value()->Write(0, data.data(), data.size());
    INFO("writing " << kScatter << " blocks in one call after " << kClones
                    << " clones: " << w.ToString());
    REQUIRE(w.ok());
    Status synced = vol->Sync();
    INFO("sync: " << synced.ToString());
    REQUIRE(synced.ok());
  }
  auto f = vol->OpenFile("new");
  REQUIRE(f.ok());
  std::vector<uint8_t> got(data.size());
  REQUIRE(f.value()->Read(0, got.data(), got.size()).ok());
  CHECK(got == data);
  f.value().reset();
  auto rep = CheckVolume(vol, false);
  REQUIRE(rep.ok());
  for (auto& p : rep->problems) INFO(p.where << ": " << p.what);
  CHECK(rep->clean());
}

namespace {

// Runs `on_read` with the first block of each read, then reads.
class ReadProbe : public test::ForwardingDevice {
 public:
  ReadProbe(BlockDevice* base, std::function<void(uint64_t)> on_read)
      : ForwardingDevice(base, "probe"), on_read_(std::move(on_read)) {}
  Status Read(uint64_t offset, void* buf, size_t len) override {
    on_read_(offset / kBlockSize);
    return base()->Read(offset, buf, len);
  }

 private:
  std::function<void(uint64_t)> on_read_;
};

// Runs `before` as each lock is asked for, then asks.
class AcquireProbe : public test::ForwardingLocks {
 public:
  AcquireProbe(std::shared_ptr<LockManager> base, std::function<void(LockId)> before)
      : ForwardingLocks(std::move(base)), before_(std::move(before)) {}
  Status Acquire(LockId id, LockMode mode, bool wait) override {
    before_(id);
    return base()->Acquire(id, mode, wait);
  }

 private:
  std::function<void(LockId)> before_;
};

}  // namespace

// Another process's dead-host scan skips a slot that is held, waiting only
// for a replay under way (kRecovery). An opener that took its slot before
// kRecovery left a moment when its slot was held and kRecovery free: a
// scan then went on and used home blocks that the opener's replay of its
// previous incarnation's journal overwrote right after.
TEST_CASE("volume: an opener holds its slot's kRecovery from before the slot is taken until its "
          "replay is done",
          "[volume]") {
  MemDevice mem(64 << 20);
  REQUIRE(FormatVolume(&mem, FormatOptions{}, false).ok());
  std::vector<std::shared_ptr<LockManager>> hosts = test::TempLockGroup(2);
  const LockId slot{LockKind::kHostSlot, 3}, recovery{LockKind::kRecovery, 3};
  // What another host sees of kRecovery(3) (true: held).
  auto recovery_held = [&] {
    Result<bool> held = hosts[1]->IsHeldElsewhere(recovery);
    REQUIRE(held.ok());
    return *held;
  };
  int slot_asks = 0;
  bool held_at_slot = false;
  auto probe = std::make_shared<AcquireProbe>(hosts[0], [&](LockId id) {
    if (!(id == slot)) return;
    slot_asks++;
    held_at_slot = recovery_held();
  });
  // And while the opener reads its own journal (the replay).
  std::vector<uint8_t> block0(kBlockSize);
  REQUIRE(mem.Read(0, block0.data(), block0.size()).ok());
  Result<Superblock> sb = DecodeSuperblock(block0.data(), 0);
  REQUIRE(sb.ok());
  const uint64_t journal_first = sb->JournalStart(3);
  const uint64_t journal_end = journal_first + sb->journal_blocks;
  int journal_reads = 0, journal_reads_unguarded = 0;
  ReadProbe dev(&mem, [&](uint64_t block) {
    if (block < journal_first || block >= journal_end) return;
    journal_reads++;
    if (!recovery_held()) journal_reads_unguarded++;
  });
  OpenOptions oo;
  oo.host_id = 3;
  oo.locks = probe;
  auto v = Volume::Open(&dev, oo);
  REQUIRE(v.ok());
  CHECK(slot_asks == 1);
  CHECK(held_at_slot);
  CHECK(journal_reads > 0);
  CHECK(journal_reads_unguarded == 0);
  CHECK_FALSE(recovery_held());  // replay done, let go
  Result<bool> slot_held = hosts[1]->IsHeldElsewhere(slot);
  REQUIRE(slot_held.ok());
  CHECK(*slot_held);
}

// With sanlock, taking a file's lock can wait out a dead host's partition
// lease (minutes). OpenInode took it holding the volume's mutex, so one
// VM's open stalled the reads and writes of every disk served by the
// process. The lock is now taken outside it.
TEST_CASE("volume: an open waiting for its file's lock does not hold up other files' I/O",
          "[volume]") {
  MemDevice dev(64 << 20);
  std::mutex gate_mu;
  std::condition_variable gate_cv;
  bool gate_open = false, acquiring = false;
  uint64_t slow_ino = 0;  // set once "slow" exists
  auto locks = std::make_shared<AcquireProbe>(TempLocks(), [&](LockId id) {
    std::unique_lock<std::mutex> g(gate_mu);
    if (slow_ino == 0 || !(id == LockId{LockKind::kInode, slow_ino})) return;
    acquiring = true;
    gate_cv.notify_all();
    gate_cv.wait_for(g, std::chrono::seconds(30), [&] { return gate_open; });
  });
  REQUIRE(FormatVolume(&dev, FormatOptions{}, false).ok());
  OpenOptions oo;
  oo.locks = locks;
  auto v = Volume::Open(&dev, oo);
  REQUIRE(v.ok());
  REQUIRE(v.value()->Create("busy", 1 << 20).ok());
  Result<FileId> slow = v.value()->Create("slow", 1 << 20);
  REQUIRE(slow.ok());
  auto busy = v.value()->OpenFile("busy");
  REQUIRE(busy.ok());
  {
    std::lock_guard<std::mutex> g(gate_mu);
    slow_ino = slow->ino;
  }
  std::future<Result<std::unique_ptr<File>>> opening =
      std::async(std::launch::async, [&] { return v.value()->OpenFile("slow"); });
  {
    std::unique_lock<std::mutex> g(gate_mu);
    REQUIRE(gate_cv.wait_for(g, std::chrono::seconds(10), [&] { return acquiring; }));
  }
  // While that open waits: the other file's I/O goes on, and a second open
  // of the same file is refused rather than racing for the lock.
  const std::vector<uint8_t> data = Pattern(64 << 10, 11);
  std::future<bool> io = std::async(std::launch::async, [&] {
    std::vector<uint8_t> back(data.size());
    return busy.value()->Write(4096, data.data(), data.size()).ok() && v.value()->Sync().ok() &&
           busy.value()->Read(4096, back.data(), back.size()).ok() && back == data;
  });
  const bool io_done = io.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  Result<std::unique_ptr<File>> again(Status::Invalid("not run"));
  std::future<void> second =
      std::async(std::launch::async, [&] { again = v.value()->OpenFile("slow"); });
  const bool second_done = second.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  {
    std::lock_guard<std::mutex> g(gate_mu);
    gate_open = true;
    gate_cv.notify_all();
  }
  CHECK(io_done);
  CHECK(io.get());
  CHECK(second_done);
  second.get();
  CHECK(again.status().code() == Status::Code::kLocked);
  Result<std::unique_ptr<File>> opened = opening.get();
  REQUIRE(opened.ok());
  opened.value().reset();
  busy.value().reset();
}

// A write that allocates publishes its blocks after writing them, outside
// the volume mutex meanwhile. When another thread's commit failed (the
// volume poisoned) during that window, the write published into a
// transaction that can never commit, and still answered Ok.
TEST_CASE("volume: a write that finds the volume poisoned after its data I/O fails", "[volume]") {
  MemDevice mem(64 << 20);
  REQUIRE(FormatVolume(&mem, FormatOptions{}, false).ok());
  struct PoisonMidWrite : test::ForwardingDevice {
    using ForwardingDevice::ForwardingDevice;
    std::function<void()> on_data_write;  // once, at the first 64 KiB write
    std::atomic<bool> fail{false};
    Status Write(uint64_t offset, const void* buf, size_t len) override {
      if (fail) return Status::IoError("injected");
      if (len == 64 * 1024 && on_data_write) {
        auto hook = std::move(on_data_write);
        on_data_write = nullptr;
        hook();
      }
      return base()->Write(offset, buf, len);
    }
  } dev(&mem, "poison-mid-write");
  OpenOptions oo;
  oo.locks = TempLocks();
  auto v = Volume::Open(&dev, oo);
  REQUIRE(v.ok());
  REQUIRE(v.value()->Create("a", 1 << 20).ok());
  REQUIRE(v.value()->Create("b", 1 << 20).ok());
  auto a = v.value()->OpenFile("a");
  auto b = v.value()->OpenFile("b");
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  const std::vector<uint8_t> small = Pattern(kBlockSize, 1), data = Pattern(64 << 10, 2);
  REQUIRE(b.value()->Write(0, small.data(), small.size()).ok());  // something to commit
  Status sync_failed;
  dev.on_data_write = [&] {
    // Another thread's flush point fails here, while a's write has its
    // blocks allocated and is writing them.
    dev.fail = true;
    std::thread t([&] { sync_failed = v.value()->Sync(); });
    t.join();
    dev.fail = false;
  };
  Status w = a.value()->Write(0, data.data(), data.size());
  REQUIRE_FALSE(sync_failed.ok());
  INFO("write: " << w.ToString());
  CHECK_FALSE(w.ok());
}

// Every allocation that found a full volume took, and gave back, every
// allocation group's lock under the volume mutex (and waited up to the
// lock wait for one held elsewhere): VMs writing into a full volume stalled
// every disk of the process, with sanlock for seconds per write. For a
// moment after, allocations look only in the groups held already.
TEST_CASE("volume: a full volume fails allocations at once for a moment, then looks again",
          "[volume]") {
  MemDevice dev(48 << 20);
  FormatOptions fo;
  fo.group_refblocks = 2;  // several groups
  REQUIRE(FormatVolume(&dev, fo, false).ok());
  std::atomic<int> group_tries{0};
  auto locks = std::make_shared<AcquireProbe>(TempLocks(), [&](LockId id) {
    if (id.kind == LockKind::kGroup) group_tries++;
  });
  ManualClock clock;
  OpenOptions oo;
  oo.locks = locks;
  oo.clock = &clock;
  auto v = Volume::Open(&dev, oo);
  REQUIRE(v.ok());
  REQUIRE(v.value()->superblock().group_count > 2);
  auto st = v.value()->Stats();
  REQUIRE(st.ok());
  const uint64_t fill_blocks = st->free_blocks;
  REQUIRE(v.value()->Create("fill", fill_blocks * kBlockSize).ok());
  REQUIRE(v.value()->Create("late", 1 << 20).ok());
  auto fill = v.value()->OpenFile("fill");
  auto late = v.value()->OpenFile("late");
  REQUIRE(fill.ok());
  REQUIRE(late.ok());
  const std::vector<uint8_t> chunk = Pattern(256 * kBlockSize, 4);
  uint64_t b = 0;
  Status w;
  for (uint64_t n = 256; n > 0; n /= 2) {
    while (b + n <= fill_blocks) {
      w = fill.value()->Write(b * kBlockSize, chunk.data(), n * kBlockSize);
      if (w.code() == Status::Code::kNoSpace) break;
      REQUIRE(w.ok());
      b += n;
    }
  }
  REQUIRE(w.code() == Status::Code::kNoSpace);
  const std::vector<uint8_t> one = Pattern(kBlockSize, 9);
  group_tries = 0;
  CHECK(late.value()->Write(0, one.data(), one.size()).code() == Status::Code::kNoSpace);
  CHECK(group_tries == 0);
  clock.Advance(3'000'000'000);  // past the moment: every group again
  CHECK(late.value()->Write(0, one.data(), one.size()).code() == Status::Code::kNoSpace);
  CHECK(group_tries >= int(v.value()->superblock().group_count) - 1);
  // Blocks freed here end the moment at once.
  CHECK(late.value()->Write(0, one.data(), one.size()).code() == Status::Code::kNoSpace);
  REQUIRE(fill.value()->Trim(0, 64 * kBlockSize).ok());
  REQUIRE(v.value()->Sync().ok());
  CHECK(late.value()->Write(0, one.data(), one.size()).ok());
  fill.value().reset();
  late.value().reset();
  auto rep = CheckVolume(v.value().get(), false);
  REQUIRE(rep.ok());
  for (auto& p : rep->problems) INFO(p.where << ": " << p.what);
  CHECK(rep->clean());
}

// File::Usage on a read-only volume (`dede ls -l`) read a refcount block
// from the device for every mapped block, holding the file's lock: about
// 20 s per GiB, during which the file's VM could not start.
TEST_CASE("volume: usage of a file reads each refcount block once", "[volume]") {
  MemDevice mem(64 << 20);
  REQUIRE(FormatVolume(&mem, FormatOptions{}, false).ok());
  const uint64_t kBlocks = 2048;
  {
    OpenOptions oo;
    oo.locks = TempLocks();
    auto v = Volume::Open(&mem, oo);
    REQUIRE(v.ok());
    REQUIRE(v.value()->Create("f", kBlocks * kBlockSize).ok());
    auto f = v.value()->OpenFile("f");
    REQUIRE(f.ok());
    const std::vector<uint8_t> data = Pattern(kBlocks * kBlockSize, 3);
    REQUIRE(f.value()->Write(0, data.data(), data.size()).ok());
  }
  std::atomic<uint64_t> reads{0};
  ReadProbe dev(&mem, [&](uint64_t) { reads++; });
  OpenOptions oo;
  oo.locks = TempLocks();
  oo.read_only = true;
  auto v = Volume::Open(&dev, oo);
  REQUIRE(v.ok());
  auto f = v.value()->OpenFile("f");
  REQUIRE(f.ok());
  reads = 0;
  Result<FileUsage> u = f.value()->Usage();
  REQUIRE(u.ok());
  CHECK(u->mapped_blocks == kBlocks);
  CHECK(u->unique_blocks == kBlocks);
  // Pointer blocks (a root and up to 5 leaves), and about kBlocks / 1016
  // refcount blocks.
  CHECK(reads.load() <= 16);
}

// A data pointer carries no checksum of its target: before the check in
// GetPtr, one that named an inode block (a damaged or foreign pointer
// block with a valid seal) had a write land on the inode table and a read
// hand the table out as file data.
TEST_CASE("volume: a data pointer that names metadata is refused, not read or written through",
          "[volume]") {
  MemDevice dev(64 << 20);
  OpenOptions oo;
  oo.locks = TempLocks();
  const OneFileVolume one = FormatWithOneFile(&dev, oo, Pattern(kBlockSize, 3));
  const Superblock& sb = one.sb;
  const uint64_t ino = one.ino;
  REQUIRE(one.inode.depth == 1);  // the root is the leaf
  const uint64_t leaf = one.inode.root;
  std::vector<uint8_t> blk(kBlockSize);
  REQUIRE(dev.Read(leaf * kBlockSize, blk.data(), kBlockSize).ok());
  auto pb = DecodePointerBlock(blk.data(), sb.uuid, leaf);
  REQUIRE(pb.ok());
  const uint64_t seq = PeekHeader(blk.data()).seq;

  struct Bad {
    const char* what;
    uint64_t ptr;
    bool watch;  // the target is a block of the device that must not change
  };
  for (Bad bad :
       {Bad{"an unused inode", sb.inode_start + ino, true}, Bad{"the backup superblock", 1, true},
        Bad{"a journal block", sb.JournalStart(1) + 5, true},
        Bad{"past the device", sb.total_blocks + 10, false},
        Bad{"reserved bits", PtrAddr(pb->ptrs[0]) | (1ull << 50), false}}) {
    INFO(bad.what);
    PointerBlock changed = *pb;
    changed.ptrs[0] = bad.ptr;
    EncodePointerBlock(changed, seq + 1, sb.uuid, leaf, blk.data());
    REQUIRE(dev.Write(leaf * kBlockSize, blk.data(), kBlockSize).ok());
    std::vector<uint8_t> before(kBlockSize), after(kBlockSize);
    if (bad.watch) REQUIRE(dev.Read(bad.ptr * kBlockSize, before.data(), kBlockSize).ok());

    auto vol = Volume::Open(&dev, oo);
    REQUIRE(vol.ok());
    auto f = vol.value()->OpenFile("f");
    REQUIRE(f.ok());
    std::vector<uint8_t> got(kBlockSize);
    Status rd = f.value()->Read(0, got.data(), got.size());
    INFO("read: " << rd.ToString());
    CHECK(rd.code() == Status::Code::kCorruption);
    const std::vector<uint8_t> other = Pattern(kBlockSize, 9);
    Status wr = f.value()->Write(0, other.data(), other.size());
    INFO("write: " << wr.ToString());
    CHECK_FALSE(wr.ok());
    f.value().reset();
    vol.value().reset();
    if (bad.watch) {
      REQUIRE(dev.Read(bad.ptr * kBlockSize, after.data(), kBlockSize).ok());
      CHECK(after == before);
    }
  }
}

// Formats `dev` with the defaults and returns the superblock an open reads.
static Superblock FormattedSuperblock(MemDevice* dev) {
  REQUIRE(FormatVolume(dev, FormatOptions{}, false).ok());
  OpenOptions oo;
  oo.locks = TempLocks();
  auto vol = Volume::Open(dev, oo);
  REQUIRE(vol.ok());
  return vol.value()->superblock();
}

// Replay wrote every image of a valid transaction to its home without
// looking at either: a forged or misdirected transaction (a buggy or
// hostile host's journal) could overwrite a superblock copy, the lease
// area or another host's journal.
TEST_CASE("journal: replay refuses an image that does not belong at its home", "[volume]") {
  MemDevice dev(64 << 20);
  const Superblock sb = FormattedSuperblock(&dev);
  auto sealed = [&](uint32_t magic, uint64_t addr) {
    std::vector<uint8_t> b(kBlockSize, 0);
    SealBlock(b.data(), BlockHeader{magic, kFormatMajor, kFormatMinor, 0, 7, addr}, sb.uuid);
    return b;
  };
  struct Case {
    const char* what;
    uint64_t home;
    std::vector<uint8_t> image;
    bool good;
  };
  const uint64_t free_inode = sb.inode_start + 5;
  const std::vector<Case> cases = {
      {"an inode over the backup superblock", 1, sealed(kMagicInode, 1), false},
      {"a pointer block over an inode", free_inode, sealed(kMagicPointerBlock, free_inode), false},
      {"a refcount block over the lease area", sb.lease_start + 3,
       sealed(kMagicRefcountBlock, sb.lease_start + 3), false},
      {"a drop list over another journal's ring", sb.JournalStart(3) + 4,
       sealed(kMagicDropList, sb.JournalStart(3) + 4), false},
      {"an inode sealed for another address", free_inode, sealed(kMagicInode, free_inode + 1),
       false},
      {"a superblock image", 1, sealed(kMagicSuperblock, 1), false},
      {"past the volume", sb.total_blocks + 1, sealed(kMagicInode, sb.total_blocks + 1), false},
      {"an inode where inodes live", free_inode, sealed(kMagicInode, free_inode), true},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    REQUIRE(Journal::Reset(&dev, sb, 2).ok());
    std::vector<uint8_t> before(kBlockSize, 0), after(kBlockSize, 0);
    const bool on_device = c.home < sb.total_blocks;
    if (on_device) REQUIRE(dev.Read(c.home * kBlockSize, before.data(), kBlockSize).ok());
    {
      auto j = Journal::Open(&dev, sb, 2);
      REQUIRE(j.ok());
      REQUIRE(j.value()->Append({c.home}, {c.image.data()}).ok());
    }
    auto j = Journal::Open(&dev, sb, 2);
    REQUIRE(j.ok());
    Result<uint64_t> replayed = j.value()->Replay();
    INFO(replayed.status().ToString());
    if (c.good) {
      CHECK(replayed.ok());
      if (on_device) REQUIRE(dev.Read(c.home * kBlockSize, after.data(), kBlockSize).ok());
      CHECK(after == c.image);
    } else {
      CHECK(replayed.status().code() == Status::Code::kCorruption);
      if (on_device) {
        REQUIRE(dev.Read(c.home * kBlockSize, after.data(), kBlockSize).ok());
        CHECK(after == before);
      }
    }
  }
}

// A newer dede's journal (a dead host of a newer version, during a rolling
// upgrade): its next transaction was taken for the end of the log, so
// replay skipped it and every later one, and the checkpoint after it
// forgot them; a header slot it wrote last was passed over for our older
// one, whose tail replays over home blocks it wrote since. Both refuse.
TEST_CASE("journal: a transaction or header of a newer format stops replay, not ends the log",
          "[volume]") {
  MemDevice dev(64 << 20);
  const Superblock sb = FormattedSuperblock(&dev);
  const uint64_t home = sb.inode_start + 5;
  std::vector<uint8_t> image(kBlockSize, 0);
  SealBlock(image.data(), BlockHeader{kMagicInode, kFormatMajor, kFormatMinor, 0, 7, home},
            sb.uuid);
  // Rewrites block `addr` as a newer major would (same fields, sound crc).
  auto make_newer = [&](uint64_t addr) {
    std::vector<uint8_t> b(kBlockSize);
    REQUIRE(dev.Read(addr * kBlockSize, b.data(), kBlockSize).ok());
    BlockHeader h = PeekHeader(b.data());
    h.major = kFormatMajor + 1;
    SealBlock(b.data(), h, sb.uuid);
    REQUIRE(dev.Write(addr * kBlockSize, b.data(), kBlockSize).ok());
  };
  std::vector<uint8_t> before(kBlockSize), after(kBlockSize);
  REQUIRE(dev.Read(home * kBlockSize, before.data(), kBlockSize).ok());
  const uint64_t headers = sb.JournalStart(2);
  SECTION("the next transaction") {
    REQUIRE(Journal::Reset(&dev, sb, 2).ok());
    {
      auto j = Journal::Open(&dev, sb, 2);
      REQUIRE(j.ok());
      REQUIRE(j.value()->Append({home}, {image.data()}).ok());
    }
    make_newer(headers + kJournalHeaderSlots);  // ring position 0: its descriptor
    auto j = Journal::Open(&dev, sb, 2);
    REQUIRE(j.ok());
    Result<uint64_t> replayed = j.value()->Replay();
    INFO(replayed.status().ToString());
    CHECK(replayed.status().code() == Status::Code::kUnsupported);
  }
  SECTION("the newest header slot") {
    REQUIRE(Journal::Reset(&dev, sb, 2).ok());
    std::vector<uint8_t> a(kBlockSize), b(kBlockSize);
    REQUIRE(dev.Read(headers * kBlockSize, a.data(), kBlockSize).ok());
    REQUIRE(dev.Read((headers + 1) * kBlockSize, b.data(), kBlockSize).ok());
    const bool a_newest = PeekHeader(a.data()).seq > PeekHeader(b.data()).seq;
    make_newer(headers + (a_newest ? 1 : 0));  // the older slot: ours still rules
    CHECK(Journal::Open(&dev, sb, 2).ok());
    make_newer(headers + (a_newest ? 0 : 1));
    auto j = Journal::Open(&dev, sb, 2);
    INFO(j.status().ToString());
    CHECK(j.status().code() == Status::Code::kUnsupported);
  }
  REQUIRE(dev.Read(home * kBlockSize, after.data(), kBlockSize).ok());
  CHECK(after == before);
}

// fsck took a block of a newer format version (kUnsupported) for damage:
// --repair cleared the inode, or cut out the pointer block and freed the
// data it mapped, destroying a file this version cannot read.
TEST_CASE("fsck: a block of a newer format stops fsck instead of being repaired away",
          "[volume][fsck]") {
  MemDevice dev(64 << 20);
  OpenOptions oo;
  oo.locks = TempLocks();
  const OneFileVolume one = FormatWithOneFile(&dev, oo, Pattern(64 * kBlockSize, 4));
  const Superblock& sb = one.sb;
  const uint64_t inode_addr = one.inode_addr;
  std::vector<uint8_t> blk(kBlockSize);
  const uint64_t target = GENERATE_COPY(inode_addr, one.inode.root);
  INFO((target == inode_addr ? "the inode" : "the pointer block"));
  REQUIRE(dev.Read(target * kBlockSize, blk.data(), kBlockSize).ok());
  BlockHeader h = PeekHeader(blk.data());
  h.major = kFormatMajor + 1;
  SealBlock(blk.data(), h, sb.uuid);
  REQUIRE(dev.Write(target * kBlockSize, blk.data(), kBlockSize).ok());
  std::vector<uint8_t> before(sb.group_start * kBlockSize + 64 * kBlockSize), after(before.size());
  REQUIRE(dev.Read(0, before.data(), before.size()).ok());
  {
    auto vol = Volume::Open(&dev, oo);
    REQUIRE(vol.ok());
    auto rep = CheckVolume(vol.value().get(), /*repair=*/true);
    INFO(rep.status().ToString());
    REQUIRE_FALSE(rep.ok());
    CHECK(rep.status().code() == Status::Code::kUnsupported);
  }
  // Nothing of the file, its counts or its inode was touched.
  REQUIRE(dev.Read(0, after.data(), after.size()).ok());
  const uint64_t groups_at = sb.GroupStart(0) * kBlockSize;
  CHECK(std::memcmp(before.data() + sb.inode_start * kBlockSize,
                    after.data() + sb.inode_start * kBlockSize,
                    (sb.group_start - sb.inode_start) * kBlockSize) == 0);
  CHECK(std::memcmp(before.data() + groups_at, after.data() + groups_at,
                    sb.GroupRefBlocks(0) * kBlockSize) == 0);
}

// A repair that fails after its changes reached the journal (the volume
// poisoned) released the files' locks all the same: another process could
// open them from home blocks that the repair's journal, replayed later,
// then contradicts. They stay held now, as CloseFile keeps them.
TEST_CASE("fsck: a repair that fails keeps the files' locks", "[volume][fsck]") {
  MemDevice base(64 << 20);
  auto locks = test::TempLockGroup(2);
  OpenOptions oo;
  oo.locks = locks[0];
  const OneFileVolume one = FormatWithOneFile(&base, oo, Pattern(8 * kBlockSize, 6));
  const Superblock& sb = one.sb;
  const uint64_t ino = one.ino;
  // A wrong count for repair to fix.
  std::vector<uint8_t> blk(kBlockSize);
  const uint64_t rb = sb.GroupStart(0);
  REQUIRE(base.Read(rb * kBlockSize, blk.data(), kBlockSize).ok());
  uint32_t slot = 0;
  while (GetRef(blk.data(), slot) != 1) slot++;
  SetRef(blk.data(), slot, 7);
  SealBlock(blk.data(), PeekHeader(blk.data()), sb.uuid);
  REQUIRE(base.Write(rb * kBlockSize, blk.data(), kBlockSize).ok());

  FaultDevice dev(&base);
  auto vol = Volume::Open(&dev, oo);
  REQUIRE(vol.ok());
  dev.FailWritesAfter(0, EIO);  // the repair's first write fails
  auto rep = CheckVolume(vol.value().get(), /*repair=*/true);
  INFO(rep.status().ToString());
  REQUIRE_FALSE(rep.ok());
  const LockId inode_lock{LockKind::kInode, ino};
  Status probe = locks[1]->Acquire(inode_lock, LockMode::kExclusive, false);
  INFO(probe.ToString());
  CHECK(probe.code() == Status::Code::kLocked);
  if (probe.ok()) REQUIRE(locks[1]->Release(inode_lock).ok());
}

// Media damage to a journal's newest header slot (not a torn write: that
// only ever hits the slot being written). The other slot held an older
// tail, so the next open replayed transactions long since home over blocks
// another host had changed since: here a refcount block, put back to a
// count one too low. Each checkpoint now writes its header to both slots.
TEST_CASE("journal: damage to the newest header slot does not replay old transactions",
          "[volume][crash]") {
  MemDevice dev(64 << 20);
  REQUIRE(FormatVolume(&dev, FormatOptions{}, false).ok());
  auto locks = test::TempLockGroup(2);
  auto open_as = [&](uint32_t host) {
    OpenOptions oo;
    oo.host_id = host;
    oo.locks = locks[host - 1];
    auto v = Volume::Open(&dev, oo);
    INFO(v.status().ToString());
    REQUIRE(v.ok());
    return std::move(v.value());
  };
  const std::vector<uint8_t> data = Pattern(kBlockSize, 31);
  Superblock sb;
  {
    auto v1 = open_as(1);
    sb = v1->superblock();
    REQUIRE(v1->Create("a", 1 << 20).ok());
    REQUIRE(v1->Create("b", 1 << 20).ok());
    auto a = v1->OpenFile("a");
    REQUIRE(a.ok());
    REQUIRE(a.value()->Write(0, data.data(), kBlockSize).ok());
  }
  {
    auto v2 = open_as(2);
    auto a = v2->OpenFile("a");
    auto b = v2->OpenFile("b");
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    REQUIRE(v2->CloneBlock(a.value().get(), 0, b.value().get(), 0).ok());
  }
  // Damage host 1's newest header slot.
  const uint64_t headers = sb.JournalStart(1);
  std::vector<uint8_t> h0(kBlockSize), h1(kBlockSize);
  REQUIRE(dev.Read(headers * kBlockSize, h0.data(), kBlockSize).ok());
  REQUIRE(dev.Read((headers + 1) * kBlockSize, h1.data(), kBlockSize).ok());
  const uint64_t newest = headers + (PeekHeader(h0.data()).seq > PeekHeader(h1.data()).seq ? 0 : 1);
  std::vector<uint8_t> blk(kBlockSize);
  REQUIRE(dev.Read(newest * kBlockSize, blk.data(), kBlockSize).ok());
  blk[200] ^= 0x40;
  REQUIRE(dev.Write(newest * kBlockSize, blk.data(), kBlockSize).ok());

  auto v1 = open_as(1);
  std::string problems = test::FsckProblems(v1.get());
  INFO("fsck:" << problems);
  CHECK(problems.find("refcount") == std::string::npos);
  auto b = v1->OpenFile("b");
  REQUIRE(b.ok());
  std::vector<uint8_t> got(kBlockSize);
  REQUIRE(b.value()->Read(0, got.data(), kBlockSize).ok());
  CHECK(got == data);
}

// fsck's check that a block with more than one reference is reached only
// through pointers with the copy-on-write bit (a write through one without
// it would change the block under its other users); and its repair.
TEST_CASE("fsck: finds and repairs a shared block's pointer without the COW bit",
          "[volume][fsck]") {
  MemDevice dev(64 << 20);
  REQUIRE(FormatVolume(&dev, FormatOptions{}, false).ok());
  OpenOptions oo;
  oo.locks = TempLocks();
  const std::vector<uint8_t> data = Pattern(4 * kBlockSize, 41);
  uint64_t ino = 0;
  Superblock sb;
  {
    auto vol = Volume::Open(&dev, oo);
    REQUIRE(vol.ok());
    sb = (*vol)->superblock();
    REQUIRE((*vol)->Create("a", 1 << 20).ok());
    REQUIRE((*vol)->Create("b", 1 << 20).ok());
    auto a = (*vol)->OpenFile("a");
    auto b = (*vol)->OpenFile("b");
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    REQUIRE((*a)->Write(0, data.data(), data.size()).ok());
    REQUIRE((*vol)->CloneBlock(a->get(), 2, b->get(), 0).ok());
    ino = (*b)->id().ino;
  }
  // Clear the COW bit of b's pointer to the shared block, on the device.
  std::vector<uint8_t> blk(kBlockSize);
  REQUIRE(dev.Read(sb.InodeBlock(ino) * kBlockSize, blk.data(), kBlockSize).ok());
  auto in = DecodeInode(blk.data(), sb.uuid, sb.InodeBlock(ino));
  REQUIRE(in.ok());
  REQUIRE(in->depth == 1);
  REQUIRE(dev.Read(in->root * kBlockSize, blk.data(), kBlockSize).ok());
  const uint64_t p = GetPtr(blk.data(), 0);
  REQUIRE((p & kPtrCow) != 0);
  SetPtr(blk.data(), 0, p & ~kPtrCow);
  SealBlock(blk.data(), PeekHeader(blk.data()), sb.uuid);
  REQUIRE(dev.Write(in->root * kBlockSize, blk.data(), kBlockSize).ok());

  auto vol = Volume::Open(&dev, oo);
  REQUIRE(vol.ok());
  auto rep = CheckVolume(vol->get(), /*repair=*/false);
  REQUIRE(rep.ok());
  REQUIRE(rep->problems.size() == 1);
  CHECK(rep->problems[0].where == "inode " + std::to_string(ino) + " block 0");
  CHECK(rep->problems[0].what.find("unshared (non-COW) pointer to block " +
                                   std::to_string(PtrAddr(p)) + ", which has 2 references") !=
        std::string::npos);
  rep = CheckVolume(vol->get(), /*repair=*/true);
  REQUIRE(rep.ok());
  REQUIRE(rep->problems.size() == 1);
  CHECK(rep->problems[0].repaired);
  rep = CheckVolume(vol->get(), /*repair=*/false);
  REQUIRE(rep.ok());
  CHECK(rep->clean());
  // A write through b now copies; a keeps its data.
  auto b = (*vol)->OpenFile("b");
  REQUIRE(b.ok());
  const std::vector<uint8_t> other = Pattern(kBlockSize, 42);
  REQUIRE((*b)->Write(0, other.data(), kBlockSize).ok());
  auto a = (*vol)->OpenFile("a");
  REQUIRE(a.ok());
  std::vector<uint8_t> got(data.size());
  REQUIRE((*a)->Read(0, got.data(), got.size()).ok());
  CHECK(got == data);
}

namespace {
std::vector<std::string> ListedNames(Volume* vol) {
  auto files = vol->List();
  REQUIRE(files.ok());
  std::vector<std::string> names;
  for (const FileInfo& f : *files) names.push_back(f.name);
  return names;
}
}  // namespace

TEST_CASE("volume: a listing reads the inode table up to a run of 256 never-written inodes",
          "[volume]") {
  MemDevice mem(64 << 20);
  FormatOptions fo;
  fo.inode_count = 1024;
  REQUIRE(FormatVolume(&mem, fo, false).ok());
  ReadCountingDevice dev(&mem);
  OpenOptions oo;
  oo.locks = TempLocks();
  auto vol = Volume::Open(&dev, oo);
  REQUIRE(vol.ok());
  for (const char* n : {"a", "b", "c"}) REQUIRE(vol.value()->Create(n, 1 << 20).ok());
  dev.Reset();
  REQUIRE(ListedNames(vol.value().get()) == std::vector<std::string>{"a", "b", "c"});
  // Inodes 1-3 and the 256 after them, read 32 at a time: 288 blocks
  // (the 1 MiB chunks of before read 512).
  CHECK(dev.bytes_read() == 288 * kBlockSize);
  // A missed lookup reads as much, and a create finds the lowest free inode.
  dev.Reset();
  CHECK(vol.value()->Lookup("nope").status().code() == Status::Code::kNotFound);
  CHECK(dev.bytes_read() == 288 * kBlockSize);
  auto d = vol.value()->Create("d", 4096);
  REQUIRE(d.ok());
  CHECK(d->ino == 4);
}

TEST_CASE("fsck: a file past the end of the listing is reported and repair makes it listed",
          "[volume][fsck]") {
  // 300 empty files (inodes 1-300), then inodes 2..(1 + zeroed) zeroed on
  // the device, as a stretch of the table wiped by something else. With
  // 255 zeroed the listing reads on and sees every file after them; with
  // 256 it ends there, and files 258-300 are in no listing or lookup.
  const uint64_t zeroed = GENERATE(255, 256);
  CAPTURE(zeroed);
  MemDevice dev(64 << 20);
  FormatOptions fo;
  fo.inode_count = 1024;
  REQUIRE(FormatVolume(&dev, fo, false).ok());
  OpenOptions oo;
  oo.locks = TempLocks();
  Superblock sb;
  {
    auto vol = Volume::Open(&dev, oo);
    REQUIRE(vol.ok());
    for (int i = 1; i <= 300; i++) REQUIRE(vol.value()->Create("f" + std::to_string(i), 4096).ok());
    sb = vol.value()->superblock();
  }
  std::vector<uint8_t> zeros(zeroed * kBlockSize, 0);
  REQUIRE(dev.Write(sb.InodeBlock(2) * kBlockSize, zeros.data(), zeros.size()).ok());
  auto vol = Volume::Open(&dev, oo);
  REQUIRE(vol.ok());
  const size_t after = 300 - 1 - zeroed;  // files after the zeroed stretch
  const std::string last = "f300";
  if (zeroed < kInodeListingEndRun) {
    CHECK(ListedNames(vol.value().get()).size() == 1 + after);
    CHECK(vol.value()->Lookup(last).ok());
    CHECK(dede::test::FsckProblems(vol.value().get()).empty());
    return;
  }
  REQUIRE(ListedNames(vol.value().get()) == std::vector<std::string>{"f1"});
  CHECK(vol.value()->Lookup(last).status().code() == Status::Code::kNotFound);
  auto rep = CheckVolume(vol.value().get(), false);
  REQUIRE(rep.ok());
  REQUIRE(rep->problems.size() == after);
  CHECK(rep->problems.front().where == "inode 258 'f258'");
  CHECK(rep->problems.back().where == "inode 300 'f300'");
  for (const auto& p : rep->problems) {
    INFO(p.where << ": " << p.what);
    CHECK(p.what.find("lies past the end of the file listing (inodes 2-257 were never written)") !=
          std::string::npos);
    CHECK(!p.repaired);
  }
  rep = CheckVolume(vol.value().get(), true);
  REQUIRE(rep.ok());
  REQUIRE(rep->problems.size() == after);
  for (const auto& p : rep->problems) CHECK(p.repaired);
  INFO(dede::test::FsckProblems(vol.value().get()));
  CHECK(dede::test::FsckProblems(vol.value().get()).empty());
  std::vector<std::string> names = ListedNames(vol.value().get());
  REQUIRE(names.size() == 1 + after);
  CHECK(names.front() == "f1");
  CHECK(names.back() == last);
  CHECK(vol.value()->Lookup(last).ok());
  // The filled inodes are free ones: a create takes the lowest, and the
  // table reads on to the end of the files.
  auto created = vol.value()->Create("new", 4096);
  REQUIRE(created.ok());
  CHECK(created->ino == 2);
  CHECK(vol.value()->Lookup(last).ok());
}

TEST_CASE("fsck reads the inode table in slices of 32 blocks", "[volume][fsck]") {
  MemDevice mem(128 << 20);
  FormatOptions fo;
  fo.inode_count = 4096;
  REQUIRE(FormatVolume(&mem, fo, false).ok());
  OpenOptions oo;
  oo.locks = TempLocks();
  Superblock sb;
  {
    auto vol = Volume::Open(&mem, oo);
    REQUIRE(vol.ok());
    for (const char* n : {"a", "b", "c"}) REQUIRE(vol.value()->Create(n, 1 << 20).ok());
    sb = vol.value()->superblock();
  }
  REQUIRE(sb.inode_count == 4096);
  ReadCountingDevice dev(&mem);  // reads that touch the inode table
  dev.Watch(sb.InodeBlock(1), sb.inode_count);
  auto vol = Volume::Open(&dev, oo);
  REQUIRE(vol.ok());
  dev.Reset();
  auto rep = CheckVolume(vol.value().get(), false);
  REQUIRE(rep.ok());
  CHECK(rep->clean());
  CHECK(rep->files == 3);
  // The scan: 4096 / 32 reads; then each file's inode again under its
  // lock, and a listing or two (about 9 reads each). One read per inode
  // was 4096.
  INFO("inode table reads " << dev.reads());
  CHECK(dev.reads() <= 4096 / 32 + 3 + 2 * 9);
  CHECK(dev.reads() >= 4096 / 32);
}

TEST_CASE("fsck reports its progress through the block maps and the reference counts",
          "[volume][fsck]") {
  MemDevice dev(64 << 20);
  REQUIRE(FormatVolume(&dev, FormatOptions{}, false).ok());
  OpenOptions oo;
  oo.locks = TempLocks();
  auto vol = Volume::Open(&dev, oo);
  REQUIRE(vol.ok());
  // Three files mapping 5, 0 and 12 blocks.
  const std::vector<std::pair<std::string, uint64_t>> files = {{"a", 5}, {"b", 0}, {"c", 12}};
  for (const auto& [name, blocks] : files) {
    REQUIRE(vol.value()->Create(name, 1 << 20).ok());
    auto f = vol.value()->OpenFile(name);
    REQUIRE(f.ok());
    const std::vector<uint8_t> d = Pattern(blocks * kBlockSize, static_cast<uint32_t>(blocks));
    REQUIRE(f.value()->Write(0, d.data(), d.size()).ok());
  }
  const Superblock sb = vol.value()->superblock();
  uint64_t data_area = 0;
  for (uint32_t g = 0; g < sb.group_count; g++) data_area += sb.GroupDataBlocks(g);

  std::vector<std::string> steps;
  std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> seen;
  auto rep = CheckVolume(vol.value().get(), false, [&](const FsckProgress& p) {
    if (steps.empty() || steps.back() != p.step) steps.push_back(p.step);
    seen[p.step].emplace_back(p.done, p.total);
  });
  REQUIRE(rep.ok());
  CHECK(rep->clean());
  REQUIRE(steps == std::vector<std::string>{"file maps", "reference counts"});
  const std::map<std::string, uint64_t> totals = {{"file maps", 17 * kBlockSize},
                                                  {"reference counts", data_area * kBlockSize}};
  for (const auto& [step, points] : seen) {
    INFO(step);
    REQUIRE(points.size() >= 2);
    CHECK(points.front().first == 0);
    CHECK(points.back().first == totals.at(step));
    for (size_t i = 0; i < points.size(); i++) {
      CHECK(points[i].second == totals.at(step));
      if (i > 0) CHECK(points[i].first >= points[i - 1].first);
    }
  }
  // The walk reports as it reaches each file that maps data: a (5 blocks)
  // at 0, c at 5, then the end.
  CHECK(seen["file maps"] ==
        std::vector<std::pair<uint64_t, uint64_t>>{{0, 17 * kBlockSize},
                                                   {0, 17 * kBlockSize},
                                                   {5 * kBlockSize, 17 * kBlockSize},
                                                   {17 * kBlockSize, 17 * kBlockSize}});
  // One report per allocation group, and the end.
  CHECK(seen["reference counts"].size() == sb.group_count + 2);
}

TEST_CASE("volume stats read each group's refcount blocks in one read", "[volume]") {
  MemDevice mem(256 << 20);
  FormatOptions fo;
  fo.group_refblocks = 4;
  REQUIRE(FormatVolume(&mem, fo, false).ok());
  OpenOptions oo;
  oo.locks = TempLocks();
  Superblock sb;
  VolumeStats before;
  {
    auto vol = Volume::Open(&mem, oo);
    REQUIRE(vol.ok());
    sb = vol.value()->superblock();
    auto st = vol.value()->Stats();
    REQUIRE(st.ok());
    before = *st;
  }
  REQUIRE(sb.group_count >= 4);
  ReadCountingDevice dev(&mem);  // reads that touch some group's refcount blocks
  for (uint32_t g = 0; g < sb.group_count; g++) dev.Watch(sb.GroupStart(g), sb.GroupRefBlocks(g));
  auto vol = Volume::Open(&dev, oo);
  REQUIRE(vol.ok());
  // Blocks in use whose refcount blocks this process has cached (maybe
  // newer than home): the figures count those as cached.
  REQUIRE(vol.value()->Create("f", 16 << 20).ok());
  auto f = vol.value()->OpenFile("f");
  REQUIRE(f.ok());
  const std::vector<uint8_t> d = Pattern(3 << 20, 5);
  REQUIRE(f.value()->Write(0, d.data(), d.size()).ok());
  dev.Reset();
  auto st = vol.value()->Stats();
  REQUIRE(st.ok());
  CHECK(dev.reads() == sb.group_count);  // was group_count * 4
  CHECK(st->used_blocks >= before.used_blocks + 768);
  CHECK(st->free_blocks + st->used_blocks == before.free_blocks + before.used_blocks);
  CHECK(st->files == 1);
  CHECK(st->logical_blocks == 768);
}

namespace {

// Parks device flushes while Hold() is in force, until Release(): every
// one, or every one after the first `pass` flushes since Hold().
class FlushGate : public test::ForwardingDevice {
 public:
  explicit FlushGate(BlockDevice* base) : ForwardingDevice(base, "flush-gate") {}
  Status Flush() override {
    {
      std::unique_lock<std::mutex> l(mu_);
      if (hold_ && pass_ > 0) {
        pass_--;
      } else if (hold_) {
        parked_++;
        cv_.notify_all();
        cv_.wait(l, [&] { return !hold_; });
      }
    }
    return ForwardingDevice::Flush();
  }
  void Hold(int pass = 0) {
    std::lock_guard<std::mutex> l(mu_);
    hold_ = true;
    pass_ = pass;
  }
  bool WaitParked() {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_for(l, std::chrono::seconds(10), [&] { return parked_ > 0; });
  }
  void Release() {
    std::lock_guard<std::mutex> l(mu_);
    hold_ = false;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool hold_ = false;
  int pass_ = 0;
  int parked_ = 0;
};

}  // namespace

// A flush point's device flush used to run under the volume mutex, which
// every VM write takes (PrepareInPlace): on a busy disk each flush point
// stalled every write of the host for 100-300 ms. Now a write in place
// goes on while the flush runs, and what the flush point covers is still
// durable when it returns.
TEST_CASE("volume: writes in place go on while a flush point's device flush runs", "[volume]") {
  const bool with_txn = GENERATE(false, true);
  INFO("metadata to commit at the flush point: " << with_txn);
  MemDevice mem(64 << 20);
  OpenOptions oo;
  oo.locks = TempLocks();
  const std::vector<uint8_t> first = Pattern(16 * kBlockSize, 21);
  FormatWithOneFile(&mem, oo, first);
  FlushGate gate(&mem);
  auto vol = Volume::Open(&gate, oo);
  REQUIRE(vol.ok());
  Volume* v = vol.value().get();
  auto f = v->OpenFile("f");
  REQUIRE(f.ok());
  if (with_txn) {
    // Allocates: the flush point then has a transaction to commit.
    const std::vector<uint8_t> more = Pattern(4 * kBlockSize, 22);
    REQUIRE(f.value()->Write(64 * kBlockSize, more.data(), more.size()).ok());
  }

  gate.Hold();
  Status synced = Status::IoError("not run");
  std::thread syncer([&] { synced = v->Sync(); });
  REQUIRE(gate.WaitParked());
  // The blocks at 0 are the file's own: written in place, no metadata.
  const std::vector<uint8_t> second = Pattern(16 * kBlockSize, 23);
  auto wrote = std::async(std::launch::async,
                          [&] { return f.value()->Write(0, second.data(), second.size()); });
  const bool done = wrote.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  gate.Release();
  syncer.join();
  CHECK(done);
  REQUIRE(wrote.get().ok());
  REQUIRE(synced.ok());
  REQUIRE(v->Sync().ok());

  std::vector<uint8_t> back(second.size());
  REQUIRE(f.value()->Read(0, back.data(), back.size()).ok());
  CHECK(back == second);
  f = Status::Invalid("closed");
  vol = Status::Invalid("closed");
  auto again = Volume::Open(&mem, oo);
  REQUIRE(again.ok());
  auto fa = again.value()->OpenFile("f");
  REQUIRE(fa.ok());
  REQUIRE(fa.value()->Read(0, back.data(), back.size()).ok());
  CHECK(back == second);
  if (with_txn) {
    std::vector<uint8_t> more_back(4 * kBlockSize);
    REQUIRE(fa.value()->Read(64 * kBlockSize, more_back.data(), more_back.size()).ok());
    CHECK(more_back == Pattern(4 * kBlockSize, 22));
  }
  fa = Status::Invalid("closed");
  auto rep = CheckVolume(again.value().get(), false);
  INFO(rep.status().ToString());
  REQUIRE(rep.ok());
  CHECK(rep->clean());
}

namespace {

// Host 1's volume on a MemDevice behind a FlushGate, with the file "f"
// (16 blocks of Pattern(.., seed)) open: for tests of what VM writes wait
// for while a checkpoint flushes.
struct GatedVolume {
  explicit GatedVolume(uint32_t seed) : mem(64 << 20), gate(&mem) {
    oo.locks = TempLocks();
    oo.host_id = 1;
    sb = FormatWithOneFile(&mem, oo, Pattern(16 * kBlockSize, seed)).sb;
    auto opened = Volume::Open(&gate, oo);
    REQUIRE(opened.ok());
    vol = std::move(opened.value());
    auto opened_f = vol->OpenFile("f");
    REQUIRE(opened_f.ok());
    f = std::move(opened_f.value());
  }
  // Whether host 1's journal, as on the device, holds a transaction past
  // its tail (none once a checkpoint moved the tail).
  bool JournalHoldsTransactions() {
    auto j = Journal::Open(&mem, sb, 1);
    REQUIRE(j.ok());
    Result<bool> has = j.value()->HasTransactions();
    REQUIRE(has.ok());
    return *has;
  }
  // Writes `data` in place at 0 while the gate holds a parked flush:
  // whether it finished within 5 s (before the flush was let go).
  bool WriteInPlaceWhileParked(const std::vector<uint8_t>& data,
                               const std::function<Status()>& then = nullptr) {
    auto wrote = std::async(std::launch::async, [&] {
      Status st = f->Write(0, data.data(), data.size());
      if (st.ok() && then) st = then();
      return st;
    });
    const bool done = wrote.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
    gate.Release();
    REQUIRE(wrote.get().ok());
    return done;
  }
  // Closes everything, opens the device again (replaying the journal),
  // checks `ranges` of "f" ({offset, bytes}) and a clean fsck.
  void CheckReopened(const std::vector<std::pair<uint64_t, std::vector<uint8_t>>>& ranges) {
    f.reset();
    vol.reset();
    auto again = Volume::Open(&mem, oo);
    REQUIRE(again.ok());
    {
      auto fa = again.value()->OpenFile("f");
      REQUIRE(fa.ok());
      for (const auto& [offset, want] : ranges) {
        std::vector<uint8_t> back(want.size());
        REQUIRE(fa.value()->Read(offset, back.data(), back.size()).ok());
        CHECK(back == want);
      }
    }
    auto rep = CheckVolume(again.value().get(), false);
    INFO(rep.status().ToString());
    REQUIRE(rep.ok());
    CHECK(rep->clean());
  }

  MemDevice mem;
  FlushGate gate;
  OpenOptions oo;
  Superblock sb;
  std::unique_ptr<Volume> vol;
  std::unique_ptr<File> f;
};

}  // namespace

// A quiet flush point writes the journal's images home (a checkpoint).
// It made every VM write in place wait for its three device flushes,
// holding the volume mutex through them. Now the flush after the images
// go home runs without it: a write in place goes on meanwhile, and the
// journal is still emptied. Metadata changed meanwhile (an allocating
// write) stops the checkpoint before the tail moves, and a later quiet
// flush point does it; either way a reopen finds every byte.
TEST_CASE("volume: writes in place go on while a quiet flush point checkpoints the journal",
          "[volume]") {
  const bool allocate_meanwhile = GENERATE(false, true);
  INFO("an allocating write during the checkpoint's flush: " << allocate_meanwhile);
  GatedVolume t(31);
  Volume* v = t.vol.get();
  // Allocates: this flush point commits a transaction, the next one is
  // quiet (nothing to commit), and the one after checkpoints.
  const std::vector<uint8_t> more = Pattern(4 * kBlockSize, 32);
  REQUIRE(t.f->Write(64 * kBlockSize, more.data(), more.size()).ok());
  REQUIRE(v->Sync().ok());
  REQUIRE(t.JournalHoldsTransactions());
  REQUIRE(v->Sync().ok());
  REQUIRE(t.JournalHoldsTransactions());

  // The checkpointing flush point: its own flush, then the one after the
  // images went home (parked here), then the header's.
  const Volume::FlushCounters before = v->flush_counters();
  t.gate.Hold(/*pass=*/1);
  Status synced = Status::IoError("not run");
  std::thread syncer([&] { synced = v->Sync(); });
  REQUIRE(t.gate.WaitParked());
  const std::vector<uint8_t> second = Pattern(16 * kBlockSize, 33);
  const std::vector<uint8_t> third = Pattern(4 * kBlockSize, 34);
  const bool done = t.WriteInPlaceWhileParked(second, [&]() -> Status {
    if (!allocate_meanwhile) return Status::Ok();
    return t.f->Write(128 * kBlockSize, third.data(), third.size());
  });
  syncer.join();
  CHECK(done);
  REQUIRE(synced.ok());
  CHECK(t.JournalHoldsTransactions() == allocate_meanwhile);
  // What VM writes waited for: only the header's flush, and only when the
  // checkpoint was not put off.
  const Volume::FlushCounters after = v->flush_counters();
  CHECK(after.unlocked - before.unlocked == 2);
  CHECK(after.held - before.held == (allocate_meanwhile ? 0u : 1u));
  CHECK(after.checkpoints - before.checkpoints == (allocate_meanwhile ? 0u : 1u));
  CHECK(after.quiet_checkpoints - before.quiet_checkpoints == (allocate_meanwhile ? 0u : 1u));
  CHECK(after.quiet_checkpoints_deferred - before.quiet_checkpoints_deferred ==
        (allocate_meanwhile ? 1u : 0u));
  if (allocate_meanwhile) {
    // Commits the allocation, then quiet, then the checkpoint.
    for (int i = 0; i < 3; i++) REQUIRE(v->Sync().ok());
    CHECK_FALSE(t.JournalHoldsTransactions());
  }
  std::vector<std::pair<uint64_t, std::vector<uint8_t>>> ranges = {{0, second},
                                                                   {64 * kBlockSize, more}};
  if (allocate_meanwhile) ranges.push_back({128 * kBlockSize, third});
  t.CheckReopened(ranges);
}

// A file's close checkpoints the journal (the next holder reads its
// metadata home), and a dedup pass closes dozens of files: held, each
// close made every VM write of the host wait for three device flushes.
// Now they run without the volume mutex while nothing else changes
// metadata, and a write in place to another file goes on meanwhile.
TEST_CASE("volume: writes in place go on while a file's close checkpoints the journal",
          "[volume]") {
  GatedVolume t(41);
  Volume* v = t.vol.get();
  REQUIRE(v->Create("g", 1 << 20).ok());
  auto g = v->OpenFile("g");
  REQUIRE(g.ok());
  // Allocates in g: its close has a transaction to commit and images to
  // write home.
  const std::vector<uint8_t> more = Pattern(8 * kBlockSize, 42);
  REQUIRE(g.value()->Write(0, more.data(), more.size()).ok());

  const Volume::FlushCounters before = v->flush_counters();
  t.gate.Hold();
  std::thread closer([&] { g = Status::Invalid("closed"); });
  REQUIRE(t.gate.WaitParked());
  const std::vector<uint8_t> second = Pattern(16 * kBlockSize, 43);
  const bool done = t.WriteInPlaceWhileParked(second);
  closer.join();
  CHECK(done);
  CHECK_FALSE(t.JournalHoldsTransactions());
  const Volume::FlushCounters after = v->flush_counters();
  CHECK(after.checkpoints - before.checkpoints == 1);
  CHECK(after.unlocked - before.unlocked == 3);  // data, journal, images home
  CHECK(after.held - before.held == 1);          // the header's
  // Closed for good: opened again at once, and its data is there.
  auto g2 = v->OpenFile("g");
  REQUIRE(g2.ok());
  std::vector<uint8_t> back(more.size());
  REQUIRE(g2.value()->Read(0, back.data(), back.size()).ok());
  CHECK(back == more);
  g2 = Status::Invalid("closed");
  REQUIRE(v->Sync().ok());
  t.CheckReopened({{0, second}});
}
