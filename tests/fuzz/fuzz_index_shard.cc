// Fuzzes the index shard decoders (index/shard_format.h): DecodeShardHeader,
// DecodeEntryBlock, DecodeFileTableBlock, DecodePendingFrame and the file
// name parsers. A shard, pending file or name another host (or a torn
// write, or a bug) left on the volume must be refused cleanly.
//
// Input: [selector u8][depth u8][index u8][block...]. The selector's bit 0
// picks the hash algorithm, depth % 41 the shard depth (lo a fixed pattern
// aligned to it): together the geometry an entry block is decoded for.
// `index` is the block index (entry / file-table block) or first block
// (pending frame) the block is decoded at. The rest is one 4 KiB block
// (fuzz_util.h) for the block decoders; the pending frame decoder gets it
// both as that block and as a buffer of exactly its own length (torn
// frames; ASan sees any read past it). Each decoder also gets a "fixed-up"
// copy: magic stamped in, counts clamped, crcs recomputed, so the fuzzer
// reaches the checks behind the crc. The fixed-up pending frame is spread
// out (ExpandFrame) so that one input makes a multi-block frame.
//
// Properties: an error is kCorruption or kUnsupported and names what was
// decoded; a decoded header keeps the geometry and count invariants and
// re-encodes to the input block up to the bytes the decoder ignores; a
// decoded entry or file-table block re-encodes to exactly the input block
// (minus its unused tail and reserved bytes); a decoded pending frame
// re-encodes to a frame that decodes to the same records, canonically; a
// parsed file name is printed back as the same name.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "index/shard_format.h"
#include "tests/fuzz/fuzz_util.h"
#include "util/crc32c.h"

using namespace dede;
using namespace dede::fuzz;

