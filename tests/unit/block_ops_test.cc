// Volume::ApplyBlockOps: the batched block operations of dedup passes.
//
// Each kind against its documented semantics (kShare = CompareAndShare,
// kCloneIfHash = CloneBlock behind a hash check, kPunchIfZero), ordering
// inside one batch (an operation sees what earlier ones did), a large
// random batch against a model of contents and reference counts, hash
// witnesses (SHA-256 volumes only), and I/O errors: a read error fails the
// batch without changing anything, a write (journal) error poisons the
// volume and a reopen finds a consistent volume with the same bytes.
//
// Reproduce one seed of the model test with DEDE_SEED=<n>.
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "tests/forwarding_device.h"
#include "tests/seeds.h"
#include "tests/temp_locks.h"
#include "util/fingerprint.h"
#include "volume/fsck.h"
#include "volume/mem_device.h"
#include "volume/volume.h"

using namespace dede;

namespace {

constexpr uint64_t kB = kBlockSize;
using Op = Volume::BlockOp;
using Kind = Volume::BlockOp::Kind;
using Code = Status::Code;
using dede::test::CutDevice;
using dede::test::TempLocks;

// Content `id` of a block: 0 is all zeros, others pseudo-random per id.
std::vector<uint8_t> Content(uint64_t id) {
  std::vector<uint8_t> out(kB, 0);
  if (id == 0) return out;
  uint64_t x = id * 0x9e3779b97f4a7c15ULL + 1;
  for (size_t i = 0; i < kB; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(out.data() + i, &x, 8);
  }
  return out;
}

const char* CodeName(Code c) {
  switch (c) {
    case Code::kOk: return "ok";
    case Code::kIoError: return "io-error";
    case Code::kCorruption: return "corruption";
    case Code::kNotFound: return "not-found";
    case Code::kExists: return "exists";
    case Code::kInvalid: return "invalid";
    case Code::kNoSpace: return "no-space";
    case Code::kLocked: return "locked";
    case Code::kUnsupported: return "unsupported";
    case Code::kMismatch: return "mismatch";
    case Code::kUnavailable: return "unavailable";
  }
  return "?";
}

// A volume on a FaultDevice over a MemDevice, with helpers.
struct TestVol {
  explicit TestVol(FormatOptions fo = FormatOptions{}, uint64_t bytes = 64ull << 20)
      : base(bytes), fdev(&base) {
    REQUIRE(FormatVolume(&fdev, fo, false).ok());
    REQUIRE(fdev.Flush().ok());
    Open();
  }

  void Open() {
    locks = TempLocks();
    cut = std::make_unique<CutDevice>(&fdev);
    OpenOptions oo;
    oo.locks = locks;
    auto v = Volume::Open(cut.get(), oo);
    REQUIRE(v.ok());
    vol = std::move(v.value());
  }

  // The process dies: nothing more reaches the device; then the device
  // drops or tears what was not flushed.
  void DieAndCrash(std::mt19937_64& rng, double keep) {
    cut->Cut();
    vol.reset();
    locks.reset();
    fdev.Crash(rng, keep);
    fdev.ClearFault();
  }

  // Back to a saved image of the device: the running volume (if any; its
  // files must be closed) dies without touching the disk, and what was not
  // flushed is dropped.
  void Restore(const std::vector<uint8_t>& image) {
    if (vol) {
      cut->Cut();
      vol.reset();
    }
    locks.reset();
    std::mt19937_64 rng(0);
    fdev.Crash(rng, 0.0);
    fdev.ClearFault();
    base.bytes() = image;
  }

  std::unique_ptr<File> NewFile(const std::string& name, uint64_t size) {
    auto id = vol->Create(name, size);
    REQUIRE(id.ok());
    return OpenF(name);
  }
  std::unique_ptr<File> OpenF(const std::string& name) {
    auto f = vol->OpenFile(name);
    REQUIRE(f.ok());
    return std::move(f.value());
  }

  Fingerprint Fp(uint64_t content) const {
    std::vector<uint8_t> c = Content(content);
    return ComputeFingerprint(vol->superblock().hash_algo, c.data(), kB);
  }

  VolumeStats Stats() {
    auto st = vol->Stats();
    REQUIRE(st.ok());
    return *st;
  }

  // Physical data blocks in use (refcount > 0, not block-map blocks).
  uint64_t DataBlocks() {
    VolumeStats st = Stats();
    return st.used_blocks - st.pointer_blocks;
  }

  void Fsck() {
    auto rep = CheckVolume(vol.get(), false);
    REQUIRE(rep.ok());
    std::string problems;
    for (const auto& p : rep->problems) problems += p.where + ": " + p.what + "; ";
    INFO("fsck: " << problems);
    REQUIRE(rep->clean());
  }

  MemDevice base;
  FaultDevice fdev;
  std::shared_ptr<LockManager> locks;
  std::unique_ptr<CutDevice> cut;
  std::unique_ptr<Volume> vol;
};

void Put(File* f, uint64_t index, uint64_t content) {
  std::vector<uint8_t> c = Content(content);
  REQUIRE(f->Write(index * kB, c.data(), kB).ok());
}

std::vector<uint8_t> Get(File* f, uint64_t index) {
  std::vector<uint8_t> out(kB);
  REQUIRE(f->Read(index * kB, out.data(), kB).ok());
  return out;
}

uint32_t Refs(File* f, uint64_t index) {
  auto r = f->BlockRefCount(index);
  REQUIRE(r.ok());
  return *r;
}

Op Share(File* s, uint64_t si, File* d, uint64_t di, Fingerprint w = Fingerprint{}) {
  Op op;
  op.kind = Kind::kShare;
  op.src = s;
  op.src_index = si;
  op.dst = d;
  op.dst_index = di;
  op.witness = w;
  return op;
}

Op Clone(File* s, uint64_t si, File* d, uint64_t di, Fingerprint w) {
  Op op = Share(s, si, d, di, w);
  op.kind = Kind::kCloneIfHash;
  return op;
}

Op Punch(File* d, uint64_t di) {
  Op op;
  op.kind = Kind::kPunchIfZero;
  op.dst = d;
  op.dst_index = di;
  return op;
}

// Applies one batch; the call itself must succeed.
void Apply(Volume* vol, std::vector<Op>* ops, VerifyMode mode = VerifyMode::kByteCompare) {
  Status st = vol->ApplyBlockOps(ops, mode);
  INFO("ApplyBlockOps: " << st.ToString());
  REQUIRE(st.ok());
}

// One operation alone; its result.
Status ApplyOne(Volume* vol, Op op, VerifyMode mode = VerifyMode::kByteCompare) {
  std::vector<Op> ops{op};
  Apply(vol, &ops, mode);
  return ops[0].result;
}

#define REQUIRE_CODE(status_expr, want_code)                                           \
  do {                                                                                 \
    const Status st_ = (status_expr);                                                  \
    const Code want_ = (want_code);                                                    \
    INFO("status: " << st_.ToString() << " (expected " << CodeName(want_) << ")");     \
    REQUIRE(st_.code() == want_);                                                      \
  } while (0)

}  // namespace

// ------------------------------------------------------------------ kShare

