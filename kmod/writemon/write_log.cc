#include "kmod/writemon/write_log.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <limits>

#include "util/coding.h"
#include "util/crc32c.h"

namespace dede {

namespace {

// Frame header layout (docs/FORMAT.md, "Write log").
constexpr size_t kOffHeaderCrc = 8;
constexpr size_t kOffReservedTail = 100;  // bytes 100..127 are reserved

constexpr uint32_t kKnownFrameFlags = kFrameRecordsDropped;
constexpr uint32_t kMaxPayloadBytes = kWriteLogMaxFrameBytes - kWriteLogHeaderSize;
// Payload entries: range = first u64, count u64, time u32; record = block
// u64, time u32, fingerprint.
constexpr size_t kRangeBytes = 20;
constexpr size_t kRecordFixedBytes = 12;
// Block indexes of a file (u64 bytes / 4 KiB); first + count never wraps.
constexpr uint64_t kBlockLimit = uint64_t{1} << 52;
constexpr uint64_t kNsPerMs = 1'000'000;
// The reader reads the log this much at a time.
constexpr size_t kReadChunk = size_t{4} << 20;

uint64_t RoundUpToBlock(uint64_t n) { return (n + kBlockSize - 1) / kBlockSize * kBlockSize; }

uint32_t HeaderCrc(const uint8_t* hdr, const Uuid& uuid, FileId owner, uint64_t log_offset) {
  uint8_t prefix[16 + 24];
  std::memcpy(prefix, uuid.data(), 16);
  EncodeU64(prefix + 16, owner.ino);
  EncodeU64(prefix + 24, owner.generation);
  EncodeU64(prefix + 32, log_offset);
  static const uint8_t kZero[4] = {0, 0, 0, 0};
  uint32_t crc = Crc32cExtend(0, prefix, sizeof prefix);
  crc = Crc32cExtend(crc, hdr, kOffHeaderCrc);
  crc = Crc32cExtend(crc, kZero, 4);
  return Crc32cExtend(crc, hdr + kOffHeaderCrc + 4, kWriteLogHeaderSize - kOffHeaderCrc - 4);
}

// Times are stored as u32 milliseconds after the frame's first_ns (49 days
// of range; a later time is clamped, which only makes it look older).
uint32_t RelMs(uint64_t t, uint64_t first_ns) {
  const uint64_t ms = (t - first_ns) / kNsPerMs;
  return static_cast<uint32_t>(std::min<uint64_t>(ms, std::numeric_limits<uint32_t>::max()));
}

std::string Hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08" PRIx32, v);
  return buf;
}

// Which entries of a batch go into which frame.
struct FramePlan {
  size_t range_begin = 0, range_end = 0;
  size_t record_begin = 0, record_end = 0;
  uint64_t payload_bytes = 0;
  uint64_t frame_bytes = 0;  // padded
};

std::vector<FramePlan> PlanFrames(const MonitorBatch& batch, HashAlgo algo) {
  std::vector<FramePlan> plans;
  const size_t record_bytes = WriteLogRecordBytes(algo);
  const size_t nranges = batch.invalidated.size(), nrecords = batch.records.size();
  size_t ri = 0, ci = 0;
  // A batch with only shed records still gets a frame: the log must learn
  // it is incomplete.
  bool need_frame = nranges > 0 || nrecords > 0 || batch.dropped_records > 0;
  while (need_frame) {
    FramePlan p;
    p.range_begin = ri;
    p.record_begin = ci;
    const size_t take_ranges = std::min<size_t>(nranges - ri, kMaxPayloadBytes / kRangeBytes);
    ri += take_ranges;
    p.payload_bytes = take_ranges * kRangeBytes;
    const size_t take_records =
        std::min<size_t>(nrecords - ci, (kMaxPayloadBytes - p.payload_bytes) / record_bytes);
    ci += take_records;
    p.payload_bytes += take_records * record_bytes;
    p.range_end = ri;
    p.record_end = ci;
    p.frame_bytes = RoundUpToBlock(kWriteLogHeaderSize + p.payload_bytes);
    plans.push_back(p);
    need_frame = ri < nranges || ci < nrecords;
  }
  return plans;
}

void EncodeFrame(const MonitorBatch& batch, const FramePlan& p, bool first_frame,
                 uint32_t host_id, HashAlgo algo, const Uuid& uuid, uint64_t log_offset,
                 uint8_t* out) {
  const size_t fp_size = HashAlgoSize(algo);
  // The frame's time range is that of its own entries.
  uint64_t first_ns = std::numeric_limits<uint64_t>::max(), last_ns = 0;
  for (size_t i = p.range_begin; i < p.range_end; i++) {
    first_ns = std::min(first_ns, batch.invalidated[i].time_ns);
    last_ns = std::max(last_ns, batch.invalidated[i].time_ns);
  }
  for (size_t i = p.record_begin; i < p.record_end; i++) {
    first_ns = std::min(first_ns, batch.records[i].time_ns);
    last_ns = std::max(last_ns, batch.records[i].time_ns);
  }
  if (p.range_begin == p.range_end && p.record_begin == p.record_end) {
    first_ns = batch.first_ns;
    last_ns = std::max(batch.first_ns, batch.last_ns);
  }

  uint8_t* payload = out + kWriteLogHeaderSize;
  Encoder pe(payload, p.payload_bytes);
  for (size_t i = p.range_begin; i < p.range_end; i++) {
    const InvalidRange& r = batch.invalidated[i];
    pe.u64(r.first);
    pe.u64(r.count);
    pe.u32(RelMs(r.time_ns, first_ns));
  }
  for (size_t i = p.record_begin; i < p.record_end; i++) {
    const BlockRecord& r = batch.records[i];
    pe.u64(r.block);
    pe.u32(RelMs(r.time_ns, first_ns));
    pe.bytes(r.fp.bytes.data(), fp_size);
  }
  const uint64_t dropped = first_frame ? batch.dropped_records : 0;
  const uint64_t dropped_since = dropped > 0 ? batch.dropped_since_ns : 0;

  Encoder e(out, kWriteLogHeaderSize);
  e.u32(kMagicWriteLogFrame);
  e.u16(kWriteLogMajor);
  e.u16(kWriteLogMinor);
  e.u32(0);  // header crc, below
  e.u32(Crc32c(payload, p.payload_bytes));
  e.u32(dropped > 0 ? kFrameRecordsDropped : 0);
  e.u32(host_id);
  e.u16(static_cast<uint16_t>(algo));
  e.u16(static_cast<uint16_t>(fp_size));
  e.u32(0);  // reserved
  e.u64(batch.file.ino);
  e.u64(batch.file.generation);
  e.u64(log_offset);
  e.u64(first_ns);
  e.u64(last_ns);
  e.u64(dropped);
  e.u64(dropped_since);
  e.u32(static_cast<uint32_t>(p.range_end - p.range_begin));
  e.u32(static_cast<uint32_t>(p.record_end - p.record_begin));
  e.u32(static_cast<uint32_t>(p.payload_bytes));
  e.zeros(kWriteLogHeaderSize - e.pos());
  EncodeU32(out + kOffHeaderCrc, HeaderCrc(out, uuid, batch.file, log_offset));
}

// The batch invariants the decoder insists on, checked before anything is
// written so a caller's bug cannot put an unreadable frame in a log.
Status CheckBatch(const MonitorBatch& batch, HashAlgo algo) {
  const std::string where = "write log batch of file " + std::to_string(batch.file.ino) + "." +
                            std::to_string(batch.file.generation) + ": ";
  uint64_t prev_end = 0;
  for (size_t i = 0; i < batch.invalidated.size(); i++) {
    const InvalidRange& r = batch.invalidated[i];
    if (r.count == 0 || r.first >= kBlockLimit || r.count > kBlockLimit - r.first ||
        (i > 0 && r.first <= prev_end)) {
      return Status::Invalid(where + "invalidated range " + std::to_string(i) +
                             " is empty, out of range, or out of order");
    }
    prev_end = r.first + r.count;
  }
  size_t ri = 0;
  for (size_t i = 0; i < batch.records.size(); i++) {
    const BlockRecord& r = batch.records[i];
    if (r.block >= kBlockLimit || (i > 0 && r.block <= batch.records[i - 1].block)) {
      return Status::Invalid(where + "record " + std::to_string(i) + " out of range or order");
    }
    if (r.fp.size != HashAlgoSize(algo)) {
      return Status::Invalid(where + "record " + std::to_string(i) + " has a " +
                             std::to_string(r.fp.size) + "-byte fingerprint, the volume uses " +
                             HashAlgoName(algo));
    }
    while (ri < batch.invalidated.size() &&
           batch.invalidated[ri].first + batch.invalidated[ri].count <= r.block) {
      ri++;
    }
    if (ri < batch.invalidated.size() && batch.invalidated[ri].first <= r.block) {
      return Status::Invalid(where + "record " + std::to_string(i) +
                             " lies in an invalidated range");
    }
  }
  return Status::Ok();
}

}  // namespace

