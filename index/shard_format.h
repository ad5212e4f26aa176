// Index shard files, pending-record files and arena files: names and the
// explicit little-endian encoding of every block (docs/FORMAT.md section 13
// is the prose twin of this file; change both together). Nothing here does
// I/O.
//
// The index is sharded by fingerprint prefix. A shard at depth d with
// first fingerprint prefix `lo` covers the 64-bit prefixes
// [lo, lo + 2^(64-d)); depth 0 is the whole space. Each version of a shard
// is its own volume file (kind kIndexShard):
//
//   block 0          header (written last: a valid header means complete)
//   blocks 1..E      entry blocks, entries sorted by fingerprint
//   blocks E+1..E+T  file table: the (ino, generation) pairs that Unique
//                    entries name by index
//
// Every block carries a magic and a crc32c over the volume UUID, the shard
// file's (ino, generation) and the block's index in the file, so a block of
// another volume, another shard version or another position fails.
//
// Entries are fixed size per shard: the fingerprint without the bytes the
// shard's depth makes common (depth / 8 leading bytes), then 7 bytes:
//   bit 55 = 0: Unique  bits 38..54 file-table index, bits 0..37 block
//   bit 55 = 1: Shared  bits 0..54 arena block index
// With XXH3-128 that is at most 23 bytes per entry, 177 per block.
#pragma once

#include <array>
#include <boost/endian/conversion.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "util/fingerprint.h"
#include "util/status.h"
#include "volume/format.h"
#include "volume/volume.h"

