// Tests for the write log (kmod/writemon/write_log.h): frame round trips,
// every damaged or misplaced frame is refused, versions, the reader's
// skipping of torn and corrupt frames, splitting of big batches, and
// AppendToWriteLog + ReplayWriteLog on an in-memory volume against a model.
#include "kmod/writemon/write_log.h"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "agent/dedup_pass.h"
#include "agent/log_flusher.h"
#include "tests/temp_locks.h"
#include "util/coding.h"
#include "util/crc32c.h"
#include "volume/mem_device.h"

using namespace dede;
using dede::test::TempLocks;

namespace {

constexpr uint64_t kB = kBlockSize;
constexpr uint64_t kMs = 1'000'000;
constexpr uint64_t kT0 = 1'700'000'000'000'000'000ull;
constexpr Uuid kUuid = {0x10, 0x32, 0x54, 0x76, 0x98, 0xba, 0xdc, 0xfe,
                        0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef};
constexpr Uuid kOtherUuid = {0x10, 0x32, 0x54, 0x76, 0x98, 0xba, 0xdc, 0xfe,
                             0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xee};
const FileId kOwner{5, 2};

bool Contains(const std::string& s, const std::string& sub) {
  return s.find(sub) != std::string::npos;
}

Fingerprint FpOf(HashAlgo algo, uint64_t seed) {
  uint8_t blk[64];
  for (size_t i = 0; i < sizeof blk; i++) blk[i] = static_cast<uint8_t>(seed * 131 + i);
  return ComputeFingerprint(algo, blk, sizeof blk);
}

// Times on whole milliseconds after the first one survive the encoding
// exactly (they are stored as ms after the frame's first time).
MonitorBatch SampleBatch(HashAlgo algo, FileId owner, size_t records, size_t ranges,
                         uint64_t block_base = 0) {
  MonitorBatch b;
  b.file = owner;
  uint64_t block = block_base;
  uint64_t t = kT0;
  for (size_t i = 0; i < ranges; i++) {
    b.invalidated.push_back(InvalidRange{block, 1 + i % 7, t + (i % 5) * kMs});
    block += 1 + i % 7 + 1;
  }
  for (size_t i = 0; i < records; i++) {
    b.records.push_back(BlockRecord{block, t + (i % 11) * kMs, FpOf(algo, i)});
    block += 1 + i % 3;
  }
  b.first_ns = kT0;
  b.last_ns = kT0 + 10 * kMs;
  return b;
}

bool SameFrame(const WriteLogFrame& f, const MonitorBatch& b) {
  if (f.records.size() != b.records.size() || f.invalidated.size() != b.invalidated.size()) {
    return false;
  }
  for (size_t i = 0; i < b.records.size(); i++) {
    if (f.records[i].block != b.records[i].block || f.records[i].time_ns != b.records[i].time_ns ||
        !(f.records[i].fp == b.records[i].fp)) {
      return false;
    }
  }
  for (size_t i = 0; i < b.invalidated.size(); i++) {
    if (f.invalidated[i].first != b.invalidated[i].first ||
        f.invalidated[i].count != b.invalidated[i].count ||
        f.invalidated[i].time_ns != b.invalidated[i].time_ns) {
      return false;
    }
  }
  return f.dropped_records == b.dropped_records && f.dropped_since_ns == b.dropped_since_ns;
}

// Recomputes a frame's header crc as docs/FORMAT.md defines it.
void ResealHeader(uint8_t* frame, const Uuid& uuid, FileId owner, uint64_t log_offset) {
  uint8_t prefix[40];
  std::memcpy(prefix, uuid.data(), 16);
  EncodeU64(prefix + 16, owner.ino);
  EncodeU64(prefix + 24, owner.generation);
  EncodeU64(prefix + 32, log_offset);
  EncodeU32(frame + 8, 0);
  uint32_t crc = Crc32cExtend(0, prefix, sizeof prefix);
  crc = Crc32cExtend(crc, frame, kWriteLogHeaderSize);
  EncodeU32(frame + 8, crc);
}

struct MemVolume {
  explicit MemVolume(HashAlgo algo = HashAlgo::kXxh128, uint64_t bytes = 64 << 20) : dev(bytes) {
    FormatOptions fo;
    fo.hash_algo = algo;
    REQUIRE(FormatVolume(&dev, fo, false).ok());
    OpenOptions oo;
    oo.locks = TempLocks();
    auto v = Volume::Open(&dev, oo);
    REQUIRE(v.ok());
    vol = std::move(v.value());
  }
  MemDevice dev;
  std::unique_ptr<Volume> vol;
};

std::vector<WriteLogFrame> ReadAll(File* log, HashAlgo algo, const Uuid& uuid, FileId owner,
                                   WriteLogScanStats* stats) {
  WriteLogReader r(log, algo, uuid, owner);
  std::vector<WriteLogFrame> out;
  WriteLogFrame f;
  while (true) {
    auto more = r.Next(&f);
    REQUIRE(more.ok());
    if (!*more) break;
    out.push_back(f);
  }
  *stats = r.stats();
  return out;
}

// A volume with one file "vm" (8 MiB) whose log the test writes.
struct VmLog {
  explicit VmLog(HashAlgo a = HashAlgo::kXxh128) : algo(a), mv(a) {
    vol = mv.vol.get();
    auto created = vol->Create("vm", 8 << 20);
    REQUIRE(created.ok());
    owner = *created;
    uuid = vol->superblock().uuid;
  }
  void Append(size_t records, size_t ranges, uint64_t block_base) {
    REQUIRE(AppendToWriteLog(vol, SampleBatch(algo, owner, records, ranges, block_base)).ok());
  }
  const HashAlgo algo;
  MemVolume mv;
  Volume* vol;
  FileId owner;
  Uuid uuid;
};

}  // namespace

TEST_CASE("writelog: names", "[writemon]") {
  CHECK(WriteLogName(kOwner) == ".dede-wlog-5-2");
  CHECK(WriteLogName(FileId{~uint64_t{0}, 0}) == ".dede-wlog-18446744073709551615-0");
  auto id = ParseWriteLogName(".dede-wlog-5-2");
  REQUIRE(id.has_value());
  CHECK(*id == kOwner);
  REQUIRE(ParseWriteLogName(".dede-wlog-18446744073709551615-0").has_value());
  for (const char* bad : {".dede-wlog-", ".dede-wlog-5", ".dede-wlog-5-", ".dede-wlog--2",
                          ".dede-wlog-05-2", ".dede-wlog-5-2x", ".dede-wlog-5-2-1", "vm-5-2",
                          ".dede-wlog-18446744073709551616-0", ".dede-wlog-+5-2", "dede-wlog-5-2"}) {
    CAPTURE(bad);
    CHECK(!ParseWriteLogName(bad).has_value());
  }
}

