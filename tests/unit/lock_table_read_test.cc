// Reading the sanlock lock table without a partition's lease
// (ReadLockTablePartition): a read that overlaps a leased update must not
// miss a record. A host slot's record missed this way makes another host
// take a live host for dead and replay its journal.
#include <sanlock_rv.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "volume/format.h"
#include "volume/mem_device.h"
#include "volume/sanlock_lock_manager.h"

using namespace dede;

namespace {

constexpr Uuid kUuid = {0x21, 0x43, 0x65, 0x87, 0xa9, 0xcb, 0xed, 0x0f,
                        0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0};

LeaseLayout Layout() {
  LeaseLayout l;
  l.partitions = 1;
  l.table_block = 16;
  return l;
}

LockRecord Rec(uint64_t id, uint32_t host = 2) {
  LockRecord r;
  r.kind = 2;  // a host slot
  r.mode = 2;
  r.host = host;
  r.id = id;
  r.generation = 1;
  return r;
}

// A device whose reads of the lock table run a hook between the first
// block and the rest: what a leased update on another host looks like to a
// read of several blocks that is not one instant.
class InterleavingDevice : public BlockDevice {
 public:
  explicit InterleavingDevice(uint64_t size) : mem_(size) {}
  uint64_t size_bytes() const override { return mem_.size_bytes(); }
  std::string name() const override { return "interleaving"; }
  Status Write(uint64_t off, const void* buf, size_t len) override {
    return mem_.Write(off, buf, len);
  }
  Status Flush() override { return mem_.Flush(); }
  Status Read(uint64_t off, void* buf, size_t len) override {
    reads++;
    if (between_blocks && len > kBlockSize) {
      RETURN_IF_ERROR(mem_.Read(off, buf, kBlockSize));
      auto hook = std::move(between_blocks);
      between_blocks = nullptr;
      hook();
      return mem_.Read(off + kBlockSize, static_cast<uint8_t*>(buf) + kBlockSize, len - kBlockSize);
    }
    return mem_.Read(off, buf, len);
  }

  std::function<void()> between_blocks;  // runs once, inside the next read
  int reads = 0;

 private:
  MemDevice mem_;
};

void WriteBlock(BlockDevice* dev, uint32_t k, const std::vector<LockRecord>& recs, uint64_t seq) {
  std::vector<uint8_t> blk(kBlockSize);
  const uint64_t addr = Layout().PartitionBlock(0, k);
  EncodeLockTableBlock(recs, seq, addr, kUuid, blk.data());
  REQUIRE(dev->Write(addr * kBlockSize, blk.data(), kBlockSize).ok());
}

bool Has(const std::vector<LockRecord>& recs, uint64_t id) {
  for (const LockRecord& r : recs) {
    if (r.id == id) return true;
  }
  return false;
}

}  // namespace

TEST_CASE("lock table: a consistent lockless read never misses a record moved by an update",
          "[lock_table]") {
  InterleavingDevice dev(1 << 20);
  // Block 0 full of fillers, record X (id 999) first in block 1.
  std::vector<LockRecord> block0;
  for (uint32_t i = 0; i < kLockRecordsPerBlock; i++) block0.push_back(Rec(100 + i));
  WriteBlock(&dev, 0, block0, 1);
  WriteBlock(&dev, 1, {Rec(999)}, 1);
  WriteBlock(&dev, 2, {}, 1);
  WriteBlock(&dev, 3, {}, 1);

  // Another host's leased update erases a filler: X moves down into block
  // 0. It writes block 0 (X in), then block 1 (X out), while our read has
  // read block 0 but not block 1 yet.
  auto erase_filler = [&] {
    std::vector<LockRecord> moved(block0.begin() + 1, block0.end());
    moved.push_back(Rec(999));
    WriteBlock(&dev, 0, moved, 2);
    WriteBlock(&dev, 1, {}, 2);
  };

  SECTION("one read misses it") {
    dev.between_blocks = erase_filler;
    auto once = ReadLockTablePartition(&dev, Layout(), kUuid, 0, LockTableRead::kOnce);
    REQUIRE(once.ok());
    CHECK_FALSE(Has(*once, 999));  // what a single read can see
  }
  SECTION("a consistent read finds it") {
    dev.between_blocks = erase_filler;
    auto read = ReadLockTablePartition(&dev, Layout(), kUuid, 0, LockTableRead::kConsistent);
    REQUIRE(read.ok());
    CHECK(Has(*read, 999));
    CHECK_FALSE(Has(*read, 100));  // the state after the update
    CHECK(dev.reads == 3);         // the mixed read, then two that agree
  }
  SECTION("with nothing changing, two reads") {
    auto read = ReadLockTablePartition(&dev, Layout(), kUuid, 0, LockTableRead::kConsistent);
    REQUIRE(read.ok());
    CHECK(Has(*read, 999));
    CHECK(read->size() == kLockRecordsPerBlock + 1);
    CHECK(dev.reads == 2);
  }
}

