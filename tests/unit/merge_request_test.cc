// Merge requests (merge/merge_request.h, DeDe section 3.3.2): the group
// codec, reading request files with damage in them, posting and applying
// on one volume, and the cross-host scenario the feature exists for: two
// Volume instances on one device whose lock managers exclude each other
// like two hosts. Host A holds file X (a running VM); host B's dedup pass
// finds X's indexed block duplicated in B's file Y, cannot touch X, and
// posts a merge request that A applies.
#include "merge/merge_request.h"

#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "agent/dedup_pass.h"
#include "index/shard_format.h"
#include "kmod/writemon/write_log.h"
#include "kmod/writemon/write_monitor.h"
#include "tests/dedup_accounting.h"
#include "tests/forwarding_locks.h"
#include "tests/pending_records.h"
#include "tests/process_device.h"
#include "tests/temp_locks.h"
#include "util/coding.h"
#include "volume/fsck.h"
#include "volume/mem_device.h"
#include "volume/volume.h"

using namespace dede;

namespace {

constexpr uint64_t kB = kBlockSize;
constexpr Uuid kUuid = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
constexpr Uuid kOtherUuid = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 17};
const FileId kRequestFile{9, 4};
constexpr uint64_t kTargetIno = 5;

// A pseudo-random block per id (id 0 is not used: zero blocks are never
// shared, they become holes).
std::vector<uint8_t> Content(uint64_t id) {
  std::vector<uint8_t> out(kB);
  uint64_t x = (id + 1) * 0x9e3779b97f4a7c15ULL;
  for (size_t i = 0; i < kB; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(out.data() + i, &x, 8);
  }
  return out;
}

MergeGroup SampleGroup(HashAlgo algo, uint64_t first_block, size_t n) {
  MergeGroup g;
  g.target = FileId{kTargetIno, 3};
  g.first_block = first_block;
  g.posted_ns = 1'700'000'000'123'456'789ull;
  g.host_id = 2;
  for (size_t i = 0; i < n; i++) {
    const std::vector<uint8_t> c = Content(i);
    g.records.push_back(
        MergeRecord{100 + 7 * i, first_block + 1 + i, ComputeFingerprint(algo, c.data(), kB)});
  }
  return g;
}

bool SameGroup(const MergeGroup& a, const MergeGroup& b) {
  if (!(a.target == b.target) || a.first_block != b.first_block || a.posted_ns != b.posted_ns ||
      a.host_id != b.host_id || a.records.size() != b.records.size()) {
    return false;
  }
  for (size_t i = 0; i < a.records.size(); i++) {
    if (a.records[i].target_block != b.records[i].target_block ||
        a.records[i].clone_block != b.records[i].clone_block ||
        !(a.records[i].witness == b.records[i].witness)) {
      return false;
    }
  }
  return true;
}

Result<MergeGroup> Decode(const std::vector<uint8_t>& blk, HashAlgo algo, uint64_t at,
                          const Uuid& uuid = kUuid, FileId file = kRequestFile,
                          uint64_t target_ino = kTargetIno) {
  return DecodeMergeGroupBlock(blk.data(), algo, uuid, file, at, target_ino, "test requests");
}

// Re-seals a hand-edited block so that only the edited field is wrong.
void Reseal(std::vector<uint8_t>* blk, uint64_t at) {
  EncodeU32(blk->data() + 8, FileBlockCrc(blk->data(), 8, kUuid, kRequestFile, at));
}

// A lock-manager pair on one lock file: like two hosts, they exclude each
// other.
void LockPair(std::shared_ptr<LockManager>* a, std::shared_ptr<LockManager>* b) {
  std::vector<std::shared_ptr<LockManager>> hosts = dede::test::TempLockGroup(2);
  *a = hosts[0];
  *b = hosts[1];
}

std::unique_ptr<Volume> OpenHost(BlockDevice* dev, std::shared_ptr<LockManager> locks,
                                 uint32_t host) {
  OpenOptions oo;
  oo.locks = std::move(locks);
  oo.host_id = host;
  auto v = Volume::Open(dev, oo);
  REQUIRE(v.ok());
  return std::move(v.value());
}

// Small groups (4 MiB): each host allocates in groups of its own, so
// neither waits for a group the other caches.
FormatOptions SmallGroups(HashAlgo algo = HashAlgo::kXxh128) {
  FormatOptions fo;
  fo.group_refblocks = 1;
  fo.hash_algo = algo;
  return fo;
}

// Lends files the test holds open (like dedupd lends its exports).
class LendingAccess : public FileAccess {
 public:
  void Lend(File* f) { files_[f->id().ino] = f; }
  Result<Handle> Get(const FileInfo& info) override {
    auto it = files_.find(info.id.ino);
    if (it == files_.end()) return Status::Locked("not lent to this test access");
    if (!(it->second->id() == info.id)) return Status::NotFound("another generation");
    return Handle{it->second};
  }

 private:
  std::map<uint64_t, File*> files_;
};

uint32_t Refs(File* f, uint64_t block) {
  Result<uint32_t> r = f->BlockRefCount(block);
  REQUIRE(r.ok());
  return r.value();
}

std::vector<uint8_t> ReadAll(File* f) {
  std::vector<uint8_t> out(f->size());
  REQUIRE(f->Read(0, out.data(), out.size()).ok());
  return out;
}

void WriteBlock(File* f, WriteMonitor* monitor, uint64_t block, const std::vector<uint8_t>& c) {
  REQUIRE(f->Write(block * kB, c.data(), kB).ok());
  if (monitor != nullptr) monitor->OnWrite(f->id(), block * kB, c.data(), kB);
}

void FlushLog(Volume* vol, WriteMonitor* monitor, FileId id) {
  MonitorBatch b = monitor->Take(id);
  REQUIRE(AppendToWriteLog(vol, b).ok());
}

using test::PhysicalDataBlocks;  // tests/dedup_accounting.h

void RequireFsckClean(Volume* vol) {
  auto rep = CheckVolume(vol, false);
  REQUIRE(rep.ok());
  std::string problems;
  for (const auto& p : rep->problems) problems += p.where + ": " + p.what + "; ";
  INFO("fsck: " << problems);
  REQUIRE(rep->clean());
}

bool HasRequestFile(Volume* vol, uint64_t target_ino) {
  auto list = vol->List();
  REQUIRE(list.ok());
  for (const FileInfo& fi : *list) {
    if (fi.name == MergeRequestFileName(target_ino)) {
      CHECK(fi.kind == FileKind::kMergeRequest);
      CHECK(fi.owner_ino == target_ino);
      return true;
    }
  }
  return false;
}

constexpr uint64_t kFileBlocks = 8;

// Creates `name` with kFileBlocks blocks, block b holding Content(content_base
// + b), and returns it open.
std::unique_ptr<File> CreateFilled(Volume* vol, const std::string& name, uint64_t content_base) {
  REQUIRE(vol->Create(name, kFileBlocks * kB).ok());
  auto f = vol->OpenFile(name);
  REQUIRE(f.ok());
  for (uint64_t b = 0; b < kFileBlocks; b++) {
    WriteBlock(f->get(), nullptr, b, Content(content_base + b));
  }
  return std::move(*f);
}
constexpr uint64_t kXBlock = 3;  // X's block holding the shared content C
constexpr uint64_t kYBlock = 5;  // Y's block holding C
constexpr uint64_t kC = 1000;    // content id of C

// Host A serves X; host B writes Y. Both on one device.
class TwoHosts {
 public:
  TwoHosts() : dev_(96ull << 20) {
    REQUIRE(FormatVolume(&dev_, SmallGroups(), false).ok());
    std::shared_ptr<LockManager> la, lb;
    LockPair(&la, &lb);
    a_ = OpenHost(&dev_, la, 1);
    b_ = OpenHost(&dev_, lb, 2);
    WriteMonitorOptions mo;
    mo.algo = a_->superblock().hash_algo;
    monitor_a_ = std::make_unique<WriteMonitor>(mo);
    monitor_b_ = std::make_unique<WriteMonitor>(mo);
    REQUIRE(a_->Create("a-idle", 0).ok());
  }