namespace {

constexpr const char* kTarget = "fuzz_index_shard";
constexpr size_t kPrefix = 3;
const FileId kFile{7, 3};
const std::string kWhat = "fuzz shard";

// Shard header field offsets (EncodeShardHeader).
constexpr size_t kHdrMajor = 4, kHdrMinor = 6, kHdrCrc = 8, kHdrFlags = 12, kHdrEnd = 116;
constexpr size_t kHdrEntryCount = 40, kHdrEntryBlocks = 48, kHdrUnique = 56, kHdrShared = 64;
constexpr size_t kHdrDepth = 16, kHdrFpSize = 17, kHdrElided = 18, kHdrEntrySize = 19,
                 kHdrAlgo = 20, kHdrLo = 24, kHdrFileCount = 72, kHdrFileBlocks = 80;
// Entry / file-table blocks: magic, crc, count u16, reserved u16.
constexpr size_t kBlkCrc = 4, kBlkCount = 8;
// Pending frame header.
constexpr size_t kPfAlgo = 12, kPfCount = 16, kPfAt = 24, kPfPayloadCrc = 32, kPfEnd = 36;

struct Geometry {
  HashAlgo algo;
  ShardRange range;
  uint64_t index;
};

Geometry GeometryOf(const uint8_t* data, size_t size) {
  const uint8_t sel = size > 0 ? data[0] : 0;
  const uint32_t depth = size > 1 ? data[1] % (kMaxShardDepth + 1) : 0;
  Geometry g;
  g.algo = (sel & 1) ? HashAlgo::kSha256 : HashAlgo::kXxh128;
  g.range.depth = depth;
  g.range.lo = depth == 0 ? 0 : 0xa5c3'96e1'7b2d'4f08ull & ~((~0ull) >> depth);
  g.index = size > 2 ? data[2] : 1;
  return g;
}

ShardHeader HeaderFor(const Geometry& g) {
  ShardHeader h;
  h.range = g.range;
  h.algo = g.algo;
  h.entry_size = EntrySize(g.algo, g.range);
  return h;
}

void CheckError(const Status& s, const std::string& what) {
  FUZZ_CHECK(FailedCleanly(s), "error without a message");
  FUZZ_CHECK(s.code() == Status::Code::kCorruption || s.code() == Status::Code::kUnsupported,
             "unexpected error code: " + s.ToString());
  FUZZ_CHECK(s.message().find(what) != std::string::npos,
             "error does not name what was decoded: " + s.message());
}

bool SameHeader(const ShardHeader& a, const ShardHeader& b) {
  return a.range == b.range && a.version == b.version && a.algo == b.algo &&
         a.entry_size == b.entry_size && a.entry_count == b.entry_count &&
         a.entry_blocks == b.entry_blocks && a.unique_count == b.unique_count &&
         a.shared_count == b.shared_count && a.file_count == b.file_count &&
         a.file_blocks == b.file_blocks && a.arena_next == b.arena_next &&
         a.created_ns == b.created_ns && a.update_ns == b.update_ns && a.host_id == b.host_id;
}

// ---------------------------------------------------------------- header

void DecodeHeader(const Blk& blk) {
  Result<ShardHeader> r = DecodeShardHeader(blk.data(), kFuzzUuid, kFile, kWhat);
  if (!r.ok()) {
    CheckError(r.status(), kWhat);
    return;
  }
  const ShardHeader& h = *r;
  FUZZ_CHECK(h.range.depth <= kMaxShardDepth, "depth");
  FUZZ_CHECK(h.range.depth == 0 ? h.range.lo == 0 : (h.range.lo & ((~0ull) >> h.range.depth)) == 0,
             "lo not aligned");
  FUZZ_CHECK(h.algo == HashAlgo::kXxh128 || h.algo == HashAlgo::kSha256, "algo");
  FUZZ_CHECK(h.entry_size == EntrySize(h.algo, h.range), "entry size");
  const uint64_t per = EntriesPerBlock(h.entry_size);
  FUZZ_CHECK(per >= 1 && per <= 0xffff, "entries per block");
  // Exact (no wrap-around): blocks * per covers the count, one block less
  // does not.
  FUZZ_CHECK(h.entry_blocks < (uint64_t{1} << 52), "entry blocks beyond a file");
  FUZZ_CHECK(h.entry_count <= h.entry_blocks * per &&
                 (h.entry_blocks == 0 || h.entry_count > (h.entry_blocks - 1) * per),
             "entry blocks do not fit the count");
  FUZZ_CHECK(h.unique_count <= h.entry_count && h.shared_count <= h.entry_count &&
                 h.unique_count + h.shared_count == h.entry_count,
             "entry counts");
  FUZZ_CHECK(h.file_count <= kMaxEntryFileRef + 1, "file count");
  FUZZ_CHECK(h.file_blocks * kFilesPerBlock >= h.file_count &&
                 (h.file_blocks == 0 || (h.file_blocks - 1) * kFilesPerBlock < h.file_count),
             "file blocks");
  FUZZ_CHECK(h.arena_next <= kMaxArenaIndex + 1, "arena next");

  // Re-encoding gives the input up to what the decoder ignores: the minor
  // version, the flags and everything past the last field.
  Blk again;
  EncodeShardHeader(h, kFuzzUuid, kFile, again.data());
  Blk norm(blk);
  EncodeU16(norm.data() + kHdrMajor, kShardMajor);
  EncodeU16(norm.data() + kHdrMinor, kShardMinor);
  EncodeU32(norm.data() + kHdrFlags, 0);
  std::memset(norm.data() + kHdrEnd, 0, kBlockSize - kHdrEnd);
  EncodeU32(norm.data() + kHdrCrc, FileBlockCrc(norm.data(), kHdrCrc, kFuzzUuid, kFile, 0));
  FUZZ_CHECK(again == norm, "header does not re-encode to its input");
  Result<ShardHeader> r2 = DecodeShardHeader(again.data(), kFuzzUuid, kFile, kWhat);
  FUZZ_CHECK(r2.ok() && SameHeader(*r2, h), "re-encoded header differs");
  // Bound to its file and volume.
  FUZZ_CHECK(
      !DecodeShardHeader(blk.data(), kFuzzUuid, FileId{kFile.ino, kFile.generation + 1}, kWhat)
           .ok(),
      "header accepted for another file");
}

void FuzzHeader(const Blk& raw, bool fix_version) {
  DecodeHeader(raw);
  Blk fixed(raw);
  uint8_t* p = fixed.data();
  EncodeU32(p, kMagicShardHeader);
  if (fix_version) {
    EncodeU16(p + kHdrMajor, kShardMajor);
    // Make the derived fields consistent now and then so the count checks
    // get exercised: geometry from depth and algo, blocks from counts.
    const uint32_t depth = p[kHdrDepth] % (kMaxShardDepth + 1);
    const HashAlgo algo = (p[kHdrAlgo] & 1) ? HashAlgo::kSha256 : HashAlgo::kXxh128;
    const ShardRange r{depth, depth == 0 ? 0 : DecodeU64(p + kHdrLo) & ~((~0ull) >> depth)};
    p[kHdrDepth] = uint8_t(depth);
    EncodeU32(p + kHdrAlgo, uint32_t(algo));
    EncodeU64(p + kHdrLo, r.lo);
    p[kHdrFpSize] = uint8_t(HashAlgoSize(algo));
    p[kHdrElided] = uint8_t(ElidedBytes(r));
    p[kHdrEntrySize] = uint8_t(EntrySize(algo, r));
    const uint64_t per = EntriesPerBlock(EntrySize(algo, r));
    const uint64_t count = DecodeU64(p + kHdrEntryCount);
    if (p[kHdrFlags] & 1) {  // keep the raw (possibly huge) counts
      EncodeU64(p + kHdrEntryBlocks, count / per + (count % per != 0));
    } else {
      const uint64_t c = count % (uint64_t{1} << 40);
      EncodeU64(p + kHdrEntryCount, c);
      EncodeU64(p + kHdrEntryBlocks, c / per + (c % per != 0));
      const uint64_t u = DecodeU64(p + kHdrUnique) % (c + 1);
      EncodeU64(p + kHdrUnique, u);
      EncodeU64(p + kHdrShared, c - u);
      const uint64_t files = DecodeU64(p + kHdrFileCount) % (kMaxEntryFileRef + 2);
      EncodeU64(p + kHdrFileCount, files);
      EncodeU64(p + kHdrFileBlocks, (files + kFilesPerBlock - 1) / kFilesPerBlock);
    }
  }
  EncodeU32(p + kHdrCrc, FileBlockCrc(p, kHdrCrc, kFuzzUuid, kFile, 0));
  DecodeHeader(fixed);
}

// ---------------------------------------------------------------- entries

void DecodeEntries(const Blk& blk, const Geometry& g) {
  const ShardHeader h = HeaderFor(g);
  std::vector<EncodedEntry> out;
  Status s = DecodeEntryBlock(blk.data(), h, kFuzzUuid, kFile, g.index, &out, kWhat);
  if (!s.ok()) {
    CheckError(s, kWhat);
    FUZZ_CHECK(out.empty(), "entries appended on error");
    return;
  }
  const uint32_t esz = EntrySize(g.algo, g.range);
  const uint32_t n = DecodeU16(blk.data() + kBlkCount);
  FUZZ_CHECK(n >= 1 && n <= EntriesPerBlock(esz) && out.size() == n, "entry count");
  const uint32_t elided = ElidedBytes(g.range);
  for (const EncodedEntry& ee : out) {
    for (uint32_t i = 0; i < elided; i++) {
      FUZZ_CHECK(ee.e.fp[i] == uint8_t(g.range.lo >> (56 - 8 * i)), "elided byte not from lo");
    }
    if (g.range.depth % 8 == 0) FUZZ_CHECK(g.range.Contains(KeyPrefix(ee.e.fp)), "key outside");
    for (size_t i = HashAlgoSize(g.algo); i < ee.e.fp.size(); i++) {
      FUZZ_CHECK(ee.e.fp[i] == 0, "bytes past the hash not zero");
    }
    if (ee.e.kind == EntryKind::kShared) {
      FUZZ_CHECK(ee.e.arena <= kMaxArenaIndex, "arena index");
    } else {
      FUZZ_CHECK(ee.file_ref <= kMaxEntryFileRef && ee.e.block <= kMaxEntryBlock, "unique fields");
    }
  }
  // Re-encoding gives the input, except the reserved bytes and the tail
  // past the last entry (neither is read).
  Blk again;
  EncodeEntryBlock(out.data(), out.size(), h, kFuzzUuid, kFile, g.index, again.data());
  Blk norm(blk);
  EncodeU16(norm.data() + kBlkCount + 2, 0);
  const size_t used = kShardBlockHeader + size_t(n) * esz;
  std::memset(norm.data() + used, 0, kBlockSize - used);
  EncodeU32(norm.data() + kBlkCrc, FileBlockCrc(norm.data(), kBlkCrc, kFuzzUuid, kFile, g.index));
  FUZZ_CHECK(again == norm, "entry block does not re-encode to its input");
  std::vector<EncodedEntry> out2;
  FUZZ_CHECK(!DecodeEntryBlock(blk.data(), h, kFuzzUuid, kFile, g.index + 1, &out2, kWhat).ok() &&
                 out2.empty(),
             "entry block accepted at another index");
}

void FuzzEntries(const Blk& raw, const Geometry& g) {
  DecodeEntries(raw, g);
  Blk fixed(raw);
  uint8_t* p = fixed.data();
  EncodeU32(p, kMagicShardEntries);
  const uint32_t per = EntriesPerBlock(EntrySize(g.algo, g.range));
  EncodeU16(p + kBlkCount, uint16_t(DecodeU16(p + kBlkCount) % (per + 2)));
  EncodeU32(p + kBlkCrc, FileBlockCrc(p, kBlkCrc, kFuzzUuid, kFile, g.index));
  DecodeEntries(fixed, g);
}

// ---------------------------------------------------------------- file table

void DecodeFiles(const Blk& blk, uint64_t index) {
  std::vector<FileId> out;
  Status s = DecodeFileTableBlock(blk.data(), kFuzzUuid, kFile, index, &out, kWhat);
  if (!s.ok()) {
    CheckError(s, kWhat);
    FUZZ_CHECK(out.empty(), "files appended on error");
    return;
  }
  const uint32_t n = DecodeU16(blk.data() + kBlkCount);
  FUZZ_CHECK(n >= 1 && n <= kFilesPerBlock && out.size() == n, "file count");
  Blk again;
  EncodeFileTableBlock(out.data(), out.size(), kFuzzUuid, kFile, index, again.data());
  Blk norm(blk);
  EncodeU16(norm.data() + kBlkCount + 2, 0);
  const size_t used = kShardBlockHeader + size_t(n) * kFileTableEntryBytes;
  std::memset(norm.data() + used, 0, kBlockSize - used);
  EncodeU32(norm.data() + kBlkCrc, FileBlockCrc(norm.data(), kBlkCrc, kFuzzUuid, kFile, index));
  FUZZ_CHECK(again == norm, "file table block does not re-encode to its input");
}

void FuzzFiles(const Blk& raw, uint64_t index) {
  DecodeFiles(raw, index);
  Blk fixed(raw);
  uint8_t* p = fixed.data();
  EncodeU32(p, kMagicShardFiles);
  EncodeU16(p + kBlkCount, uint16_t(DecodeU16(p + kBlkCount) % (kFilesPerBlock + 2)));
  EncodeU32(p + kBlkCrc, FileBlockCrc(p, kBlkCrc, kFuzzUuid, kFile, index));
  DecodeFiles(fixed, index);
}

// ---------------------------------------------------------------- pending

bool SameRecords(const std::vector<PendingRecord>& a, const std::vector<PendingRecord>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); i++) {
    if (!(a[i].fp == b[i].fp && a[i].file == b[i].file && a[i].block == b[i].block)) return false;
  }
  return true;
}