TEST_CASE("block ops: share of equal blocks shares them and writes copy on write",
          "[volume][blockops]") {
  TestVol t;
  auto a = t.NewFile("a", 8 * kB);
  auto b = t.NewFile("b", 8 * kB);
  Put(a.get(), 1, 7);
  Put(b.get(), 5, 7);
  Put(a.get(), 2, 8);
  const uint64_t data0 = t.DataBlocks();
  const uint64_t shared0 = t.Stats().shared_blocks;
  REQUIRE(Refs(a.get(), 1) == 1);
  REQUIRE(Refs(b.get(), 5) == 1);

  REQUIRE(ApplyOne(t.vol.get(), Share(a.get(), 1, b.get(), 5)).ok());
  CHECK(Refs(a.get(), 1) == 2);
  CHECK(Refs(b.get(), 5) == 2);
  CHECK(Get(a.get(), 1) == Content(7));
  CHECK(Get(b.get(), 5) == Content(7));
  CHECK(t.DataBlocks() == data0 - 1);
  CHECK(t.Stats().shared_blocks == shared0 + 1);
  CHECK(t.Stats().logical_blocks == 3);

  // A write to one copy copies it; the other keeps the shared content.
  Put(b.get(), 5, 9);
  CHECK(Get(b.get(), 5) == Content(9));
  CHECK(Get(a.get(), 1) == Content(7));
  CHECK(Refs(a.get(), 1) == 1);
  CHECK(Refs(b.get(), 5) == 1);
  // And the other way round, on a fresh share.
  Put(b.get(), 6, 8);
  REQUIRE(ApplyOne(t.vol.get(), Share(b.get(), 6, a.get(), 2)).ok());
  CHECK(Refs(a.get(), 2) == 2);
  Put(b.get(), 6, 10);
  CHECK(Get(a.get(), 2) == Content(8));
  CHECK(Get(b.get(), 6) == Content(10));
  CHECK(Refs(a.get(), 2) == 1);
  REQUIRE(t.vol->Sync().ok());
  a.reset();
  b.reset();
  t.Fsck();
}

TEST_CASE("block ops: share of different blocks is a mismatch and changes nothing",
          "[volume][blockops]") {
  TestVol t;
  auto a = t.NewFile("a", 4 * kB);
  auto b = t.NewFile("b", 4 * kB);
  Put(a.get(), 0, 1);
  Put(b.get(), 0, 2);
  // Same first bytes, one different byte at the end: a real compare.
  std::vector<uint8_t> almost = Content(1);
  almost[kB - 1] ^= 1;
  REQUIRE(b->Write(1 * kB, almost.data(), kB).ok());
  const VolumeStats before = t.Stats();

  std::vector<Op> ops{Share(a.get(), 0, b.get(), 0), Share(a.get(), 0, b.get(), 1),
                      Share(b.get(), 1, a.get(), 0)};
  Apply(t.vol.get(), &ops);
  for (const Op& op : ops) REQUIRE_CODE(op.result, Code::kMismatch);
  CHECK(Get(a.get(), 0) == Content(1));
  CHECK(Get(b.get(), 0) == Content(2));
  CHECK(Get(b.get(), 1) == almost);
  CHECK(Refs(a.get(), 0) == 1);
  CHECK(Refs(b.get(), 0) == 1);
  CHECK(Refs(b.get(), 1) == 1);
  const VolumeStats after = t.Stats();
  CHECK(after.used_blocks == before.used_blocks);
  CHECK(after.shared_blocks == before.shared_blocks);
  CHECK(after.logical_blocks == before.logical_blocks);
  a.reset();
  b.reset();
  t.Fsck();
}

TEST_CASE("block ops: share with a hole on either side is a mismatch", "[volume][blockops]") {
  TestVol t;
  auto a = t.NewFile("a", 4 * kB);
  auto b = t.NewFile("b", 4 * kB);
  Put(a.get(), 0, 0);  // an allocated zero block
  Put(b.get(), 0, 0);
  REQUIRE(Refs(a.get(), 0) == 1);
  // a:1, b:1 and b:2 are holes; they read as zeros like a:0 and b:0.
  REQUIRE(Refs(a.get(), 1) == 0);
  REQUIRE(Refs(b.get(), 1) == 0);
  const VolumeStats before = t.Stats();
  std::vector<Op> ops{Share(a.get(), 0, b.get(), 1),   // hole destination
                      Share(a.get(), 1, b.get(), 0),   // hole source
                      Share(a.get(), 1, b.get(), 2),   // both holes
                      Share(a.get(), 1, a.get(), 1)};  // a hole with itself
  Apply(t.vol.get(), &ops);
  for (size_t i = 0; i < ops.size(); i++) {
    INFO("op " << i);
    REQUIRE_CODE(ops[i].result, Code::kMismatch);
  }
  CHECK(Refs(a.get(), 0) == 1);
  CHECK(Refs(b.get(), 0) == 1);
  CHECK(Refs(a.get(), 1) == 0);
  CHECK(Refs(b.get(), 1) == 0);
  CHECK(Refs(b.get(), 2) == 0);
  CHECK(t.Stats().used_blocks == before.used_blocks);
  CHECK(t.Stats().logical_blocks == before.logical_blocks);
  CHECK(Get(b.get(), 1) == Content(0));
}

TEST_CASE("block ops: share of blocks already shared is ok and adds no reference",
          "[volume][blockops]") {
  TestVol t;
  auto a = t.NewFile("a", 4 * kB);
  auto b = t.NewFile("b", 4 * kB);
  auto c = t.NewFile("c", 4 * kB);
  Put(a.get(), 0, 3);
  Put(b.get(), 0, 3);
  Put(c.get(), 0, 3);
  REQUIRE(ApplyOne(t.vol.get(), Share(a.get(), 0, b.get(), 0)).ok());
  REQUIRE(Refs(a.get(), 0) == 2);
  const uint64_t data = t.DataBlocks();
  // Again, both directions, a block with itself, and the same share twice
  // in one batch next to a new one.
  std::vector<Op> ops{Share(a.get(), 0, b.get(), 0), Share(b.get(), 0, a.get(), 0),
                      Share(a.get(), 0, a.get(), 0), Share(a.get(), 0, c.get(), 0),
                      Share(a.get(), 0, c.get(), 0), Share(c.get(), 0, b.get(), 0)};
  Apply(t.vol.get(), &ops);
  for (size_t i = 0; i < ops.size(); i++) {
    INFO("op " << i << ": " << ops[i].result.ToString());
    CHECK(ops[i].result.ok());
  }
  CHECK(Refs(a.get(), 0) == 3);
  CHECK(Refs(b.get(), 0) == 3);
  CHECK(Refs(c.get(), 0) == 3);
  CHECK(t.DataBlocks() == data - 1);
  CHECK(Get(c.get(), 0) == Content(3));
  // Byte-compare mode ignores the witness (even a wrong one).
  Put(a.get(), 1, 4);
  Put(b.get(), 1, 4);
  REQUIRE(ApplyOne(t.vol.get(), Share(a.get(), 1, b.get(), 1, t.Fp(5))).ok());
  CHECK(Refs(b.get(), 1) == 2);
  a.reset();
  b.reset();
  c.reset();
  t.Fsck();
}