  // Host A hands back the group locks it caches (refcount changes of
  // shared blocks leave it holding B's groups), as dedupd's flush timer
  // does when another host waits: closing a file releases them. The test
  // is single-threaded, so B must not be made to wait for A.
  void AGoesIdle() {
    auto f = a_->OpenFile("a-idle");
    REQUIRE(f.ok());
  }

  // A: X with C at block 3 and unique blocks elsewhere, indexed by A's own
  // pass (so the index says Unique(X, 3) for C). X stays open on A.
  void HostAIndexesX() {
    auto id = a_->Create("x", kFileBlocks * kB);
    REQUIRE(id.ok());
    x_id_ = *id;
    auto f = a_->OpenFile("x");
    REQUIRE(f.ok());
    x_ = std::move(*f);
    monitor_a_->AddFile(x_id_, true);
    for (uint64_t b = 0; b < kFileBlocks; b++) {
      WriteBlock(x_.get(), monitor_a_.get(), b, Content(b == kXBlock ? kC : 100 + b));
    }
    FlushLog(a_.get(), monitor_a_.get(), x_id_);
    LendingAccess access;
    access.Lend(x_.get());
    auto st = RunDedupPass(a_.get(), &access, DedupOptions{});
    REQUIRE(st.ok());
    REQUIRE(st->unique_added == kFileBlocks);
    REQUIRE(st->shared_new == 0);
  }

  // B: Y with C at block 5; B's pass runs while A holds X: the index's
  // Unique(X, 3) is in a file B cannot open, so B posts a merge request.
  DedupStats HostBWritesYAndRunsAPass() {
    HostBWritesY();
    return HostBRunsAPass();
  }
  void HostBWritesY() {
    auto id = b_->Create("y", kFileBlocks * kB);
    REQUIRE(id.ok());
    y_id_ = *id;
    {
      auto f = b_->OpenFile("y");
      REQUIRE(f.ok());
      monitor_b_->AddFile(y_id_, true);
      for (uint64_t b = 0; b < kFileBlocks; b++) {
        WriteBlock(f->get(), monitor_b_.get(), b, Content(b == kYBlock ? kC : 200 + b));
      }
    }
    FlushLog(b_.get(), monitor_b_.get(), y_id_);
  }
  DedupStats HostBRunsAPass() {
    // Like `dede dedup` on host B: it opens what it can lock.
    auto access = std::make_unique<VolumeFileAccess>(b_.get());
    auto st = RunDedupPass(b_.get(), access.get(), DedupOptions{});
    access.reset();
    REQUIRE(st.ok());
    return *st;
  }

  Result<MergeApplyStats> HostAApplies() {
    LendingAccess access;
    access.Lend(x_.get());
    return ApplyMergeRequestsForHeldFiles(a_.get(), &access, VerifyMode::kByteCompare);
  }

  std::vector<uint8_t> ExpectedX() const {
    std::vector<uint8_t> out;
    for (uint64_t b = 0; b < kFileBlocks; b++) {
      const std::vector<uint8_t> c = Content(b == kXBlock ? kC : 100 + b);
      out.insert(out.end(), c.begin(), c.end());
    }
    return out;
  }
  std::vector<uint8_t> ExpectedY() const {
    std::vector<uint8_t> out;
    for (uint64_t b = 0; b < kFileBlocks; b++) {
      const std::vector<uint8_t> c = Content(b == kYBlock ? kC : 200 + b);
      out.insert(out.end(), c.begin(), c.end());
    }
    return out;
  }

  std::vector<uint8_t> ReadY() {
    AGoesIdle();
    auto f = b_->OpenFile("y");
    REQUIRE(f.ok());
    return ReadAll(f->get());
  }
  uint32_t YRefs(uint64_t block) {
    AGoesIdle();
    auto f = b_->OpenFile("y");
    REQUIRE(f.ok());
    auto r = (*f)->BlockRefCount(block);
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    return *r;
  }

  // Closes everything on both hosts; B goes away so A can fsck alone.
  void FinishOnA() {
    x_.reset();
    b_.reset();
    RequireFsckClean(a_.get());
  }

  MemDevice dev_;
  std::unique_ptr<Volume> a_, b_;
  std::unique_ptr<WriteMonitor> monitor_a_, monitor_b_;
  FileId x_id_, y_id_;
  std::unique_ptr<File> x_;
};

// One volume, one process: a target file and a source of clones.
class OneHost {
 public:
  explicit OneHost(HashAlgo algo = HashAlgo::kXxh128) : dev_(64ull << 20) {
    REQUIRE(FormatVolume(&dev_, SmallGroups(algo), false).ok());
    vol_ = OpenHost(&dev_, dede::test::TempLocks(), 1);
    algo_ = algo;
    target_ = Make("target", 0);
    source_ = Make("source", 0);
    target_id_ = target_->id();
  }

  std::unique_ptr<File> Make(const std::string& name, uint64_t content_base) {
    return CreateFilled(vol_.get(), name, content_base);
  }

  Fingerprint Fp(uint64_t content) const {
    const std::vector<uint8_t> c = Content(content);
    return ComputeFingerprint(algo_, c.data(), kB);
  }

  // A request for target block b, cloned from source block s.
  MergeRequest Req(uint64_t b, uint64_t s, uint64_t content) const {
    return MergeRequest{b, Fp(content), s};
  }

  MemDevice dev_;
  std::unique_ptr<Volume> vol_;
  HashAlgo algo_;
  std::unique_ptr<File> target_, source_;
  FileId target_id_;
};

}  // namespace

// ---------------------------------------------------------------- names

TEST_CASE("merge request file names round trip and reject others", "[merge]") {
  CHECK(MergeRequestFileName(5) == ".dede-mr-0000000000000005");
  CHECK(MergeRequestFileName(0xabcdef0123456789ull) == ".dede-mr-abcdef0123456789");
  for (uint64_t ino : {uint64_t{1}, uint64_t{77}, ~uint64_t{0}}) {
    auto parsed = ParseMergeRequestFileName(MergeRequestFileName(ino));
    REQUIRE(parsed.has_value());
    CHECK(*parsed == ino);
  }
  for (const char* bad :
       {".dede-mr-", ".dede-mr-5", ".dede-mr-000000000000005", ".dede-mr-00000000000000005",
        ".dede-mr-000000000000000A", ".dede-mr-000000000000000g", ".dede-mr-0000000000000000",
        "dede-mr-0000000000000005", ".dede-mr-0000000000000005-", ".dede-wlog-5-1", "x"}) {
    INFO(bad);
    CHECK_FALSE(ParseMergeRequestFileName(bad).has_value());
  }
}

// ---------------------------------------------------------------- codec

TEST_CASE("merge request groups round trip for both hash algorithms", "[merge]") {
  const HashAlgo algo = GENERATE(HashAlgo::kXxh128, HashAlgo::kSha256);
  const size_t n = GENERATE(size_t{1}, size_t{17}, size_t{kMaxMergeRecordsPerGroup});
  INFO(HashAlgoName(algo) << " with " << n << " records");
  const MergeGroup g = SampleGroup(algo, 12, n);
  std::vector<uint8_t> blk(kB);
  EncodeMergeGroupBlock(g, algo, kUuid, kRequestFile, blk.data());
  CHECK(DecodeU32(blk.data()) == kMagicMergeGroup);
  CHECK(std::memcmp(blk.data(), "DDMR", 4) == 0);
  auto back = Decode(blk, algo, 12);
  REQUIRE(back.ok());
  CHECK(SameGroup(*back, g));
  CHECK(back->blocks() == 1 + n);
  // Canonical: encoding the decoded group gives the same bytes.
  std::vector<uint8_t> again(kB);
  EncodeMergeGroupBlock(*back, algo, kUuid, kRequestFile, again.data());
  CHECK(again == blk);
}

