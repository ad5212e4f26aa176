// The dede volume's on-disk structures: layout arithmetic plus explicit
// little-endian encode/decode for every metadata block. docs/FORMAT.md is
// the prose twin of this file; change both together.
//
// Every metadata block is 4 KiB and starts with a 32-byte BlockHeader. Its
// crc32c covers the volume UUID, the block's own address and the block's
// bytes (crc field zeroed), so a block written to the wrong place or
// belonging to another volume fails the check. Nothing here does I/O.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "util/fingerprint.h"
#include "util/status.h"

namespace dede {

inline constexpr uint32_t kBlockSize = 4096;
inline constexpr uint32_t kHeaderSize = 32;

// Largest size a file may be created with or truncated to: 1 EiB (2^48
// blocks). Far beyond any LUN, and far enough below 2^64 bytes that block
// counts and byte offsets of a file never wrap (a size near 2^64 made
// "rounded up to whole blocks" wrap to 0, and a grow punched the file).
inline constexpr uint64_t kMaxFileBytes = uint64_t{1} << 60;

// Whether block `index` lies whole inside a file of `size` bytes; never
// wraps, whatever `index` is (an index from a log or a merge request).
inline bool WholeBlockInside(uint64_t index, uint64_t size) {
  return index < size / kBlockSize;
}

// Magic numbers (u32, little-endian on disk). Never reuse a value.
inline constexpr uint32_t kMagicSuperblock = 0x42534444;  // "DDSB"
inline constexpr uint32_t kMagicJournalHeader = 0x484a4444;  // "DDJH"
inline constexpr uint32_t kMagicJournalTxn = 0x544a4444;  // "DDJT"
inline constexpr uint32_t kMagicInode = 0x4e494444;  // "DDIN"
inline constexpr uint32_t kMagicPointerBlock = 0x50504444;  // "DDPP"
inline constexpr uint32_t kMagicRefcountBlock = 0x43524444;  // "DDRC"
inline constexpr uint32_t kMagicLockTable = 0x544c4444;  // "DDLT"
inline constexpr uint32_t kMagicDropList = 0x4c444444;  // "DDDL"

// Format version this code writes. A block with a larger major is refused;
// a larger minor is read (minor bumps only add fields in reserved space).
inline constexpr uint16_t kFormatMajor = 1;
inline constexpr uint16_t kFormatMinor = 1;

using Uuid = std::array<uint8_t, 16>;
std::string UuidToString(const Uuid& u);
Uuid NewRandomUuid();

struct BlockHeader {
  uint32_t magic = 0;
  uint16_t major = kFormatMajor;
  uint16_t minor = kFormatMinor;
  uint32_t flags = 0;  // structure specific (pointer block: level)
  uint64_t seq = 0;    // bumped on every rewrite of the block
  uint64_t addr = 0;   // the block's own address (in 4 KiB blocks)
};

// Writes `h` into blk[0..32) and the crc over uuid|addr|blk.
void SealBlock(uint8_t* blk, const BlockHeader& h, const Uuid& uuid);
// Checks magic, crc, version and address, in that order; `what` names the
// structure in the error ("inode 7").
Status CheckBlock(const uint8_t* blk, uint32_t magic, uint64_t addr, const Uuid& uuid,
                  const std::string& what);
BlockHeader PeekHeader(const uint8_t* blk);
uint32_t BlockCrc(const uint8_t* blk, const Uuid& uuid, uint64_t addr);

// ---------------------------------------------------------------- layout

inline constexpr uint64_t kLeaseAreaStartBlock = 256;  // 1 MiB
inline constexpr uint64_t kLeaseBlocks = 256;          // 1 MiB per sanlock lease
inline constexpr uint32_t kRefsPerBlock = (kBlockSize - kHeaderSize) / 4;      // 1016
inline constexpr uint32_t kPointersPerBlock = (kBlockSize - kHeaderSize) / 8;  // 508
inline constexpr uint32_t kMaxNameLen = 255;
inline constexpr uint32_t kMaxHosts = 250;  // sanlock: 1 MiB leases with 4K sectors

// incompat_features bits. Never renumber.
// kIncompatSanlock: the lease area holds an initialised sanlock lockspace
// and lease table; every opener must coordinate through the sanlock
// backend (local locks alone would let another host in).
inline constexpr uint64_t kIncompatSanlock = 1;
// kIncompatDropLists: the last `drop_blocks` blocks of every host's journal
// region are its deferred-drop list (section 5.6 of FORMAT.md); a reader
// that does not know would take them for journal ring.
inline constexpr uint64_t kIncompatDropLists = 2;
// Most blocks a host's drop list may have (format makes at most this many;
// an opener holds the whole list in memory).
inline constexpr uint32_t kMaxDropBlocks = 0xffff;
inline constexpr uint64_t kKnownIncompatFeatures = kIncompatSanlock | kIncompatDropLists;

struct Superblock {
  Uuid uuid{};
  uint32_t block_size = kBlockSize;
  HashAlgo hash_algo = HashAlgo::kXxh128;
  uint64_t total_blocks = 0;
  uint32_t max_hosts = 0;
  uint32_t lease_slots = 0;     // resource leases after the lockspace
  uint64_t lease_start = 0;     // block; lockspace (1 MiB) then lease_slots x 1 MiB
  uint64_t lease_blocks = 0;
  uint64_t journal_start = 0;   // host h (1-based) at journal_start + (h-1)*journal_blocks
  uint64_t journal_blocks = 0;  // per host, header block included
  uint64_t inode_start = 0;     // inode i (1-based) at inode_start + i - 1
  uint64_t inode_count = 0;
  uint64_t group_start = 0;
  uint32_t group_count = 0;
  uint32_t group_refblocks = 0;  // refcount blocks in a full group
  uint64_t created_ns = 0;
  uint64_t compat_features = 0;
  uint64_t incompat_features = 0;  // any unknown bit: refuse to open
  // Per host: the tail of its journal region holding its deferred-drop
  // list (0: none, the volume predates them; kIncompatDropLists iff > 0).
  uint32_t drop_blocks = 0;