std::string WriteLogName(FileId owner) {
  return ".dede-wlog-" + std::to_string(owner.ino) + "-" + std::to_string(owner.generation);
}

std::optional<FileId> ParseWriteLogName(const std::string& name) {
  static const std::string kPrefix = ".dede-wlog-";
  if (name.compare(0, kPrefix.size(), kPrefix) != 0) return std::nullopt;
  // Two canonical decimal numbers: no sign, no leading zero, no overflow.
  auto number = [&](size_t* pos, char stop, uint64_t* out) {
    const size_t start = *pos;
    uint64_t v = 0;
    while (*pos < name.size() && name[*pos] != stop) {
      const char c = name[*pos];
      if (c < '0' || c > '9') return false;
      const uint64_t digit = static_cast<uint64_t>(c - '0');
      if (v > (std::numeric_limits<uint64_t>::max() - digit) / 10) return false;
      v = v * 10 + digit;
      ++*pos;
    }
    const size_t len = *pos - start;
    if (len == 0 || (len > 1 && name[start] == '0')) return false;
    *out = v;
    return true;
  };
  FileId id;
  size_t pos = kPrefix.size();
  if (!number(&pos, '-', &id.ino) || pos == name.size()) return std::nullopt;
  pos++;  // '-'
  if (!number(&pos, '\0', &id.generation) || pos != name.size()) return std::nullopt;
  return id;
}