TEST_CASE("merge request groups reject corrupt torn misplaced and foreign bytes", "[merge]") {
  const HashAlgo algo = HashAlgo::kXxh128;
  const MergeGroup g = SampleGroup(algo, 12, 5);
  std::vector<uint8_t> good(kB);
  EncodeMergeGroupBlock(g, algo, kUuid, kRequestFile, good.data());
  REQUIRE(Decode(good, algo, 12).ok());
  auto corrupt = [&](const Result<MergeGroup>& r, const std::string& says) {
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == Status::Code::kCorruption);
    INFO(r.status().message());
    CHECK(r.status().message().find(says) != std::string::npos);
    CHECK(r.status().message().find("test requests group at block") != std::string::npos);
  };

  SECTION("a flipped bit anywhere fails the checksum") {
    for (size_t byte : {size_t{1}, size_t{5}, size_t{20}, size_t{64 + 3}, size_t{64 + 48 * 4 + 20},
                        size_t{kB - 1}}) {
      std::vector<uint8_t> b = good;
      b[byte] ^= 0x10;
      INFO("byte " << byte);
      corrupt(Decode(b, algo, 12), byte < 4 ? "bad magic" : "bad checksum");
    }
  }
  SECTION("a torn write (the block's tail from elsewhere) fails") {
    std::vector<uint8_t> b = good;
    const std::vector<uint8_t> other = Content(77);
    std::memcpy(b.data() + 2048, other.data(), 2048);
    corrupt(Decode(b, algo, 12), "bad checksum");
    std::vector<uint8_t> zero_tail = good;
    std::fill(zero_tail.begin() + 64, zero_tail.end(), 0);
    corrupt(Decode(zero_tail, algo, 12), "bad checksum");
    corrupt(Decode(std::vector<uint8_t>(kB, 0), algo, 12), "bad magic");
  }
  SECTION("a block read from another position fails") {
    corrupt(Decode(good, algo, 13), "bad checksum");
    corrupt(Decode(good, algo, 0), "bad checksum");
    // Even re-sealed for the new position, the group names its own block.
    std::vector<uint8_t> moved = good;
    Reseal(&moved, 13);
    corrupt(Decode(moved, algo, 13), "claims block 12");
  }
  SECTION("a block of another volume or another request file fails") {
    corrupt(Decode(good, algo, 12, kOtherUuid), "bad checksum");
    corrupt(Decode(good, algo, 12, kUuid, FileId{kRequestFile.ino, kRequestFile.generation + 1}),
            "bad checksum");
    corrupt(Decode(good, algo, 12, kUuid, FileId{kRequestFile.ino + 1, kRequestFile.generation}),
            "bad checksum");
  }
  SECTION("a group for another target inode fails") {
    corrupt(Decode(good, algo, 12, kUuid, kRequestFile, kTargetIno + 1), "is for inode 5");
  }
  SECTION("fields out of range fail even with a valid checksum") {
    auto edited = [&](size_t at, int width, uint64_t v) {
      std::vector<uint8_t> b = good;
      if (width == 2) EncodeU16(b.data() + at, uint16_t(v));
      if (width == 4) EncodeU32(b.data() + at, uint32_t(v));
      if (width == 8) EncodeU64(b.data() + at, v);
      Reseal(&b, 12);
      return b;
    };
    corrupt(Decode(edited(4, 2, 0), algo, 12), "format version 0");
    corrupt(Decode(edited(12, 4, 1), algo, 12), "unknown flags");
    corrupt(Decode(edited(16, 2, 2), algo, 12), "hash algorithm 2");
    corrupt(Decode(edited(18, 2, 32), algo, 12), "fingerprint size 32");
    corrupt(Decode(edited(20, 4, 0), algo, 12), "0 records");
    corrupt(Decode(edited(20, 4, kMaxMergeRecordsPerGroup + 1), algo, 12), "85 records");
    corrupt(Decode(edited(20, 4, 4), algo, 12), "past the records is not zero");
    corrupt(Decode(edited(60, 4, 1), algo, 12), "reserved header bytes");
    corrupt(Decode(edited(64 + 48 * 2 + 8, 8, 99), algo, 12), "record 2 names clone block 99");
    corrupt(Decode(edited(64 + 48 * 1, 8, uint64_t{1} << 60), algo, 12),
            "record 1 is past the largest file");
    // xxh128 witnesses take 16 of the field's 32 bytes; the rest is zero.
    corrupt(Decode(edited(64 + 48 * 3 + 16 + 20, 4, 7), algo, 12), "witness padding");
    // A newer minor may use the reserved bytes: accepted.
    std::vector<uint8_t> newer_minor = edited(6, 2, kMergeMinor + 1);
    EncodeU32(newer_minor.data() + 60, 42);
    Reseal(&newer_minor, 12);
    CHECK(Decode(newer_minor, algo, 12).ok());
  }
  SECTION("a newer major version is unsupported not corrupt") {
    std::vector<uint8_t> b = good;
    EncodeU16(b.data() + 4, kMergeMajor + 1);
    Reseal(&b, 12);
    auto r = Decode(b, algo, 12);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == Status::Code::kUnsupported);
  }
  SECTION("a group of another hash algorithm fails on this volume") {
    std::vector<uint8_t> sha(kB);
    EncodeMergeGroupBlock(SampleGroup(HashAlgo::kSha256, 12, 2), HashAlgo::kSha256, kUuid,
                          kRequestFile, sha.data());
    corrupt(Decode(sha, algo, 12), "hash algorithm 2");
  }
}

// ---------------------------------------------------------------- one volume