  bool UsesSanlock() const { return (incompat_features & kIncompatSanlock) != 0; }

  // Derived layout of group g.
  uint64_t GroupStart(uint32_t g) const;
  uint32_t GroupRefBlocks(uint32_t g) const;
  uint64_t GroupDataStart(uint32_t g) const { return GroupStart(g) + GroupRefBlocks(g); }
  uint64_t GroupDataBlocks(uint32_t g) const;
  uint64_t FullGroupBlocks() const {
    return group_refblocks + uint64_t{group_refblocks} * kRefsPerBlock;
  }
  // Which group holds data block `b`; false if b is not a data block.
  bool LocateData(uint64_t b, uint32_t* group, uint64_t* refblock, uint32_t* slot) const;
  uint64_t JournalStart(uint32_t host) const {
    return journal_start + uint64_t{host - 1} * journal_blocks;
  }
  // The journal ring of each host: its region less the two header slots
  // and the drop list.
  uint64_t JournalRingBlocks() const { return journal_blocks - 2 - drop_blocks; }
  uint64_t DropListStart(uint32_t host) const {
    return JournalStart(host) + journal_blocks - drop_blocks;
  }
  uint64_t InodeBlock(uint64_t ino) const { return inode_start + ino - 1; }
  uint64_t DataBlocks() const;
};

inline constexpr uint64_t kSuperblockAddrs[2] = {0, 1};

void EncodeSuperblock(const Superblock& sb, uint64_t addr, uint8_t* blk);
Result<Superblock> DecodeSuperblock(const uint8_t* blk, uint64_t addr);

struct FormatParams {
  uint64_t device_bytes = 0;
  uint32_t max_hosts = 8;
  HashAlgo hash_algo = HashAlgo::kXxh128;
  uint64_t inode_count = 0;     // 0: one per 16 MiB, within [256, 65536]
  uint32_t lease_slots = 0;     // 0: 8 below 4 GiB, else 64
  uint64_t journal_blocks = 0;  // 0: 256 below 1 GiB, else 1024
  uint32_t group_refblocks = 32;
  int64_t drop_blocks = -1;     // per host; -1: journal_blocks / 32 (at least 1)
};
// Lays out a volume on a device; kNoSpace with the minimum size if too small.
Result<Superblock> PlanLayout(const FormatParams& p);

// ------------------------------------------------------------- lock table
//
// With the sanlock backend (volume/sanlock_lock_manager.h) the lease area's
// slots are: slot 0 the "volume" resource lease; slots 1..P the leases that
// guard the P lock-table partitions; the last slot stores the partitions,
// kLockTableBlocksPerPartition blocks each. A block lists lock records.
struct LockRecord {
  uint16_t kind = 0;        // LockKind
  uint8_t mode = 0;         // 1 shared, 2 exclusive
  uint32_t host = 0;        // sanlock host id of the holder
  uint64_t id = 0;          // LockId::id
  uint64_t generation = 0;  // the holder's sanlock host generation
  uint64_t since_ns = 0;    // when it was taken (diagnostics only)
  bool operator==(const LockRecord& o) const {
    return kind == o.kind && mode == o.mode && host == o.host && id == o.id &&
           generation == o.generation && since_ns == o.since_ns;
  }
};
// A record's `generation` when the process of a live host that held the
// lock died (SanlockLockManager::CollectStaleRecords): sanlock host
// generations start at 1, so every host takes such a record for a dead
// holder's. On disk; never reuse.
inline constexpr uint64_t kDeadProcessGeneration = 0;
inline constexpr uint32_t kLockRecordSize = 32;
inline constexpr uint32_t kLockRecordsPerBlock =
    (kBlockSize - kHeaderSize - 8) / kLockRecordSize;  // 126
inline constexpr uint32_t kLockTableBlocksPerPartition = 4;
inline constexpr uint32_t kMaxLockTablePartitions = 62;

struct LeaseLayout {
  uint32_t partitions = 0;  // 0: the volume has too few lease slots for sanlock
  uint64_t lockspace_offset = 0;  // bytes
  uint64_t SlotOffset(uint32_t slot) const {  // bytes; resource lease slot
    return lockspace_offset + (uint64_t{slot} + 1) * kLeaseBlocks * kBlockSize;
  }
  uint64_t table_block = 0;  // block of partition 0, block 0
  uint64_t PartitionBlock(uint32_t p, uint32_t k) const {
    return table_block + uint64_t{p} * kLockTableBlocksPerPartition + k;
  }
};
LeaseLayout LeaseLayoutOf(const Superblock& sb);

// An all-zero block decodes as an empty block (format zeroes the area).
void EncodeLockTableBlock(const std::vector<LockRecord>& recs, uint64_t seq, uint64_t addr,
                          const Uuid& uuid, uint8_t* blk);
Result<std::vector<LockRecord>> DecodeLockTableBlock(const uint8_t* blk, uint64_t addr,
                                                     const Uuid& uuid);

// ---------------------------------------------------------------- journal

// Each host's journal region: two header slots (blocks 0 and 1, written
// alternately; the valid one with the larger header seq wins) then a ring of
// journal_blocks - 2 - drop_blocks blocks holding transactions
// (Superblock::JournalRingBlocks), then the drop list.
inline constexpr uint64_t kJournalHeaderSlots = 2;
struct JournalHeader {
  uint32_t host = 0;
  uint64_t tail_seq = 1;  // sequence number of the oldest live transaction
  uint64_t tail_pos = 0;  // its ring position (0 .. ring size - 1)
};
void EncodeJournalHeader(const JournalHeader& jh, uint64_t seq, const Uuid& uuid, uint64_t addr,
                         uint8_t* blk);
Result<JournalHeader> DecodeJournalHeader(const uint8_t* blk, const Uuid& uuid, uint64_t addr);

// A transaction: one descriptor block then `homes.size()` block images.
inline constexpr uint32_t kMaxTxnBlocks = (kBlockSize - 40) / 8;  // 507
// The fewest metadata blocks a volume's transactions must be able to hold
// (JournalRingBlocks() / 2 - 1): a block operation asks for 32, and a
// write round one refcount block per new block. Format refuses less.
inline constexpr uint32_t kMinTxnBlocks = 32;
struct JournalTxn {
  uint64_t seq = 0;
  uint32_t images_crc = 0;  // crc32c over the images, in order
  std::vector<uint64_t> homes;
};
void EncodeJournalTxn(const JournalTxn& t, const Uuid& uuid, uint64_t addr, uint8_t* blk);
Result<JournalTxn> DecodeJournalTxn(const uint8_t* blk, const Uuid& uuid, uint64_t addr);

// ------------------------------------------------------------- drop lists
//
// A host's deferred reference drops (docs/LOCKING.md "Deferred drops"): each
// entry is one reference to a data block that this host's block maps no
// longer hold, whose refcount is not yet decremented because another host
// had the block's group. Entries are written in the same journal
// transaction as the pointer change that dropped the reference, and
// removed in the one that decrements the count. The same address may appear
// more than once (one entry per reference).
inline constexpr uint32_t kDropsPerBlock = (kBlockSize - kHeaderSize - 8) / 8;  // 507
// Decodes the drop-list block at `addr` of host slot `host`: kCorruption
// naming the block on a bad magic/crc, another host, a count past
// kDropsPerBlock, an entry that is not a data block of `sb`, or nonzero
// bytes past the entries. An all-zero block (never written) is empty.
Result<std::vector<uint64_t>> DecodeDropListBlock(const uint8_t* blk, const Superblock& sb,
                                                  uint32_t host, uint64_t addr);
// Encodes up to kDropsPerBlock entries (the caller checks the count).
void EncodeDropListBlock(const std::vector<uint64_t>& drops, uint32_t host, uint64_t seq,
                         const Uuid& uuid, uint64_t addr, uint8_t* blk);

// ---------------------------------------------------------------- inodes

// Inode flags (bits; never renumber).
inline constexpr uint32_t kInodeInUse = 1u << 0;
inline constexpr uint32_t kInodeDedupOff = 1u << 1;
inline constexpr uint32_t kInodeKnownFlags = kInodeInUse | kInodeDedupOff;

// The file listing ends at the first run of this many never-written
// (all-zero) inode blocks: creates take the lowest free inode, so such a
// run has no used inode after it (docs/FORMAT.md, section 1). fsck
// reports a used inode past it, which no listing or lookup would find.
inline constexpr uint64_t kInodeListingEndRun = 256;

// What a file is for (never renumber; later issues store their structures
// as ordinary files of these kinds).
enum class FileKind : uint16_t {
  kNone = 0,
  kRegular = 1,       // a VM disk or any user file
  kIndexShard = 2,    // index/ (issue 4)
  kArena = 3,         // virtual arena (issue 4)
  kWriteLog = 4,      // per-file write log (issue 3)
  kMergeRequest = 5,  // merge/ (issue 5)
  kSystem = 6,        // other internal files
};
const char* FileKindName(FileKind k);

struct Inode {
  uint64_t ino = 0;
  uint64_t generation = 0;
  uint32_t flags = 0;
  FileKind kind = FileKind::kNone;
  uint8_t depth = 0;  // block-map levels, the root's level; 0 = no map yet
  uint64_t size = 0;  // bytes
  uint64_t root = 0;  // block address of the top pointer block, 0 if none
  uint64_t mapped_blocks = 0;  // data pointers in the map (shared or not)
  uint64_t ctime_ns = 0;
  uint64_t mtime_ns = 0;
  uint64_t owner_ino = 0;  // file this one belongs to (write log, merge file)
  std::string name;

