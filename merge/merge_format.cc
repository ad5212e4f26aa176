// Names and the little-endian encoding of merge-request group blocks
// (docs/FORMAT.md section 14). Nothing here does I/O, so the decoder can be
// fuzzed on its own (tests/fuzz/fuzz_merge_request.cc).
#include <cinttypes>
#include <cstdio>
#include <cstring>

#include "index/shard_format.h"
#include "merge/merge_request.h"
#include "util/coding.h"

namespace dede {

namespace {

// Header field offsets (docs/FORMAT.md 14.2).
constexpr size_t kOffMagic = 0;
constexpr size_t kOffMajor = 4;
constexpr size_t kOffMinor = 6;
constexpr size_t kOffCrc = 8;
constexpr size_t kOffFlags = 12;
constexpr size_t kOffAlgo = 16;
constexpr size_t kOffFpSize = 18;
constexpr size_t kOffCount = 20;
constexpr size_t kOffFirstBlock = 24;
constexpr size_t kOffTargetIno = 32;
constexpr size_t kOffTargetGeneration = 40;
constexpr size_t kOffPostedNs = 48;
constexpr size_t kOffHostId = 56;
constexpr size_t kOffReserved = 60;
// Record field offsets, relative to the record.
constexpr size_t kRecTargetBlock = 0;
constexpr size_t kRecCloneBlock = 8;
constexpr size_t kRecWitness = 16;
constexpr size_t kWitnessBytes = 32;

const char kNamePrefix[] = ".dede-mr-";
constexpr size_t kNamePrefixLen = sizeof kNamePrefix - 1;

std::string Hex32(uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08" PRIx32, v);
  return b;
}

}  // namespace

std::string MergeRequestFileName(uint64_t target_ino) {
  char b[32];
  std::snprintf(b, sizeof b, "%s%016" PRIx64, kNamePrefix, target_ino);
  return b;
}

std::optional<uint64_t> ParseMergeRequestFileName(const std::string& name) {
  if (name.size() != kNamePrefixLen + 16 || name.compare(0, kNamePrefixLen, kNamePrefix) != 0) {
    return std::nullopt;
  }
  uint64_t v = 0;
  for (size_t i = kNamePrefixLen; i < name.size(); i++) {
    const char c = name[i];
    uint64_t digit;
    if (c >= '0' && c <= '9') {
      digit = uint64_t(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      digit = uint64_t(c - 'a' + 10);
    } else {
      return std::nullopt;  // canonical: lowercase hex only
    }
    v = v << 4 | digit;
  }
  if (v == 0) return std::nullopt;  // inode numbers start at 1
  return v;
}

void EncodeMergeGroupBlock(const MergeGroup& g, HashAlgo algo, const Uuid& uuid,
                           FileId request_file, uint8_t* blk) {
  std::memset(blk, 0, kBlockSize);
  Encoder e(blk, kBlockSize);
  e.u32(kMagicMergeGroup);
  e.u16(kMergeMajor);
  e.u16(kMergeMinor);
  e.u32(0);  // crc, below
  e.u32(0);  // flags: none defined
  e.u16(uint16_t(algo));
  e.u16(uint16_t(HashAlgoSize(algo)));
  e.u32(uint32_t(g.records.size()));
  e.u64(g.first_block);
  e.u64(g.target.ino);
  e.u64(g.target.generation);
  e.u64(g.posted_ns);
  e.u32(g.host_id);
  e.u32(0);  // reserved
  const size_t fp_size = HashAlgoSize(algo);
  for (const MergeRecord& r : g.records) {
    e.u64(r.target_block);
    e.u64(r.clone_block);
    e.bytes(r.witness.bytes.data(), fp_size);
    e.zeros(kWitnessBytes - fp_size);
  }
  EncodeU32(blk + kOffCrc, FileBlockCrc(blk, kOffCrc, uuid, request_file, g.first_block));
}

Result<MergeGroup> DecodeMergeGroupBlock(const uint8_t* blk, HashAlgo algo, const Uuid& uuid,
                                         FileId request_file, uint64_t block_index,
                                         uint64_t target_ino, const std::string& what) {
  const std::string where = what + " group at block " + std::to_string(block_index);
  auto bad = [&](const std::string& why) { return Status::Corruption(where + ": " + why); };
  const uint32_t magic = DecodeU32(blk + kOffMagic);
  if (magic != kMagicMergeGroup) {
    return bad("bad magic " + Hex32(magic) + " (expected " + Hex32(kMagicMergeGroup) + ")");
  }
  // The crc binds the volume, the request file (ino and generation) and
  // the position read from: a group of another volume, another request
  // file or another place fails here.
  const uint32_t stored = DecodeU32(blk + kOffCrc);
  const uint32_t computed = FileBlockCrc(blk, kOffCrc, uuid, request_file, block_index);
  if (stored != computed) {
    return bad("bad checksum (stored " + Hex32(stored) + ", computed " + Hex32(computed) + ")");
  }
  const uint16_t major = DecodeU16(blk + kOffMajor);
  const uint16_t minor = DecodeU16(blk + kOffMinor);
  if (major > kMergeMajor) {
    return Status::Unsupported(where + ": merge-request format version " + std::to_string(major) +
                               "." + std::to_string(minor) + " is newer than this dede supports (" +
                               std::to_string(kMergeMajor) + "." + std::to_string(kMergeMinor) +
                               ")");
  }
  if (major == 0) return bad("format version 0");
  MergeGroup g;
  g.first_block = DecodeU64(blk + kOffFirstBlock);
  if (g.first_block != block_index) {
    return bad("group claims block " + std::to_string(g.first_block));
  }
  g.target.ino = DecodeU64(blk + kOffTargetIno);
  if (g.target.ino != target_ino) {
    return bad("group is for inode " + std::to_string(g.target.ino) + ", the file's target is " +
               std::to_string(target_ino));
  }
  const uint32_t flags = DecodeU32(blk + kOffFlags);
  if (flags != 0) return bad("unknown flags " + Hex32(flags));
  const uint16_t algo_field = DecodeU16(blk + kOffAlgo);
  if (algo_field != uint16_t(algo)) {
    return bad("hash algorithm " + std::to_string(algo_field) + " (the volume uses " +
               HashAlgoName(algo) + ")");
  }
  const size_t fp_size = HashAlgoSize(algo);
  const uint16_t fp_field = DecodeU16(blk + kOffFpSize);
  if (fp_field != fp_size) {
    return bad("fingerprint size " + std::to_string(fp_field) + " (expected " +
               std::to_string(fp_size) + ")");
  }
  const uint32_t count = DecodeU32(blk + kOffCount);
  if (count < 1 || count > kMaxMergeRecordsPerGroup) {
    return bad(std::to_string(count) + " records (1.." + std::to_string(kMaxMergeRecordsPerGroup) +
               ")");
  }
  // The group's blocks must be addressable (no wrap-around below).
  if (g.first_block > kMaxMergeBlock - count) return bad("group runs past the largest file");
  const size_t used = kMergeGroupHeaderBytes + size_t(count) * kMergeRecordBytes;
  if (minor <= kMergeMinor) {
    // Reserved bytes are zero in this version; a newer minor may use them.
    if (DecodeU32(blk + kOffReserved) != 0) return bad("reserved header bytes are not zero");
    for (size_t i = used; i < kBlockSize; i++) {
      if (blk[i] != 0) return bad("byte " + std::to_string(i) + " past the records is not zero");
    }
  }
  g.target.generation = DecodeU64(blk + kOffTargetGeneration);
  g.posted_ns = DecodeU64(blk + kOffPostedNs);
  g.host_id = DecodeU32(blk + kOffHostId);
  g.records.reserve(count);
  for (uint32_t i = 0; i < count; i++) {
    const uint8_t* p = blk + kMergeGroupHeaderBytes + size_t(i) * kMergeRecordBytes;
    MergeRecord r;
    r.target_block = DecodeU64(p + kRecTargetBlock);
    r.clone_block = DecodeU64(p + kRecCloneBlock);
    if (r.target_block > kMaxMergeBlock) {
      return bad("record " + std::to_string(i) + " is past the largest file");
    }
    if (r.clone_block != g.first_block + 1 + i) {
      return bad("record " + std::to_string(i) + " names clone block " +
                 std::to_string(r.clone_block) + " (expected " +
                 std::to_string(g.first_block + 1 + i) + ")");
    }
    for (size_t k = fp_size; k < kWitnessBytes; k++) {
      if (p[kRecWitness + k] != 0) {
        return bad("record " + std::to_string(i) + ": witness padding is not zero");
      }
    }
    r.witness.size = uint8_t(fp_size);
    std::memcpy(r.witness.bytes.data(), p + kRecWitness, fp_size);
    g.records.push_back(r);
  }
  return g;
}

void MergeApplyStats::Add(const MergeApplyStats& o) {
  request_files += o.request_files;
  request_files_busy += o.request_files_busy;
  request_files_removed += o.request_files_removed;
  records += o.records;
  applied += o.applied;
  already_shared += o.already_shared;
  failed_verification += o.failed_verification;
  stale += o.stale;
  busy += o.busy;
  corrupt_groups += o.corrupt_groups;
  newer_files_kept += o.newer_files_kept;
}

}  // namespace dede