TEST_CASE("merge requests post and apply on one volume", "[merge]") {
  OneHost h;
  // Source blocks 0..3 hold contents the target's blocks 4..7 get.
  for (uint64_t i = 0; i < 4; i++) {
    const std::vector<uint8_t> c = Content(500 + i);
    REQUIRE(h.source_->Write(i * kB, c.data(), kB).ok());
    REQUIRE(h.target_->Write((4 + i) * kB, c.data(), kB).ok());
  }
  std::vector<uint8_t> expected = ReadAll(h.target_.get());
  const std::vector<uint8_t> source_bytes = ReadAll(h.source_.get());
  REQUIRE(PostMergeRequests(
              h.vol_.get(), h.target_id_,
              {h.Req(4, 0, 500), h.Req(5, 1, 500 + 1), h.Req(6, 2, 500 + 2), h.Req(7, 3, 500 + 3)},
              h.source_.get())
              .ok());
  REQUIRE(h.vol_->Sync().ok());
  REQUIRE(HasRequestFile(h.vol_.get(), h.target_id_.ino));
  // The clones hold references: the source blocks are shared now.
  for (uint64_t i = 0; i < 4; i++) CHECK(Refs(h.source_.get(), i) == 2);

  SECTION("apply shares every verified block and removes the request file") {
    auto st = ApplyMergeRequests(h.vol_.get(), h.target_.get(), VerifyMode::kByteCompare);
    REQUIRE(st.ok());
    CHECK(st->records == 4);
    CHECK(st->applied == 4);
    CHECK(st->already_shared == 0);
    CHECK(st->failed_verification == 0);
    CHECK(st->stale == 0);
    CHECK(st->request_files == 1);
    CHECK_FALSE(HasRequestFile(h.vol_.get(), h.target_id_.ino));
    for (uint64_t i = 0; i < 4; i++) {
      CHECK(Refs(h.source_.get(), i) == 2);  // source and target
      CHECK(Refs(h.target_.get(), 4 + i) == 2);
    }
    CHECK(ReadAll(h.target_.get()) == expected);
    CHECK(ReadAll(h.source_.get()) == source_bytes);

    // Re-applying the same requests (a crash before the clear) is harmless.
    REQUIRE(
        PostMergeRequests(h.vol_.get(), h.target_id_, {h.Req(4, 0, 500)}, h.source_.get()).ok());
    auto again = ApplyMergeRequests(h.vol_.get(), h.target_.get(), VerifyMode::kByteCompare);
    REQUIRE(again.ok());
    CHECK(again->applied == 1);
    CHECK(again->already_shared == 1);
    CHECK(Refs(h.source_.get(), 0) == 2);
    CHECK(ReadAll(h.target_.get()) == expected);
  }
  SECTION("a target block rewritten since fails verification and keeps its data") {
    const std::vector<uint8_t> d = Content(900);
    REQUIRE(h.target_->Write(5 * kB, d.data(), kB).ok());
    std::memcpy(expected.data() + 5 * kB, d.data(), kB);
    auto st = ApplyMergeRequests(h.vol_.get(), h.target_.get(), VerifyMode::kByteCompare);
    REQUIRE(st.ok());
    CHECK(st->applied == 3);
    CHECK(st->failed_verification == 1);
    CHECK(Refs(h.target_.get(), 5) == 1);
    CHECK(Refs(h.source_.get(), 1) == 1);  // the request's clone is gone too
    CHECK(ReadAll(h.target_.get()) == expected);
  }
  SECTION("a witness that does not match fails verification") {
    REQUIRE(
        PostMergeRequests(h.vol_.get(), h.target_id_, {h.Req(0, 0, 4242)}, h.source_.get()).ok());
    auto st = ApplyMergeRequests(h.vol_.get(), h.target_.get(), VerifyMode::kByteCompare);
    REQUIRE(st.ok());
    CHECK(st->applied == 4);
    CHECK(st->failed_verification == 1);
    CHECK(ReadAll(h.target_.get()) == expected);
  }
  SECTION("records of a truncated or dedup=off target are stale") {
    REQUIRE(h.target_->Truncate(6 * kB).ok());
    expected.resize(6 * kB);
    auto st = ApplyMergeRequests(h.vol_.get(), h.target_.get(), VerifyMode::kByteCompare);
    REQUIRE(st.ok());
    CHECK(st->applied == 2);
    CHECK(st->stale == 2);
    CHECK(ReadAll(h.target_.get()) == expected);
    REQUIRE(
        PostMergeRequests(h.vol_.get(), h.target_id_, {h.Req(4, 0, 500)}, h.source_.get()).ok());
    REQUIRE(h.target_->SetDedup(false).ok());
    auto off = ApplyMergeRequests(h.vol_.get(), h.target_.get(), VerifyMode::kByteCompare);
    REQUIRE(off.ok());
    CHECK(off->stale == 1);
    CHECK(off->applied == 0);
  }
  SECTION("a request file open elsewhere makes posts busy and applies wait") {
    auto held = h.vol_->OpenFile(MergeRequestFileName(h.target_id_.ino));
    REQUIRE(held.ok());
    Status busy =
        PostMergeRequests(h.vol_.get(), h.target_id_, {h.Req(4, 0, 500)}, h.source_.get());
    CHECK(busy.code() == Status::Code::kLocked);
    auto st = ApplyMergeRequests(h.vol_.get(), h.target_.get(), VerifyMode::kByteCompare);
    REQUIRE(st.ok());
    CHECK(st->request_files_busy == 1);
    CHECK(st->applied == 0);
    CHECK(Refs(h.target_.get(), 4) == 1);
  }
  SECTION("a file under the request name that is not a request file is left alone") {
    // Not reachable through posts (the name is always the request file's)
    // but a user may create any name: posts refuse it, applies skip it.
    auto other = h.Make("other", 50);
    const FileId other_id = other->id();
    REQUIRE(h.vol_->Create(MergeRequestFileName(other_id.ino), kB).ok());
    Status st = PostMergeRequests(h.vol_.get(), other_id, {h.Req(0, 0, 500)}, h.source_.get());
    CHECK(st.code() == Status::Code::kCorruption);
    auto applied = ApplyMergeRequests(h.vol_.get(), other.get(), VerifyMode::kByteCompare);
    REQUIRE(applied.ok());
    CHECK(applied->records == 0);
    CHECK(h.vol_->Lookup(MergeRequestFileName(other_id.ino)).ok());
  }
  h.target_.reset();
  h.source_.reset();
  RequireFsckClean(h.vol_.get());
}

TEST_CASE("a merge post tells a busy request file from a failed clone, and counts what it posted",
          "[merge]") {
  // The pass retries a post only while the request file is busy (held for
  // a moment by another poster or the applier). A clone that fails after
  // waiting for a group held elsewhere is kLocked too; retrying that held
  // the shard lock for up to 40 such waits and posted the earlier groups
  // again.
  OneHost h;
  const std::string name = MergeRequestFileName(h.target_id_.ino);
  MergePostOutcome out;
  REQUIRE(
      PostMergeRequests(h.vol_.get(), h.target_id_, {h.Req(1, 0, 0)}, h.source_.get(), &out).ok());
  CHECK(out.posted == 1);
  CHECK_FALSE(out.file_busy);
  {
    auto held = h.vol_->OpenFile(name);
    REQUIRE(held.ok());
    Status st =
        PostMergeRequests(h.vol_.get(), h.target_id_, {h.Req(2, 1, 1)}, h.source_.get(), &out);
    CHECK(st.code() == Status::Code::kLocked);
    CHECK(out.file_busy);
    CHECK(out.posted == 0);
  }
  // A clone fails in the second group: the first group stands.
  std::vector<MergeRequest> reqs;
  for (uint64_t i = 0; i < kMaxMergeRecordsPerGroup + 3; i++) reqs.push_back(h.Req(i % 8, 0, 0));
  reqs.back().source_index = 1ull << 30;  // past the source's end
  Status st = PostMergeRequests(h.vol_.get(), h.target_id_, reqs, h.source_.get(), &out);
  CHECK_FALSE(st.ok());
  CHECK_FALSE(out.file_busy);
  CHECK(out.posted == kMaxMergeRecordsPerGroup);
  REQUIRE(h.vol_->Sync().ok());
  auto f = h.vol_->OpenFile(name);
  REQUIRE(f.ok());
  MergeScanStats scan;
  auto groups =
      ReadMergeRequestFile(f->get(), h.algo_, h.vol_->superblock().uuid, h.target_id_.ino, &scan);
  REQUIRE(groups.ok());
  size_t records = 0;
  for (const MergeGroup& g : *groups) records += g.records.size();
  CHECK(records == 1 + kMaxMergeRecordsPerGroup);
}

TEST_CASE("merge request files skip torn and damaged groups", "[merge]") {
  OneHost h;
  for (uint64_t i = 0; i < 3; i++) {
    const std::vector<uint8_t> c = Content(600 + i);
    REQUIRE(h.source_->Write(i * kB, c.data(), kB).ok());
    REQUIRE(h.target_->Write(i * kB, c.data(), kB).ok());
  }
  const std::vector<uint8_t> expected = ReadAll(h.target_.get());
  const std::string name = MergeRequestFileName(h.target_id_.ino);
  // Group 1 at block 0 (header + 1 clone), then two garbage blocks, then
  // group 2 at block 4 (header + 1 clone), then a torn group at block 6
  // whose header names a clone past the end.
  REQUIRE(PostMergeRequests(h.vol_.get(), h.target_id_, {h.Req(0, 0, 600)}, h.source_.get()).ok());
  {
    auto mr = h.vol_->OpenFile(name);
    REQUIRE(mr.ok());
    REQUIRE((*mr)->Truncate(4 * kB).ok());
    const std::vector<uint8_t> junk = Content(4711);
    REQUIRE((*mr)->Write(2 * kB, junk.data(), kB).ok());
    REQUIRE((*mr)->Write(3 * kB, junk.data(), kB).ok());
  }
  REQUIRE(PostMergeRequests(h.vol_.get(), h.target_id_, {h.Req(1, 1, 601)}, h.source_.get()).ok());
  REQUIRE(PostMergeRequests(h.vol_.get(), h.target_id_, {h.Req(2, 2, 602), h.Req(2, 2, 602)},
                            h.source_.get())
              .ok());
  {
    // Tear the last group: cut its second clone off.
    auto mr = h.vol_->OpenFile(name);
    REQUIRE(mr.ok());
    REQUIRE((*mr)->size() == 9 * kB);
    REQUIRE((*mr)->Truncate(8 * kB).ok());
    MergeScanStats scan;
    auto groups = ReadMergeRequestFile(mr->get(), h.algo_, h.vol_->superblock().uuid,
                                       h.target_id_.ino, &scan);
    REQUIRE(groups.ok());
    REQUIRE(groups->size() == 2);
    CHECK((*groups)[0].first_block == 0);
    CHECK((*groups)[1].first_block == 4);
    CHECK(scan.groups == 2);
    CHECK(scan.records == 2);
    CHECK(scan.corrupt_groups == 2);  // the junk run, the torn group's run
    // Read against another target inode: nothing passes.
    MergeScanStats foreign;
    auto none = ReadMergeRequestFile(mr->get(), h.algo_, h.vol_->superblock().uuid,
                                     h.target_id_.ino + 1, &foreign);
    REQUIRE(none.ok());
    CHECK(none->empty());
  }
  auto st = ApplyMergeRequests(h.vol_.get(), h.target_.get(), VerifyMode::kByteCompare);
  REQUIRE(st.ok());
  CHECK(st->applied == 2);
  CHECK(st->corrupt_groups == 2);
  CHECK(Refs(h.target_.get(), 0) == 2);
  CHECK(Refs(h.target_.get(), 1) == 2);
  CHECK(Refs(h.target_.get(), 2) == 1);
  CHECK(ReadAll(h.target_.get()) == expected);
  CHECK_FALSE(HasRequestFile(h.vol_.get(), h.target_id_.ino));
  h.target_.reset();
  h.source_.reset();
  RequireFsckClean(h.vol_.get());
}