size_t WriteLogRecordBytes(HashAlgo algo) { return kRecordFixedBytes + HashAlgoSize(algo); }
size_t WriteLogRangeBytes() { return kRangeBytes; }

uint64_t EncodedWriteLogBytes(const MonitorBatch& batch, HashAlgo algo) {
  uint64_t n = 0;
  for (const FramePlan& p : PlanFrames(batch, algo)) n += p.frame_bytes;
  return n;
}

std::vector<uint8_t> EncodeWriteLogFrames(const MonitorBatch& batch, uint32_t host_id,
                                          HashAlgo algo, const Uuid& uuid,
                                          uint64_t log_offset) {
  std::vector<uint8_t> out;
  EncodeWriteLogFrames(batch, host_id, algo, uuid, log_offset, &out);
  return out;
}

void EncodeWriteLogFrames(const MonitorBatch& batch, uint32_t host_id, HashAlgo algo,
                          const Uuid& uuid, uint64_t log_offset, std::vector<uint8_t>* out) {
  const std::vector<FramePlan> plans = PlanFrames(batch, algo);
  uint64_t total = 0;
  for (const FramePlan& p : plans) total += p.frame_bytes;
  out->assign(total, 0);  // zeros: the padding
  uint64_t pos = 0;
  for (size_t i = 0; i < plans.size(); i++) {
    EncodeFrame(batch, plans[i], i == 0, host_id, algo, uuid, log_offset + pos, out->data() + pos);
    pos += plans[i].frame_bytes;
  }
}

