// Fuzzes DecodeWriteLogFrame, WriteLogReader and ParseWriteLogName
// (kmod/writemon/write_log.h):
// a write log is read back by whichever host next consumes it, so whatever
// another host, a torn append or a stale LUN left there must be refused
// cleanly.
//
// The input is one 4 KiB block (fuzz_util.h). Its header names the owner,
// offset and hash algorithm it claims; it is decoded for those, then
// "fixed up" (magic, version, payload length clamped to the block, both
// crcs recomputed) so the fuzzer reaches the field checks behind the crcs.
//
// Properties: an error names the log and the offset; a decoded frame keeps
// every invariant the format promises, re-encodes to a frame that decodes
// to the same content, and that encoding is canonical. A reader over a log
// of [valid frame][input][valid frame] returns only valid frames in order,
// the first one always, and the last one unless an input frame validly
// covers it; it never fails (no I/O errors in memory).
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "kmod/writemon/write_log.h"
#include "tests/fuzz/fuzz_util.h"
#include "util/crc32c.h"

using namespace dede;
using namespace dede::fuzz;

namespace {

constexpr const char* kTarget = "fuzz_write_log";
constexpr uint64_t kBlockLimit = uint64_t{1} << 52;

// Field offsets of the frame header (docs/FORMAT.md, "Write log").
constexpr size_t kMajor = 4, kMinor = 6, kHeaderCrc = 8, kPayloadCrc = 12, kAlgo = 24;
constexpr size_t kOwnerIno = 32, kOwnerGen = 40, kLogOffset = 48, kPayloadBytes = 96;

HashAlgo AlgoOf(const uint8_t* blk) {
  return DecodeU16(blk + kAlgo) == static_cast<uint16_t>(HashAlgo::kSha256) ? HashAlgo::kSha256
                                                                            : HashAlgo::kXxh128;
}

FileId OwnerOf(const uint8_t* blk) { return FileId{DecodeU64(blk + kOwnerIno), DecodeU64(blk + kOwnerGen)}; }

void SealHeader(uint8_t* blk, const Uuid& uuid, FileId owner, uint64_t offset) {
  uint8_t prefix[40];
  std::memcpy(prefix, uuid.data(), 16);
  EncodeU64(prefix + 16, owner.ino);
  EncodeU64(prefix + 24, owner.generation);
  EncodeU64(prefix + 32, offset);
  EncodeU32(blk + kHeaderCrc, 0);
  uint32_t crc = Crc32cExtend(0, prefix, sizeof prefix);
  EncodeU32(blk + kHeaderCrc, Crc32cExtend(crc, blk, kWriteLogHeaderSize));
}

MonitorBatch BatchOf(const WriteLogFrame& f) {
  MonitorBatch b;
  b.file = f.owner;
  b.records = f.records;
  b.invalidated = f.invalidated;
  b.first_ns = f.first_ns;
  b.last_ns = f.last_ns;
  b.dropped_records = f.dropped_records;
  b.dropped_since_ns = f.dropped_since_ns;
  return b;
}

bool SameContent(const WriteLogFrame& a, const WriteLogFrame& b) {
  if (a.records.size() != b.records.size() || a.invalidated.size() != b.invalidated.size()) {
    return false;
  }
  for (size_t i = 0; i < a.records.size(); i++) {
    if (a.records[i].block != b.records[i].block || a.records[i].time_ns != b.records[i].time_ns ||
        !(a.records[i].fp == b.records[i].fp)) {
      return false;
    }
  }
  for (size_t i = 0; i < a.invalidated.size(); i++) {
    if (a.invalidated[i].first != b.invalidated[i].first ||
        a.invalidated[i].count != b.invalidated[i].count ||
        a.invalidated[i].time_ns != b.invalidated[i].time_ns) {
      return false;
    }
  }
  return a.dropped_records == b.dropped_records && a.dropped_since_ns == b.dropped_since_ns &&
         a.owner == b.owner && a.host_id == b.host_id;
}

void CheckInvariants(const WriteLogFrame& f, HashAlgo algo, size_t len) {
  FUZZ_CHECK(f.encoded_bytes % kBlockSize == 0 && f.encoded_bytes <= len &&
                 f.encoded_bytes <= kWriteLogMaxFrameBytes,
             "frame size");
  FUZZ_CHECK(f.first_ns <= f.last_ns, "time range");
  FUZZ_CHECK(!f.records.empty() || !f.invalidated.empty() || f.dropped_records > 0, "empty frame");
  FUZZ_CHECK(f.dropped_records > 0 || f.dropped_since_ns == 0, "dropped since without a count");
  uint64_t prev_end = 0;
  for (size_t i = 0; i < f.invalidated.size(); i++) {
    const InvalidRange& r = f.invalidated[i];
    FUZZ_CHECK(r.count > 0 && r.first < kBlockLimit && r.count <= kBlockLimit - r.first,
               "range bounds");
    FUZZ_CHECK(i == 0 || r.first > prev_end, "ranges overlap or touch");
    FUZZ_CHECK(r.time_ns >= f.first_ns && r.time_ns <= f.last_ns, "range time");
    prev_end = r.first + r.count;
  }
  size_t ri = 0;
  for (size_t i = 0; i < f.records.size(); i++) {
    const BlockRecord& r = f.records[i];
    FUZZ_CHECK(r.block < kBlockLimit, "record bounds");
    FUZZ_CHECK(i == 0 || r.block > f.records[i - 1].block, "records out of order");
    FUZZ_CHECK(r.fp.size == HashAlgoSize(algo), "fingerprint size");
    FUZZ_CHECK(r.time_ns >= f.first_ns && r.time_ns <= f.last_ns, "record time");
    while (ri < f.invalidated.size() &&
           f.invalidated[ri].first + f.invalidated[ri].count <= r.block) {
      ri++;
    }
    FUZZ_CHECK(ri == f.invalidated.size() || f.invalidated[ri].first > r.block,
               "record inside an invalidated range");
  }
}

// Decodes buf[0..len) as the frame at `offset` of `owner`'s log.
void DecodeOne(const uint8_t* buf, size_t len, HashAlgo algo, FileId owner, uint64_t offset) {
  uint64_t frame_bytes = 0;
  Result<WriteLogFrame> r =
      DecodeWriteLogFrame(buf, len, algo, kFuzzUuid, owner, offset, &frame_bytes);
  if (!r.ok()) {
    FUZZ_CHECK(FailedCleanly(r.status()), "error without a message");
    FUZZ_CHECK(r.status().code() == Status::Code::kCorruption ||
                   r.status().code() == Status::Code::kUnsupported,
               "unexpected error code: " + r.status().ToString());
    const std::string where =
        "write log " + WriteLogName(owner) + " frame at offset " + std::to_string(offset) + ": ";
    FUZZ_CHECK(r.status().message().find(where) == 0,
               "error does not name the log and offset: " + r.status().message());
    FUZZ_CHECK(frame_bytes % kBlockSize == 0 && frame_bytes <= kWriteLogMaxFrameBytes,
               "bad frame_bytes on error");
    return;
  }
  const WriteLogFrame& f = *r;
  FUZZ_CHECK(frame_bytes == f.encoded_bytes, "frame_bytes differs from encoded_bytes");
  FUZZ_CHECK(f.owner == owner && f.log_offset == offset, "frame identity");
  CheckInvariants(f, algo, len);

  const std::vector<uint8_t> again =
      EncodeWriteLogFrames(BatchOf(f), f.host_id, algo, kFuzzUuid, offset);
  FUZZ_CHECK(again.size() == f.encoded_bytes, "re-encoded frame has another size");
  FUZZ_CHECK(EncodedWriteLogBytes(BatchOf(f), algo) == again.size(), "EncodedWriteLogBytes");
  Result<WriteLogFrame> r2 =
      DecodeWriteLogFrame(again.data(), again.size(), algo, kFuzzUuid, owner, offset, nullptr);
  FUZZ_CHECK(r2.ok(), "re-encoded frame does not decode: " + r2.status().ToString());
  FUZZ_CHECK(SameContent(*r2, f), "frame changed in a round trip");
  const std::vector<uint8_t> third =
      EncodeWriteLogFrames(BatchOf(*r2), r2->host_id, algo, kFuzzUuid, offset);
  FUZZ_CHECK(third == again, "write log encoding is not canonical");
}

// A File over bytes in memory, for the reader.
class MemFile : public File {
 public:
  MemFile(FileId id, std::vector<uint8_t> bytes) : id_(id), bytes_(std::move(bytes)) {}
  FileId id() const override { return id_; }
  Result<FileInfo> Info() override {
    FileInfo fi;
    fi.id = id_;
    fi.name = WriteLogName(id_);
    fi.kind = FileKind::kWriteLog;
    fi.size = bytes_.size();
    return fi;
  }
  uint64_t size() override { return bytes_.size(); }
  Status Read(uint64_t offset, void* buf, size_t len) override {
    if (offset > bytes_.size() || len > bytes_.size() - offset) {
      Fail(kTarget, "reader read past the end of the log");
    }
    std::memcpy(buf, bytes_.data() + offset, len);
    return Status::Ok();
  }
  Status Write(uint64_t, const void*, size_t) override { return Status::Invalid("read-only"); }
  Result<std::unique_ptr<InPlaceWrite>> PrepareInPlaceWrite(uint64_t, size_t) override {
    return Status::Invalid("read-only");
  }
  Status Trim(uint64_t, uint64_t) override { return Status::Invalid("read-only"); }
  Status Truncate(uint64_t) override { return Status::Invalid("read-only"); }
  Status SetDedup(bool) override { return Status::Invalid("read-only"); }
  Status Flush() override { return Status::Ok(); }
  uint64_t cow_copies() override { return 0; }
  Result<uint32_t> BlockRefCount(uint64_t) override { return uint32_t{1}; }
  Result<uint32_t> TryBlockRefCount(uint64_t) override { return uint32_t{1}; }
  Status TakeBlockGroup(uint64_t) override { return Status::Ok(); }
  Status Punch(uint64_t) override { return Status::Invalid("read-only"); }
  Status TryPunch(uint64_t) override { return Status::Invalid("read-only"); }
  Result<FileUsage> Usage() override { return FileUsage{}; }
  Result<bool> WantedElsewhere() override { return false; }