TEST_CASE("block ops: partial last blocks and blocks past the end are invalid",
          "[volume][blockops]") {
  TestVol t;
  auto a = t.NewFile("a", 3 * kB + 100);  // block 3 is partial
  auto b = t.NewFile("b", 4 * kB);
  std::vector<uint8_t> tail(100, 0);
  std::vector<uint8_t> c5 = Content(5);
  std::memcpy(tail.data(), c5.data(), 100);
  Put(a.get(), 0, 5);
  REQUIRE(a->Write(3 * kB, tail.data(), 100).ok());
  // b:3 starts like a:3 and is zeros after 100 bytes: a:3 reads the same.
  std::vector<uint8_t> b3(kB, 0);
  std::memcpy(b3.data(), tail.data(), 100);
  REQUIRE(b->Write(3 * kB, b3.data(), kB).ok());
  Put(b.get(), 0, 5);
  Put(b.get(), 2, 0);
  const VolumeStats before = t.Stats();
  const Fingerprint fb3 = ComputeFingerprint(t.vol->superblock().hash_algo, b3.data(), kB);
  std::vector<Op> ops{
      Share(a.get(), 3, b.get(), 3),          // partial source
      Share(b.get(), 3, a.get(), 3),          // partial destination
      Clone(b.get(), 3, a.get(), 3, fb3),     // clone into a partial block
      Clone(a.get(), 3, b.get(), 1, fb3),     // clone out of a partial block
      Share(a.get(), 4, b.get(), 0),          // past the end
      Share(b.get(), 0, a.get(), 7),          // past the end
      Clone(a.get(), 0, b.get(), 4, t.Fp(5)), // past the end
      Punch(a.get(), 3),                      // partial
      Punch(b.get(), 4),                      // past the end
      Share(a.get(), 0, b.get(), 0),          // a valid one among them
  };
  Apply(t.vol.get(), &ops);
  for (size_t i = 0; i + 1 < ops.size(); i++) {
    INFO("op " << i);
    REQUIRE_CODE(ops[i].result, Code::kInvalid);
  }
  REQUIRE(ops.back().result.ok());
  CHECK(Refs(b.get(), 0) == 2);
  CHECK(Refs(a.get(), 3) == 1);
  CHECK(Refs(b.get(), 3) == 1);
  CHECK(Refs(b.get(), 1) == 0);
  CHECK(Refs(b.get(), 2) == 1);  // the zero block was not punched by the invalid op
  CHECK(t.DataBlocks() == before.used_blocks - before.pointer_blocks - 1);
  std::vector<uint8_t> got(100);
  REQUIRE(a->Read(3 * kB, got.data(), 100).ok());
  CHECK(got == tail);
  // Bytes past EOF stay zero after growing the file.
  REQUIRE(a->Truncate(4 * kB).ok());
  std::vector<uint8_t> a3(kB, 0);
  std::memcpy(a3.data(), tail.data(), 100);
  CHECK(Get(a.get(), 3) == a3);
  a.reset();
  b.reset();
  t.Fsck();
}

TEST_CASE("block ops: share inside one file", "[volume][blockops]") {
  TestVol t;
  auto a = t.NewFile("a", 16 * kB);
  Put(a.get(), 1, 6);
  Put(a.get(), 3, 6);
  Put(a.get(), 9, 6);
  Put(a.get(), 4, 2);
  const uint64_t data = t.DataBlocks();
  std::vector<Op> ops{Share(a.get(), 1, a.get(), 3), Share(a.get(), 9, a.get(), 3),
                      Share(a.get(), 1, a.get(), 4)};
  Apply(t.vol.get(), &ops);
  REQUIRE(ops[0].result.ok());
  REQUIRE(ops[1].result.ok());
  REQUIRE_CODE(ops[2].result, Code::kMismatch);
  // The second share moved a:3 on to a:9's block: a:1 keeps its own.
  CHECK(Refs(a.get(), 1) == 1);
  CHECK(Refs(a.get(), 9) == 2);
  CHECK(Refs(a.get(), 3) == 2);
  CHECK(t.DataBlocks() == data - 1);
  Put(a.get(), 3, 7);
  CHECK(Get(a.get(), 1) == Content(6));
  CHECK(Get(a.get(), 9) == Content(6));
  CHECK(Get(a.get(), 3) == Content(7));
  CHECK(Get(a.get(), 4) == Content(2));
  CHECK(Refs(a.get(), 3) == 1);
  a.reset();
  t.Fsck();
}

// ------------------------------------------------------------ kCloneIfHash

TEST_CASE("block ops: clone if hash clones only when the source matches the witness",
          "[volume][blockops]") {
  TestVol t;
  auto f = t.NewFile("f", 8 * kB);
  auto a = t.NewFile("a", 8 * kB);
  Put(f.get(), 0, 11);
  Put(f.get(), 1, 12);
  Put(a.get(), 1, 13);
  const uint64_t data0 = t.DataBlocks();

  // Into a hole, with the right witness.
  REQUIRE(ApplyOne(t.vol.get(), Clone(f.get(), 0, a.get(), 0, t.Fp(11))).ok());
  CHECK(Get(a.get(), 0) == Content(11));
  CHECK(Refs(a.get(), 0) == 2);
  CHECK(Refs(f.get(), 0) == 2);
  CHECK(t.DataBlocks() == data0);
  // Over a block with other content: it is replaced and freed.
  REQUIRE(ApplyOne(t.vol.get(), Clone(f.get(), 1, a.get(), 1, t.Fp(12))).ok());
  CHECK(Get(a.get(), 1) == Content(12));
  CHECK(Refs(a.get(), 1) == 2);
  CHECK(t.DataBlocks() == data0 - 1);

  // A wrong witness: nothing happens.
  Put(a.get(), 2, 14);
  const VolumeStats before = t.Stats();
  std::vector<Op> ops{Clone(f.get(), 1, a.get(), 2, t.Fp(11)),  // another block's hash
                      Clone(f.get(), 1, a.get(), 3, t.Fp(14)),  // the destination's hash
                      Clone(f.get(), 1, a.get(), 4, Fingerprint{})};
  Apply(t.vol.get(), &ops);
  for (size_t i = 0; i < ops.size(); i++) {
    INFO("op " << i);
    REQUIRE_CODE(ops[i].result, Code::kMismatch);
  }
  CHECK(Get(a.get(), 2) == Content(14));
  CHECK(Refs(a.get(), 2) == 1);
  CHECK(Refs(a.get(), 3) == 0);
  CHECK(Refs(a.get(), 4) == 0);
  CHECK(Refs(f.get(), 1) == 2);
  CHECK(t.Stats().used_blocks == before.used_blocks);

  // A hole source is a mismatch, even with the hash of a zero block, and
  // even onto a hole; the destination keeps its block.
  REQUIRE_CODE(ApplyOne(t.vol.get(), Clone(f.get(), 5, a.get(), 2, t.Fp(0))), Code::kMismatch);
  REQUIRE_CODE(ApplyOne(t.vol.get(), Clone(f.get(), 5, a.get(), 6, t.Fp(0))), Code::kMismatch);
  CHECK(Get(a.get(), 2) == Content(14));
  CHECK(Refs(a.get(), 2) == 1);
  CHECK(Refs(a.get(), 6) == 0);

  // A copy-on-write after the clone leaves the source alone.
  Put(a.get(), 0, 15);
  CHECK(Get(f.get(), 0) == Content(11));
  CHECK(Refs(f.get(), 0) == 1);
  f.reset();
  a.reset();
  t.Fsck();
}

// ------------------------------------------------------------ kPunchIfZero

TEST_CASE("block ops: punch if zero frees zero blocks only", "[volume][blockops]") {
  TestVol t;
  auto a = t.NewFile("a", 8 * kB);
  auto b = t.NewFile("b", 8 * kB);
  Put(a.get(), 0, 0);
  Put(a.get(), 1, 0);
  Put(a.get(), 2, 21);
  std::vector<uint8_t> one(kB, 0);
  one[kB - 1] = 1;  // zero but for the last byte
  REQUIRE(a->Write(3 * kB, one.data(), kB).ok());
  Put(b.get(), 0, 0);
  REQUIRE(Refs(a.get(), 0) == 1);
  REQUIRE(ApplyOne(t.vol.get(), Share(a.get(), 1, b.get(), 0)).ok());  // a shared zero block
  auto info0 = a->Info();
  REQUIRE(info0.ok());
  const VolumeStats before = t.Stats();

  std::vector<Op> ops{Punch(a.get(), 0), Punch(a.get(), 2), Punch(a.get(), 3),
                      Punch(a.get(), 5) /* a hole */, Punch(a.get(), 1)};
  Apply(t.vol.get(), &ops);
  REQUIRE(ops[0].result.ok());
  REQUIRE_CODE(ops[1].result, Code::kMismatch);
  REQUIRE_CODE(ops[2].result, Code::kMismatch);
  REQUIRE(ops[3].result.ok());
  REQUIRE(ops[4].result.ok());
  CHECK(Refs(a.get(), 0) == 0);
  CHECK(Refs(a.get(), 1) == 0);
  CHECK(Refs(b.get(), 0) == 1);  // b keeps the shared zero block
  CHECK(Refs(a.get(), 2) == 1);
  CHECK(Refs(a.get(), 3) == 1);
  CHECK(Refs(a.get(), 5) == 0);
  CHECK(Get(a.get(), 0) == Content(0));
  CHECK(Get(a.get(), 1) == Content(0));
  CHECK(Get(a.get(), 2) == Content(21));
  CHECK(Get(a.get(), 3) == one);
  CHECK(Get(b.get(), 0) == Content(0));
  const VolumeStats after = t.Stats();
  CHECK(after.used_blocks == before.used_blocks - 1);  // a:0's block; a:1's is b's still
  CHECK(after.shared_blocks == before.shared_blocks - 1);
  CHECK(after.logical_blocks == before.logical_blocks - 2);
  auto info1 = a->Info();
  REQUIRE(info1.ok());
  CHECK(info1->mapped_blocks == info0->mapped_blocks - 2);
  // The punched block is writable again (allocates a fresh block).
  Put(a.get(), 0, 22);
  CHECK(Get(a.get(), 0) == Content(22));
  CHECK(Get(b.get(), 0) == Content(0));
  a.reset();
  b.reset();
  t.Fsck();
}