// docs/FORMAT.md section 9: a newer major version is refused, not taken
// for damage. A group a newer dede posted was skipped as corrupt and the
// file removed with it once the rest was applied.
TEST_CASE("a merge-request file holding a group of a newer format version is kept", "[merge]") {
  OneHost h;
  for (uint64_t i = 0; i < 2; i++) {
    const std::vector<uint8_t> c = Content(650 + i);
    REQUIRE(h.source_->Write(i * kB, c.data(), kB).ok());
    REQUIRE(h.target_->Write(i * kB, c.data(), kB).ok());
  }
  const std::string name = MergeRequestFileName(h.target_id_.ino);
  REQUIRE(PostMergeRequests(h.vol_.get(), h.target_id_, {h.Req(0, 0, 650)}, h.source_.get()).ok());
  REQUIRE(PostMergeRequests(h.vol_.get(), h.target_id_, {h.Req(1, 1, 651)}, h.source_.get()).ok());
  uint64_t size = 0;
  {
    // The second group (block 2) as a newer dede would post it.
    auto mr = h.vol_->OpenFile(name);
    REQUIRE(mr.ok());
    std::vector<uint8_t> blk(kB);
    REQUIRE((*mr)->Read(2 * kB, blk.data(), kB).ok());
    EncodeU16(blk.data() + 4, kMergeMajor + 1);
    EncodeU32(blk.data() + 8,
              FileBlockCrc(blk.data(), 8, h.vol_->superblock().uuid, (*mr)->id(), 2));
    REQUIRE((*mr)->Write(2 * kB, blk.data(), kB).ok());
    size = (*mr)->size();
    MergeScanStats scan;
    auto groups = ReadMergeRequestFile(mr->get(), h.algo_, h.vol_->superblock().uuid,
                                       h.target_id_.ino, &scan);
    REQUIRE(groups.ok());
    CHECK(groups->size() == 1);
    CHECK(scan.newer_groups == 1);
    CHECK(scan.corrupt_groups == 0);
  }
  auto st = ApplyMergeRequests(h.vol_.get(), h.target_.get(), VerifyMode::kByteCompare);
  REQUIRE(st.ok());
  CHECK(st->applied == 1);
  CHECK(st->newer_files_kept == 1);
  CHECK(st->corrupt_groups == 0);
  CHECK(Refs(h.target_.get(), 0) == 3);  // source, target, the kept file's clone
  REQUIRE(HasRequestFile(h.vol_.get(), h.target_id_.ino));
  auto mr = h.vol_->OpenFile(name);
  REQUIRE(mr.ok());
  CHECK((*mr)->size() == size);
}

// A damaged inode can claim any size: the reader stepped through every
// block of it, one read each (2^28 for a terabyte), holes included.
TEST_CASE("a merge-request file whose size runs far past its groups is read in bounded time",
          "[merge]") {
  constexpr uint64_t kSparse = uint64_t{1} << 40;  // 1 TiB, a hole past the group
  OneHost h;
  const std::vector<uint8_t> c = Content(660);
  REQUIRE(h.source_->Write(0, c.data(), kB).ok());
  REQUIRE(h.target_->Write(0, c.data(), kB).ok());
  REQUIRE(PostMergeRequests(h.vol_.get(), h.target_id_, {h.Req(0, 0, 660)}, h.source_.get()).ok());
  const std::string name = MergeRequestFileName(h.target_id_.ino);
  {
    auto mr = h.vol_->OpenFile(name);
    REQUIRE(mr.ok());
    REQUIRE((*mr)->Truncate(kSparse).ok());
    const auto t0 = std::chrono::steady_clock::now();
    MergeScanStats scan;
    auto groups = ReadMergeRequestFile(mr->get(), h.algo_, h.vol_->superblock().uuid,
                                       h.target_id_.ino, &scan);
    REQUIRE(groups.ok());
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
    CHECK(groups->size() == 1);
    CHECK(scan.corrupt_groups == 1);
    CHECK(scan.gave_up);
  }
  auto st = ApplyMergeRequests(h.vol_.get(), h.target_.get(), VerifyMode::kByteCompare);
  REQUIRE(st.ok());
  CHECK(st->applied == 1);
  CHECK_FALSE(HasRequestFile(h.vol_.get(), h.target_id_.ino));
}

TEST_CASE("merge requests apply with a SHA-256 witness", "[merge]") {
  OneHost h(HashAlgo::kSha256);
  const std::vector<uint8_t> c = Content(700);
  REQUIRE(h.source_->Write(0, c.data(), kB).ok());
  REQUIRE(h.target_->Write(2 * kB, c.data(), kB).ok());
  REQUIRE(h.target_->Write(3 * kB, c.data(), kB).ok());
  const std::vector<uint8_t> expected = ReadAll(h.target_.get());
  REQUIRE(PostMergeRequests(h.vol_.get(), h.target_id_,
                            {h.Req(2, 0, 700), MergeRequest{3, h.Fp(701), 0}}, h.source_.get())
              .ok());
  auto st = ApplyMergeRequests(h.vol_.get(), h.target_.get(), VerifyMode::kHashWitness);
  REQUIRE(st.ok());
  CHECK(st->applied == 1);
  CHECK(st->failed_verification == 1);  // the volume checked the (wrong) witness
  CHECK(Refs(h.target_.get(), 2) == 2);
  CHECK(Refs(h.target_.get(), 3) == 1);
  CHECK(ReadAll(h.target_.get()) == expected);
}

// ---------------------------------------------------------------- two hosts