TEST_CASE("lock table: a partition that changes under every read is reported, not guessed",
          "[lock_table]") {
  InterleavingDevice dev(1 << 20);
  uint64_t seq = 1;
  WriteBlock(&dev, 0, {Rec(1)}, seq);
  for (uint32_t k = 1; k < kLockTableBlocksPerPartition; k++) WriteBlock(&dev, k, {}, 1);
  // Every read sees a new update of block 0.
  std::function<void()> churn = [&] {
    WriteBlock(&dev, 0, {Rec(1)}, ++seq);
    dev.between_blocks = churn;
  };
  dev.between_blocks = churn;
  auto read = ReadLockTablePartition(&dev, Layout(), kUuid, 0, LockTableRead::kConsistent);
  CHECK(read.status().code() == Status::Code::kUnavailable);
  CHECK(read.status().message().find("changed under each of 50 reads") != std::string::npos);
}

TEST_CASE("lock table: a torn block is read again, a lasting one is reported", "[lock_table]") {
  InterleavingDevice dev(1 << 20);
  WriteBlock(&dev, 0, {Rec(7)}, 1);
  for (uint32_t k = 1; k < kLockTableBlocksPerPartition; k++) WriteBlock(&dev, k, {}, 1);
  // Block 1 half rewritten (a write in progress, or one a crash tore).
  std::vector<uint8_t> good(kBlockSize), torn(kBlockSize);
  const uint64_t addr1 = Layout().PartitionBlock(0, 1);
  EncodeLockTableBlock({Rec(8)}, 2, addr1, kUuid, good.data());
  torn = good;
  torn[kBlockSize / 2] ^= 0x5a;  // its second half not there yet
  REQUIRE(dev.Write(addr1 * kBlockSize, torn.data(), kBlockSize).ok());

  SECTION("torn at every read") {
    auto read = ReadLockTablePartition(&dev, Layout(), kUuid, 0, LockTableRead::kConsistent);
    CHECK(read.status().code() == Status::Code::kCorruption);
    CHECK(dev.reads == 5);
  }
  SECTION("the writer completes it while the read is retried") {
    int calls = 0;
    std::function<void()> hook = [&] {
      if (++calls == 1) {
        dev.between_blocks = hook;  // the first read sees block 1 torn
        return;
      }
      REQUIRE(dev.Write(addr1 * kBlockSize, good.data(), kBlockSize).ok());
    };
    dev.between_blocks = hook;
    auto read = ReadLockTablePartition(&dev, Layout(), kUuid, 0, LockTableRead::kConsistent);
    REQUIRE(read.ok());
    CHECK(Has(*read, 7));
    CHECK(Has(*read, 8));
    CHECK(dev.reads == 3);  // torn, whole, whole again
  }
}

// The staleness rule for another host's lock record (LOCKING.md, Acquire).
// A host that has just joined (or re-joined) looks FREE or DEAD to the
// other hosts' daemons until their next renewal reads its lease (up to
// about 2 io_timeouts later): its fresh records, which carry the new
// generation, were taken as stale, so another process could take its host
// slot or adopt the drop list it holds.
TEST_CASE("sanlock: a record newer than our daemon's view of its host is live", "[sanlock]") {
  using S = LeaseHostState;
  // Our view is current (same generation): the state decides.
  CHECK(RecordHolderLive(5, S::kLive, 5));
  CHECK(RecordHolderLive(5, S::kFail, 5));
  CHECK(RecordHolderLive(5, S::kUnknown, 5));
  CHECK_FALSE(RecordHolderLive(5, S::kFree, 5));
  CHECK_FALSE(RecordHolderLive(5, S::kDead, 5));
  // The host re-joined since the record was written: stale, whatever state.
  for (S s : {S::kLive, S::kFail, S::kUnknown, S::kFree, S::kDead}) {
    CHECK_FALSE(RecordHolderLive(4, s, 5));
  }
  // The record is newer than our view (the host joined after our daemon
  // last read its lease; never read: generation 0): live, whatever state.
  for (S s : {S::kLive, S::kFail, S::kUnknown, S::kFree, S::kDead}) {
    CHECK(RecordHolderLive(6, s, 5));
    CHECK(RecordHolderLive(1, s, 0));
  }
}