// ----------------------------------------------------------------- ordering

TEST_CASE("block ops: later operations in a batch see earlier ones", "[volume][blockops]") {
  TestVol t;
  auto F = t.NewFile("F", 8 * kB);
  auto G = t.NewFile("G", 8 * kB);
  auto H = t.NewFile("H", 8 * kB);
  auto A = t.NewFile("A", 8 * kB);  // an arena: holes
  Put(F.get(), 2, 31);
  Put(G.get(), 4, 31);
  Put(H.get(), 6, 31);
  Put(G.get(), 5, 32);
  Put(H.get(), 7, 32);
  const uint64_t data0 = t.DataBlocks();

  SECTION("clone then shares through the clone") {
    std::vector<Op> ops{Clone(F.get(), 2, A.get(), 0, t.Fp(31)),
                        Share(A.get(), 0, G.get(), 4, t.Fp(31)),
                        Share(A.get(), 0, H.get(), 6, t.Fp(31))};
    Apply(t.vol.get(), &ops);
    for (size_t i = 0; i < ops.size(); i++) {
      INFO("op " << i << ": " << ops[i].result.ToString());
      REQUIRE(ops[i].result.ok());
    }
    CHECK(Refs(A.get(), 0) == 4);
    CHECK(Refs(F.get(), 2) == 4);
    CHECK(Refs(G.get(), 4) == 4);
    CHECK(Refs(H.get(), 6) == 4);
    CHECK(t.DataBlocks() == data0 - 2);
    CHECK(Get(G.get(), 4) == Content(31));
    CHECK(Get(H.get(), 6) == Content(31));
  }
  SECTION("a failed clone leaves a hole the shares then fail on") {
    std::vector<Op> ops{Clone(F.get(), 2, A.get(), 0, t.Fp(32)),
                        Share(A.get(), 0, G.get(), 4, t.Fp(32)),
                        Share(A.get(), 0, H.get(), 6, t.Fp(32))};
    Apply(t.vol.get(), &ops);
    for (size_t i = 0; i < ops.size(); i++) {
      INFO("op " << i);
      REQUIRE_CODE(ops[i].result, Code::kMismatch);
    }
    CHECK(Refs(A.get(), 0) == 0);
    CHECK(Refs(F.get(), 2) == 1);
    CHECK(Refs(G.get(), 4) == 1);
    CHECK(Refs(H.get(), 6) == 1);
    CHECK(t.DataBlocks() == data0);
  }
  SECTION("a block shared away is the new block for later operations") {
    // G:5 takes H:7's block, a clone of G:5 carries it into A:1, A:1 and
    // H:7 are then already shared; F:3 is a hole and H:7 is not zeros.
    std::vector<Op> ops{Share(H.get(), 7, G.get(), 5), Clone(G.get(), 5, A.get(), 1, t.Fp(32)),
                        Share(A.get(), 1, H.get(), 7), Share(G.get(), 5, F.get(), 3),
                        Punch(H.get(), 7)};
    Apply(t.vol.get(), &ops);
    REQUIRE(ops[0].result.ok());
    REQUIRE(ops[1].result.ok());
    REQUIRE(ops[2].result.ok());  // already shared
    REQUIRE_CODE(ops[3].result, Code::kMismatch);
    REQUIRE_CODE(ops[4].result, Code::kMismatch);
    CHECK(Refs(G.get(), 5) == 3);
    CHECK(Refs(H.get(), 7) == 3);
    CHECK(Refs(A.get(), 1) == 3);
    CHECK(Get(A.get(), 1) == Content(32));
    CHECK(t.DataBlocks() == data0 - 1);
  }
  F.reset();
  G.reset();
  H.reset();
  A.reset();
  t.Fsck();
}

TEST_CASE("block ops: punch and share of the same block in one batch", "[volume][blockops]") {
  TestVol t;
  auto a = t.NewFile("a", 8 * kB);
  auto b = t.NewFile("b", 8 * kB);
  for (uint64_t i = 0; i < 4; i++) {
    Put(a.get(), i, 0);
    Put(b.get(), i, 0);
  }
  const uint64_t data0 = t.DataBlocks();
  std::vector<Op> ops{
      Punch(a.get(), 0), Share(a.get(), 0, b.get(), 0),  // the source is a hole now
      Punch(b.get(), 1), Share(a.get(), 1, b.get(), 1),  // the destination is a hole now
      Share(a.get(), 2, b.get(), 2), Punch(b.get(), 2),  // shared, then b drops it
      Share(a.get(), 3, b.get(), 3), Punch(a.get(), 3), Punch(b.get(), 3),  // both drop it
  };
  Apply(t.vol.get(), &ops);
  const Code want[] = {Code::kOk, Code::kMismatch, Code::kOk, Code::kMismatch, Code::kOk,
                       Code::kOk, Code::kOk,       Code::kOk, Code::kOk};
  for (size_t i = 0; i < ops.size(); i++) {
    INFO("op " << i);
    REQUIRE_CODE(ops[i].result, want[i]);
  }
  CHECK(Refs(a.get(), 0) == 0);
  CHECK(Refs(b.get(), 0) == 1);
  CHECK(Refs(a.get(), 1) == 1);
  CHECK(Refs(b.get(), 1) == 0);
  CHECK(Refs(a.get(), 2) == 1);
  CHECK(Refs(b.get(), 2) == 0);
  CHECK(Refs(a.get(), 3) == 0);
  CHECK(Refs(b.get(), 3) == 0);
  // 8 zero blocks: a:0, b:1 punched; a:2/b:2 shared then one dropped; a:3
  // and b:3 both gone.
  CHECK(t.DataBlocks() == data0 - 5);
  for (uint64_t i = 0; i < 4; i++) {
    CHECK(Get(a.get(), i) == Content(0));
    CHECK(Get(b.get(), i) == Content(0));
  }
  a.reset();
  b.reset();
  t.Fsck();
}

