#include "index/shard_format.h"

#include <cinttypes>
#include <cstdio>
#include <cstring>

#include <boost/endian/conversion.hpp>

#include "util/coding.h"
#include "util/crc32c.h"

namespace dede {

namespace {

constexpr size_t kHdrCrcAt = 8;   // shard header, pending frame header
constexpr size_t kBlkCrcAt = 4;   // entry and file-table blocks

std::string Hex16(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016" PRIx64, v);
  return b;
}

bool ParseHex(const std::string& s, size_t digits, uint64_t* out) {
  if (s.size() != digits) return false;
  uint64_t v = 0;
  for (char c : s) {
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else return false;
    v = v << 4 | uint64_t(d);
  }
  *out = v;
  return true;
}

bool ValidRange(const ShardRange& r) {
  if (r.depth > kMaxShardDepth) return false;
  if (r.depth == 0) return r.lo == 0;
  const uint64_t span_mask = (~0ull) >> r.depth;
  return (r.lo & span_mask) == 0;
}

// Splits "a-b-c" after `prefix` into its dash-separated fields.
bool Fields(const std::string& name, const std::string& prefix, std::vector<std::string>* out) {
  if (name.compare(0, prefix.size(), prefix) != 0) return false;
  out->clear();
  size_t pos = prefix.size();
  while (true) {
    size_t dash = name.find('-', pos);
    out->push_back(name.substr(pos, dash == std::string::npos ? std::string::npos : dash - pos));
    if (dash == std::string::npos) break;
    pos = dash + 1;
  }
  return true;
}

bool ParseRangeFields(const std::string& d, const std::string& l, ShardRange* r) {
  uint64_t depth, lo;
  if (!ParseHex(d, 2, &depth) || !ParseHex(l, 16, &lo)) return false;
  ShardRange out{uint32_t(depth), lo};
  if (!ValidRange(out)) return false;
  *r = out;
  return true;
}

void EncodeEntryMeta(uint8_t* p, const EncodedEntry& ee) {
  uint64_t v;
  if (ee.e.kind == EntryKind::kShared) {
    v = (1ull << 55) | (ee.e.arena & kMaxArenaIndex);
  } else {
    v = (uint64_t(ee.file_ref) & kMaxEntryFileRef) << 38 | (ee.e.block & kMaxEntryBlock);
  }
  for (uint32_t i = 0; i < kEntryMetaBytes; i++) p[i] = uint8_t(v >> (8 * i));
}

void DecodeEntryMeta(const uint8_t* p, EncodedEntry* ee) {
  uint64_t v = 0;
  for (uint32_t i = 0; i < kEntryMetaBytes; i++) v |= uint64_t(p[i]) << (8 * i);
  if (v >> 55) {
    ee->e.kind = EntryKind::kShared;
    ee->e.arena = v & kMaxArenaIndex;
  } else {
    ee->e.kind = EntryKind::kUnique;
    ee->file_ref = uint32_t(v >> 38 & kMaxEntryFileRef);
    ee->e.block = v & kMaxEntryBlock;
  }
}

Status CheckBlockMagicCrc(const uint8_t* blk, uint32_t magic, size_t crc_at, const Uuid& uuid,
                          FileId file, uint64_t index, const std::string& what) {
  if (DecodeU32(blk) != magic) {
    return Status::Corruption(what + " block " + std::to_string(index) + ": bad magic");
  }
  if (DecodeU32(blk + crc_at) != FileBlockCrc(blk, crc_at, uuid, file, index)) {
    return Status::Corruption(what + " block " + std::to_string(index) + ": bad checksum");
  }
  return Status::Ok();
}

}  // namespace

FpKey KeyOf(const Fingerprint& fp) {
  FpKey k{};
  std::memcpy(k.data(), fp.bytes.data(), fp.size);
  return k;
}

Fingerprint FingerprintOf(const FpKey& k, HashAlgo algo) {
  Fingerprint fp;
  fp.size = uint8_t(HashAlgoSize(algo));
  std::memcpy(fp.bytes.data(), k.data(), fp.size);
  return fp;
}

std::string ShardRange::ToString() const {
  return "[" + Hex16(lo) + ".." + Hex16(last()) + "]/" + std::to_string(depth);
}

std::string ShardFileName(const ShardRange& r, uint64_t version) {
  char d[3];
  std::snprintf(d, sizeof d, "%02x", r.depth);
  return std::string(".dede-ix-") + d + "-" + Hex16(r.lo) + "-" + Hex16(version);
}

bool ParseShardFileName(const std::string& name, ShardRange* r, uint64_t* version) {
  std::vector<std::string> f;
  if (!Fields(name, ".dede-ix-", &f) || f.size() != 3) return false;
  return ParseRangeFields(f[0], f[1], r) && ParseHex(f[2], 16, version);
}

std::string PendingFileName(const ShardRange& r) {
  char d[3];
  std::snprintf(d, sizeof d, "%02x", r.depth);
  return std::string(".dede-ixp-") + d + "-" + Hex16(r.lo);
}

bool ParsePendingFileName(const std::string& name, ShardRange* r) {
  std::vector<std::string> f;
  if (!Fields(name, ".dede-ixp-", &f) || f.size() != 2) return false;
  return ParseRangeFields(f[0], f[1], r);
}

std::string ArenaFileName(uint64_t lo) { return ".dede-arena-" + Hex16(lo); }

bool ParseArenaFileName(const std::string& name, uint64_t* lo) {
  std::vector<std::string> f;
  if (!Fields(name, ".dede-arena-", &f) || f.size() != 1) return false;
  return ParseHex(f[0], 16, lo);
}

uint32_t EntrySize(HashAlgo algo, const ShardRange& r) {
  return uint32_t(HashAlgoSize(algo)) - ElidedBytes(r) + kEntryMetaBytes;
}

uint32_t EntriesPerBlock(uint32_t entry_size) {
  return (kBlockSize - kShardBlockHeader) / entry_size;
}

uint32_t FileBlockCrc(const uint8_t* blk, size_t crc_at, const Uuid& uuid, FileId file,
                      uint64_t index) {
  uint8_t pre[16 + 24];
  std::memcpy(pre, uuid.data(), 16);
  EncodeU64(pre + 16, file.ino);
  EncodeU64(pre + 24, file.generation);
  EncodeU64(pre + 32, index);
  static const uint8_t zero[4] = {0, 0, 0, 0};
  uint32_t c = Crc32cExtend(0, pre, sizeof pre);
  c = Crc32cExtend(c, blk, crc_at);
  c = Crc32cExtend(c, zero, 4);
  return Crc32cExtend(c, blk + crc_at + 4, kBlockSize - crc_at - 4);
}

// ---------------------------------------------------------------- header

void EncodeShardHeader(const ShardHeader& h, const Uuid& uuid, FileId file, uint8_t* blk) {
  std::memset(blk, 0, kBlockSize);
  Encoder e(blk, kBlockSize);
  e.u32(kMagicShardHeader);
  e.u16(kShardMajor);
  e.u16(kShardMinor);
  e.u32(0);  // crc
  e.u32(0);  // flags
  e.u8(uint8_t(h.range.depth));
  e.u8(uint8_t(HashAlgoSize(h.algo)));
  e.u8(uint8_t(ElidedBytes(h.range)));
  e.u8(uint8_t(EntrySize(h.algo, h.range)));
  e.u32(uint32_t(h.algo));
  e.u64(h.range.lo);
  e.u64(h.version);
  e.u64(h.entry_count);
  e.u64(h.entry_blocks);
  e.u64(h.unique_count);
  e.u64(h.shared_count);
  e.u64(h.file_count);
  e.u64(h.file_blocks);
  e.u64(h.arena_next);
  e.u64(h.created_ns);
  e.u64(h.update_ns);
  e.u32(h.host_id);
  EncodeU32(blk + kHdrCrcAt, FileBlockCrc(blk, kHdrCrcAt, uuid, file, 0));
}

Result<ShardHeader> DecodeShardHeader(const uint8_t* blk, const Uuid& uuid, FileId file,
                                      const std::string& what) {
  auto bad = [&](const std::string& why) {
    return Status::Corruption(what + " header: " + why);
  };
  if (DecodeU32(blk) != kMagicShardHeader) return bad("bad magic");
  if (DecodeU32(blk + kHdrCrcAt) != FileBlockCrc(blk, kHdrCrcAt, uuid, file, 0)) {
    return bad("bad checksum");
  }
  Decoder d(blk + 4, kBlockSize - 4);
  uint16_t major = d.u16();
  const uint16_t minor = d.u16();  // newer minors only add fields in the zeroed tail
  if (major > kShardMajor) {
    return Status::Unsupported(what + ": shard format major version " + std::to_string(major) +
                               " is newer than this build (" + std::to_string(kShardMajor) + ")");
  }
  if (major == 0) return bad("format version 0");
  d.u32();  // crc
  const uint32_t flags = d.u32();
  // None defined: a newer minor may define some.
  if (flags != 0 && minor <= kShardMinor) return bad("unknown flags " + std::to_string(flags));
  ShardHeader h;
  h.range.depth = d.u8();
  uint8_t fp_size = d.u8();
  uint8_t elided = d.u8();
  uint8_t entry_size = d.u8();
  uint32_t algo = d.u32();
  h.range.lo = d.u64();
  h.version = d.u64();
  h.entry_count = d.u64();
  h.entry_blocks = d.u64();
  h.unique_count = d.u64();
  h.shared_count = d.u64();
  h.file_count = d.u64();
  h.file_blocks = d.u64();
  h.arena_next = d.u64();
  h.created_ns = d.u64();
  h.update_ns = d.u64();
  h.host_id = d.u32();
  if (algo != uint32_t(HashAlgo::kXxh128) && algo != uint32_t(HashAlgo::kSha256)) {
    return bad("unknown hash algorithm " + std::to_string(algo));
  }
  h.algo = HashAlgo(algo);
  // Not ToString(): last() of an invalid range shifts by >= 64 or wraps.
  if (!ValidRange(h.range)) {
    return bad("invalid range: depth " + std::to_string(h.range.depth) + " lo " +
               Hex16(h.range.lo));
  }
  if (fp_size != HashAlgoSize(h.algo) || elided != ElidedBytes(h.range) ||
      entry_size != EntrySize(h.algo, h.range)) {
    return bad("entry geometry does not match depth and hash");
  }
  h.entry_size = entry_size;
  const uint64_t per = EntriesPerBlock(entry_size);
  // No count may wrap: a volume file holds fewer than 2^52 blocks (its
  // byte size is a u64), which also keeps the shard's byte size in range.
  if (h.entry_blocks >= (uint64_t{1} << 52) ||
      h.entry_blocks != h.entry_count / per + (h.entry_count % per != 0)) {
    return bad("entry block count wrong");
  }
  if (h.unique_count > h.entry_count || h.shared_count != h.entry_count - h.unique_count) {
    return bad("entry counts disagree");
  }
  if (h.file_count > kMaxEntryFileRef + 1 ||
      h.file_blocks != (h.file_count + kFilesPerBlock - 1) / kFilesPerBlock) {
    return bad("file table size wrong");
  }
  // The whole file (header, entries, file table) in blocks: below 2^52,
  // so its byte size does not wrap (a reader compares it with the file's).
  if (1 + h.entry_blocks + h.file_blocks >= (uint64_t{1} << 52)) {
    return bad("entry and file table blocks beyond any file");
  }
  if (h.arena_next > kMaxArenaIndex + 1) return bad("arena size out of range");
  return h;
}

// ---------------------------------------------------------------- entries

void EncodeEntryBlock(const EncodedEntry* entries, size_t n, const ShardHeader& h,
                      const Uuid& uuid, FileId file, uint64_t index, uint8_t* blk) {
  std::memset(blk, 0, kBlockSize);
  const uint32_t esz = EntrySize(h.algo, h.range);
  const uint32_t elided = ElidedBytes(h.range);
  const uint32_t fp_bytes = uint32_t(HashAlgoSize(h.algo)) - elided;
  EncodeU32(blk, kMagicShardEntries);
  EncodeU16(blk + 8, uint16_t(n));
  uint8_t* p = blk + kShardBlockHeader;
  for (size_t i = 0; i < n; i++, p += esz) {
    std::memcpy(p, entries[i].e.fp.data() + elided, fp_bytes);
    EncodeEntryMeta(p + fp_bytes, entries[i]);
  }
  EncodeU32(blk + kBlkCrcAt, FileBlockCrc(blk, kBlkCrcAt, uuid, file, index));
}

Result<uint32_t> CheckEntryBlock(const uint8_t* blk, const ShardHeader& h, const Uuid& uuid,
                                 FileId file, uint64_t index, const std::string& what) {
  RETURN_IF_ERROR(
      CheckBlockMagicCrc(blk, kMagicShardEntries, kBlkCrcAt, uuid, file, index, what));
  const uint32_t n = DecodeU16(blk + 8);
  if (n == 0 || n > EntriesPerBlock(EntrySize(h.algo, h.range))) {
    return Status::Corruption(what + " block " + std::to_string(index) + ": entry count " +
                              std::to_string(n) + " out of range");
  }
  return n;
}

FpKey EntryPrefix(const ShardHeader& h) {
  FpKey prefix{};
  for (uint32_t i = 0; i < ElidedBytes(h.range); i++) {
    prefix[i] = uint8_t(h.range.lo >> (56 - 8 * i));
  }
  return prefix;
}

void DecodeEntry(const uint8_t* p, const ShardHeader& h, const FpKey& prefix, EncodedEntry* out) {
  const uint32_t elided = ElidedBytes(h.range);
  const uint32_t fp_bytes = uint32_t(HashAlgoSize(h.algo)) - elided;
  out->e.fp = prefix;
  std::memcpy(out->e.fp.data() + elided, p, fp_bytes);
  DecodeEntryMeta(p + fp_bytes, out);
}

Status DecodeEntryBlock(const uint8_t* blk, const ShardHeader& h, const Uuid& uuid, FileId file,
                        uint64_t index, std::vector<EncodedEntry>* out, const std::string& what) {
  ASSIGN_OR_RETURN(uint32_t n, CheckEntryBlock(blk, h, uuid, file, index, what));
  const uint32_t esz = EntrySize(h.algo, h.range);
  const FpKey prefix = EntryPrefix(h);
  const uint8_t* p = blk + kShardBlockHeader;
  for (uint32_t i = 0; i < n; i++, p += esz) {
    EncodedEntry ee;
    DecodeEntry(p, h, prefix, &ee);
    out->push_back(ee);
  }
  return Status::Ok();
}

void EncodeFileTableBlock(const FileId* files, size_t n, const Uuid& uuid, FileId file,
                          uint64_t index, uint8_t* blk) {
  std::memset(blk, 0, kBlockSize);
  EncodeU32(blk, kMagicShardFiles);
  EncodeU16(blk + 8, uint16_t(n));
  uint8_t* p = blk + kShardBlockHeader;
  for (size_t i = 0; i < n; i++, p += kFileTableEntryBytes) {
    EncodeU64(p, files[i].ino);
    EncodeU64(p + 8, files[i].generation);
  }
  EncodeU32(blk + kBlkCrcAt, FileBlockCrc(blk, kBlkCrcAt, uuid, file, index));
}

Status DecodeFileTableBlock(const uint8_t* blk, const Uuid& uuid, FileId file, uint64_t index,
                            std::vector<FileId>* out, const std::string& what) {
  RETURN_IF_ERROR(CheckBlockMagicCrc(blk, kMagicShardFiles, kBlkCrcAt, uuid, file, index, what));
  const uint32_t n = DecodeU16(blk + 8);
  if (n == 0 || n > kFilesPerBlock) {
    return Status::Corruption(what + " file table block " + std::to_string(index) +
                              ": count out of range");
  }
  const uint8_t* p = blk + kShardBlockHeader;
  for (uint32_t i = 0; i < n; i++, p += kFileTableEntryBytes) {
    out->push_back(FileId{DecodeU64(p), DecodeU64(p + 8)});
  }
  return Status::Ok();
}

// ---------------------------------------------------------------- pending

uint32_t PendingRecordSize(HashAlgo algo) { return uint32_t(HashAlgoSize(algo)) + 24; }
uint32_t PendingRecordsPerBlock(HashAlgo algo) { return kBlockSize / PendingRecordSize(algo); }

namespace {
uint32_t PendingPayloadCrc(const uint8_t* payload, size_t len, const Uuid& uuid, FileId file,
                           uint64_t first_block) {
  uint8_t pre[16 + 24];
  std::memcpy(pre, uuid.data(), 16);
  EncodeU64(pre + 16, file.ino);
  EncodeU64(pre + 24, file.generation);
  EncodeU64(pre + 32, first_block);
  return Crc32cExtend(Crc32cExtend(0, pre, sizeof pre), payload, len);
}
}  // namespace

std::vector<uint8_t> EncodePendingFrame(const std::vector<PendingRecord>& recs, HashAlgo algo,
                                        const Uuid& uuid, FileId file, uint64_t first_block) {
  const uint32_t rsz = PendingRecordSize(algo);
  const uint32_t per = PendingRecordsPerBlock(algo);
  const uint64_t data_blocks = (recs.size() + per - 1) / per;
  std::vector<uint8_t> out((1 + data_blocks) * kBlockSize, 0);
  const size_t fp = HashAlgoSize(algo);
  for (size_t i = 0; i < recs.size(); i++) {
    uint8_t* p = out.data() + kBlockSize * (1 + i / per) + rsz * (i % per);
    std::memcpy(p, recs[i].fp.data(), fp);
    EncodeU64(p + fp, recs[i].file.ino);
    EncodeU64(p + fp + 8, recs[i].file.generation);
    EncodeU64(p + fp + 16, recs[i].block);
  }
  uint8_t* h = out.data();
  Encoder e(h, kBlockSize);
  e.u32(kMagicPendingFrame);
  e.u16(kShardMajor);
  e.u16(kShardMinor);
  e.u32(0);  // crc
  e.u32(uint32_t(algo));
  e.u64(recs.size());
  e.u64(first_block);
  e.u32(PendingPayloadCrc(out.data() + kBlockSize, data_blocks * kBlockSize, uuid, file,
                          first_block));
  EncodeU32(h + kHdrCrcAt, FileBlockCrc(h, kHdrCrcAt, uuid, file, first_block));
  return out;
}

Status DecodePendingFrame(const uint8_t* buf, size_t len, HashAlgo algo, const Uuid& uuid,
                          FileId file, uint64_t first_block, std::vector<PendingRecord>* out,
                          uint64_t* frame_blocks, const std::string& what) {
  *frame_blocks = 0;
  const std::string where = what + " frame at block " + std::to_string(first_block);
  if (len < kBlockSize) return Status::Corruption(where + ": cut short");
  if (DecodeU32(buf) != kMagicPendingFrame) return Status::Corruption(where + ": bad magic");
  if (DecodeU32(buf + kHdrCrcAt) != FileBlockCrc(buf, kHdrCrcAt, uuid, file, first_block)) {
    return Status::Corruption(where + ": bad checksum");
  }
  Decoder d(buf + 4, kBlockSize - 4);
  uint16_t major = d.u16();
  d.u16();
  if (major > kShardMajor) return Status::Unsupported(where + ": newer major version");
  if (major == 0) return Status::Corruption(where + ": format version 0");
  d.u32();
  uint32_t a = d.u32();
  uint64_t count = d.u64();
  uint64_t at = d.u64();
  uint32_t payload_crc = d.u32();
  if (a != uint32_t(algo)) return Status::Corruption(where + ": hash algorithm differs");
  if (at != first_block) return Status::Corruption(where + ": misplaced frame");
  const uint32_t per = PendingRecordsPerBlock(algo);
  if (count > (uint64_t{1} << 32)) return Status::Corruption(where + ": count out of range");
  const uint64_t data_blocks = (count + per - 1) / per;
  *frame_blocks = 1 + data_blocks;
  if (len < (1 + data_blocks) * kBlockSize) return Status::Corruption(where + ": cut short");
  if (PendingPayloadCrc(buf + kBlockSize, data_blocks * kBlockSize, uuid, file, first_block) !=
      payload_crc) {
    return Status::Corruption(where + ": bad record checksum");
  }
  const uint32_t rsz = PendingRecordSize(algo);
  const size_t fp = HashAlgoSize(algo);
  for (uint64_t i = 0; i < count; i++) {
    const uint8_t* p = buf + kBlockSize * (1 + i / per) + rsz * (i % per);
    PendingRecord r;
    std::memcpy(r.fp.data(), p, fp);
    r.file = FileId{DecodeU64(p + fp), DecodeU64(p + fp + 8)};
    r.block = DecodeU64(p + fp + 16);
    out->push_back(r);
  }
  return Status::Ok();
}

}  // namespace dede