// sanlock drops a lease from the process before writing it free on disk,
// so a release that failed cannot be retried by releasing again: the retry
// answered -1 ("no resource"), which was reported as the failure of a
// lock operation whose table update had landed (a VM's open failed with
// "releasing lock-table lease lt-1: Unknown error (-1)" on a loaded host).
namespace {
struct ScriptedSanlock {
  std::vector<int> releases;  // answers, in order
  std::vector<int> acquires;
  std::string calls;  // "R" per release, "A" per acquire, "." per pause
  size_t r = 0, a = 0;
  LeaseReleaseResult Run(int attempts = 3) {
    return ReleaseSanlockLease(
        [&] {
          calls += 'R';
          REQUIRE(r < releases.size());
          return releases[r++];
        },
        [&] {
          calls += 'A';
          REQUIRE(a < acquires.size());
          return acquires[a++];
        },
        [&] { calls += '.'; }, attempts);
  }
};
}  // namespace

TEST_CASE("sanlock: a failed lease release is never retried by releasing again", "[sanlock]") {
  SECTION("released at once") {
    ScriptedSanlock s{{0}, {}};
    LeaseReleaseResult r = s.Run();
    CHECK(r.rv == 0);
    CHECK(s.calls == "R");
  }
  SECTION("a timed-out release is finished by the daemon: released, no retry") {
    ScriptedSanlock s{{SANLK_AIO_TIMEOUT}, {}};
    LeaseReleaseResult r = s.Run();
    CHECK(r.rv == 0);
    CHECK(r.left_to_daemon);
    CHECK(s.calls == "R");
  }
  SECTION("an I/O error: the lease is taken back, then released") {
    ScriptedSanlock s{{-EIO, 0}, {0}};
    LeaseReleaseResult r = s.Run();
    CHECK(r.rv == 0);
    CHECK(r.retakes == 1);
    CHECK(s.calls == "R.AR");
  }
  SECTION("taking it back finds it busy: another host or the daemon has it, not ours") {
    ScriptedSanlock s{{-EIO}, {-EAGAIN}};
    LeaseReleaseResult r = s.Run();
    CHECK(r.rv == 0);
    CHECK(r.retakes == 0);
    CHECK(s.calls == "R.A");
  }
  SECTION("the release after taking it back times out: the daemon finishes it") {
    ScriptedSanlock s{{-EIO, SANLK_AIO_TIMEOUT}, {0}};
    LeaseReleaseResult r = s.Run();
    CHECK(r.rv == 0);
    CHECK(r.left_to_daemon);
    CHECK(s.calls == "R.AR");
  }
  SECTION("a release that never reached the daemon: still ours (-EEXIST), released again") {
    ScriptedSanlock s{{-ENOTCONN, 0}, {-EEXIST}};
    LeaseReleaseResult r = s.Run();
    CHECK(r.rv == 0);
    CHECK(s.calls == "R.AR");
  }
  SECTION("-EEXIST from another process of this host: the release answers -1, not ours") {
    ScriptedSanlock s{{-EIO, -1}, {-EEXIST}};
    LeaseReleaseResult r = s.Run();
    CHECK(r.rv == 0);
    CHECK(s.calls == "R.AR");
  }
  SECTION("a failing take-back is tried again") {
    ScriptedSanlock s{{-EIO, 0}, {-EIO, 0}};
    LeaseReleaseResult r = s.Run();
    CHECK(r.rv == 0);
    CHECK(s.calls == "R.A.AR");
  }
  SECTION("storage that keeps failing: the last error, after `attempts` rounds") {
    ScriptedSanlock s{{-EIO, -EIO, -EIO}, {0, 0}};
    LeaseReleaseResult r = s.Run(2);
    CHECK(r.rv == -EIO);
    CHECK(r.retakes == 2);
    CHECK(s.calls == "R.AR.AR");
  }
  SECTION("-1 at the first release: this process did not hold it; reported, nothing taken") {
    ScriptedSanlock s{{-1}, {}};
    LeaseReleaseResult r = s.Run();
    CHECK(r.rv == -1);
    CHECK(s.calls == "R");
  }
}