TEST_CASE("writelog: frame round trip, both hash algorithms", "[writemon]") {
  for (HashAlgo algo : {HashAlgo::kXxh128, HashAlgo::kSha256}) {
    CAPTURE(HashAlgoName(algo));
    CHECK(WriteLogRecordBytes(algo) == 12 + HashAlgoSize(algo));
    MonitorBatch b = SampleBatch(algo, kOwner, 50, 6);
    b.dropped_records = 3;
    b.dropped_since_ns = kT0 - 5;
    const uint64_t off = 8192;
    std::vector<uint8_t> enc = EncodeWriteLogFrames(b, 7, algo, kUuid, off);
    REQUIRE(enc.size() == kB);
    CHECK(EncodedWriteLogBytes(b, algo) == enc.size());
    uint64_t fb = 0;
    auto f = DecodeWriteLogFrame(enc.data(), enc.size(), algo, kUuid, kOwner, off, &fb);
    REQUIRE(f.ok());
    CHECK(fb == kB);
    CHECK(f->encoded_bytes == kB);
    CHECK(f->log_offset == off);
    CHECK(f->host_id == 7);
    CHECK(f->owner == kOwner);
    CHECK(f->first_ns == kT0);
    CHECK(f->last_ns == kT0 + 10 * kMs);
    CHECK(SameFrame(*f, b));
    // Encoding is canonical.
    MonitorBatch again;
    again.file = kOwner;
    again.records = f->records;
    again.invalidated = f->invalidated;
    again.dropped_records = f->dropped_records;
    again.dropped_since_ns = f->dropped_since_ns;
    CHECK(EncodeWriteLogFrames(again, 7, algo, kUuid, off) == enc);
    // Into a reused buffer (the append path's): the same bytes, whatever
    // the buffer held before (its padding must be zeros again).
    std::vector<uint8_t> reused(3 * kB + 5, 0xee);
    EncodeWriteLogFrames(b, 7, algo, kUuid, off, &reused);
    CHECK(reused == enc);
    // The other algorithm's reader refuses it.
    HashAlgo other = algo == HashAlgo::kXxh128 ? HashAlgo::kSha256 : HashAlgo::kXxh128;
    auto wrong = DecodeWriteLogFrame(enc.data(), enc.size(), other, kUuid, kOwner, off, &fb);
    CHECK(wrong.status().code() == Status::Code::kCorruption);
    CHECK(Contains(wrong.status().message(), "hash algorithm"));
  }
  // Sub-millisecond times are rounded down to the frame's millisecond grid.
  MonitorBatch b;
  b.file = kOwner;
  b.records.push_back(BlockRecord{3, kT0 + 1, FpOf(HashAlgo::kXxh128, 1)});
  b.records.push_back(BlockRecord{4, kT0 + 2 * kMs + 999, FpOf(HashAlgo::kXxh128, 2)});
  auto enc = EncodeWriteLogFrames(b, 1, HashAlgo::kXxh128, kUuid, 0);
  auto f = DecodeWriteLogFrame(enc.data(), enc.size(), HashAlgo::kXxh128, kUuid, kOwner, 0, nullptr);
  REQUIRE(f.ok());
  CHECK(f->first_ns == kT0 + 1);
  CHECK(f->last_ns == kT0 + 2 * kMs + 999);
  CHECK(f->records[0].time_ns == kT0 + 1);
  CHECK(f->records[1].time_ns == kT0 + 1 + 2 * kMs);
  // An empty batch encodes to nothing; one with only shed records to a frame.
  MonitorBatch e;
  e.file = kOwner;
  CHECK(EncodeWriteLogFrames(e, 1, HashAlgo::kXxh128, kUuid, 0).empty());
  e.dropped_records = 9;
  e.dropped_since_ns = kT0;
  enc = EncodeWriteLogFrames(e, 1, HashAlgo::kXxh128, kUuid, 0);
  f = DecodeWriteLogFrame(enc.data(), enc.size(), HashAlgo::kXxh128, kUuid, kOwner, 0, nullptr);
  REQUIRE(f.ok());
  CHECK(f->dropped_records == 9);
  CHECK(f->dropped_since_ns == kT0);
  CHECK(f->records.empty());
}