Result<WriteLogFrame> DecodeWriteLogFrame(const uint8_t* buf, size_t len, HashAlgo algo,
                                          const Uuid& uuid, FileId owner, uint64_t log_offset,
                                          uint64_t* frame_bytes) {
  if (frame_bytes != nullptr) *frame_bytes = 0;
  auto corrupt = [&](const std::string& what) {
    return Status::Corruption("write log " + WriteLogName(owner) + " frame at offset " +
                              std::to_string(log_offset) + ": " + what);
  };
  if (len < kWriteLogHeaderSize) {
    return corrupt("truncated header (" + std::to_string(len) + " of " +
                   std::to_string(kWriteLogHeaderSize) + " bytes)");
  }
  Decoder d(buf, kWriteLogHeaderSize);
  const uint32_t magic = d.u32();
  const uint16_t major = d.u16();
  const uint16_t minor = d.u16();
  const uint32_t header_crc = d.u32();
  const uint32_t payload_crc = d.u32();
  const uint32_t flags = d.u32();
  const uint32_t host_id = d.u32();
  const uint16_t algo_field = d.u16();
  const uint16_t fp_size = d.u16();
  const uint32_t reserved = d.u32();
  FileId frame_owner;
  frame_owner.ino = d.u64();
  frame_owner.generation = d.u64();
  const uint64_t frame_offset = d.u64();
  const uint64_t first_ns = d.u64();
  const uint64_t last_ns = d.u64();
  const uint64_t dropped = d.u64();
  const uint64_t dropped_since = d.u64();
  const uint32_t nranges = d.u32();
  const uint32_t nrecords = d.u32();
  const uint32_t payload_bytes = d.u32();

  if (magic != kMagicWriteLogFrame) {
    return corrupt("bad magic " + Hex32(magic) + " (expected " + Hex32(kMagicWriteLogFrame) + ")");
  }
  const uint32_t computed = HeaderCrc(buf, uuid, owner, log_offset);
  if (header_crc != computed) {
    return corrupt("header crc mismatch (stored " + Hex32(header_crc) + ", computed " +
                   Hex32(computed) + ")");
  }
  if (major > kWriteLogMajor) {
    return Status::Unsupported("write log " + WriteLogName(owner) + " frame at offset " +
                               std::to_string(log_offset) + ": format version " +
                               std::to_string(major) + "." + std::to_string(minor) +
                               " is newer than this dede supports (" +
                               std::to_string(kWriteLogMajor) + "." +
                               std::to_string(kWriteLogMinor) + ")");
  }
  if (major == 0) return corrupt("format version 0");
  // The crc already binds owner and offset; these say which one is wrong
  // only for a writer that sealed a frame with fields it did not mean.
  if (frame_offset != log_offset) return corrupt("frame claims offset " + std::to_string(frame_offset));
  if (!(frame_owner == owner)) {
    return corrupt("frame belongs to file " + std::to_string(frame_owner.ino) + "." +
                   std::to_string(frame_owner.generation));
  }
  if (log_offset % kBlockSize != 0) return corrupt("offset is not 4 KiB-aligned");
  if ((flags & ~kKnownFrameFlags) != 0) return corrupt("unknown flags " + Hex32(flags));
  if (minor <= kWriteLogMinor) {
    // A newer minor may use reserved bytes; ours must leave them zero.
    bool zero = reserved == 0;
    for (size_t i = kOffReservedTail; i < kWriteLogHeaderSize; i++) zero = zero && buf[i] == 0;
    if (!zero) return corrupt("reserved header bytes are not zero");
  }
  if (algo_field != static_cast<uint16_t>(algo)) {
    return corrupt("hash algorithm " + std::to_string(algo_field) + " (the volume uses " +
                   HashAlgoName(algo) + ")");
  }
  if (fp_size != HashAlgoSize(algo)) {
    return corrupt("fingerprint size " + std::to_string(fp_size) + " (expected " +
                   std::to_string(HashAlgoSize(algo)) + ")");
  }
  if (((flags & kFrameRecordsDropped) != 0) != (dropped > 0) ||
      (dropped == 0 && dropped_since != 0)) {
    return corrupt("dropped-records flag, count and time disagree");
  }
  if (first_ns > last_ns) return corrupt("time range ends before it starts");
  if (nranges == 0 && nrecords == 0 && dropped == 0) return corrupt("empty frame");
  if (payload_bytes > kMaxPayloadBytes) {
    return corrupt("payload of " + std::to_string(payload_bytes) + " bytes exceeds the frame limit");
  }
  const size_t record_bytes = kRecordFixedBytes + fp_size;
  if (payload_bytes != uint64_t{nranges} * kRangeBytes + uint64_t{nrecords} * record_bytes) {
    return corrupt(std::to_string(nranges) + " ranges and " + std::to_string(nrecords) +
                   " records do not fit a payload of " + std::to_string(payload_bytes) + " bytes");
  }
  const uint64_t padded = RoundUpToBlock(kWriteLogHeaderSize + uint64_t{payload_bytes});

  // The header is sound: a caller can step over this frame.
  if (frame_bytes != nullptr) *frame_bytes = padded;
  if (len < padded) {
    return corrupt("frame cut short (" + std::to_string(len) + " of " + std::to_string(padded) +
                   " bytes)");
  }
  const uint8_t* payload = buf + kWriteLogHeaderSize;
  const uint32_t computed_payload = Crc32c(payload, payload_bytes);
  if (payload_crc != computed_payload) {
    return corrupt("payload crc mismatch (stored " + Hex32(payload_crc) + ", computed " +
                   Hex32(computed_payload) + ")");
  }
  for (uint64_t i = kWriteLogHeaderSize + uint64_t{payload_bytes}; i < padded; i++) {
    if (buf[i] != 0) return corrupt("padding byte " + std::to_string(i) + " is not zero");
  }

  WriteLogFrame f;
  f.log_offset = log_offset;
  f.host_id = host_id;
  f.owner = owner;
  f.first_ns = first_ns;
  f.last_ns = last_ns;
  f.dropped_records = dropped;
  f.dropped_since_ns = dropped_since;
  f.encoded_bytes = padded;
  const uint64_t span = last_ns - first_ns;
  auto time_of = [&](uint32_t ms, uint64_t* t) {
    if (uint64_t{ms} * kNsPerMs > span) return false;
    *t = first_ns + uint64_t{ms} * kNsPerMs;
    return true;
  };
  Decoder pd(payload, payload_bytes);
  f.invalidated.resize(nranges);
  uint64_t prev_end = 0;
  for (uint32_t i = 0; i < nranges; i++) {
    InvalidRange& r = f.invalidated[i];
    r.first = pd.u64();
    r.count = pd.u64();
    const uint32_t ms = pd.u32();
    auto bad = [&](const char* what) {
      return corrupt("invalidated range " + std::to_string(i) + what);
    };
    if (r.count == 0) return bad(" is empty");
    if (r.first >= kBlockLimit || r.count > kBlockLimit - r.first) {
      return bad(" is past the largest file");
    }
    if (i > 0 && r.first <= prev_end) return bad(" overlaps or touches the previous one");
    if (!time_of(ms, &r.time_ns)) return bad(" has a time past last_ns");
    prev_end = r.first + r.count;
  }
  f.records.resize(nrecords);
  uint32_t ri = 0;  // first range that may hold the current record
  for (uint32_t i = 0; i < nrecords; i++) {
    BlockRecord& r = f.records[i];
    r.block = pd.u64();
    const uint32_t ms = pd.u32();
    r.fp.size = static_cast<uint8_t>(fp_size);
    pd.bytes(r.fp.bytes.data(), fp_size);
    auto bad = [&](const char* what) { return corrupt("record " + std::to_string(i) + what); };
    if (r.block >= kBlockLimit) return bad(" is past the largest file");
    if (i > 0 && r.block <= f.records[i - 1].block) return bad(" is out of order");
    if (!time_of(ms, &r.time_ns)) return bad(" has a time past last_ns");
    while (ri < nranges && f.invalidated[ri].first + f.invalidated[ri].count <= r.block) ri++;
    if (ri < nranges && f.invalidated[ri].first <= r.block) {
      return bad(" lies in an invalidated range");
    }
  }
  return f;
}