// A large batch with a mix of outcomes against a model of the positions'
// physical blocks.
TEST_CASE("block ops: a large mixed batch matches a model", "[volume][blockops][seeded]") {
  const uint64_t seed = GENERATE(from_range(dede::test::SeedsFromEnv({101, 102, 103})));
  INFO("seed " << seed << " (reproduce with DEDE_SEED=" << seed << ")");
  std::mt19937_64 rng(seed);
  auto below = [&](uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng); };
  TestVol t;
  const uint64_t kFiles = 3;
  const uint64_t whole[kFiles] = {48, 48, 40};
  const uint64_t sizes[kFiles] = {48 * kB, 48 * kB, 40 * kB + 123};  // f2: partial block 40
  std::vector<std::unique_ptr<File>> f(kFiles);
  // Model: per position a physical id (0: hole); per physical id a content.
  std::vector<std::vector<uint64_t>> phys(kFiles);
  std::map<uint64_t, uint64_t> content;  // phys -> content id
  uint64_t next_phys = 1;
  for (uint64_t i = 0; i < kFiles; i++) {
    f[i] = t.NewFile("m" + std::to_string(i), sizes[i]);
    phys[i].assign(whole[i], 0);
    for (uint64_t b = 0; b < whole[i]; b++) {
      const uint64_t r = below(100);
      if (r < 15) continue;  // hole
      const uint64_t c = r < 27 ? 0 : 1 + below(6);
      Put(f[i].get(), b, c);
      phys[i][b] = next_phys;
      content[next_phys++] = c;
    }
  }
  std::vector<uint8_t> tail(123);
  for (auto& x : tail) x = uint8_t(below(256));
  REQUIRE(f[2]->Write(40 * kB, tail.data(), tail.size()).ok());
  // Some sharing to start from (clones: content-blind, so the model follows).
  for (int k = 0; k < 20; k++) {
    const uint64_t sf = below(kFiles), sb = below(whole[sf]);
    const uint64_t df = below(kFiles), db = below(whole[df]);
    REQUIRE(t.vol->CloneBlock(f[sf].get(), sb, f[df].get(), db).ok());
    phys[df][db] = phys[sf][sb];
  }
  auto fp_of = [&](uint64_t c) { return t.Fp(c); };

  // The batch, and its expected outcomes evaluated in order.
  std::vector<Op> ops;
  std::vector<Code> want;
  std::vector<bool> either;  // kCloneIfHash with a wrong witness onto its own block
  uint64_t n_ok = 0, n_mismatch = 0, n_invalid = 0;
  for (int k = 0; k < 3000; k++) {
    const uint64_t kind = below(10);
    const uint64_t sf = below(kFiles), df = below(kFiles);
    // Mostly valid indexes; now and then the partial block or past the end.
    auto pick = [&](uint64_t fi) {
      return below(50) == 0 ? whole[fi] + below(2) : below(whole[fi]);
    };
    const uint64_t sb = pick(sf), db = pick(df);
    const bool svalid = sb < whole[sf], dvalid = db < whole[df];
    Op op;
    Code w = Code::kOk;
    bool may = false;
    if (kind < 5) {
      op = Share(f[sf].get(), sb, f[df].get(), db);
      if (!svalid || !dvalid) {
        w = Code::kInvalid;
      } else {
        const uint64_t sp = phys[sf][sb], dp = phys[df][db];
        if (sp == 0 || dp == 0) {
          w = Code::kMismatch;
        } else if (sp == dp) {
          w = Code::kOk;
        } else if (content[sp] != content[dp]) {
          w = Code::kMismatch;
        } else {
          phys[df][db] = sp;
        }
      }
    } else if (kind < 8) {
      const uint64_t sp = svalid ? phys[sf][sb] : 0;
      const uint64_t truth = sp ? content[sp] : 0;
      const uint64_t wc = below(4) != 0 ? truth : below(7);
      op = Clone(f[sf].get(), sb, f[df].get(), db, fp_of(wc));
      if (!svalid || !dvalid) {
        w = Code::kInvalid;
      } else if (sp == 0) {
        w = Code::kMismatch;
      } else if (wc != truth) {
        w = Code::kMismatch;
        may = phys[df][db] == sp;  // nothing to do either way
      } else {
        phys[df][db] = sp;
      }
    } else {
      op = Punch(f[df].get(), db);
      if (!dvalid) {
        w = Code::kInvalid;
      } else if (phys[df][db] == 0) {
        w = Code::kOk;
      } else if (content[phys[df][db]] != 0) {
        w = Code::kMismatch;
      } else {
        phys[df][db] = 0;
      }
    }
    ops.push_back(op);
    want.push_back(w);
    either.push_back(may);
    n_ok += w == Code::kOk;
    n_mismatch += w == Code::kMismatch;
    n_invalid += w == Code::kInvalid;
  }
  // The mix must exercise every outcome.
  REQUIRE(n_ok > 300);
  REQUIRE(n_mismatch > 300);
  REQUIRE(n_invalid > 20);

  Apply(t.vol.get(), &ops);
  uint64_t wrong = 0;
  for (size_t k = 0; k < ops.size(); k++) {
    const Code got = ops[k].result.code();
    if (got == want[k] || (either[k] && got == Code::kOk)) continue;
    if (wrong++ < 5) {
      UNSCOPED_INFO("op " << k << " (kind " << int(ops[k].kind) << "): got "
                          << ops[k].result.ToString() << ", expected " << CodeName(want[k]));
    }
  }
  REQUIRE(wrong == 0);

  // Contents and reference counts.
  std::map<uint64_t, uint64_t> refs;  // phys -> positions
  uint64_t mapped = 0;
  for (uint64_t i = 0; i < kFiles; i++) {
    for (uint64_t p : phys[i]) {
      if (p) {
        refs[p]++;
        mapped++;
      }
    }
  }
  auto check_all = [&](const char* when) {
    INFO(when);
    for (uint64_t i = 0; i < kFiles; i++) {
      std::vector<uint8_t> got(sizes[i]);
      REQUIRE(f[i]->Read(0, got.data(), got.size()).ok());
      for (uint64_t b = 0; b < whole[i]; b++) {
        const uint64_t p = phys[i][b];
        INFO("file m" << i << " block " << b);
        REQUIRE(std::equal(got.begin() + long(b * kB), got.begin() + long((b + 1) * kB),
                           Content(p ? content[p] : 0).begin()));
        REQUIRE(Refs(f[i].get(), b) == (p ? refs[p] : 0));
      }
    }
    std::vector<uint8_t> got_tail(123);
    REQUIRE(f[2]->Read(40 * kB, got_tail.data(), 123).ok());
    REQUIRE(got_tail == tail);
    uint64_t shared = 0;
    for (const auto& [p, n] : refs) shared += n > 1;
    const VolumeStats st = t.Stats();
    CHECK(st.used_blocks - st.pointer_blocks == refs.size() + 1);  // + f2's partial block
    CHECK(st.shared_blocks == shared);
    CHECK(st.logical_blocks == mapped + 1);
  };
  check_all("after the batch");

  // Copy-on-write of shared blocks keeps every other position.
  for (int k = 0; k < 30; k++) {
    const uint64_t i = below(kFiles), b = below(whole[i]);
    const uint64_t p = phys[i][b];
    Put(f[i].get(), b, 100 + uint64_t(k));
    if (p && --refs[p] == 0) refs.erase(p);
    if (!p) mapped++;
    phys[i][b] = next_phys;
    content[next_phys] = 100 + uint64_t(k);
    refs[next_phys++] = 1;
  }
  check_all("after rewrites");
  REQUIRE(t.vol->Sync().ok());
  for (auto& x : f) x.reset();
  t.Fsck();
}

// ------------------------------------------------------------ hash witness

TEST_CASE("block ops: hash witness mode needs a sha256 volume", "[volume][blockops]") {
  TestVol t;  // xxh128
  REQUIRE(t.vol->superblock().hash_algo == HashAlgo::kXxh128);
  auto a = t.NewFile("a", 4 * kB);
  auto b = t.NewFile("b", 4 * kB);
  Put(a.get(), 0, 1);
  Put(b.get(), 0, 1);
  Put(b.get(), 1, 0);
  std::vector<Op> ops{Share(a.get(), 0, b.get(), 0, t.Fp(1)), Punch(b.get(), 1),
                      Clone(a.get(), 0, b.get(), 2, t.Fp(1))};
  REQUIRE_CODE(t.vol->ApplyBlockOps(&ops, VerifyMode::kHashWitness), Code::kInvalid);
  CHECK(Refs(a.get(), 0) == 1);
  CHECK(Refs(b.get(), 0) == 1);
  CHECK(Refs(b.get(), 1) == 1);
  CHECK(Refs(b.get(), 2) == 0);
  // The same batch in byte-compare mode works.
  Apply(t.vol.get(), &ops);
  for (const Op& op : ops) CHECK(op.result.ok());
  CHECK(Refs(b.get(), 0) == 3);  // a:0, b:0 and the clone b:2
  CHECK(Refs(b.get(), 1) == 0);
}