 private:
  FileId id_;
  std::vector<uint8_t> bytes_;
};

MonitorBatch SampleBatch(HashAlgo algo, FileId owner, uint64_t salt) {
  MonitorBatch b;
  b.file = owner;
  const uint64_t t0 = 1'700'000'000'000'000'000ull + salt;
  b.invalidated.push_back(InvalidRange{salt % 7, 3, t0});
  for (uint64_t i = 0; i < 5; i++) {
    const uint8_t data[8] = {static_cast<uint8_t>(salt), static_cast<uint8_t>(i)};
    b.records.push_back(BlockRecord{20 + i * 2, t0 + i * 1'000'000, ComputeFingerprint(algo, data, 8)});
  }
  b.first_ns = t0;
  b.last_ns = t0 + 4'000'000;
  return b;
}

void ReadLog(const Blk& input, HashAlgo algo, FileId owner) {
  std::vector<uint8_t> head = EncodeWriteLogFrames(SampleBatch(algo, owner, 1), 3, algo, kFuzzUuid, 0);
  std::vector<uint8_t> tail =
      EncodeWriteLogFrames(SampleBatch(algo, owner, 2), 4, algo, kFuzzUuid, 2 * kBlockSize);
  FUZZ_CHECK(head.size() == kBlockSize && tail.size() == kBlockSize, "sample frame size");
  std::vector<uint8_t> log = head;
  log.insert(log.end(), input.data(), input.data() + kBlockSize);
  log.insert(log.end(), tail.begin(), tail.end());
  MemFile file(owner, std::move(log));
  WriteLogReader reader(&file, algo, kFuzzUuid, owner);
  WriteLogFrame f;
  std::vector<WriteLogFrame> frames;
  while (true) {
    Result<bool> more = reader.Next(&f);
    FUZZ_CHECK(more.ok(), "reader failed in memory: " + more.status().ToString());
    if (!*more) break;
    FUZZ_CHECK(frames.empty() ||
                   f.log_offset >= frames.back().log_offset + frames.back().encoded_bytes,
               "reader went backwards or overlapped frames");
    CheckInvariants(f, algo, 3 * kBlockSize - f.log_offset);
    frames.push_back(f);
  }
  FUZZ_CHECK(!frames.empty() && frames.front().log_offset == 0 && frames.front().host_id == 3,
             "the first valid frame was not read");
  const WriteLogFrame& last = frames.back();
  const bool tail_read = last.log_offset == 2 * kBlockSize && last.host_id == 4;
  const bool tail_covered = last.log_offset == kBlockSize && last.encoded_bytes > kBlockSize;
  FUZZ_CHECK(tail_read || tail_covered, "a valid frame after the input was skipped");
  const WriteLogScanStats& st = reader.stats();
  FUZZ_CHECK(st.frames == frames.size(), "frame count");
  uint64_t valid_bytes = 0;
  for (const WriteLogFrame& x : frames) valid_bytes += x.encoded_bytes;
  FUZZ_CHECK(st.skipped_bytes + valid_bytes == 3 * kBlockSize, "skipped bytes do not add up");
  FUZZ_CHECK((st.skipped_bytes == 0) == (st.corrupt_frames == 0), "corrupt count vs skipped");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  std::vector<Blk> seeds;
  auto add = [&](const MonitorBatch& b, HashAlgo algo, uint64_t offset) {
    std::vector<uint8_t> enc = EncodeWriteLogFrames(b, 2, algo, kFuzzUuid, offset);
    seeds.emplace_back(enc.data(), enc.size());
  };
  const FileId owner{5, 2};
  add(SampleBatch(HashAlgo::kXxh128, owner, 1), HashAlgo::kXxh128, 0);
  add(SampleBatch(HashAlgo::kSha256, owner, 9), HashAlgo::kSha256, 8192);
  MonitorBatch shed;
  shed.file = FileId{77, 1};
  shed.dropped_records = 12;
  shed.dropped_since_ns = 1'700'000'000'000'000'000ull;
  add(shed, HashAlgo::kXxh128, 1 << 20);
  MonitorBatch many;
  many.file = FileId{3, 9};
  many.invalidated.push_back(InvalidRange{0, (uint64_t{100} << 30) / kBlockSize, 5'000'000});
  for (uint64_t i = 0; i < 100; i++) {
    const uint8_t data[2] = {static_cast<uint8_t>(i), 1};
    many.records.push_back(BlockRecord{(uint64_t{100} << 30) / kBlockSize + 1 + i,
                                       5'000'000 + i * 3'000'000,
                                       ComputeFingerprint(HashAlgo::kXxh128, data, 2)});
  }
  add(many, HashAlgo::kXxh128, 4096);
  MaybeWriteSeeds(kTarget, seeds);
  return 0;
}

// ParseWriteLogName: a pass finds logs by name in the listing; whatever
// name it accepts must be the one WriteLogName gives its owner.
void FuzzName(const uint8_t* data, size_t size) {
  const std::string s(reinterpret_cast<const char*>(data), size < 64 ? size : 64);
  const std::string prefix = ".dede-wlog-";
  for (const std::string& name : {s, prefix + s}) {
    // Shorter than the prefix: libstdc++'s string::compare subtracts the
    // lengths as unsigned (well defined), which the instrumented build's
    // unsigned-overflow trap flags.
    if (name.size() < prefix.size()) continue;
    if (std::optional<FileId> id = ParseWriteLogName(name)) {
      FUZZ_CHECK(WriteLogName(*id) == name, "write log name");
    }
  }
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzName(data, size);
  const Blk raw(data, size);
  const HashAlgo algo = AlgoOf(raw.data());
  const FileId owner = OwnerOf(raw.data());
  const uint64_t offset = DecodeU64(raw.data() + kLogOffset);
  DecodeOne(raw.data(), kBlockSize, algo, owner, offset);
  // Every length a reader might pass (torn tails), and a misplaced frame.
  DecodeOne(raw.data(), size < kBlockSize ? size : kBlockSize, algo, owner, offset);
  DecodeOne(raw.data(), kBlockSize, algo, owner, offset + kBlockSize);

  for (int variant = 0; variant < 2; variant++) {
    Blk fixed(raw);
    uint8_t* p = fixed.data();
    EncodeU32(p, kMagicWriteLogFrame);
    if (variant == 1) {
      EncodeU16(p + kMajor, kWriteLogMajor);
      EncodeU16(p + kMinor, kWriteLogMinor);
    }
    const uint32_t max_payload = kBlockSize - kWriteLogHeaderSize;
    const uint32_t payload = DecodeU32(p + kPayloadBytes) % (max_payload + 1);
    EncodeU32(p + kPayloadBytes, payload);
    EncodeU32(p + kPayloadCrc, Crc32c(p + kWriteLogHeaderSize, payload));
    SealHeader(p, kFuzzUuid, owner, offset);
    DecodeOne(p, kBlockSize, algo, owner, offset);
    // The fixed-up frame as the middle of a log (its offset must be 4096
    // there: reseal for it).
    Blk mid(fixed);
    EncodeU64(mid.data() + kLogOffset, kBlockSize);
    SealHeader(mid.data(), kFuzzUuid, owner, kBlockSize);
    ReadLog(mid, algo, owner);
  }
  ReadLog(raw, algo, owner);
  return 0;
}