// ---------------------------------------------------------------- reader

WriteLogReader::WriteLogReader(File* log, HashAlgo algo, const Uuid& uuid, FileId owner)
    : log_(log), algo_(algo), uuid_(uuid), owner_(owner), size_(log->size()) {}

Status WriteLogReader::Fill(uint64_t offset, size_t want) {
  const uint64_t n = std::min<uint64_t>(std::max(want, kReadChunk), size_ - offset);
  buf_.resize(n);
  buf_offset_ = offset;
  Status st = log_->Read(offset, buf_.data(), n);
  if (!st.ok()) {
    buf_.clear();
    return st.WithContext("reading write log " + WriteLogName(owner_) + " at offset " +
                          std::to_string(offset));
  }
  return Status::Ok();
}

Result<bool> WriteLogReader::Next(WriteLogFrame* out) {
  while (pos_ < size_) {
    const uint64_t rest = size_ - pos_;
    // Buffered bytes from pos_ on (the buffer always starts at or before pos_).
    auto avail = [&]() -> uint64_t {
      const uint64_t buf_end = buf_offset_ + buf_.size();
      return pos_ >= buf_offset_ && pos_ < buf_end ? buf_end - pos_ : 0;
    };
    if (avail() < std::min<uint64_t>(kBlockSize, rest)) RETURN_IF_ERROR(Fill(pos_, kBlockSize));
    uint64_t frame_bytes = 0;
    Result<WriteLogFrame> r =
        DecodeWriteLogFrame(buf_.data() + (pos_ - buf_offset_), avail(), algo_, uuid_, owner_,
                            pos_, &frame_bytes);
    if (!r.ok() && frame_bytes > avail() && avail() < rest) {
      // A sound header whose frame runs past the buffer: read it whole.
      RETURN_IF_ERROR(Fill(pos_, std::min<uint64_t>(frame_bytes, rest)));
      r = DecodeWriteLogFrame(buf_.data(), avail(), algo_, uuid_, owner_, pos_, &frame_bytes);
    }
    if (r.ok()) {
      WriteLogFrame& f = r.value();
      stats_.frames++;
      stats_.records += f.records.size();
      stats_.invalidations += f.invalidated.size();
      stats_.dropped_records += f.dropped_records;
      if (f.dropped_since_ns != 0 &&
          (stats_.dropped_since_ns == 0 || f.dropped_since_ns < stats_.dropped_since_ns)) {
        stats_.dropped_since_ns = f.dropped_since_ns;
      }
      pos_ += f.encoded_bytes;
      in_bad_run_ = false;
      *out = std::move(f);
      return true;
    }
    // Not a frame here. A sound header (bad payload, torn tail) is a frame
    // of its own; otherwise this block continues the current bad run. Step
    // one block either way: the next valid header may lie inside the bad
    // frame's extent (an append after a torn one).
    if (frame_bytes > 0 || !in_bad_run_) stats_.corrupt_frames++;
    if (r.status().code() == Status::Code::kUnsupported) stats_.newer_frames++;
    in_bad_run_ = true;
    const uint64_t step = std::min<uint64_t>(kBlockSize, rest);
    stats_.skipped_bytes += step;
    pos_ += step;
  }
  return false;
}