TEST_CASE("writelog: every single-bit flip is detected", "[writemon]") {
  for (HashAlgo algo : {HashAlgo::kXxh128, HashAlgo::kSha256}) {
    MonitorBatch b = SampleBatch(algo, kOwner, 60, 4);
    const uint64_t off = 3 * kB;
    const std::vector<uint8_t> enc = EncodeWriteLogFrames(b, 2, algo, kUuid, off);
    REQUIRE(enc.size() == kB);
    size_t header_flips = 0, payload_flips = 0;
    for (size_t bit = 0; bit < enc.size() * 8; bit++) {
      std::vector<uint8_t> x = enc;
      x[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
      uint64_t fb = 0;
      auto f = DecodeWriteLogFrame(x.data(), x.size(), algo, kUuid, kOwner, off, &fb);
      if (f.ok()) FAIL("flip of bit " << bit << " not detected");
      CHECK(Contains(f.status().message(), "write log .dede-wlog-5-2 frame at offset 12288: "));
      (bit / 8 < kWriteLogHeaderSize ? header_flips : payload_flips)++;
      if (bit / 8 >= kWriteLogHeaderSize) CHECK(fb == kB);  // the header still names the frame
    }
    CHECK(header_flips == kWriteLogHeaderSize * 8);
  }
  // The message names the failure.
  MonitorBatch b = SampleBatch(HashAlgo::kXxh128, kOwner, 10, 0);
  std::vector<uint8_t> enc = EncodeWriteLogFrames(b, 2, HashAlgo::kXxh128, kUuid, 8192);
  enc[kWriteLogHeaderSize + 3] ^= 1;
  auto f = DecodeWriteLogFrame(enc.data(), enc.size(), HashAlgo::kXxh128, kUuid, kOwner, 8192,
                               nullptr);
  CHECK(f.status().code() == Status::Code::kCorruption);
  CHECK(Contains(f.status().message(),
                 "write log .dede-wlog-5-2 frame at offset 8192: payload crc mismatch"));
}

TEST_CASE("writelog: misdirected and foreign frames fail", "[writemon]") {
  MonitorBatch b = SampleBatch(HashAlgo::kXxh128, kOwner, 10, 2);
  const std::vector<uint8_t> enc = EncodeWriteLogFrames(b, 1, HashAlgo::kXxh128, kUuid, 8192);
  auto dec = [&](const Uuid& uuid, FileId owner, uint64_t off) {
    return DecodeWriteLogFrame(enc.data(), enc.size(), HashAlgo::kXxh128, uuid, owner, off, nullptr);
  };
  REQUIRE(dec(kUuid, kOwner, 8192).ok());
  for (auto r : {dec(kUuid, kOwner, 4096), dec(kUuid, kOwner, 12288), dec(kUuid, FileId{5, 3}, 8192),
                 dec(kUuid, FileId{6, 2}, 8192), dec(kOtherUuid, kOwner, 8192)}) {
    CHECK(r.status().code() == Status::Code::kCorruption);
    CHECK(Contains(r.status().message(), "header crc mismatch"));
  }
}

TEST_CASE("writelog: versions, flags, reserved bytes and field checks", "[writemon]") {
  const HashAlgo algo = HashAlgo::kXxh128;
  MonitorBatch b = SampleBatch(algo, kOwner, 10, 2);
  const std::vector<uint8_t> enc = EncodeWriteLogFrames(b, 1, algo, kUuid, 0);
  auto edit = [&](const std::function<void(uint8_t*)>& change) {
    std::vector<uint8_t> x = enc;
    change(x.data());
    ResealHeader(x.data(), kUuid, kOwner, 0);
    return DecodeWriteLogFrame(x.data(), x.size(), algo, kUuid, kOwner, 0, nullptr);
  };
  auto newer_major = edit([](uint8_t* p) { EncodeU16(p + 4, kWriteLogMajor + 1); });
  CHECK(newer_major.status().code() == Status::Code::kUnsupported);
  CHECK(Contains(newer_major.status().message(), "format version 2.0 is newer"));
  CHECK(edit([](uint8_t* p) { EncodeU16(p + 4, 0); }).status().code() == Status::Code::kCorruption);
  // A newer minor is read, and may use the reserved bytes.
  auto newer_minor = edit([](uint8_t* p) {
    EncodeU16(p + 6, kWriteLogMinor + 1);
    p[28] = 0xaa;
    p[127] = 0x55;
  });
  REQUIRE(newer_minor.ok());
  CHECK(SameFrame(*newer_minor, b));
  // Our own minor must leave them zero.
  struct Case {
    const char* name;
    std::function<void(uint8_t*)> change;
    const char* message;
  };
  const Case cases[] = {
      {"reserved u32", [](uint8_t* p) { p[29] = 1; }, "reserved header bytes"},
      {"reserved tail", [](uint8_t* p) { p[110] = 1; }, "reserved header bytes"},
      {"unknown flag", [](uint8_t* p) { EncodeU32(p + 16, 2); }, "unknown flags 0x00000002"},
      {"flag without count", [](uint8_t* p) { EncodeU32(p + 16, kFrameRecordsDropped); }, "disagree"},
      {"count without flag", [](uint8_t* p) { EncodeU64(p + 72, 1); }, "disagree"},
      {"since without count", [](uint8_t* p) { EncodeU64(p + 80, 1); }, "disagree"},
      {"algo", [](uint8_t* p) { EncodeU16(p + 24, 2); }, "hash algorithm 2"},
      {"fp size", [](uint8_t* p) { EncodeU16(p + 26, 32); }, "fingerprint size 32"},
      {"time range", [](uint8_t* p) { EncodeU64(p + 64, DecodeU64(p + 56) - 1); }, "time range"},
      {"last before a record", [](uint8_t* p) { EncodeU64(p + 64, DecodeU64(p + 56) + kMs); },
       "time past last_ns"},
      {"range count", [](uint8_t* p) { EncodeU32(p + 88, 3); }, "do not fit a payload"},
      {"record count", [](uint8_t* p) { EncodeU32(p + 92, 9); }, "do not fit a payload"},
      {"payload too big", [](uint8_t* p) { EncodeU32(p + 96, kWriteLogMaxFrameBytes); },
       "exceeds the frame limit"},
      {"claimed offset", [](uint8_t* p) { EncodeU64(p + 48, 4096); }, "claims offset 4096"},
      {"owner", [](uint8_t* p) { EncodeU64(p + 32, 6); }, "belongs to file 6.2"},
      {"magic", [](uint8_t* p) { EncodeU32(p, kMagicWriteLogFrame + 1); }, "bad magic"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    auto r = edit(c.change);
    CHECK(r.status().code() == Status::Code::kCorruption);
    CHECK(Contains(r.status().message(), c.message));
  }
  // Payload checks, with both crcs recomputed.
  auto payload_edit = [&](const std::function<void(uint8_t*)>& change) {
    std::vector<uint8_t> x = enc;
    uint8_t* payload = x.data() + kWriteLogHeaderSize;
    const uint32_t len = DecodeU32(x.data() + 96);
    change(payload);
    EncodeU32(x.data() + 12, Crc32c(payload, len));
    ResealHeader(x.data(), kUuid, kOwner, 0);
    return DecodeWriteLogFrame(x.data(), x.size(), algo, kUuid, kOwner, 0, nullptr);
  };
  constexpr size_t rec0 = 2 * 20;  // first record after two ranges
  const Case payload_cases[] = {
      {"empty range", [](uint8_t* p) { EncodeU64(p + 8, 0); }, "range 0 is empty"},
      {"range past the largest file", [](uint8_t* p) { EncodeU64(p, uint64_t{1} << 52); },
       "past the largest file"},
      {"range wraps", [](uint8_t* p) { EncodeU64(p + 8, ~uint64_t{0}); }, "past the largest file"},
      {"ranges overlap", [](uint8_t* p) { EncodeU64(p + 20, DecodeU64(p)); }, "overlaps"},
      {"records out of order",
       [](uint8_t* p) { EncodeU64(p + rec0 + 28, DecodeU64(p + rec0)); }, "out of order"},
      {"record in a range", [](uint8_t* p) { EncodeU64(p + rec0, 0); }, "in an invalidated range"},
      {"record time", [](uint8_t* p) { EncodeU32(p + rec0 + 8, 1000000); }, "time past last_ns"},
  };
  for (const Case& c : payload_cases) {
    CAPTURE(c.name);
    auto r = payload_edit(c.change);
    CHECK(r.status().code() == Status::Code::kCorruption);
    CHECK(Contains(r.status().message(), c.message));
  }
  // Nonzero padding.
  std::vector<uint8_t> x = enc;
  x.back() = 1;
  auto r = DecodeWriteLogFrame(x.data(), x.size(), algo, kUuid, kOwner, 0, nullptr);
  CHECK(Contains(r.status().message(), "padding byte 4095 is not zero"));
  // Short buffers.
  uint64_t fb = 1;
  r = DecodeWriteLogFrame(enc.data(), 100, algo, kUuid, kOwner, 0, &fb);
  CHECK(Contains(r.status().message(), "truncated header"));
  CHECK(fb == 0);
  r = DecodeWriteLogFrame(enc.data(), 1000, algo, kUuid, kOwner, 0, &fb);
  CHECK(Contains(r.status().message(), "frame cut short (1000 of 4096 bytes)"));
  CHECK(fb == kB);
}

TEST_CASE("writelog: a big batch splits into several frames", "[writemon]") {
  const HashAlgo algo = HashAlgo::kXxh128;
  // 20 000 ranges and 400 000 records: about 11.6 MB of payload.
  MonitorBatch b = SampleBatch(algo, kOwner, 400000, 20000);
  b.dropped_records = 5;
  b.dropped_since_ns = kT0;
  const uint64_t off = 40960;
  std::vector<uint8_t> enc = EncodeWriteLogFrames(b, 3, algo, kUuid, off);
  CHECK(enc.size() == EncodedWriteLogBytes(b, algo));
  CHECK(enc.size() % kB == 0);
  uint64_t pos = 0;
  size_t frames = 0, records = 0, ranges = 0, dropped = 0;
  MonitorBatch joined;
  while (pos < enc.size()) {
    uint64_t fb = 0;
    auto f = DecodeWriteLogFrame(enc.data() + pos, enc.size() - pos, algo, kUuid, kOwner, off + pos,
                                 &fb);
    REQUIRE(f.ok());
    CHECK(fb <= kWriteLogMaxFrameBytes);
    records += f->records.size();
    ranges += f->invalidated.size();
    dropped += f->dropped_records;
    joined.records.insert(joined.records.end(), f->records.begin(), f->records.end());
    joined.invalidated.insert(joined.invalidated.end(), f->invalidated.begin(), f->invalidated.end());
    pos += fb;
    frames++;
  }
  CHECK(frames == 2);
  CHECK(records == b.records.size());
  CHECK(ranges == b.invalidated.size());
  CHECK(dropped == 5);
  joined.file = kOwner;
  joined.dropped_records = 5;
  joined.dropped_since_ns = kT0;
  // Frames carry their own time ranges, so compare entries and times.
  WriteLogFrame all;
  all.records = joined.records;
  all.invalidated = joined.invalidated;
  all.dropped_records = 5;
  all.dropped_since_ns = kT0;
  CHECK(SameFrame(all, b));
}

TEST_CASE("writelog: append and replay on a volume match a model", "[writemon]") {
  for (HashAlgo algo : {HashAlgo::kXxh128, HashAlgo::kSha256}) {
    CAPTURE(HashAlgoName(algo));
    MemVolume mv(algo);
    Volume* vol = mv.vol.get();
    auto created = vol->Create("vm", 1 << 20);
    REQUIRE(created.ok());
    const FileId owner = *created;
    CHECK(OpenWriteLog(vol, owner).status().code() == Status::Code::kNotFound);
    // Empty batches write nothing, not even a log.
    MonitorBatch empty;
    empty.file = owner;
    REQUIRE(AppendToWriteLog(vol, empty).ok());
    CHECK(vol->Lookup(WriteLogName(owner)).status().code() == Status::Code::kNotFound);

    std::mt19937_64 rng(11);
    std::map<uint64_t, BlockRecord> model;
    uint64_t t = kT0;
    uint64_t total_dropped = 0;
    for (int round = 0; round < 12; round++) {
      // A random coalesced batch through the monitor's own rules.
      std::map<uint64_t, BlockRecord> recs;
      std::map<uint64_t, uint64_t> ranges;  // first -> count
      MonitorBatch b;
      b.file = owner;
      const int nr = static_cast<int>(rng() % 4);
      uint64_t cursor = rng() % 50;
      for (int i = 0; i < nr; i++) {
        const uint64_t count = 1 + rng() % (round == 5 ? (uint64_t{100} << 30) / kB : 40);
        b.invalidated.push_back(InvalidRange{cursor, count, t});
        cursor += count + 1 + rng() % 20;
        if (round == 5) break;
      }
      t += kMs;
      const int n = static_cast<int>(rng() % 300);
      uint64_t block = 0;
      for (int i = 0; i < n; i++) {
        block += 1 + rng() % 4;
        bool in_range = false;
        for (const InvalidRange& r : b.invalidated) {
          in_range = in_range || (block >= r.first && block < r.first + r.count);
        }
        if (in_range) continue;
        b.records.push_back(BlockRecord{block, t, FpOf(algo, rng())});
      }
      if (round % 4 == 3) {
        b.dropped_records = 1 + round;
        b.dropped_since_ns = t;
        total_dropped += b.dropped_records;
      }
      b.first_ns = kT0;
      b.last_ns = t;
      if (b.empty()) continue;
      REQUIRE(AppendToWriteLog(vol, b).ok());
      for (const InvalidRange& r : b.invalidated) {
        auto it = model.lower_bound(r.first);
        while (it != model.end() && it->first < r.first + r.count) it = model.erase(it);
      }
      for (const BlockRecord& r : b.records) model[r.block] = r;
      t += kMs;
    }
    auto info = vol->Lookup(WriteLogName(owner));
    REQUIRE(info.ok());
    CHECK(info->kind == FileKind::kWriteLog);
    CHECK(info->owner_ino == owner.ino);
    CHECK(info->size % kB == 0);

    auto log = OpenWriteLog(vol, owner);
    REQUIRE(log.ok());
    // The log is locked while open: appends must wait.
    CHECK(AppendToWriteLog(vol, SampleBatch(algo, owner, 3, 0)).code() == Status::Code::kLocked);
    auto st = ReplayWriteLog(log->get(), algo, vol->superblock().uuid, owner);
    REQUIRE(st.ok());
    CHECK(st->stats.corrupt_frames == 0);
    CHECK(st->stats.skipped_bytes == 0);
    CHECK(st->stats.dropped_records == total_dropped);
    REQUIRE(st->records.size() == model.size());
    for (const auto& [block, r] : model) {
      const BlockRecord& got = st->records.at(block);
      CHECK(got.fp == r.fp);
      CHECK(got.time_ns == r.time_ns);
    }
  }
}

TEST_CASE("writelog: the reader skips torn and corrupt frames", "[writemon]") {
  const HashAlgo algo = HashAlgo::kXxh128;
  MemVolume mv(algo);
  Volume* vol = mv.vol.get();
  const Uuid uuid = vol->superblock().uuid;
  auto created = vol->Create("vm", 1 << 20);
  REQUIRE(created.ok());
  const FileId owner = *created;
  // Five frames: 1 block, 3 blocks (300 records), 1, 1, 3.
  const size_t sizes[] = {10, 300, 20, 30, 300};
  std::vector<uint64_t> offsets;
  for (size_t i = 0; i < 5; i++) {
    auto info = vol->Lookup(WriteLogName(owner));
    offsets.push_back(info.ok() ? info->size : 0);
    REQUIRE(AppendToWriteLog(vol, SampleBatch(algo, owner, sizes[i], 1, i * 100000)).ok());
  }
  auto log = OpenWriteLog(vol, owner);
  REQUIRE(log.ok());
  File* f = log->get();
  CHECK(offsets == std::vector<uint64_t>{0, kB, 4 * kB, 5 * kB, 6 * kB});
  CHECK(f->size() == 9 * kB);
  WriteLogScanStats stats;
  CHECK(ReadAll(f, algo, uuid, owner, &stats).size() == 5);
  CHECK(stats.records == 660);
  CHECK(stats.invalidations == 5);

  SECTION("a corrupt payload in the middle") {
    uint8_t byte;
    REQUIRE(f->Read(kB + 2000, &byte, 1).ok());
    byte ^= 0x10;
    REQUIRE(f->Write(kB + 2000, &byte, 1).ok());
    auto frames = ReadAll(f, algo, uuid, owner, &stats);
    REQUIRE(frames.size() == 4);
    CHECK(frames[1].log_offset == 4 * kB);
    CHECK(stats.corrupt_frames == 1);
    CHECK(stats.skipped_bytes == 3 * kB);
    CHECK(stats.records == 360);
  }
  SECTION("a bad header run in the middle") {
    std::vector<uint8_t> junk(4 * kB, 0xab);
    REQUIRE(f->Write(kB, junk.data(), junk.size()).ok());
    auto frames = ReadAll(f, algo, uuid, owner, &stats);
    REQUIRE(frames.size() == 3);
    CHECK(frames[1].log_offset == 5 * kB);
    CHECK(stats.corrupt_frames == 1);
    CHECK(stats.skipped_bytes == 4 * kB);
  }
  SECTION("a torn tail") {
    REQUIRE(f->Truncate(8 * kB).ok());  // the last frame loses its last block
    auto frames = ReadAll(f, algo, uuid, owner, &stats);
    CHECK(frames.size() == 4);
    CHECK(stats.corrupt_frames == 1);
    CHECK(stats.skipped_bytes == 2 * kB);
    // Zeros where the tail should be (extended, never written).
    REQUIRE(f->Truncate(6 * kB).ok());
    REQUIRE(f->Truncate(9 * kB).ok());
    frames = ReadAll(f, algo, uuid, owner, &stats);
    CHECK(frames.size() == 4);
    CHECK(stats.corrupt_frames == 1);
    CHECK(stats.skipped_bytes == 3 * kB);
    // A ragged end (not a whole block) is skipped as well.
    REQUIRE(f->Truncate(6 * kB + 100).ok());
    frames = ReadAll(f, algo, uuid, owner, &stats);
    CHECK(frames.size() == 4);
    CHECK(stats.corrupt_frames == 1);
    CHECK(stats.skipped_bytes == 100);
  }
  SECTION("a frame appended inside a torn frame's extent is found") {
    // Frame 2 (3 blocks at 1..3) loses its last two blocks; a new frame
    // lands at block 2, inside the extent its header claims.
    std::vector<uint8_t> zeros(2 * kB, 0);
    REQUIRE(f->Write(2 * kB, zeros.data(), zeros.size()).ok());
    MonitorBatch nb = SampleBatch(algo, owner, 5, 0, 999999);
    std::vector<uint8_t> enc = EncodeWriteLogFrames(nb, vol->host_id(), algo, uuid, 2 * kB);
    REQUIRE(enc.size() == kB);
    REQUIRE(f->Write(2 * kB, enc.data(), enc.size()).ok());
    auto frames = ReadAll(f, algo, uuid, owner, &stats);
    REQUIRE(frames.size() == 5);
    CHECK(frames[1].log_offset == 2 * kB);
    CHECK(frames[1].records.size() == 5);
    CHECK(stats.corrupt_frames == 2);  // the torn frame, then the zero block after the new one
    CHECK(stats.skipped_bytes == 2 * kB);
  }
  SECTION("a whole log of garbage") {
    std::vector<uint8_t> junk(9 * kB);
    std::mt19937 rng(3);
    for (auto& x : junk) x = static_cast<uint8_t>(rng());
    REQUIRE(f->Write(0, junk.data(), junk.size()).ok());
    auto frames = ReadAll(f, algo, uuid, owner, &stats);
    CHECK(frames.empty());
    CHECK(stats.corrupt_frames == 1);
    CHECK(stats.skipped_bytes == 9 * kB);
  }
}

TEST_CASE("writelog: a log bigger than the read chunk replays", "[writemon]") {
  VmLog t;
  // Three appends of ~3.2 MB each: frames straddle the 4 MiB read chunks.
  for (int i = 0; i < 3; i++) t.Append(120000, 0, i * 1000000);
  auto log = OpenWriteLog(t.vol, t.owner);
  REQUIRE(log.ok());
  CHECK((*log)->size() > (8u << 20));
  auto st = ReplayWriteLog(log->get(), t.algo, t.uuid, t.owner);
  REQUIRE(st.ok());
  CHECK(st->stats.frames == 3);
  CHECK(st->stats.corrupt_frames == 0);
  CHECK(st->records.size() == 360000);
}

TEST_CASE("writelog: monitor batches through the log", "[writemon]") {
  // End to end: monitor -> Take -> AppendToWriteLog -> ReplayWriteLog.
  MemVolume mv(HashAlgo::kSha256);
  Volume* vol = mv.vol.get();
  auto created = vol->Create("vm", 1 << 20);
  REQUIRE(created.ok());
  const FileId owner = *created;
  ManualClock clock(kT0);
  WriteMonitorOptions o;
  o.algo = vol->superblock().hash_algo;
  o.clock = &clock;
  WriteMonitor m(o);
  m.AddFile(owner, true);
  std::vector<uint8_t> d(16 * kB);
  for (size_t i = 0; i < d.size(); i++) d[i] = static_cast<uint8_t>(i * 7 + i / kB);
  m.OnWrite(owner, 0, d.data(), d.size());
  REQUIRE(AppendToWriteLog(vol, m.Take(owner)).ok());
  clock.Advance(3 * kMs);
  m.OnInvalidate(owner, 4 * kB, 4 * kB);
  m.OnWrite(owner, 10 * kB + 1, d.data(), 100);
  m.OnWrite(owner, 15 * kB, d.data(), kB);
  REQUIRE(AppendToWriteLog(vol, m.Take(owner)).ok());
  auto log = OpenWriteLog(vol, owner);
  REQUIRE(log.ok());
  auto st = ReplayWriteLog(log->get(), o.algo, vol->superblock().uuid, owner);
  REQUIRE(st.ok());
  CHECK(st->records.size() == 16 - 4 - 1);
  CHECK(st->records.count(5) == 0);
  CHECK(st->records.count(10) == 0);
  CHECK(st->records.at(15).fp == ComputeFingerprint(o.algo, d.data(), kB));
  CHECK(st->records.at(15).time_ns == kT0 + 3 * kMs);
  CHECK(st->records.at(3).fp == ComputeFingerprint(o.algo, d.data() + 3 * kB, kB));
  CHECK(st->records.at(3).time_ns == kT0);
}

TEST_CASE("writelog: appends refuse bad batches and foreign files", "[writemon]") {
  MemVolume mv;
  Volume* vol = mv.vol.get();
  auto created = vol->Create("vm", 1 << 20);
  REQUIRE(created.ok());
  const FileId owner = *created;
  MonitorBatch b = SampleBatch(HashAlgo::kXxh128, owner, 5, 2);

  MonitorBatch unsorted = b;
  std::swap(unsorted.records[0], unsorted.records[1]);
  CHECK(AppendToWriteLog(vol, unsorted).code() == Status::Code::kInvalid);
  MonitorBatch overlap = b;
  overlap.records[0].block = overlap.invalidated[0].first;
  CHECK(AppendToWriteLog(vol, overlap).code() == Status::Code::kInvalid);
  MonitorBatch touching = b;
  touching.invalidated[1].first = touching.invalidated[0].first + touching.invalidated[0].count;
  CHECK(AppendToWriteLog(vol, touching).code() == Status::Code::kInvalid);
  MonitorBatch other_algo = SampleBatch(HashAlgo::kSha256, owner, 5, 2);
  Status st = AppendToWriteLog(vol, other_algo);
  CHECK(st.code() == Status::Code::kInvalid);
  CHECK(Contains(st.message(), "the volume uses xxh128"));
  // Nothing was created by the refused appends.
  CHECK(vol->Lookup(WriteLogName(owner)).status().code() == Status::Code::kNotFound);

  // A regular file squatting on the log's name is not taken for the log.
  const FileId other{owner.ino, owner.generation + 1};
  REQUIRE(vol->Create(WriteLogName(other), 0).ok());
  MonitorBatch ob = SampleBatch(HashAlgo::kXxh128, other, 5, 0);
  CHECK(AppendToWriteLog(vol, ob).code() == Status::Code::kCorruption);
  CHECK(OpenWriteLog(vol, other).status().code() == Status::Code::kCorruption);

  REQUIRE(AppendToWriteLog(vol, b).ok());
  auto log = OpenWriteLog(vol, owner);
  REQUIRE(log.ok());
  auto state = ReplayWriteLog(log->get(), HashAlgo::kXxh128, vol->superblock().uuid, owner);
  REQUIRE(state.ok());
  CHECK(state->records.size() == 5);
  // Read with the wrong volume UUID, every frame is foreign.
  auto foreign = ReplayWriteLog(log->get(), HashAlgo::kXxh128, kOtherUuid, owner);
  REQUIRE(foreign.ok());
  CHECK(foreign->records.empty());
  CHECK(foreign->stats.corrupt_frames == 1);
}

namespace {
uint64_t LogSize(Volume* vol, FileId owner) {
  auto log = OpenWriteLog(vol, owner);
  REQUIRE(log.ok());
  return (*log)->size();
}

WriteLogState Replay(Volume* vol, FileId owner) {
  auto log = OpenWriteLog(vol, owner);
  REQUIRE(log.ok());
  auto st = ReplayWriteLog(log->get(), vol->superblock().hash_algo, vol->superblock().uuid, owner);
  REQUIRE(st.ok());
  return std::move(*st);
}
}  // namespace

TEST_CASE("writelog: a log at its limit saturates and takes no more records", "[writemon]") {
  const HashAlgo algo = HashAlgo::kXxh128;
  MemVolume mv(algo);
  Volume* vol = mv.vol.get();
  auto created = vol->Create("vm", 64 << 20);
  REQUIRE(created.ok());
  const FileId owner = *created;
  // 100 records: 128 + 100 x 28 bytes, one 4 KiB frame per batch.
  const uint64_t limit = 3 * kB;
  LogAppendOutcome outcome = LogAppendOutcome::kSaturated;
  for (int i = 0; i < 3; i++) {
    REQUIRE(AppendToWriteLog(vol, SampleBatch(algo, owner, 100, 2, i * 10000), limit, &outcome)
                .ok());
    CHECK(outcome == LogAppendOutcome::kAppended);
  }
  REQUIRE(LogSize(vol, owner) == 3 * kB);
  CHECK_FALSE(Replay(vol, owner).saturated);

  // The fourth would pass the limit: a saturation frame takes its place.
  MonitorBatch fourth = SampleBatch(algo, owner, 100, 2, 30000);
  fourth.dropped_records = 7;
  fourth.dropped_since_ns = kT0 - 5 * kMs;
  REQUIRE(AppendToWriteLog(vol, fourth, limit, &outcome).ok());
  CHECK(outcome == LogAppendOutcome::kSaturated);
  CHECK(LogSize(vol, owner) == 4 * kB);
  WriteLogState st = Replay(vol, owner);
  CHECK(st.saturated);
  // Every earlier record is superseded: the whole file changed.
  CHECK(st.records.empty());
  REQUIRE(!st.invalidated.empty());
  CHECK(st.invalidated.back().first == 0);
  CHECK(st.invalidated.back().count == kWriteLogWholeFileBlocks);
  CHECK(st.invalidated.back().time_ns == fourth.last_ns);
  CHECK(st.stats.dropped_records == 100 + 2 + 7);
  CHECK(st.stats.dropped_since_ns == kT0 - 5 * kMs);
  CHECK(st.stats.corrupt_frames == 0);

  // From now on nothing is written, however small the batch, even one
  // that would fit under the limit.
  REQUIRE(AppendToWriteLog(vol, SampleBatch(algo, owner, 1, 0, 40000), 100 * kB, &outcome).ok());
  CHECK(outcome == LogAppendOutcome::kAlreadySaturated);
  for (int i = 0; i < 3; i++) {
    REQUIRE(AppendToWriteLog(vol, SampleBatch(algo, owner, 1, 0, 50000 + i), limit, &outcome).ok());
    CHECK(outcome == LogAppendOutcome::kAlreadySaturated);
  }
  CHECK(LogSize(vol, owner) == 4 * kB);
  // Without a limit (a pass writing back what it deferred) it appends.
  REQUIRE(AppendToWriteLog(vol, SampleBatch(algo, owner, 1, 0, 60000), 0, &outcome).ok());
  CHECK(outcome == LogAppendOutcome::kAppended);
  CHECK(LogSize(vol, owner) == 5 * kB);
  CHECK_FALSE(Replay(vol, owner).saturated);
  // That append was past the limit, and the tail is no saturation frame
  // any more: the next limited append saturates again.
  REQUIRE(AppendToWriteLog(vol, SampleBatch(algo, owner, 1, 0, 70000), limit, &outcome).ok());
  CHECK(outcome == LogAppendOutcome::kSaturated);
  CHECK(Replay(vol, owner).saturated);

  // A pass consumed the log (truncated it): appends go in again.
  {
    auto log = OpenWriteLog(vol, owner);
    REQUIRE(log.ok());
    REQUIRE((*log)->Truncate(0).ok());
  }
  REQUIRE(AppendToWriteLog(vol, SampleBatch(algo, owner, 100, 0), limit, &outcome).ok());
  CHECK(outcome == LogAppendOutcome::kAppended);
  WriteLogState after = Replay(vol, owner);
  CHECK_FALSE(after.saturated);
  CHECK(after.records.size() == 100);
}

TEST_CASE("writelog: saturation is read from the log's own tail", "[writemon]") {
  const HashAlgo algo = HashAlgo::kSha256;
  MemVolume mv(algo);
  Volume* vol = mv.vol.get();
  auto created = vol->Create("vm", 64 << 20);
  REQUIRE(created.ok());
  const FileId owner = *created;
  const uint64_t limit = kB;
  LogAppendOutcome outcome;
  REQUIRE(AppendToWriteLog(vol, SampleBatch(algo, owner, 50, 0), limit, &outcome).ok());
  REQUIRE(outcome == LogAppendOutcome::kAppended);
  SECTION("a torn tail is not a saturation frame") {
    {
      auto log = OpenWriteLog(vol, owner);
      REQUIRE(log.ok());
      std::vector<uint8_t> junk(100, 0x5a);
      REQUIRE((*log)->Truncate(kB + junk.size()).ok());
      REQUIRE((*log)->Write(kB, junk.data(), junk.size()).ok());
    }
    REQUIRE(AppendToWriteLog(vol, SampleBatch(algo, owner, 50, 0, 1000), limit, &outcome).ok());
    CHECK(outcome == LogAppendOutcome::kSaturated);
    CHECK(LogSize(vol, owner) == 3 * kB);
    WriteLogState st = Replay(vol, owner);
    CHECK(st.saturated);
    CHECK(st.stats.corrupt_frames == 1);
  }
  SECTION("a corrupt saturation frame does not count") {
    REQUIRE(AppendToWriteLog(vol, SampleBatch(algo, owner, 50, 0, 1000), limit, &outcome).ok());
    REQUIRE(outcome == LogAppendOutcome::kSaturated);
    {
      auto log = OpenWriteLog(vol, owner);
      REQUIRE(log.ok());
      uint8_t b = 0;
      REQUIRE((*log)->Read(kB + 200, &b, 1).ok());
      b ^= 1;
      REQUIRE((*log)->Write(kB + 200, &b, 1).ok());
    }
    // The appender cannot tell it was one: it writes another.
    REQUIRE(AppendToWriteLog(vol, SampleBatch(algo, owner, 50, 0, 2000), limit, &outcome).ok());
    CHECK(outcome == LogAppendOutcome::kSaturated);
    CHECK(LogSize(vol, owner) == 3 * kB);
    REQUIRE(AppendToWriteLog(vol, SampleBatch(algo, owner, 50, 0, 3000), limit, &outcome).ok());
    CHECK(outcome == LogAppendOutcome::kAlreadySaturated);
  }
  SECTION("an opt-out marker is not a saturation frame") {
    // It covers the file's blocks, not every block index, and is written
    // whatever the limit.
    REQUIRE(AppendOptOutMarker(vol, owner, 64 << 20, kT0).ok());
    CHECK(LogSize(vol, owner) == 2 * kB);
    CHECK_FALSE(Replay(vol, owner).saturated);
    REQUIRE(AppendToWriteLog(vol, SampleBatch(algo, owner, 50, 0, 1000), limit, &outcome).ok());
    CHECK(outcome == LogAppendOutcome::kSaturated);
    CHECK(Replay(vol, owner).saturated);
  }
}

// A volume with one 8 MiB file "vm", a monitor that finds it due at
// `records_per_flush` records, and a flusher; `data` is `blocks` distinct
// 4 KiB blocks to write.
struct FlusherRig {
  FlusherRig(size_t records_per_flush, size_t blocks) : mv(kAlgo), data(blocks * kB) {
    vol = mv.vol.get();
    auto created = vol->Create("vm", 8 << 20);
    REQUIRE(created.ok());
    owner = *created;
    WriteMonitorOptions mo;
    mo.algo = kAlgo;
    mo.flush_bytes = records_per_flush * WriteLogRecordBytes(kAlgo);
    monitor = std::make_unique<WriteMonitor>(mo);
    monitor->AddFile(owner, true);
    flusher = std::make_unique<LogFlusher>(vol, monitor.get());
    for (size_t i = 0; i < data.size(); i++) data[i] = static_cast<uint8_t>(i * 7 + i / kB);
  }
  static constexpr HashAlgo kAlgo = HashAlgo::kXxh128;
  MemVolume mv;
  Volume* vol;
  FileId owner;
  std::unique_ptr<WriteMonitor> monitor;
  std::unique_ptr<LogFlusher> flusher;  // destroyed before the monitor
  std::vector<uint8_t> data;
};

// Fills `vol` with a file "filler" until a write fails for want of space.
void FillVolume(Volume* vol) {
  REQUIRE(vol->Create("filler", uint64_t{1} << 30).ok());
  auto filler = vol->OpenFile("filler");
  REQUIRE(filler.ok());
  // 1 MiB writes, then 4 KiB ones for what a failed 1 MiB write left.
  std::vector<uint8_t> chunk(1 << 20, 0x5a);
  uint64_t off = 0;
  for (size_t len : {chunk.size(), size_t{kB}}) {
    Status st;
    while (st.ok()) {
      st = (*filler)->Write(off, chunk.data(), len);
      if (st.ok()) off += len;
    }
    REQUIRE(st.code() == Status::Code::kNoSpace);
  }
}

TEST_CASE("log flusher: its thread appends a file that reaches the flush size, unprompted",
          "[writemon]") {
  FlusherRig rig(200, 400);
  const HashAlgo algo = rig.kAlgo;
  Volume* vol = rig.vol;
  const FileId owner = rig.owner;
  WriteMonitor& monitor = *rig.monitor;
  LogFlusher& flusher = *rig.flusher;
  const std::vector<uint8_t>& data = rig.data;
  flusher.Start();
  auto flushes_within = [&](uint64_t want, int ms) {
    for (int waited = 0; waited < ms && flusher.stats().flushes < want; waited += 5) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return flusher.stats().flushes;
  };

  // Below the flush size nothing wakes the thread.
  monitor.OnWrite(owner, 0, data.data(), 199 * kB);
  CHECK(flushes_within(1, 200) == 0);
  // The write that reaches it does: one batch of all 200 records, with no
  // Tick from anyone.
  monitor.OnWrite(owner, 199 * kB, data.data() + 199 * kB, kB);
  CHECK(flushes_within(1, 10000) == 1);
  CHECK(flusher.stats().records == 200);
  WriteLogState st = Replay(vol, owner);
  REQUIRE(st.records.size() == 200);
  for (uint64_t b = 0; b < 200; b++) {
    CHECK(st.records.at(b).fp == ComputeFingerprint(algo, data.data() + b * kB, kB));
  }

  // Stopped: the monitor's hook is gone and nothing more is appended by
  // itself; FlushAll still works.
  flusher.Stop();
  monitor.OnWrite(owner, 200 * kB, data.data() + 200 * kB, 200 * kB);
  CHECK(flushes_within(2, 200) == 1);
  REQUIRE(flusher.FlushAll().ok());
  CHECK(flusher.stats().flushes == 2);
  CHECK(Replay(vol, owner).records.size() == 400);
  flusher.Stop();  // idempotent
}

TEST_CASE("log flusher: a busy file's log stays open between appends, and a pass can borrow it",
          "[writemon]") {
  FlusherRig rig(10, 64);
  const HashAlgo algo = rig.kAlgo;
  Volume* vol = rig.vol;
  const FileId owner = rig.owner;
  WriteMonitor& monitor = *rig.monitor;
  LogFlusher& flusher = *rig.flusher;
  const std::vector<uint8_t>& data = rig.data;
  flusher.TrackFile(owner, 8 << 20);  // exported: its log may stay open
  auto log_is_open_here = [&] {
    Result<std::unique_ptr<File>> log = OpenWriteLog(vol, owner);
    return !log.ok() && log.status().code() == Status::Code::kLocked;
  };

  monitor.OnWrite(owner, 0, data.data(), 16 * kB);
  REQUIRE(flusher.Tick().ok());
  CHECK(flusher.stats().flushes == 1);
  CHECK(log_is_open_here());
  // The next append goes through the same handle.
  monitor.OnWrite(owner, 16 * kB, data.data() + 16 * kB, 16 * kB);
  REQUIRE(flusher.Tick().ok());
  CHECK(flusher.stats().flushes == 2);
  // The opt-out marker goes through it too (an export switched off).
  REQUIRE(flusher.AppendOptOutMarker(owner, 8 << 20, 12345).ok());

  // A pass borrows the open log; meanwhile the flusher finds it busy and
  // keeps the batch.
  std::unique_ptr<File> lent = flusher.LendLog(owner);
  REQUIRE(lent != nullptr);
  CHECK(flusher.LendLog(owner) == nullptr);
  {
    Result<WriteLogState> st = ReplayWriteLog(lent.get(), algo, vol->superblock().uuid, owner);
    REQUIRE(st.ok());
    CHECK(st->records.empty());  // the marker invalidated all 32
    CHECK(st->invalidated.size() == 1);
  }
  monitor.OnWrite(owner, 32 * kB, data.data() + 32 * kB, 16 * kB);
  REQUIRE(flusher.Tick().ok());
  CHECK(flusher.stats().deferred == 1);
  CHECK(flusher.stats().flushes == 2);
  lent.reset();  // the pass is done with it
  REQUIRE(flusher.Tick().ok());
  CHECK(flusher.stats().flushes == 3);
  CHECK(log_is_open_here());

  // A flush point closes only logs idle since the one before.
  flusher.CloseIdleLogs();  // appended since: stays open, marked idle
  CHECK(log_is_open_here());
  monitor.OnWrite(owner, 0, data.data(), 16 * kB);
  REQUIRE(flusher.Tick().ok());
  flusher.CloseIdleLogs();  // appended again: stays open
  CHECK(log_is_open_here());
  flusher.CloseIdleLogs();  // idle since: closed
  CHECK_FALSE(log_is_open_here());
  // The thread does it when a flush point wakes it.
  monitor.OnWrite(owner, 0, data.data(), 16 * kB);
  REQUIRE(flusher.Tick().ok());
  CHECK(log_is_open_here());
  flusher.Start();
  for (int i = 0; i < 500 && log_is_open_here(); i++) {
    flusher.WakeAtFlushPoint();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK_FALSE(log_is_open_here());
  flusher.Stop();

  // FlushAll leaves every log closed, and so does ForgetFile.
  monitor.OnWrite(owner, 48 * kB, data.data() + 48 * kB, 16 * kB);
  REQUIRE(flusher.Tick().ok());
  CHECK(log_is_open_here());
  REQUIRE(flusher.FlushAll().ok());
  CHECK_FALSE(log_is_open_here());
  monitor.OnWrite(owner, 0, data.data(), 16 * kB);
  REQUIRE(flusher.Tick().ok());
  CHECK(log_is_open_here());
  flusher.ForgetFile(owner);
  CHECK_FALSE(log_is_open_here());
  WriteLogState st = Replay(vol, owner);
  CHECK(st.records.size() == 48);  // blocks 0-15 rewritten, 32-63 after the marker
  for (const auto& [b, r] : st.records) {
    CHECK(r.fp == ComputeFingerprint(algo, data.data() + b * kB, kB));
  }
}

TEST_CASE("log flusher: after a log append finds the volume full, Tick drops without trying "
          "and writes are not hashed",
          "[writemon]") {
  FlusherRig rig(10, 64);
  const HashAlgo algo = rig.kAlgo;
  Volume* vol = rig.vol;
  const FileId owner = rig.owner;
  WriteMonitor& monitor = *rig.monitor;
  LogFlusher& flusher = *rig.flusher;
  const std::vector<uint8_t>& data = rig.data;

  FillVolume(vol);

  // The first batch is tried and lost.
  monitor.OnWrite(owner, 0, data.data(), 10 * kB);
  Status st = flusher.Tick();
  REQUIRE(st.code() == Status::Code::kNoSpace);
  CHECK(flusher.stats().failed == 1);
  CHECK(flusher.stats().no_space_skipped == 0);
  CHECK(monitor.FileStats(owner).dropped_records == 10);
  CHECK(monitor.FileStats(owner).log_no_space);
  CHECK_FALSE(monitor.Recording(owner));  // dedupd does not hash ahead
  CHECK(monitor.FileStats(owner).hashed_blocks == 10);

  // Space comes back, but Tick does not try: the next batch due is
  // dropped untried (had it tried, the append would have succeeded). The
  // writes were not hashed: each is an invalidation of the blocks it
  // touched (16 scattered blocks: 16 ranges, enough to be due).
  REQUIRE(vol->Remove("filler").ok());
  for (uint64_t b = 10; b < 42; b += 2) monitor.OnWrite(owner, b * kB, data.data() + b * kB, kB);
  CHECK(monitor.FileStats(owner).hashed_blocks == 10);
  REQUIRE(flusher.Tick().ok());
  CHECK(flusher.stats().no_space_skipped == 1);
  CHECK(flusher.stats().flushes == 0);
  CHECK(flusher.stats().failed == 1);
  CHECK(monitor.FileStats(owner).dropped_records == 26);

  // FlushAll tries again and succeeds; the log says entries were lost, and
  // the blocks written since are invalidated (the pass rehashes them).
  monitor.OnWrite(owner, 20 * kB + 512, data.data() + 20 * kB, 10 * kB);  // blocks 20-30
  CHECK(monitor.FileStats(owner).hashed_blocks == 10);
  REQUIRE(flusher.FlushAll().ok());
  CHECK(flusher.stats().flushes == 1);
  WriteLogState log = Replay(vol, owner);
  CHECK(log.stats.dropped_records == 26);
  CHECK(log.records.empty());
  REQUIRE(log.invalidated.size() == 1);
  CHECK(log.invalidated[0].first == 20);
  CHECK(log.invalidated[0].count == 11);

  // Recording with fingerprints again: Tick appends records.
  CHECK_FALSE(monitor.FileStats(owner).log_no_space);
  CHECK(monitor.Recording(owner));
  monitor.OnWrite(owner, 30 * kB, data.data() + 30 * kB, 10 * kB);
  CHECK(monitor.FileStats(owner).hashed_blocks == 20);
  REQUIRE(flusher.Tick().ok());
  CHECK(flusher.stats().flushes == 2);
  CHECK(flusher.stats().no_space_skipped == 1);
  log = Replay(vol, owner);
  REQUIRE(log.records.size() == 10);
  for (uint64_t b = 30; b < 40; b++) {
    CHECK(log.records.at(b).fp == ComputeFingerprint(algo, data.data() + b * kB, kB));
  }
}

// Blocks 0..3 written and logged; then the log made unwritable by
// `block_log` (which returns the code the close's flush then gets) and the
// file closed with a TRIM of block 1 buffered: the close's batch is parked;
// the file is forgotten by the flusher and the monitor. By default the
// volume is filled (a file "filler"): the flush fails for want of space.
namespace {
void CloseWithParkedTrim(FlusherRig* rig, const std::function<Status::Code()>& block_log) {
  rig->monitor->OnWrite(rig->owner, 0, rig->data.data(), 4 * kB);
  REQUIRE(rig->flusher->FlushAll().ok());
  REQUIRE(Replay(rig->vol, rig->owner).records.size() == 4);
  const Status::Code flush_code = block_log();
  rig->monitor->OnInvalidate(rig->owner, kB, kB);  // a TRIM of block 1
  CHECK(rig->flusher->FlushFile(rig->owner).code() == flush_code);
  REQUIRE(rig->flusher->parked_files() == 1);
  rig->flusher->ForgetFile(rig->owner);
  rig->monitor->RemoveFile(rig->owner);
}
void CloseWithParkedTrim(FlusherRig* rig) {
  CloseWithParkedTrim(rig, [rig] {
    FillVolume(rig->vol);
    return Status::Code::kNoSpace;
  });
}
}  // namespace

TEST_CASE("log flusher: an export's last flush that fails is parked, and logged once it can be",
          "[writemon]") {
  // An export's close flushed its file's batch once; when the append
  // failed for good (a full volume, an I/O error) the batch was dropped
  // with the monitor's buffer, marks included: the log kept the block's
  // old record as if the block still held that content, with no sign that
  // anything was lost. The batch is now parked as changed blocks.
  FlusherRig rig(1000, 64);
  Volume* vol = rig.vol;
  const FileId owner = rig.owner;
  LogFlusher& flusher = *rig.flusher;
  CloseWithParkedTrim(&rig);
  // Still no room: kept.
  CHECK_FALSE(flusher.FlushAll().ok());
  CHECK(flusher.parked_files() == 1);
  // Room again: logged.
  REQUIRE(vol->Remove("filler").ok());
  REQUIRE(flusher.FlushAll().ok());
  CHECK(flusher.parked_files() == 0);
  WriteLogState log = Replay(vol, owner);
  CHECK(log.records.count(0) == 1);
  CHECK(log.records.count(1) == 0);  // the trim reached the log
  CHECK(log.records.count(2) == 1);
}

TEST_CASE("log flusher: a parked batch goes into the log before the reopened file's newer records",
          "[writemon]") {
  // The parked changes of a closed export (its log full or held) were
  // appended by FlushAll after the batches due, so when the file was
  // reopened meanwhile and its block rewritten, the older "changed" mark
  // landed after the new record and cancelled it: the log no longer named
  // the block's final content.
  FlusherRig rig(1000, 64);
  Volume* vol = rig.vol;
  const FileId owner = rig.owner;
  WriteMonitor& monitor = *rig.monitor;
  LogFlusher& flusher = *rig.flusher;
  CloseWithParkedTrim(&rig);
  REQUIRE(vol->Remove("filler").ok());
  // Reopened: block 1 written again, with new content.
  monitor.AddFile(owner, true);
  const uint8_t* fresh = rig.data.data() + 10 * kB;
  monitor.OnWrite(owner, kB, fresh, kB);
  REQUIRE(flusher.FlushAll().ok());
  CHECK(flusher.parked_files() == 0);
  WriteLogState log = Replay(vol, owner);
  REQUIRE(log.records.count(1) == 1);
  CHECK(log.records.at(1).fp == ComputeFingerprint(FlusherRig::kAlgo, fresh, kB));
  CHECK(log.records.count(0) == 1);
  CHECK(log.records.count(2) == 1);
}

TEST_CASE("log flusher: at shutdown, parked changes wait a while for their held log",
          "[writemon]") {
  // An export closed while a pass held its log parks its changes; dedupd's
  // exit tried once more and then lost them, though a pass holds a log
  // only for the seconds it gathers it.
  FlusherRig rig(1000, 64);
  Volume* vol = rig.vol;
  const FileId owner = rig.owner;
  LogFlusher& flusher = *rig.flusher;
  // The log held here, as by this dedupd's own pass: the close parks at
  // once and reports no error.
  std::unique_ptr<File> held;
  CloseWithParkedTrim(&rig, [&] {
    Result<std::unique_ptr<File>> log = vol->OpenFile(WriteLogName(owner));
    REQUIRE(log.ok());
    held = std::move(log).value();
    return Status::Code::kOk;
  });

  // Still held throughout: tried for the time given, then left parked.
  auto t0 = std::chrono::steady_clock::now();
  REQUIRE(flusher.FlushParked(0.3).ok());
  CHECK(std::chrono::steady_clock::now() - t0 >= std::chrono::milliseconds(300));
  CHECK(flusher.parked_files() == 1);

  // Given back after a moment: logged before the wait runs out.
  std::thread pass([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    held.reset();
  });
  t0 = std::chrono::steady_clock::now();
  Status st = flusher.FlushParked(10);
  const auto took = std::chrono::steady_clock::now() - t0;
  pass.join();
  REQUIRE(st.ok());
  CHECK(took < std::chrono::seconds(5));
  CHECK(flusher.parked_files() == 0);
  WriteLogState log = Replay(vol, owner);
  CHECK(log.records.count(0) == 1);
  CHECK(log.records.count(1) == 0);  // the trim reached the log
  CHECK(log.records.count(2) == 1);

  // A failure for good ends the tries at once.
  rig.monitor->AddFile(owner, true);
  FillVolume(vol);
  rig.monitor->OnInvalidate(owner, 2 * kB, kB);
  CHECK(flusher.FlushFile(owner).code() == Status::Code::kNoSpace);
  REQUIRE(flusher.parked_files() == 1);
  t0 = std::chrono::steady_clock::now();
  CHECK(flusher.FlushParked(10).code() == Status::Code::kNoSpace);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  CHECK(flusher.parked_files() == 1);
}

TEST_CASE("writelog: a replay holds at most max_entries records and ranges", "[writemon]") {
  // A log's limit is 3% of its file: the log of a 1 TiB disk can describe
  // every one of its 268 million blocks, gigabytes in the replay's map.
  // Past its bound the replay says what a saturation frame says.
  VmLog t;
  const HashAlgo algo = t.algo;
  const Uuid uuid = t.uuid;
  const FileId owner = t.owner;
  t.Append(60, 2, 0);
  t.Append(60, 2, 5000);
  auto log = OpenWriteLog(t.vol, owner);
  REQUIRE(log.ok());
  auto whole = ReplayWriteLog(log->get(), algo, uuid, owner);
  REQUIRE(whole.ok());
  CHECK_FALSE(whole->over_budget);
  CHECK(whole->records.size() == 120);
  auto bounded = ReplayWriteLog(log->get(), algo, uuid, owner, 200);
  REQUIRE(bounded.ok());
  CHECK_FALSE(bounded->over_budget);
  CHECK(bounded->records.size() == 120);
  auto over = ReplayWriteLog(log->get(), algo, uuid, owner, 50);
  REQUIRE(over.ok());
  CHECK(over->over_budget);
  CHECK(over->records.empty());
  REQUIRE(over->invalidated.size() == 1);
  CHECK(over->invalidated[0].first == 0);
  CHECK(over->invalidated[0].count == kWriteLogWholeFileBlocks);
  uint64_t newest = 0;
  for (const auto& [b, r] : whole->records) newest = std::max(newest, r.time_ns);
  for (const InvalidRange& r : whole->invalidated) newest = std::max(newest, r.time_ns);
  CHECK(over->invalidated[0].time_ns >= newest);
  CHECK(over->stats.frames == 2);  // read to the end all the same
}

TEST_CASE("writelog: frames of a newer major version are counted apart", "[writemon]") {
  VmLog t;
  const HashAlgo algo = t.algo;
  const Uuid uuid = t.uuid;
  const FileId owner = t.owner;
  Volume* vol = t.vol;
  t.Append(10, 1, 0);
  t.Append(10, 1, 100);
  {
    auto log = OpenWriteLog(vol, owner);
    REQUIRE(log.ok());
    std::vector<uint8_t> head(kWriteLogHeaderSize);
    REQUIRE((*log)->Read(0, head.data(), head.size()).ok());
    EncodeU16(head.data() + 4, kWriteLogMajor + 1);
    ResealHeader(head.data(), uuid, owner, 0);
    REQUIRE((*log)->Write(0, head.data(), head.size()).ok());
    auto st = ReplayWriteLog(log->get(), algo, uuid, owner);
    REQUIRE(st.ok());
    CHECK(st->stats.frames == 1);
    CHECK(st->stats.newer_frames == 1);
    CHECK(st->stats.corrupt_frames >= 1);
  }
  // A pass leaves such a log whole: consuming it (cutting it to nothing)
  // destroyed what a newer dede wrote and this one cannot read.
  const uint64_t size_before = Replay(vol, owner).stats.skipped_bytes;
  VolumeFileAccess access(vol);
  DedupOptions o;
  auto pass = RunDedupPass(vol, &access, o);
  REQUIRE(pass.ok());
  CHECK(pass->newer_format_left_alone == 1);
  CHECK(pass->logs_consumed == 0);
  WriteLogState after = Replay(vol, owner);
  CHECK(after.stats.frames == 1);
  CHECK(after.stats.newer_frames == 1);
  CHECK(after.stats.skipped_bytes == size_before);
}