void DecodePending(const uint8_t* buf, size_t len, HashAlgo algo, uint64_t first) {
  std::vector<PendingRecord> out;
  uint64_t frame_blocks = 0;
  Status s =
      DecodePendingFrame(buf, len, algo, kFuzzUuid, kFile, first, &out, &frame_blocks, kWhat);
  if (!s.ok()) {
    CheckError(s, kWhat);
    FUZZ_CHECK(out.empty(), "records appended on error");
    return;
  }
  const uint32_t per = PendingRecordsPerBlock(algo);
  const uint64_t count = DecodeU64(buf + kPfCount);
  FUZZ_CHECK(out.size() == count, "record count");
  FUZZ_CHECK(frame_blocks == 1 + (count + per - 1) / per, "frame blocks");
  FUZZ_CHECK(frame_blocks * kBlockSize <= len, "frame longer than its buffer");
  for (const PendingRecord& r : out) {
    for (size_t i = HashAlgoSize(algo); i < r.fp.size(); i++) {
      FUZZ_CHECK(r.fp[i] == 0, "bytes past the hash not zero");
    }
  }
  const std::vector<uint8_t> again = EncodePendingFrame(out, algo, kFuzzUuid, kFile, first);
  FUZZ_CHECK(again.size() == frame_blocks * kBlockSize, "re-encoded frame has another size");
  std::vector<PendingRecord> out2;
  uint64_t fb2 = 0;
  Status s2 = DecodePendingFrame(again.data(), again.size(), algo, kFuzzUuid, kFile, first, &out2,
                                 &fb2, kWhat);
  FUZZ_CHECK(s2.ok() && fb2 == frame_blocks && SameRecords(out, out2),
             "re-encoded frame does not decode to the same records");
  FUZZ_CHECK(EncodePendingFrame(out2, algo, kFuzzUuid, kFile, first) == again,
             "pending encoding is not canonical");
  // The record bytes the decoder read are the input's.
  const uint32_t rsz = PendingRecordSize(algo);
  for (uint64_t b = 1; b < frame_blocks; b++) {
    const uint64_t in_block = b + 1 < frame_blocks ? per : count - (frame_blocks - 2) * per;
    FUZZ_CHECK(
        std::memcmp(again.data() + b * kBlockSize, buf + b * kBlockSize, in_block * rsz) == 0,
        "record bytes differ");
  }
}