Result<WriteLogState> ReplayWriteLog(File* log, HashAlgo algo, const Uuid& uuid, FileId owner,
                                     size_t max_entries) {
  WriteLogState state;
  WriteLogReader reader(log, algo, uuid, owner);
  WriteLogFrame f;
  uint64_t newest_ns = 0;
  while (true) {
    ASSIGN_OR_RETURN(bool more, reader.Next(&f));
    if (!more) break;
    newest_ns = std::max(newest_ns, f.last_ns);
    for (const InvalidRange& r : f.invalidated) newest_ns = std::max(newest_ns, r.time_ns);
    state.saturated = IsSaturationFrame(f);
    if (state.over_budget) continue;  // only the times and the stats now
    state.invalidated.insert(state.invalidated.end(), f.invalidated.begin(), f.invalidated.end());
    for (const InvalidRange& r : f.invalidated) {
      // Only the records present are visited: a whole-disk TRIM is cheap.
      auto it = state.records.lower_bound(r.first);
      const uint64_t end = r.first + r.count;
      while (it != state.records.end() && it->first < end) it = state.records.erase(it);
    }
    for (const BlockRecord& r : f.records) state.records.insert_or_assign(r.block, r);
    if (state.records.size() + state.invalidated.size() > max_entries) {
      state.over_budget = true;
      std::map<uint64_t, BlockRecord>().swap(state.records);
      std::vector<InvalidRange>().swap(state.invalidated);
    }
  }
  if (state.over_budget) {
    state.invalidated.push_back(InvalidRange{0, kWriteLogWholeFileBlocks, newest_ns});
  }
  state.stats = reader.stats();
  return state;
}

// ---------------------------------------------------------------- on the volume

namespace {
Status CheckIsLogOf(File* log, FileId owner) {
  ASSIGN_OR_RETURN(FileInfo info, log->Info());
  if (info.kind != FileKind::kWriteLog || info.owner_ino != owner.ino) {
    return Status::Corruption("'" + info.name + "' is a " + FileKindName(info.kind) +
                              " of owner inode " + std::to_string(info.owner_ino) +
                              ", not the write log of inode " + std::to_string(owner.ino));
  }
  return Status::Ok();
}
}  // namespace

bool IsSaturationFrame(const WriteLogFrame& frame) {
  return frame.records.empty() && frame.invalidated.size() == 1 &&
         frame.invalidated[0].first == 0 &&
         frame.invalidated[0].count == kWriteLogWholeFileBlocks;
}