TEST_CASE("block ops: hash witness mode on sha256 shares only blocks matching the witness",
          "[volume][blockops]") {
  FormatOptions fo;
  fo.hash_algo = HashAlgo::kSha256;
  TestVol t(fo);
  REQUIRE(t.vol->superblock().hash_algo == HashAlgo::kSha256);
  auto a = t.NewFile("a", 8 * kB);
  auto b = t.NewFile("b", 8 * kB);
  for (uint64_t i = 0; i < 6; i++) Put(a.get(), i, 40 + i % 2);
  Put(b.get(), 0, 40);
  Put(b.get(), 1, 40);
  Put(b.get(), 2, 41);
  Put(b.get(), 3, 40);
  Put(b.get(), 4, 42);
  REQUIRE(t.Fp(40).size == 32);
  const uint64_t data0 = t.DataBlocks();
  std::vector<Op> ops{
      Share(a.get(), 0, b.get(), 0, t.Fp(40)),      // both match: shared
      Share(a.get(), 2, b.get(), 1, t.Fp(41)),      // equal blocks, witness of another content
      Share(a.get(), 1, b.get(), 2, t.Fp(41)),      // both match 41
      Share(a.get(), 4, b.get(), 3, Fingerprint{}), // no witness at all
      Share(a.get(), 4, b.get(), 4, t.Fp(40)),      // source matches, destination differs
      Share(b.get(), 4, a.get(), 5, t.Fp(42)),      // destination differs (a:5 is 41)
      Clone(a.get(), 2, b.get(), 6, t.Fp(40)),      // clones check the source with SHA-256
      Clone(a.get(), 2, b.get(), 7, t.Fp(41)),
  };
  Apply(t.vol.get(), &ops, VerifyMode::kHashWitness);
  const Code want[] = {Code::kOk,       Code::kMismatch, Code::kOk, Code::kMismatch,
                       Code::kMismatch, Code::kMismatch, Code::kOk, Code::kMismatch};
  for (size_t i = 0; i < ops.size(); i++) {
    INFO("op " << i);
    REQUIRE_CODE(ops[i].result, want[i]);
  }
  CHECK(Refs(b.get(), 0) == 2);
  CHECK(Refs(b.get(), 1) == 1);
  CHECK(Refs(b.get(), 2) == 2);
  CHECK(Refs(b.get(), 3) == 1);
  CHECK(Refs(b.get(), 4) == 1);
  CHECK(Refs(b.get(), 6) == 2);  // a:2 and b:6
  CHECK(Refs(b.get(), 7) == 0);
  CHECK(Get(b.get(), 6) == Content(40));
  CHECK(t.DataBlocks() == data0 - 2);
  a.reset();
  b.reset();
  t.Fsck();
}

// ------------------------------------------------------------------ errors

namespace {

// A volume with blocks spread over several refcount blocks, so a batch
// must read (metadata and data) in both its planning and its apply phase.
struct ErrorScene {
  static constexpr uint64_t kBig = 2200;  // > 2 refcount blocks of data
  std::vector<uint8_t> snapshot;

  void Build(TestVol& t) {
    auto r = t.NewFile("r", kBig * kB);
    auto s = t.NewFile("s", 16 * kB);
    std::vector<uint8_t> buf(kBig * kB);
    for (uint64_t i = 0; i < kBig; i++) {
      std::vector<uint8_t> c = Content(i == kBig - 1 ? 0x5000 : 0x1000 + i);
      std::memcpy(buf.data() + i * kB, c.data(), kB);
    }
    REQUIRE(r->Write(0, buf.data(), buf.size()).ok());
    Put(r.get(), 0, 0x5000);    // r:0 == r:last, far apart on the disk
    Put(s.get(), 0, 0x1000 + 1100);  // s:0 == r:1100
    Put(s.get(), 2, 0);
    Put(s.get(), 3, 0x1000 + 7);
    Put(s.get(), 4, 0x5000);
    r.reset();
    s.reset();
  }

  static std::vector<Op> Ops(TestVol& t, File* r, File* s) {
    return {Share(r, 0, r, kBig - 1), Share(r, 1100, s, 0), Clone(r, 5, s, 1, t.Fp(0x1000 + 5)),
            Punch(s, 2), Share(s, 3, r, 8) /* mismatch */, Share(s, 4, r, kBig - 1),
            Clone(r, kBig - 1, s, 5, t.Fp(0x5000))};
  }

  // Expected bytes and refcounts before and after the batch.
  struct View {
    std::vector<uint8_t> r, s;
    std::vector<uint32_t> rrefs, srefs;
  };
  static View Look(File* r, File* s) {
    View v;
    v.r.resize(kBig * kB);
    v.s.resize(16 * kB);
    REQUIRE(r->Read(0, v.r.data(), v.r.size()).ok());
    REQUIRE(s->Read(0, v.s.data(), v.s.size()).ok());
    for (uint64_t i : {uint64_t{0}, uint64_t{1}, uint64_t{5}, uint64_t{8}, uint64_t{1100},
                       kBig - 1}) {
      v.rrefs.push_back(Refs(r, i));
    }
    for (uint64_t i = 0; i < 6; i++) v.srefs.push_back(Refs(s, i));
    return v;
  }
};

}  // namespace

TEST_CASE("block ops: a read error fails the batch and changes nothing", "[volume][blockops]") {
  TestVol t(FormatOptions{}, 32ull << 20);
  ErrorScene scene;
  scene.Build(t);
  REQUIRE(t.vol->Sync().ok());
  t.vol.reset();  // clean close: the snapshot is at rest
  scene.snapshot = t.base.bytes();

  // The batch's result without faults.
  ErrorScene::View before, after;
  {
    t.Open();
    auto r = t.OpenF("r");
    auto s = t.OpenF("s");
    before = ErrorScene::Look(r.get(), s.get());
    std::vector<Op> ops = ErrorScene::Ops(t, r.get(), s.get());
    Apply(t.vol.get(), &ops);
    for (size_t i = 0; i < ops.size(); i++) {
      INFO("op " << i << ": " << ops[i].result.ToString());
      CHECK(ops[i].result.ok() == (i != 4));
    }
    after = ErrorScene::Look(r.get(), s.get());
    REQUIRE(after.r == before.r);
    REQUIRE(after.srefs != before.srefs);
  }

  uint64_t failures = 0;
  uint64_t poisoned = 0;
  bool done = false;
  // Cold: the batch starts with an empty cache (the plan phase reads block
  // maps, the apply phase refcount blocks); warm: with the metadata the
  // batch needs cached, so only its data reads fail.
  for (int warm = 0; warm < 2; warm++) {
    done = false;
    for (uint64_t n = 0; n < 200 && !done; n++) {
      INFO("read fault after " << n << " reads, warm cache " << warm);
      t.Restore(scene.snapshot);
      t.Open();
      auto r = t.OpenF("r");
      auto s = t.OpenF("s");
      if (warm) (void)ErrorScene::Look(r.get(), s.get());
      std::vector<Op> ops = ErrorScene::Ops(t, r.get(), s.get());
      t.fdev.FailReadsAfter(n, EIO);
      Status st = t.vol->ApplyBlockOps(&ops, VerifyMode::kByteCompare);
      t.fdev.ClearFault();
      if (st.ok()) {
        done = true;  // enough reads for the whole batch
        ErrorScene::View v = ErrorScene::Look(r.get(), s.get());
        CHECK(v.r == after.r);
        CHECK(v.s == after.s);
        CHECK(v.rrefs == after.rrefs);
        CHECK(v.srefs == after.srefs);
        continue;
      }
      failures++;
      REQUIRE_CODE(st, Code::kIoError);
      // Either nothing changed (an error before any change: bytes and
      // references as before the batch, consistent once durable), or the
      // error came half-way through an operation and the volume poisoned
      // itself, so nothing of it can commit: a reopen finds the state
      // before the batch.
      Status sync = t.vol->Sync();
      if (sync.ok()) {
        ErrorScene::View v = ErrorScene::Look(r.get(), s.get());
        CHECK(v.r == before.r);
        CHECK(v.s == before.s);
        CHECK(v.rrefs == before.rrefs);
        CHECK(v.srefs == before.srefs);
      } else {
        poisoned++;
        REQUIRE_CODE(sync, Code::kIoError);
      }
      r.reset();
      s.reset();
      if (sync.ok()) {
        t.Fsck();
      } else {
        // A volume that poisoned itself: a reopen must find the state
        // before the batch.
        INFO("sync after the read error: " << sync.ToString());
        std::mt19937_64 crng(n);
        t.DieAndCrash(crng, 1.0);
        t.Open();
        auto r2 = t.OpenF("r");
        auto s2 = t.OpenF("s");
        ErrorScene::View v2 = ErrorScene::Look(r2.get(), s2.get());
        CHECK(v2.r == before.r);
        CHECK(v2.s == before.s);
        CHECK(v2.rrefs == before.rrefs);
        CHECK(v2.srefs == before.srefs);
        r2.reset();
        s2.reset();
        t.Fsck();
      }
    }
  }
  CHECK(done);
  CHECK(failures > 2);
}