// The fixed-up frame's layout: its header is the body's first kPfEnd
// bytes (zero-padded to a block), then each kRecordChunk bytes of the rest
// start one record block, so a 4 KiB input spans a multi-block frame.
constexpr size_t kRecordChunk = 512;

std::vector<uint8_t> ExpandFrame(const uint8_t* body, size_t size) {
  const size_t head = size < kPfEnd ? size : kPfEnd;
  const size_t rest = size - head;
  const size_t blocks = rest == 0 ? 1 : (rest + kRecordChunk - 1) / kRecordChunk;
  std::vector<uint8_t> frame((1 + blocks) * kBlockSize, 0);
  std::memcpy(frame.data(), body, head);
  for (size_t i = 0; i * kRecordChunk < rest; i++) {
    const size_t n =
        rest - i * kRecordChunk < kRecordChunk ? rest - i * kRecordChunk : kRecordChunk;
    std::memcpy(frame.data() + (1 + i) * kBlockSize, body + head + i * kRecordChunk, n);
  }
  return frame;
}

void FuzzPending(const uint8_t* body, size_t size, const Blk& raw, const Geometry& g) {
  // Exactly `size` bytes on the heap: a read past them is an ASan report.
  const std::vector<uint8_t> exact(body, body + size);
  DecodePending(exact.data(), exact.size(), g.algo, g.index);
  DecodePending(raw.data(), kBlockSize, g.algo, g.index);

  // Fixed up: magic, major, algo, place and a count that fits the buffer,
  // both crcs recomputed.
  std::vector<uint8_t> buf = ExpandFrame(body, size);
  uint8_t* p = buf.data();
  EncodeU32(p, kMagicPendingFrame);
  EncodeU16(p + 4, kShardMajor);
  EncodeU32(p + kPfAlgo, uint32_t(g.algo));
  EncodeU64(p + kPfAt, g.index);
  const uint64_t per = PendingRecordsPerBlock(g.algo);
  const uint64_t max_count = (buf.size() / kBlockSize - 1) * per;
  const uint64_t count = DecodeU64(p + kPfCount) % (max_count + 1);
  EncodeU64(p + kPfCount, count);
  const uint64_t data_blocks = (count + per - 1) / per;
  uint8_t pre[40];
  std::memcpy(pre, kFuzzUuid.data(), 16);
  EncodeU64(pre + 16, kFile.ino);
  EncodeU64(pre + 24, kFile.generation);
  EncodeU64(pre + 32, g.index);
  const uint32_t payload_crc =
      Crc32cExtend(Crc32cExtend(0, pre, sizeof pre), p + kBlockSize, data_blocks * kBlockSize);
  EncodeU32(p + kPfPayloadCrc, payload_crc);
  EncodeU32(p + 8, FileBlockCrc(p, 8, kFuzzUuid, kFile, g.index));
  DecodePending(buf.data(), buf.size(), g.algo, g.index);
  // Torn: the same frame cut one byte short (exact length again).
  const std::vector<uint8_t> torn(buf.begin(),
                                  buf.begin() + long((1 + data_blocks) * kBlockSize - 1));
  DecodePending(torn.data(), torn.size(), g.algo, g.index);
}