Status AppendToWriteLog(Volume* vol, const MonitorBatch& batch, uint64_t max_log_bytes,
                        LogAppendOutcome* outcome) {
  if (batch.empty()) return Status::Ok();
  const Superblock& sb = vol->superblock();
  RETURN_IF_ERROR(CheckBatch(batch, sb.hash_algo));
  Result<std::unique_ptr<File>> opened = OpenOrCreateWriteLog(vol, batch.file);
  if (!opened.ok()) return opened.status();  // kLocked: the caller keeps the batch
  return AppendToOpenWriteLog(vol, opened.value().get(), batch, max_log_bytes, outcome);
}

Result<std::unique_ptr<File>> OpenOrCreateWriteLog(Volume* vol, FileId owner) {
  const std::string name = WriteLogName(owner);
  Result<std::unique_ptr<File>> opened = vol->OpenFile(name);
  if (!opened.ok() && opened.status().code() == Status::Code::kNotFound) {
    Result<FileId> created = vol->Create(name, 0, FileKind::kWriteLog, owner.ino);
    // kExists: another host created it first; use theirs.
    if (!created.ok() && created.status().code() != Status::Code::kExists) {
      return created.status().WithContext("creating write log " + name);
    }
    opened = vol->OpenFile(name);
  }
  if (!opened.ok()) return opened.status();
  RETURN_IF_ERROR(CheckIsLogOf(opened.value().get(), owner));
  return opened;
}

namespace {
// Whether the log of `owner` (size `size`) ends in a saturation frame. A
// saturation frame takes one 4 KiB block, so it is the last block; a log
// whose size is not block-aligned ends in a torn append, not in one.
Result<bool> EndsSaturated(File* log, uint64_t size, const Superblock& sb, FileId owner) {
  if (size < kBlockSize || size % kBlockSize != 0) return false;
  thread_local std::vector<uint8_t> tail;
  tail.resize(kBlockSize);
  const uint64_t at = size - kBlockSize;
  RETURN_IF_ERROR(log->Read(at, tail.data(), kBlockSize));
  Result<WriteLogFrame> f =
      DecodeWriteLogFrame(tail.data(), kBlockSize, sb.hash_algo, sb.uuid, owner, at, nullptr);
  return f.ok() && IsSaturationFrame(*f);
}

// The frame that stands for `batch` (and everything after it) in a log at
// its limit: every block may have changed, as of the batch's newest change.
MonitorBatch SaturationBatch(const MonitorBatch& batch) {
  MonitorBatch sat;
  sat.file = batch.file;
  const uint64_t t = std::max(batch.first_ns, batch.last_ns);
  sat.invalidated.push_back(InvalidRange{0, kWriteLogWholeFileBlocks, t});
  sat.first_ns = sat.last_ns = t;
  sat.dropped_records = batch.entries();
  sat.dropped_since_ns = batch.oldest_ns();
  if (sat.dropped_since_ns == 0) sat.dropped_since_ns = t;
  return sat;
}
}  // namespace

Result<bool> WriteLogIsSaturated(Volume* vol, FileId owner) {
  Result<std::unique_ptr<File>> log = OpenWriteLog(vol, owner);
  if (!log.ok()) {
    if (log.status().code() == Status::Code::kNotFound) return false;
    return log.status();
  }
  ASSIGN_OR_RETURN(FileInfo info, (*log)->Info());
  return EndsSaturated(log->get(), info.size, vol->superblock(), owner);
}