TEST_CASE("block ops: a write error poisons the volume and a reopen is consistent",
          "[volume][blockops]") {
  // A small journal: every operation's EnsureRoom commits the ones before
  // it, and checkpoints come often, so a batch writes all along.
  FormatOptions fo;
  fo.journal_blocks = 70;  // the least format takes
  TestVol t(fo, 32ull << 20);
  const uint64_t kN = 96;
  {
    auto w0 = t.NewFile("w0", kN * kB);
    auto w1 = t.NewFile("w1", kN * kB);
    for (uint64_t i = 0; i < kN; i++) {
      Put(w0.get(), i, i % 8 == 7 ? 0 : 1 + i % 5);
      Put(w1.get(), i, i % 9 == 8 ? 0 : 1 + (i * 7) % 5);
    }
  }
  REQUIRE(t.vol->Sync().ok());
  t.vol.reset();
  const std::vector<uint8_t> snapshot = t.base.bytes();
  auto ops_for = [&](File* w0, File* w1) {
    std::vector<Op> ops;
    for (uint64_t i = 0; i < kN; i++) {
      ops.push_back(Share(w0, i % 5, w1, i));
      ops.push_back(Share(w1, i, w0, (i * 3) % kN));
      ops.push_back(Punch(w0, i));
    }
    return ops;
  };

  // The batch without faults: what it writes, and the bytes.
  std::vector<uint8_t> want0(kN * kB), want1(kN * kB);
  uint64_t writes = 0;
  {
    t.Open();
    auto w0 = t.OpenF("w0");
    auto w1 = t.OpenF("w1");
    REQUIRE(w0->Read(0, want0.data(), want0.size()).ok());
    REQUIRE(w1->Read(0, want1.data(), want1.size()).ok());
    std::vector<Op> ops = ops_for(w0.get(), w1.get());
    const uint64_t w_before = t.fdev.writes();
    Apply(t.vol.get(), &ops);
    REQUIRE(t.vol->Sync().ok());
    writes = t.fdev.writes() - w_before;
    uint64_t ok = 0;
    for (const Op& op : ops) ok += op.result.ok();
    REQUIRE(ok > kN / 3);
  }
  INFO("the batch and its sync write " << writes << " times");
  REQUIRE(writes > 20);

  std::vector<uint64_t> ns;
  for (uint64_t n = 0; n < 12; n++) ns.push_back(n);
  for (uint64_t k = 1; k <= 24; k++) ns.push_back(12 + k * (writes - 12) / 25);
  ns.push_back(writes - 1);
  ns.push_back(writes + 5);  // no fault within the batch
  uint64_t failures = 0;
  for (size_t k = 0; k < ns.size(); k++) {
    const uint64_t n = ns[k];
    const int err = k % 2 ? EIO : ENOSPC;
    const Code code = err == EIO ? Code::kIoError : Code::kNoSpace;
    INFO("write fault (" << CodeName(code) << ") after " << n << " writes");
    t.Restore(snapshot);
    t.Open();
    auto w0 = t.OpenF("w0");
    auto w1 = t.OpenF("w1");
    std::vector<Op> ops = ops_for(w0.get(), w1.get());
    t.fdev.FailWritesAfter(n, err);
    Status st = t.vol->ApplyBlockOps(&ops, VerifyMode::kByteCompare);
    if (st.ok()) st = t.vol->Sync();
    t.fdev.ClearFault();
    if (n >= writes) {
      REQUIRE(st.ok());
    } else {
      REQUIRE(!st.ok());
    }
    if (!st.ok()) {
      failures++;
      REQUIRE_CODE(st, code);
      // Poisoned: every later change fails with the same error; reads work.
      std::vector<uint8_t> blk = Content(3);
      REQUIRE_CODE(w0->Write(0, blk.data(), kB), code);
      REQUIRE_CODE(w1->Write(5 * kB, blk.data(), 100), code);
      REQUIRE_CODE(w0->Punch(3), code);
      REQUIRE_CODE(t.vol->CloneBlock(w0.get(), 1, w1.get(), 1), code);
      REQUIRE_CODE(t.vol->Sync(), code);
      std::vector<Op> again = ops_for(w0.get(), w1.get());
      REQUIRE_CODE(t.vol->ApplyBlockOps(&again, VerifyMode::kByteCompare), code);
      Status cs = t.vol->CompareAndShare(w0.get(), 1, w1.get(), 1, VerifyMode::kByteCompare);
      REQUIRE(!cs.ok());
      std::vector<uint8_t> g0(kN * kB), g1(kN * kB);
      REQUIRE(w0->Read(0, g0.data(), g0.size()).ok());
      REQUIRE(w1->Read(0, g1.data(), g1.size()).ok());
      CHECK(g0 == want0);
      CHECK(g1 == want1);
    }
    // The host dies; the device keeps some of what was not flushed. Every
    // operation preserves contents, so the bytes are the synced ones
    // whatever survived, and the volume must be consistent.
    w0.reset();
    w1.reset();
    std::mt19937_64 crng(n * 31 + 7);
    t.DieAndCrash(crng, std::vector<double>{0.0, 0.5, 1.0}[k % 3]);
    t.Open();
    t.Fsck();
    auto r0 = t.OpenF("w0");
    auto r1 = t.OpenF("w1");
    std::vector<uint8_t> g0(kN * kB), g1(kN * kB);
    REQUIRE(r0->Read(0, g0.data(), g0.size()).ok());
    REQUIRE(r1->Read(0, g1.data(), g1.size()).ok());
    CHECK(g0 == want0);
    CHECK(g1 == want1);
    if (st.ok()) {
      // Everything applied and synced: every zero block of w0 is a hole.
      for (uint64_t i = 0; i < kN; i++) {
        INFO("block " << i);
        CHECK((Refs(r0.get(), i) == 0) == (i % 8 == 7));
      }
    }
    r0.reset();
    r1.reset();
  }
  CHECK(failures + 1 == ns.size());
}

// ------------------------------------------------------------- read buffer