TEST_CASE("a pass posts a merge request for a file another host holds and the holder applies it",
          "[merge][dedup]") {
  TwoHosts t;
  t.HostAIndexesX();
  const DedupStats b = t.HostBWritesYAndRunsAPass();
  CHECK(b.merge_requests_posted == 1);
  CHECK(b.merge_posts_busy == 0);
  CHECK(b.shared_new == 1);  // Y:5 became the arena block
  // Nothing given up yet: X:3 is A's to release (counted by A's apply).
  CHECK(b.indexed_shared == 0);
  CHECK(b.blocks_released() == 0);
  CHECK(b.busy_targets == 0);
  CHECK(b.files_busy == 1);  // X's log: X is A's
  REQUIRE(HasRequestFile(t.b_.get(), t.x_id_.ino));
  // Before A applies: X:3 and Y:5 each hold C.
  CHECK(Refs(t.x_.get(), kXBlock) == 1);
  CHECK(t.YRefs(kYBlock) == 3);  // Y, the arena, the request's clone
  // 16 blocks of X and Y, and the request's header block.
  CHECK(PhysicalDataBlocks(t.a_.get()) == 2 * kFileBlocks + 1);

  SECTION("the holder applies it and dedup is exact") {
    auto st = t.HostAApplies();
    REQUIRE(st.ok());
    CHECK(st->applied == 1);
    CHECK(st->already_shared == 0);
    CHECK(st->failed_verification == 0);
    CHECK(st->stale == 0);
    CHECK(st->request_files == 1);
    CHECK_FALSE(HasRequestFile(t.a_.get(), t.x_id_.ino));
    CHECK(Refs(t.x_.get(), kXBlock) == 3);  // X, Y, the arena
    CHECK(t.YRefs(kYBlock) == 3);
    // Exact: 15 distinct contents, 15 physical blocks.
    CHECK(PhysicalDataBlocks(t.a_.get()) == 2 * kFileBlocks - 1);
    CHECK(ReadAll(t.x_.get()) == t.ExpectedX());
    CHECK(t.ReadY() == t.ExpectedY());
    // A's next pass finds nothing left to apply.
    LendingAccess access;
    access.Lend(t.x_.get());
    auto pass = RunDedupPass(t.a_.get(), &access, DedupOptions{});
    REQUIRE(pass.ok());
    CHECK(pass->merge_requests_applied == 0);
    t.FinishOnA();
  }
  SECTION("A's next pass applies it too") {
    LendingAccess access;
    access.Lend(t.x_.get());
    auto pass = RunDedupPass(t.a_.get(), &access, DedupOptions{});
    REQUIRE(pass.ok());
    CHECK(pass->merge_requests_applied == 1);
    CHECK(pass->merge_requests_failed_verification == 0);
    CHECK(pass->blocks_released() == 1);  // X:3
    CHECK(PhysicalDataBlocks(t.a_.get()) == 2 * kFileBlocks - 1);
    CHECK(ReadAll(t.x_.get()) == t.ExpectedX());
    CHECK(t.ReadY() == t.ExpectedY());
    t.FinishOnA();
  }
  SECTION("a block the holder rewrote fails verification and stays intact") {
    std::vector<uint8_t> expected = t.ExpectedX();
    const std::vector<uint8_t> d = Content(4242);
    REQUIRE(t.x_->Write(kXBlock * kB, d.data(), kB).ok());
    std::memcpy(expected.data() + kXBlock * kB, d.data(), kB);
    auto st = t.HostAApplies();
    REQUIRE(st.ok());
    CHECK(st->applied == 0);
    CHECK(st->failed_verification == 1);
    CHECK_FALSE(HasRequestFile(t.a_.get(), t.x_id_.ino));
    CHECK(Refs(t.x_.get(), kXBlock) == 1);
    CHECK(t.YRefs(kYBlock) == 2);  // Y and the arena
    CHECK(ReadAll(t.x_.get()) == expected);
    CHECK(t.ReadY() == t.ExpectedY());
    t.FinishOnA();
  }
  SECTION("a request for a recreated file is stale") {
    const FileId old_id = t.x_id_;
    t.x_.reset();
    REQUIRE(t.a_->Remove("x").ok());
    REQUIRE(t.a_->Remove(WriteLogName(old_id)).ok());
    auto id = t.a_->Create("x", kFileBlocks * kB);
    REQUIRE(id.ok());
    // The same inode again (the lowest free one), a new generation: the
    // request file, named by inode, is found, and its records are stale.
    REQUIRE(id->ino == old_id.ino);
    REQUIRE(id->generation != old_id.generation);
    auto f = t.a_->OpenFile("x");
    REQUIRE(f.ok());
    t.x_ = std::move(*f);
    const std::vector<uint8_t> c = Content(kC);
    REQUIRE(t.x_->Write(kXBlock * kB, c.data(), kB).ok());
    REQUIRE(HasRequestFile(t.a_.get(), old_id.ino));
    auto st = t.HostAApplies();
    REQUIRE(st.ok());
    CHECK(st->records == 1);
    CHECK(st->stale == 1);
    CHECK(st->applied == 0);
    CHECK_FALSE(HasRequestFile(t.a_.get(), old_id.ino));
    CHECK(Refs(t.x_.get(), kXBlock) == 1);
    CHECK(t.YRefs(kYBlock) == 2);
    t.FinishOnA();
  }
  SECTION("the request file of a deleted file is removed by the next pass") {
    const FileId old_id = t.x_id_;
    t.x_.reset();
    REQUIRE(t.a_->Remove("x").ok());
    REQUIRE(t.a_->Remove(WriteLogName(old_id)).ok());
    LendingAccess access;
    auto pass = RunDedupPass(t.a_.get(), &access, DedupOptions{});
    REQUIRE(pass.ok());
    CHECK(pass->merge_files_removed == 1);
    CHECK_FALSE(HasRequestFile(t.a_.get(), old_id.ino));
    CHECK(t.YRefs(kYBlock) == 2);  // the request's reference went with it
    CHECK(t.ReadY() == t.ExpectedY());
    t.FinishOnA();
  }
  SECTION("a busy request file makes the post busy not fatal, and the revisit posts it") {
    // Host A has X's request file open (applying, say) when B posts again,
    // and keeps it past the post's ~2 s of retries.
    auto applied = t.HostAApplies();
    REQUIRE(applied.ok());
    REQUIRE(t.a_->Create(MergeRequestFileName(t.x_id_.ino), 0, FileKind::kMergeRequest, t.x_id_.ino)
                .ok());
    auto held = t.a_->OpenFile(MergeRequestFileName(t.x_id_.ino));
    REQUIRE(held.ok());
    // B's new file Z repeats X's block 0, which the index has as
    // Unique(X, 0): another unique-to-shared transition with X held by A.
    t.AGoesIdle();
    auto z = t.b_->Create("z", kFileBlocks * kB);
    REQUIRE(z.ok());
    {
      auto f = t.b_->OpenFile("z");
      REQUIRE(f.ok());
      t.monitor_b_->AddFile(*z, true);
      WriteBlock(f->get(), t.monitor_b_.get(), 1, Content(100 + 0));  // = X's block 0
    }
    FlushLog(t.b_.get(), t.monitor_b_.get(), *z);
    auto access = std::make_unique<VolumeFileAccess>(t.b_.get());
    DedupOptions o;
    // A is done applying by the time B's pass pauses to revisit the shard
    // whose records were held back. (Called on B's pass thread while the
    // test's thread waits in RunDedupPass: A's volume is not used
    // concurrently.)
    int revisits = 0;
    o.progress = [&](const std::string& s) {
      if (s.rfind("revisiting", 0) != 0) return;
      revisits++;
      held->reset();
    };
    auto pass = RunDedupPass(t.b_.get(), access.get(), o);
    access.reset();
    REQUIRE(pass.ok());
    CHECK(pass->merge_posts_busy == 1);
    CHECK(pass->shared_new == 1);  // the arena block is made all the same
    // Held back, not dropped: the request was parked in the shard's
    // pending file and posted by the pass's revisit (without parking: 0
    // posted, and X:0 never shared).
    CHECK(pass->records_parked_busy == 1);
    CHECK(revisits == 1);
    CHECK(pass->merge_requests_posted == 1);
    REQUIRE(HasRequestFile(t.a_.get(), t.x_id_.ino));
    auto st = t.HostAApplies();
    REQUIRE(st.ok());
    CHECK(st->applied == 1);
    CHECK(st->failed_verification == 0);
    CHECK(Refs(t.x_.get(), 0) == 3);  // X, Z and the arena
    CHECK(ReadAll(t.x_.get()) == t.ExpectedX());
    t.FinishOnA();
  }
}