Status AppendToOpenWriteLog(Volume* vol, File* log, const MonitorBatch& batch,
                            uint64_t max_log_bytes, LogAppendOutcome* outcome) {
  if (outcome != nullptr) *outcome = LogAppendOutcome::kAppended;
  if (batch.empty()) return Status::Ok();
  const Superblock& sb = vol->superblock();
  RETURN_IF_ERROR(CheckBatch(batch, sb.hash_algo));
  RETURN_IF_ERROR(CheckIsLogOf(log, batch.file));
  const std::string name = WriteLogName(batch.file);
  ASSIGN_OR_RETURN(FileInfo info, log->Info());
  // Frames start on 4 KiB boundaries, whatever a torn append left behind.
  const uint64_t offset = RoundUpToBlock(info.size);
  if (max_log_bytes > 0) {
    // Checked first, whatever this batch's size: a small batch could fit
    // under the limit after a saturation frame, and appending it would
    // end the saturation without a pass. (One 4 KiB read per append.)
    ASSIGN_OR_RETURN(bool saturated, EndsSaturated(log, info.size, sb, batch.file));
    if (saturated) {
      if (outcome != nullptr) *outcome = LogAppendOutcome::kAlreadySaturated;
      return Status::Ok();
    }
    if (offset + EncodedWriteLogBytes(batch, sb.hash_algo) > max_log_bytes) {
      if (outcome != nullptr) *outcome = LogAppendOutcome::kSaturated;
      return AppendToOpenWriteLog(vol, log, SaturationBatch(batch));
    }
  }
  // Appends come from a few long-lived threads (the flusher, passes): each
  // keeps its encoding buffer, so an append does not fault in fresh pages
  // (7-30 us each on these guests). A buffer grown past 8 MiB by a rare
  // big batch is not kept.
  thread_local std::vector<uint8_t> frames;
  EncodeWriteLogFrames(batch, vol->host_id(), sb.hash_algo, sb.uuid, offset, &frames);
  struct ShrinkAfter {
    ~ShrinkAfter() {
      if (frames.capacity() > (size_t{8} << 20)) std::vector<uint8_t>().swap(frames);
    }
  } shrink_after;
  const std::string ctx = "appending to write log " + name + " at offset " + std::to_string(offset);
  RETURN_IF_ERROR(log->Truncate(offset + frames.size()).WithContext(ctx));
  Status st = log->Write(offset, frames.data(), frames.size());
  if (!st.ok()) {
    // Best effort: do not leave a half-written frame for readers to skip.
    Status undo = log->Truncate(info.size);
    (void)undo;
    return st.WithContext(ctx);
  }
  return Status::Ok();
}

// Three steps, each leaving a log that holds the batch if the next fails:
// the batch appended after the old frames; the batch written again over
// the log's front (frames already consumed); the log cut after that copy.
Status ReplaceOpenWriteLog(Volume* vol, File* log, const MonitorBatch& batch) {
  if (batch.empty()) return log->Truncate(0);
  const Superblock& sb = vol->superblock();
  ASSIGN_OR_RETURN(FileInfo info, log->Info());
  const uint64_t old_end = RoundUpToBlock(info.size);
  // A failed append cuts what it wrote: the old log is left as it was.
  RETURN_IF_ERROR(AppendToOpenWriteLog(vol, log, batch));
  // Frames carry their offset, so the front copy is encoded for offset 0.
  std::vector<uint8_t> front;
  EncodeWriteLogFrames(batch, vol->host_id(), sb.hash_algo, sb.uuid, 0, &front);
  // It must not reach the copy just appended, the one that makes a torn
  // front harmless. Rarely bigger than the whole old log (the batch came
  // from it): then the old frames stay, to be consumed again.
  if (front.size() > old_end) return Status::Ok();
  const std::string ctx = "rewriting write log " + WriteLogName(batch.file);
  RETURN_IF_ERROR(log->Write(0, front.data(), front.size()).WithContext(ctx));
  return log->Truncate(front.size()).WithContext(ctx);
}

MonitorBatch OptOutMarkerBatch(FileId file, uint64_t size_bytes, uint64_t now_ns) {
  const uint64_t blocks = (size_bytes + kBlockSize - 1) / kBlockSize;
  MonitorBatch batch;
  batch.file = file;
  if (blocks == 0) return batch;
  batch.invalidated.push_back(InvalidRange{0, std::min<uint64_t>(blocks, kBlockLimit), now_ns});
  batch.first_ns = batch.last_ns = now_ns;
  return batch;
}

Status AppendOptOutMarker(Volume* vol, FileId file, uint64_t size_bytes, uint64_t now_ns) {
  return AppendToWriteLog(vol, OptOutMarkerBatch(file, size_bytes, now_ns));
}

Result<std::unique_ptr<File>> OpenWriteLog(Volume* vol, FileId owner) {
  ASSIGN_OR_RETURN(std::unique_ptr<File> log, vol->OpenFile(WriteLogName(owner)));
  RETURN_IF_ERROR(CheckIsLogOf(log.get(), owner));
  return log;
}

}  // namespace dede