// ---------------------------------------------------------------- names

void FuzzNames(const uint8_t* data, size_t size) {
  const std::string s(reinterpret_cast<const char*>(data), size < 80 ? size : 80);
  for (const std::string& name : {s, ".dede-ix-" + s, ".dede-ixp-" + s, ".dede-arena-" + s}) {
    // Names shorter than the longest prefix are skipped: libstdc++'s
    // string::compare subtracts the lengths as unsigned (well defined),
    // which the unsigned-overflow trap of the instrumented parser flags.
    if (name.size() < std::string(".dede-arena-").size()) continue;
    ShardRange r;
    uint64_t v = 0;
    if (ParseShardFileName(name, &r, &v)) {
      FUZZ_CHECK(r.depth <= kMaxShardDepth && ShardFileName(r, v) == name, "shard name");
    }
    if (ParsePendingFileName(name, &r)) {
      FUZZ_CHECK(r.depth <= kMaxShardDepth && PendingFileName(r) == name, "pending name");
    }
    uint64_t lo = 0;
    if (ParseArenaFileName(name, &lo)) FUZZ_CHECK(ArenaFileName(lo) == name, "arena name");
  }
}

// ---------------------------------------------------------------- seeds

std::vector<uint8_t> WithPrefix(uint8_t sel, uint8_t depth, uint8_t index, const uint8_t* blk,
                                size_t len) {
  std::vector<uint8_t> v = {sel, depth, index};
  v.insert(v.end(), blk, blk + len);
  return v;
}