// A dedup pass sends every batch through one Volume::ReadBuffer, and the
// volume keeps each batch's inodes decoded and stores them only when an
// operation changed their block map. Stale bytes in a reused buffer must
// never decide an outcome, and a map that grows mid-batch must reach the
// disk.
TEST_CASE("block ops: batches through one read buffer", "[volume][blockops]") {
  TestVol t;
  constexpr uint64_t kN = 160;
  auto F = t.NewFile("F", kN * kB);
  auto G = t.NewFile("G", kN * kB);
  auto A = t.NewFile("A", 2048 * kB);  // an arena: holes; block 1000 needs a deeper map
  for (uint64_t i = 0; i < kN; i++) Put(F.get(), i, 100 + i);
  for (uint64_t i = 0; i < kN; i++) Put(G.get(), i, 100 + i);
  Put(G.get(), 150, 7);  // differs from F:150
  auto apply = [&](std::vector<Op>* ops, Volume::ReadBuffer* buf) {
    Status st = t.vol->ApplyBlockOps(ops, VerifyMode::kByteCompare, buf);
    INFO("ApplyBlockOps: " << st.ToString());
    REQUIRE(st.ok());
  };
  Volume::ReadBuffer buf;
  CHECK(buf.blocks() == 0);

  // 1. The buffer grows to hold F:0-99 and G:0-99.
  std::vector<Op> ops;
  for (uint64_t i = 0; i < 100; i++) ops.push_back(Share(F.get(), i, G.get(), i));
  apply(&ops, &buf);
  for (const Op& op : ops) REQUIRE(op.result.ok());
  const size_t grown = buf.blocks();
  CHECK(grown >= 200);

  // 2. A smaller batch reuses it: the mismatch is still seen.
  ops = {Share(F.get(), 150, G.get(), 150), Share(F.get(), 120, G.get(), 120)};
  apply(&ops, &buf);
  REQUIRE_CODE(ops[0].result, Code::kMismatch);
  REQUIRE(ops[1].result.ok());
  CHECK(buf.blocks() == grown);
  // Different contents read into the reused buffer: G:121 rewritten.
  Put(G.get(), 121, 8);
  ops = {Share(F.get(), 121, G.get(), 121)};
  apply(&ops, &buf);
  REQUIRE_CODE(ops[0].result, Code::kMismatch);

  // 3. A clone that grows the arena's map, then shares through it.
  auto info0 = A->Info();
  REQUIRE(info0.ok());
  CHECK(info0->mapped_blocks == 0);
  ops = {Clone(F.get(), 130, A.get(), 1000, t.Fp(230)), Share(A.get(), 1000, G.get(), 130),
         Share(A.get(), 1000, F.get(), 131), Clone(F.get(), 132, A.get(), 1001, t.Fp(232))};
  apply(&ops, &buf);
  REQUIRE(ops[0].result.ok());
  REQUIRE(ops[1].result.ok());
  REQUIRE_CODE(ops[2].result, Code::kMismatch);
  REQUIRE(ops[3].result.ok());
  CHECK(Refs(A.get(), 1000) == 3);
  CHECK(Refs(A.get(), 1001) == 2);
  auto info1 = A->Info();
  REQUIRE(info1.ok());
  CHECK(info1->mapped_blocks == 2);

  // 4. A batch of more blocks than the buffer holds grows it again: H is
  // a third copy of F's contents.
  auto H = t.NewFile("H", kN * kB);
  for (uint64_t i = 0; i < kN; i++) Put(H.get(), i, 100 + i);
  ops.clear();
  for (uint64_t i = 0; i < kN; i++) ops.push_back(Share(F.get(), i, H.get(), i));
  apply(&ops, &buf);
  for (const Op& op : ops) REQUIRE(op.result.ok());
  CHECK(buf.blocks() >= 2 * kN);
  CHECK(buf.blocks() > grown);
  H.reset();

  // Everything is on the disk after a sync and a reopen.
  REQUIRE(t.vol->Sync().ok());
  F.reset();
  G.reset();
  A.reset();
  t.vol.reset();
  t.Open();
  F = t.OpenF("F");
  G = t.OpenF("G");
  A = t.OpenF("A");
  auto info2 = A->Info();
  REQUIRE(info2.ok());
  CHECK(info2->mapped_blocks == 2);
  CHECK(Get(A.get(), 1000) == Content(230));
  CHECK(Get(A.get(), 1001) == Content(232));
  CHECK(Refs(A.get(), 1000) == 4);  // F, A, G and H
  for (uint64_t i = 0; i < kN; i++) {
    INFO("block " << i);
    CHECK(Get(F.get(), i) == Content(100 + i));
    const uint64_t want_g = i == 150 ? 7 : i == 121 ? 8 : 100 + i;
    CHECK(Get(G.get(), i) == Content(want_g));
    // F, H, and G where G was shared; A too for 130 and 132.
    const bool with_g = i < 100 || i == 120 || i == 130;
    const bool with_a = i == 130 || i == 132;
    CHECK(Refs(F.get(), i) == 2u + with_g + with_a);
  }
  F.reset();
  G.reset();
  A.reset();
  t.Fsck();
}

// A block with as many references as its count holds (2^32 - 1, 16 TiB of
// one 4 KiB pattern) cannot be shared once more. The failing increment
// poisoned the volume, every write failing until a restart, and the next
// pass planned the same share again.
TEST_CASE("block ops: a share from a block with a saturated count fails alone",
          "[volume][blockops]") {
  TestVol t;
  uint64_t addr = 0;
  {
    auto a = t.NewFile("a", 4 * kB);
    auto b = t.NewFile("b", 4 * kB);
    Put(a.get(), 0, 1);
    Put(b.get(), 0, 2);
    REQUIRE(t.vol->Sync().ok());
  }
  const Superblock sb = t.vol->superblock();
  t.vol.reset();
  // Find a's block (content 1) and saturate its count on the device.
  const std::vector<uint8_t> want = Content(1);
  for (uint64_t blk = sb.group_start; blk < sb.total_blocks && addr == 0; blk++) {
    uint32_t g, slot;
    uint64_t rb;
    if (!sb.LocateData(blk, &g, &rb, &slot)) continue;
    if (std::memcmp(t.base.bytes().data() + blk * kB, want.data(), kB) == 0) addr = blk;
  }
  REQUIRE(addr != 0);
  {
    uint32_t g, slot;
    uint64_t rb;
    REQUIRE(sb.LocateData(addr, &g, &rb, &slot));
    uint8_t* blk = t.base.bytes().data() + rb * kB;
    REQUIRE(GetRef(blk, slot) == 1);
    SetRef(blk, slot, UINT32_MAX);
    SealBlock(blk, PeekHeader(blk), sb.uuid);
  }
  t.Open();
  auto a = t.OpenF("a");
  auto b = t.OpenF("b");
  Put(b.get(), 0, 1);
  // The share fails alone, changing nothing; the volume goes on working.
  std::vector<Op> ops{Share(a.get(), 0, b.get(), 0)};
  Apply(t.vol.get(), &ops, VerifyMode::kByteCompare);
  INFO(ops[0].result.ToString());
  CHECK(ops[0].result.code() == Code::kMismatch);
  CHECK_FALSE(ops[0].changed);
  CHECK(Refs(a.get(), 0) == UINT32_MAX);
  CHECK(Refs(b.get(), 0) == 1);
  // The same through CloneBlock (merge requests, arena moves) and
  // CompareAndShare.
  Status clone = t.vol->CloneBlock(a.get(), 0, b.get(), 0);
  INFO(clone.ToString());
  CHECK(clone.code() == Code::kMismatch);
  Status share = t.vol->CompareAndShare(a.get(), 0, b.get(), 0, VerifyMode::kByteCompare);
  INFO(share.ToString());
  CHECK(share.code() == Code::kMismatch);
  CHECK(Refs(a.get(), 0) == UINT32_MAX);
  Put(a.get(), 1, 7);
  Put(b.get(), 1, 8);
  REQUIRE(t.vol->Sync().ok());
  CHECK(Get(a.get(), 0) == want);
  CHECK(Get(b.get(), 0) == want);
  CHECK(Get(a.get(), 1) == Content(7));
}