TEST_CASE("a parked record of a file another host holds gets a merge request when its entry is shared",
          "[merge][dedup]") {
  // A record parked for a file its host holds (a post held back, a share
  // held back by a busy group before the holder took the file) was skipped
  // by every later pass that could not open the file: the holder's own
  // passes never see it again, so the block stayed unshared for good. It
  // gets a merge request like the indexed block G:c does, whichever of the
  // group's records comes first.
  TwoHosts t;
  t.HostAIndexesX();  // Unique(X, 3) for C
  // A group's records sort by the pass's file numbers, given in the order
  // it meets the files: the write logs first (B walks Q's, finds Q held
  // and leaves it), then the files pending records name. Q's record comes
  // before Y's when Q's log is older (the entry is still Unique when it is
  // met), after it otherwise (met once Y's block is the anchor).
  const bool y_first = GENERATE(false, true);
  INFO((y_first ? "the held file's record comes after the anchor"
                : "the held file's record comes first"));
  if (y_first) t.HostBWritesY();
  // A also holds Q, whose block 2 holds C; a record of it waits in the
  // shard's pending file (A's pass has not run since Q was written: Q's
  // own records wait in its log, which only A may take).
  auto qid = t.a_->Create("q", kFileBlocks * kB);
  REQUIRE(qid.ok());
  auto q = t.a_->OpenFile("q");
  REQUIRE(q.ok());
  t.monitor_a_->AddFile(*qid, true);
  for (uint64_t b = 0; b < kFileBlocks; b++) {
    WriteBlock(q->get(), t.monitor_a_.get(), b, Content(b == 2 ? kC : 300 + b));
  }
  FlushLog(t.a_.get(), t.monitor_a_.get(), *qid);
  const std::vector<uint8_t> expected_q = ReadAll(q->get());
  test::ParkPendingRecord(t.a_.get(), Content(kC).data(), *qid, 2);
  t.AGoesIdle();
  if (!y_first) t.HostBWritesY();
  REQUIRE((t.y_id_.ino < qid->ino) == y_first);
  const DedupStats b = t.HostBRunsAPass();
  CHECK(b.shared_new == 1);  // Y:5 became the arena block
  // X:3 (the indexed block) and Q:2 (the parked record); without the
  // request for Q:2 it is counted in busy_targets and lost.
  CHECK(b.merge_requests_posted == 2);
  CHECK(b.busy_targets == 0);
  CHECK(b.merge_posts_busy == 0);
  REQUIRE(HasRequestFile(t.b_.get(), qid->ino));

  LendingAccess access;
  access.Lend(t.x_.get());
  access.Lend(q->get());
  auto st = ApplyMergeRequestsForHeldFiles(t.a_.get(), &access, VerifyMode::kByteCompare);
  REQUIRE(st.ok());
  CHECK(st->applied == 2);
  CHECK(st->failed_verification == 0);
  CHECK(Refs(q->get(), 2) == 4);  // Q, X, Y and the arena
  CHECK(Refs(t.x_.get(), kXBlock) == 4);
  CHECK(ReadAll(q->get()) == expected_q);
  CHECK(ReadAll(t.x_.get()) == t.ExpectedX());
  CHECK(t.ReadY() == t.ExpectedY());
  q->reset();
  t.FinishOnA();
}

// ---------------------------------------------------------------- crashes

namespace {

using DyingProcessDevice = test::ProcessDevice;  // tests/process_device.h

}  // namespace

TEST_CASE("a crash at any instant of a post or an apply loses no data", "[merge]") {
  // The scene: target blocks 4..7 and source blocks 0..3 hold the same
  // contents; synced. Each trial: a new process posts requests for the
  // target (clones of the source blocks) and applies them, and dies (or
  // gets EIO) after n device writes; the device crashes keeping none, half
  // or all of the unflushed writes; a new process must find fsck clean, the
  // bytes unchanged, and an apply that then succeeds and leaves no request.
  MemDevice base(64ull << 20);
  REQUIRE(FormatVolume(&base, SmallGroups(), false).ok());
  std::vector<uint8_t> target_bytes, source_bytes;
  {
    auto v = OpenHost(&base, dede::test::TempLocks(), 1);
    for (const char* name : {"target", "source"}) {
      REQUIRE(v->Create(name, kFileBlocks * kB).ok());
      auto f = v->OpenFile(name);
      REQUIRE(f.ok());
      for (uint64_t b = 0; b < kFileBlocks; b++) {
        const bool is_target = std::string(name) == "target";
        const uint64_t id =
            is_target ? (b >= 4 ? 800 + b - 4 : 10 + b) : (b < 4 ? 800 + b : 20 + b);
        WriteBlock(f->get(), nullptr, b, Content(id));
      }
      if (std::string(name) == "target") {
        target_bytes = ReadAll(f->get());
      } else {
        source_bytes = ReadAll(f->get());
      }
    }
    REQUIRE(v->Sync().ok());
  }
  const std::vector<uint8_t> snapshot = base.bytes();
  const HashAlgo algo = HashAlgo::kXxh128;
  auto requests = [&]() {
    std::vector<MergeRequest> out;
    for (uint64_t i = 0; i < 4; i++) {
      const std::vector<uint8_t> c = Content(800 + i);
      out.push_back(MergeRequest{4 + i, ComputeFingerprint(algo, c.data(), kB), i});
    }
    return out;
  };
  // Post then apply, in a process on `dev`; returns the first failure.
  auto post_and_apply = [&](BlockDevice* dev) -> Status {
    auto v = Volume::Open(dev, [] {
      OpenOptions oo;
      oo.locks = dede::test::TempLocks();
      oo.host_id = 1;
      return oo;
    }());
    if (!v.ok()) return v.status();
    auto target = (*v)->OpenFile("target");
    auto source = (*v)->OpenFile("source");
    if (!target.ok() || !source.ok()) return Status::IoError("open");
    RETURN_IF_ERROR(PostMergeRequests(v->get(), (*target)->id(), requests(), source->get()));
    RETURN_IF_ERROR((*v)->Sync());
    Result<MergeApplyStats> st =
        ApplyMergeRequests(v->get(), target->get(), VerifyMode::kByteCompare);
    return st.ok() ? Status::Ok() : st.status();
  };

  // Trial 0 measures the writes of an undisturbed run.
  uint64_t total_writes = 0;
  {
    base.bytes() = snapshot;
    DyingProcessDevice pdev(&base);
    REQUIRE(post_and_apply(&pdev).ok());
    total_writes = pdev.writes();
    REQUIRE(total_writes > 10);
  }
  std::mt19937_64 rng(5);
  uint64_t crashed_with_requests = 0;
  for (uint64_t n = 0; n <= total_writes; n++) {
    for (int mode = 0; mode < 2; mode++) {
      const double keep = std::vector<double>{0.0, 0.5, 1.0}[(n + uint64_t(mode)) % 3];
      INFO("crash after " << n << " of " << total_writes << " writes, "
                          << (mode == 0 ? "silent death" : "EIO") << ", keep " << keep);
      base.bytes() = snapshot;
      FaultDevice fdev(&base);
      {
        DyingProcessDevice pdev(&fdev);
        if (mode == 0) pdev.DieAfter(n);
        if (mode == 1) fdev.FailWritesAfter(n, EIO);
        Status st = post_and_apply(&pdev);
        if (mode == 0) REQUIRE(st.ok());  // a dead process never notices
        pdev.DieAfter(0);                 // whatever it does on the way out is lost
      }
      fdev.Crash(rng, keep);
      fdev.ClearFault();
      // Recovery: a new process.
      auto v = OpenHost(&fdev, dede::test::TempLocks(), 1);
      RequireFsckClean(v.get());
      auto target = v->OpenFile("target");
      auto source = v->OpenFile("source");
      REQUIRE(target.ok());
      REQUIRE(source.ok());
      crashed_with_requests += HasRequestFile(v.get(), (*target)->id().ino);
      REQUIRE(ReadAll(target->get()) == target_bytes);
      REQUIRE(ReadAll(source->get()) == source_bytes);
      auto st = ApplyMergeRequests(v.get(), target->get(), VerifyMode::kByteCompare);
      REQUIRE(st.ok());
      CHECK(st->failed_verification == 0);
      CHECK(st->stale == 0);
      REQUIRE(ReadAll(target->get()) == target_bytes);
      REQUIRE(ReadAll(source->get()) == source_bytes);
      CHECK_FALSE(HasRequestFile(v.get(), (*target)->id().ino));
      target->reset();
      source->reset();
      RequireFsckClean(v.get());
    }
  }
  // Some crashes must have left requests behind for the recovery to apply.
  CHECK(crashed_with_requests > 0);
}