namespace dede {

inline constexpr uint32_t kMagicShardHeader = 0x58494444;   // "DDIX"
inline constexpr uint32_t kMagicShardEntries = 0x45494444;  // "DDIE"
inline constexpr uint32_t kMagicShardFiles = 0x46494444;    // "DDIF"
inline constexpr uint32_t kMagicPendingFrame = 0x50494444;  // "DDIP"
inline constexpr uint16_t kShardMajor = 1;
inline constexpr uint16_t kShardMinor = 0;

inline constexpr uint32_t kShardBlockHeader = 12;  // magic, crc, count, reserved
inline constexpr uint32_t kEntryMetaBytes = 7;
inline constexpr uint32_t kMaxShardDepth = 40;     // lock ids keep lo >> 16
inline constexpr uint64_t kMaxEntryFileRef = (1ull << 17) - 1;
inline constexpr uint64_t kMaxEntryBlock = (1ull << 38) - 1;
inline constexpr uint64_t kMaxArenaIndex = (1ull << 55) - 1;
inline constexpr uint32_t kFileTableEntryBytes = 16;
inline constexpr uint32_t kFilesPerBlock = (kBlockSize - kShardBlockHeader) / kFileTableEntryBytes;

// A fingerprint as the index sorts it: its bytes, compared as a string.
using FpKey = std::array<uint8_t, 32>;
FpKey KeyOf(const Fingerprint& fp);
Fingerprint FingerprintOf(const FpKey& k, HashAlgo algo);
// The 64-bit prefix (big-endian first 8 bytes) that picks the shard.
// Inline: the reader's scan loop calls it once per entry.
inline uint64_t KeyPrefix(const FpKey& k) { return boost::endian::load_big_u64(k.data()); }

// A shard's place in the fingerprint space.
struct ShardRange {
  uint32_t depth = 0;
  uint64_t lo = 0;
  // Last prefix inside (inclusive, so depth 0 needs no 2^64).
  uint64_t last() const {
    return depth == 0 ? ~0ull : lo + ((~0ull) >> depth);
  }
  bool Contains(uint64_t prefix) const { return prefix >= lo && prefix <= last(); }
  ShardRange Lower() const { return {depth + 1, lo}; }
  ShardRange Upper() const { return {depth + 1, lo + (1ull << (63 - depth))}; }
  bool operator==(const ShardRange& o) const { return depth == o.depth && lo == o.lo; }
  bool operator<(const ShardRange& o) const { return lo != o.lo ? lo < o.lo : depth < o.depth; }
  std::string ToString() const;  // "[lo..last]/depth"
};
// Bytes of every fingerprint in the range that are equal (elided on disk).
inline uint32_t ElidedBytes(const ShardRange& r) { return r.depth / 8; }

// The LockManager id of a shard's lock (LockKind::kIndexShard): lo >> 16
// (depth <= 40 keeps lo a multiple of 2^24).
inline uint64_t ShardLockId(const ShardRange& r) { return r.lo >> 16; }

// Volume file names.
//   ".dede-ix-<depth:2 hex>-<lo:16 hex>-<version:16 hex>"  shard version
//   ".dede-ixp-<depth:2 hex>-<lo:16 hex>"                   pending records
//   ".dede-arena-<lo:16 hex>"                               arena of the shard
//                                                           starting at lo
std::string ShardFileName(const ShardRange& r, uint64_t version);
bool ParseShardFileName(const std::string& name, ShardRange* r, uint64_t* version);
std::string PendingFileName(const ShardRange& r);
bool ParsePendingFileName(const std::string& name, ShardRange* r);
std::string ArenaFileName(uint64_t lo);
bool ParseArenaFileName(const std::string& name, uint64_t* lo);

// Entry kinds (on disk as bit 55; never renumber).
enum class EntryKind : uint8_t { kUnique = 0, kShared = 1 };

// One index entry in memory. Unique entries name (file, block) and are a
// hint; Shared entries name a block of the shard's arena and are stable
// (shared blocks are copy-on-write).
struct IndexEntry {
  FpKey fp{};
  EntryKind kind = EntryKind::kUnique;
  FileId file;          // Unique
  uint64_t block = 0;   // Unique: block index in file
  uint64_t arena = 0;   // Shared: arena block index
};

struct ShardHeader {
  ShardRange range;
  uint64_t version = 0;
  HashAlgo algo = HashAlgo::kXxh128;
  uint32_t entry_size = 0;     // bytes per entry (derived, checked)
  uint64_t entry_count = 0;
  uint64_t entry_blocks = 0;
  uint64_t unique_count = 0;
  uint64_t shared_count = 0;
  uint64_t file_count = 0;
  uint64_t file_blocks = 0;
  uint64_t arena_next = 0;     // arena blocks below this may be in use
  uint64_t created_ns = 0;
  uint64_t update_ns = 0;      // how long the update that wrote it took
  uint32_t host_id = 0;
};

uint32_t EntrySize(HashAlgo algo, const ShardRange& r);
uint32_t EntriesPerBlock(uint32_t entry_size);

// crc of a block of a volume-file structure: uuid | ino | generation |
// block index in the file | the block with bytes [crc_at, crc_at+4) zero.
uint32_t FileBlockCrc(const uint8_t* blk, size_t crc_at, const Uuid& uuid, FileId file,
                      uint64_t index);

void EncodeShardHeader(const ShardHeader& h, const Uuid& uuid, FileId file, uint8_t* blk);
// kCorruption naming `what` on any failed check, kUnsupported for a newer
// major version.
Result<ShardHeader> DecodeShardHeader(const uint8_t* blk, const Uuid& uuid, FileId file,
                                      const std::string& what);

// An entry block holds up to EntriesPerBlock entries. Unique entries carry
// a file-table index (`file_ref`) instead of the FileId.
struct EncodedEntry {
  IndexEntry e;
  uint32_t file_ref = 0;
};
// `n` entries (1..EntriesPerBlock) at block `index` of the shard file.
void EncodeEntryBlock(const EncodedEntry* entries, size_t n, const ShardHeader& h,
                      const Uuid& uuid, FileId file, uint64_t index, uint8_t* blk);
// Checks an entry block's magic, crc and count; returns the count.
Result<uint32_t> CheckEntryBlock(const uint8_t* blk, const ShardHeader& h, const Uuid& uuid,
                                 FileId file, uint64_t index, const std::string& what);
// Decodes the entry at `p` (inside a checked block): `prefix` holds the
// range's elided leading bytes (EntryPrefix).
FpKey EntryPrefix(const ShardHeader& h);
void DecodeEntry(const uint8_t* p, const ShardHeader& h, const FpKey& prefix, EncodedEntry* out);
// Appends the block's entries to *out (file_ref filled, e.file unset).
Status DecodeEntryBlock(const uint8_t* blk, const ShardHeader& h, const Uuid& uuid, FileId file,
                        uint64_t index, std::vector<EncodedEntry>* out, const std::string& what);

void EncodeFileTableBlock(const FileId* files, size_t n, const Uuid& uuid, FileId file,
                          uint64_t index, uint8_t* blk);
Status DecodeFileTableBlock(const uint8_t* blk, const Uuid& uuid, FileId file, uint64_t index,
                            std::vector<FileId>* out, const std::string& what);

// Pending records: records a pass deferred for a shard whose rewrite is
// not due yet (batching). A pending file is a sequence of frames; a frame
// is a header block then ceil(count / per-block) record blocks:
//   header: magic "DDIP", major, minor, header crc, algo, count,
//           first_block (the frame's own block index), crc of the record
//           blocks (docs/FORMAT.md section 13.5).
//   record: fingerprint (algo size), ino u64, generation u64, block u64.
struct PendingRecord {
  FpKey fp{};
  FileId file;
  uint64_t block = 0;
};
uint32_t PendingRecordSize(HashAlgo algo);
uint32_t PendingRecordsPerBlock(HashAlgo algo);
// Encodes `recs` as one frame starting at block `first_block` of the file.
std::vector<uint8_t> EncodePendingFrame(const std::vector<PendingRecord>& recs, HashAlgo algo,
                                        const Uuid& uuid, FileId file, uint64_t first_block);
// Decodes the frame at buf (len bytes from block `first_block`); sets
// *frame_blocks to its size when the header is valid.
Status DecodePendingFrame(const uint8_t* buf, size_t len, HashAlgo algo, const Uuid& uuid,
                          FileId file, uint64_t first_block, std::vector<PendingRecord>* out,
                          uint64_t* frame_blocks, const std::string& what);

}  // namespace dede