  bool in_use() const { return flags & kInodeInUse; }
};
void EncodeInode(const Inode& in, uint64_t seq, const Uuid& uuid, uint64_t addr, uint8_t* blk);
Result<Inode> DecodeInode(const uint8_t* blk, const Uuid& uuid, uint64_t addr);

// ---------------------------------------------------------------- block map

// A block pointer: bits 0-47 physical block, bit 63 copy-on-write, bits
// 48-62 reserved (must be zero). 0 is a hole.
inline constexpr uint64_t kPtrCow = 1ull << 63;
inline constexpr uint64_t kPtrAddrMask = (1ull << 48) - 1;
inline constexpr uint64_t kPtrReserved = ~(kPtrCow | kPtrAddrMask);
inline uint64_t PtrAddr(uint64_t p) { return p & kPtrAddrMask; }
inline bool PtrCow(uint64_t p) { return p & kPtrCow; }

struct PointerBlock {
  uint8_t level = 1;  // 1: entries point at data blocks; >1: at pointer blocks
  std::array<uint64_t, kPointersPerBlock> ptrs{};
};
void EncodePointerBlock(const PointerBlock& pb, uint64_t seq, const Uuid& uuid, uint64_t addr,
                        uint8_t* blk);
Result<PointerBlock> DecodePointerBlock(const uint8_t* blk, const Uuid& uuid, uint64_t addr);

// ---------------------------------------------------------------- refcounts

struct RefcountBlock {
  std::array<uint32_t, kRefsPerBlock> refs{};
};
void EncodeRefcountBlock(const RefcountBlock& rb, uint64_t seq, const Uuid& uuid, uint64_t addr,
                         uint8_t* blk);
Result<RefcountBlock> DecodeRefcountBlock(const uint8_t* blk, const Uuid& uuid, uint64_t addr);

// Pointer and refcount blocks are edited in place in the volume's cache;
// these accessors read and write one slot of an encoded block.
uint64_t GetPtr(const uint8_t* blk, uint32_t i);
void SetPtr(uint8_t* blk, uint32_t i, uint64_t v);
uint32_t GetRef(const uint8_t* blk, uint32_t i);
void SetRef(uint8_t* blk, uint32_t i, uint32_t v);

}  // namespace dede