// DeDe's hosts apply the requests for their files "periodically"; a pass
// also does at its end, so a request another host posted while the pass
// held the target waits for nothing (before, it waited for the holder's
// next pass, which may be a window away).
TEST_CASE("a merge request posted while the holder's pass runs is applied when that pass ends",
          "[merge][dedup]") {
  TwoHosts t;
  t.HostAIndexesX();
  // A's next pass holds X; while it gathers (no shard lock held), B
  // writes Y and passes: Unique(X, 3) is in a file A holds, so B posts.
  LendingAccess access;
  access.Lend(t.x_.get());
  DedupOptions o;
  std::optional<DedupStats> b;
  o.progress = [&](const std::string& step) {
    if (step == "gathering write logs" && !b) {
      t.AGoesIdle();
      b = t.HostBWritesYAndRunsAPass();
    }
  };
  Result<DedupStats> a = RunDedupPass(t.a_.get(), &access, o);
  INFO(a.status().ToString());
  REQUIRE(a.ok());
  REQUIRE(b.has_value());
  CHECK(b->merge_requests_posted == 1);
  CHECK(a->merge_requests_applied == 1);
  CHECK(a->merge_requests_failed_verification == 0);
  CHECK_FALSE(HasRequestFile(t.a_.get(), t.x_id_.ino));
  CHECK(Refs(t.x_.get(), kXBlock) == 3);  // X, Y, the arena
  CHECK(PhysicalDataBlocks(t.a_.get()) == 2 * kFileBlocks - 1);
  CHECK(ReadAll(t.x_.get()) == t.ExpectedX());
  CHECK(t.ReadY() == t.ExpectedY());
  t.FinishOnA();
}

namespace {

// Forwards to another lock manager and runs a hook, once, at a chosen
// moment: right after a lock is released (when another host could take
// it), or right before one is acquired (after whatever came before).
class HookedLocks : public test::ForwardingLocks {
 public:
  using Match = std::function<bool(LockId)>;
  using ForwardingLocks::ForwardingLocks;
  void AfterRelease(Match match, std::function<void()> hook) {
    release_match_ = std::move(match);
    release_hook_ = std::move(hook);
  }
  void BeforeAcquire(Match match, std::function<void()> hook) {
    acquire_match_ = std::move(match);
    acquire_hook_ = std::move(hook);
  }
  Status Acquire(LockId id, LockMode mode, bool wait) override {
    RunOnce(id, &acquire_match_, &acquire_hook_);
    return base()->Acquire(id, mode, wait);
  }
  Status Release(LockId id) override {
    Status st = base()->Release(id);
    RunOnce(id, &release_match_, &release_hook_);
    return st;
  }

 private:
  static void RunOnce(LockId id, Match* match, std::function<void()>* hook) {
    if (!*hook || !(*match)(id)) return;
    std::function<void()> run = std::move(*hook);
    *hook = nullptr;
    run();
  }
  Match release_match_, acquire_match_;
  std::function<void()> release_hook_, acquire_hook_;
};

// Hosts A and B on one device, like TwoHosts; one of them locks through
// HookedLocks. Each has a file ("x" on A, "y" on B) filled with
// Content(1 + b), held open.
struct HookedHosts {
  enum class Hooked { kA, kB };
  explicit HookedHosts(Hooked which) : dev(96ull << 20) {
    REQUIRE(FormatVolume(&dev, SmallGroups(), false).ok());
    std::shared_ptr<LockManager> la, lb;
    LockPair(&la, &lb);
    hooked = std::make_shared<HookedLocks>(which == Hooked::kA ? la : lb);
    a = OpenHost(&dev, which == Hooked::kA ? hooked : la, 1);
    b = OpenHost(&dev, which == Hooked::kB ? hooked : lb, 2);
    x = CreateFilled(a.get(), "x", 1);
    y = CreateFilled(b.get(), "y", 1);
  }
  MemDevice dev;
  std::shared_ptr<HookedLocks> hooked;
  std::unique_ptr<Volume> a, b;
  std::unique_ptr<File> x, y;
};

}  // namespace

TEST_CASE("a post that lands the moment an apply lets go of the request file is not lost",
          "[merge]") {
  // The race the three-host integration test once lost 60 requests to:
  // the holder (A) applied and emptied the request file, closed it, and
  // removed it by name; a poster (B) that opened, appended and closed it
  // in between saw its groups removed with the file. A now removes the
  // file before it lets go of it, so B's post finds no file and creates a
  // fresh one, which A's next apply takes.
  // X on A (held open, a running VM) and Y on B with the same contents.
  HookedHosts h(HookedHosts::Hooked::kA);
  Volume* a = h.a.get();
  Volume* b = h.b.get();
  HookedLocks* hooked = h.hooked.get();
  std::unique_ptr<File>& x = h.x;
  const FileId x_id = x->id();
  const Fingerprint fp1 = ComputeFingerprint(HashAlgo::kXxh128, Content(2).data(), kB);
  const Fingerprint fp2 = ComputeFingerprint(HashAlgo::kXxh128, Content(3).data(), kB);
  // B posts from Y, then closes Y (handing back its allocation groups, as
  // an idle dedupd does at its flush points).
  auto post = [&](uint64_t blk, const Fingerprint& fp) {
    auto y = b->OpenFile("y");
    REQUIRE(y.ok());
    Status st = PostMergeRequests(b, x_id, {MergeRequest{blk, fp, blk}}, y->get());
    INFO(st.ToString());
    REQUIRE(st.ok());
  };
  h.y.reset();
  post(1, fp1);
  auto request_file = a->Lookup(MergeRequestFileName(x_id.ino));
  REQUIRE(request_file.ok());

  bool posted_in_between = false;
  const LockId request_lock{LockKind::kInode, request_file->id.ino};
  hooked->AfterRelease([&](LockId id) { return id == request_lock; }, [&] {
    post(2, fp2);
    posted_in_between = true;
  });
  auto first = ApplyMergeRequests(a, x.get(), VerifyMode::kByteCompare);
  INFO(first.status().ToString());
  REQUIRE(first.ok());
  REQUIRE(posted_in_between);
  CHECK(first->applied == 1);
  CHECK(first->request_files == 1);
  CHECK(Refs(x.get(), 1) == 2);
  CHECK(Refs(x.get(), 2) == 1);  // B's request for it waits in a fresh file

  // B's post survived: the next apply shares block 2 as well.
  CHECK(HasRequestFile(a, x_id.ino));
  auto second = ApplyMergeRequests(a, x.get(), VerifyMode::kByteCompare);
  INFO(second.status().ToString());
  REQUIRE(second.ok());
  CHECK(second->applied == 1);
  CHECK(second->already_shared == 0);
  CHECK_FALSE(HasRequestFile(a, x_id.ino));
  CHECK(Refs(x.get(), 2) == 2);  // X and Y
  x.reset();
  h.b.reset();
  RequireFsckClean(a);
}

TEST_CASE("a post whose new request file an apply removes before the post opens it creates another",
          "[merge]") {
  // Host B creates X's request file and, before B opens it, A's timer
  // applies X's requests: it finds the file empty and removes it. B
  // creates the file again instead of failing its pass with kNotFound.
  HookedHosts h(HookedHosts::Hooked::kB);
  Volume* a = h.a.get();
  Volume* b = h.b.get();
  HookedLocks* hooked = h.hooked.get();
  std::unique_ptr<File>& x = h.x;
  std::unique_ptr<File>& y = h.y;
  const uint64_t x_ino = x->id().ino, y_ino = y->id().ino;

  int removed_under_b = 0;
  // The second time B takes an inode lock other than Y's: Create takes the
  // new request file's once (and lets go), the OpenFile after it again.
  std::map<uint64_t, int> inode_takes;
  hooked->BeforeAcquire(
      [&](LockId id) {
        return id.kind == LockKind::kInode && id.id != y_ino && ++inode_takes[id.id] == 2;
      },
      [&] {
        REQUIRE(HasRequestFile(a, x_ino));
        auto applied = ApplyMergeRequests(a, x.get(), VerifyMode::kByteCompare);
        REQUIRE(applied.ok());
        removed_under_b = static_cast<int>(applied->request_files);
      });
  const Fingerprint fp = ComputeFingerprint(HashAlgo::kXxh128, Content(4).data(), kB);
  Status st = PostMergeRequests(b, x->id(), {MergeRequest{3, fp, 3}}, y.get());
  INFO(st.ToString());
  REQUIRE(st.ok());
  REQUIRE(removed_under_b == 1);  // the moment happened, and A removed B's new file

  auto applied = ApplyMergeRequests(a, x.get(), VerifyMode::kByteCompare);
  REQUIRE(applied.ok());
  CHECK(applied->applied == 1);
  CHECK(Refs(x.get(), 3) == 2);  // X and Y
  CHECK_FALSE(HasRequestFile(a, x_ino));
  x.reset();
  y.reset();
  h.b.reset();
  RequireFsckClean(a);
}