std::vector<Blk> Seeds() {
  std::vector<std::vector<uint8_t>> inputs;
  uint64_t x = 0x9e3779b97f4a7c15ull;
  auto rnd = [&] {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
  };
  for (int which = 0; which < 4; which++) {
    const HashAlgo algo = (which & 1) ? HashAlgo::kSha256 : HashAlgo::kXxh128;
    const uint32_t depth = which < 2 ? 0 : 16;
    const Geometry g{algo,
                     {depth, depth == 0 ? 0 : 0xa5c3'96e1'7b2d'4f08ull & ~((~0ull) >> depth)},
                     uint64_t(1 + which)};
    ShardHeader h = HeaderFor(g);
    h.version = 5 + which;
    h.unique_count = 300;
    h.shared_count = 100;
    h.entry_count = 400;
    const uint64_t per = EntriesPerBlock(h.entry_size);
    h.entry_blocks = (400 + per - 1) / per;
    h.file_count = 3;
    h.file_blocks = 1;
    h.arena_next = 100;
    h.created_ns = 1'700'000'000'000'000'000ull;
    h.host_id = 2;
    Blk hb;
    EncodeShardHeader(h, kFuzzUuid, kFile, hb.data());
    inputs.push_back(WithPrefix(uint8_t(which & 1), uint8_t(depth), 0, hb.data(), kBlockSize));

    std::vector<EncodedEntry> entries;
    for (int i = 0; i < 12; i++) {
      EncodedEntry ee;
      for (size_t b = 0; b < HashAlgoSize(algo); b++) ee.e.fp[b] = uint8_t(rnd());
      for (uint32_t b = 0; b < ElidedBytes(g.range); b++) {
        ee.e.fp[b] = uint8_t(g.range.lo >> (56 - 8 * b));
      }
      if (i % 3 == 2) {
        ee.e.kind = EntryKind::kShared;
        ee.e.arena = rnd() % 1000;
      } else {
        ee.file_ref = uint32_t(i % 3);
        ee.e.block = rnd() % 100000;
      }
      entries.push_back(ee);
    }
    Blk eb;
    EncodeEntryBlock(entries.data(), entries.size(), h, kFuzzUuid, kFile, g.index, eb.data());
    inputs.push_back(
        WithPrefix(uint8_t(which & 1), uint8_t(depth), uint8_t(g.index), eb.data(), kBlockSize));

    const FileId files[3] = {{11, 1}, {12, 4}, {99, 2}};
    Blk fb;
    EncodeFileTableBlock(files, 3, kFuzzUuid, kFile, g.index, fb.data());
    inputs.push_back(
        WithPrefix(uint8_t(which & 1), uint8_t(depth), uint8_t(g.index), fb.data(), kBlockSize));

    std::vector<PendingRecord> recs;
    for (int i = 0; i < 5; i++) {
      PendingRecord r;
      for (size_t b = 0; b < HashAlgoSize(algo); b++) r.fp[b] = uint8_t(rnd());
      r.file = files[i % 3];
      r.block = rnd() % 100000;
      recs.push_back(r);
    }
    // In ExpandFrame's layout: the header's fields, then the records.
    const std::vector<uint8_t> frame = EncodePendingFrame(recs, algo, kFuzzUuid, kFile, g.index);
    std::vector<uint8_t> body(frame.begin(), frame.begin() + kPfEnd);
    body.insert(body.end(), frame.begin() + kBlockSize,
                frame.begin() + kBlockSize + recs.size() * PendingRecordSize(algo));
    inputs.push_back(
        WithPrefix(uint8_t(which & 1), uint8_t(depth), uint8_t(g.index), body.data(), body.size()));
    // An empty frame decodes as it is.
    const std::vector<uint8_t> empty = EncodePendingFrame({}, algo, kFuzzUuid, kFile, g.index);
    inputs.push_back(
        WithPrefix(uint8_t(which & 1), uint8_t(depth), uint8_t(g.index), empty.data(), kBlockSize));
  }
  std::vector<Blk> seeds;
  for (const auto& in : inputs) seeds.emplace_back(in.data(), in.size());
  return seeds;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  MaybeWriteSeeds(kTarget, Seeds());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Geometry g = GeometryOf(data, size);
  const uint8_t* body = size > kPrefix ? data + kPrefix : data;
  const size_t body_size = size > kPrefix ? size - kPrefix : 0;
  const Blk raw(body, body_size);
  FuzzHeader(raw, false);
  FuzzHeader(raw, true);
  FuzzEntries(raw, g);
  FuzzFiles(raw, g.index);
  FuzzPending(body, body_size, raw, g);
  FuzzNames(body, body_size);
  return 0;
}
