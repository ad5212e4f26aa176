// Merge requests (DeDe section 3.3.2): how a host asks the holder of a file
// to share one of that file's blocks, without ever touching the file.
//
// A host's dedup pass may find that the index's Unique(G, c) names a block
// of a file G that another process or host holds (G's lock is held
// elsewhere, so this host may neither read nor repoint G's blocks). It
// still promotes its own record's block to an arena block (the index entry
// becomes Shared), and *posts a merge request* for G:c: the block index,
// the fingerprint the index had for it (the witness), and a copy-on-write
// reference to the shared block, cloned into the request file itself. The
// holder of G applies the requests for the files it holds (at each pass and
// on a timer in dedupd): it checks that G:c still hashes to the witness and
// lets the volume compare_and_share G:c with the request's clone. The
// clone keeps the shared block alive even if the arena drops it meanwhile,
// so the applier never needs the arena (or the index's lock).
//
// Files: one request file per target inode, a volume file of kind
// kMergeRequest named ".dede-mr-<target ino, 16 lowercase hex digits>"
// with owner_ino = the target's ino. It is append-only between clears: a
// sequence of *groups*, each a header block (magic "DDMR") listing up to
// kMaxMergeRecordsPerGroup records, followed by one data block per record
// holding the record's clone. The layout, crcs and decoding rules are
// docs/FORMAT.md section 14 (this header and merge_format.cc are its
// source of truth).
//
// Locking: the request file's inode lock (an OpenFile) is its only guard,
// taken with try-lock by poster and applier alike and held only for one
// post or one apply. Nobody ever waits for it: a busy request file makes a
// post give up (kLocked: the dedup pass parks the requests it did not post
// and tries again later; at worst an opportunity is lost, never data) and
// an apply skip the file until next time.
//
// Trust: nothing in a request file is trusted. A group that fails its
// checks is skipped and counted; a record is applied only through the
// volume's verified share (witness check first, then a byte compare or a
// SHA-256 witness under both files' locks), so a wrong, stale or forged
// request can cost a failed share, never data.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "util/fingerprint.h"
#include "util/status.h"
#include "volume/format.h"
#include "volume/volume.h"

namespace dede {

inline constexpr uint32_t kMagicMergeGroup = 0x524d4444;  // "DDMR"
inline constexpr uint16_t kMergeMajor = 1;
inline constexpr uint16_t kMergeMinor = 0;
inline constexpr uint32_t kMergeGroupHeaderBytes = 64;
// target_block u64, clone_block u64, witness (32 bytes, zero-padded).
inline constexpr uint32_t kMergeRecordBytes = 48;
inline constexpr uint32_t kMaxMergeRecordsPerGroup =
    (kBlockSize - kMergeGroupHeaderBytes) / kMergeRecordBytes;  // 84
// Block indexes of files stay below 2^52 (a u64 byte size in 4 KiB blocks).
inline constexpr uint64_t kMaxMergeBlock = (uint64_t{1} << 52) - 1;

// ".dede-mr-<ino:16 hex>": the request file of the file with inode `ino`.
// Named by inode only: a file removed and recreated in the same inode finds
// the old requests, which carry the old generation and are dropped.
std::string MergeRequestFileName(uint64_t target_ino);
std::optional<uint64_t> ParseMergeRequestFileName(const std::string& name);

// ---------------------------------------------------------------- codec

// One record as stored: share block `target_block` of the target with the
// request file's block `clone_block` if the target block hashes to
// `witness`.
struct MergeRecord {
  uint64_t target_block = 0;
  uint64_t clone_block = 0;  // = the group's first_block + 1 + its position
  Fingerprint witness;
};

// One group: its header block's fields and records.
struct MergeGroup {
  FileId target;                     // the generation is the one the poster saw
  uint64_t first_block = 0;          // the header block's index in the request file
  uint64_t posted_ns = 0;            // wall clock of the post (information only)
  uint32_t host_id = 0;              // poster's host slot (information only)
  std::vector<MergeRecord> records;  // 1..kMaxMergeRecordsPerGroup
  // Blocks the group takes in the file: its header and its clones.
  uint64_t blocks() const { return 1 + records.size(); }
};

// Encodes the header block of `g` (records' clone_block must already be
// first_block + 1 + i; witnesses must be of `algo`) for the request file
// `request_file` of the volume `uuid`.
void EncodeMergeGroupBlock(const MergeGroup& g, HashAlgo algo, const Uuid& uuid,
                           FileId request_file, uint8_t* blk);
// Decodes the block read from index `block_index` of the request file
// `request_file`, whose target inode is `target_ino`. kCorruption naming
// `what` and the block on any failed check (bad magic or crc, a block of
// another volume, file or position, another target inode, hash algorithm,
// unknown flags, a count or record out of range, nonzero reserved bytes);
// kUnsupported for a newer major version. Never reads past the block.
Result<MergeGroup> DecodeMergeGroupBlock(const uint8_t* blk, HashAlgo algo, const Uuid& uuid,
                                         FileId request_file, uint64_t block_index,
                                         uint64_t target_ino, const std::string& what);

// ---------------------------------------------------------------- files

struct MergeScanStats {
  uint64_t groups = 0;
  uint64_t records = 0;
  uint64_t corrupt_groups = 0;  // runs of blocks that held no valid group
  // Group headers of a newer major format version (a newer dede posted
  // them): skipped like bad blocks, but not damage, and the file that
  // holds them is never cleared by this dede (docs/FORMAT.md section 9).
  uint64_t newer_groups = 0;
  // A run of kMaxMergeBadRunBlocks blocks without a group header ended the
  // scan: what follows was not read (a damaged inode's size, or a sparse
  // tail, would otherwise be stepped through one block at a time).
  bool gave_up = false;
};
// A post that dies leaves at most 1 + kMaxMergeRecordsPerGroup blocks
// without a header; a run this long is damage.
inline constexpr uint64_t kMaxMergeBadRunBlocks = 4096;

// Reads every valid group of an open request file, in file order. A block
// that is not a valid group header (torn post, damage, foreign bytes) is
// skipped one block at a time and counted once per run, like a write log's
// torn frame; a header whose group runs past the file's end is torn too.
// A run of kMaxMergeBadRunBlocks such blocks ends the scan (gave_up).
// Only I/O errors fail.
Result<std::vector<MergeGroup>> ReadMergeRequestFile(File* request, HashAlgo algo, const Uuid& uuid,
                                                     uint64_t target_ino, MergeScanStats* stats);

// What a poster asks for one block of the target.
struct MergeRequest {
  uint64_t target_block = 0;  // block index in the target file
  Fingerprint witness;        // the content the poster expects there
  uint64_t source_index = 0;  // block of `clone_source` to clone into the request
};

// Appends `requests` (in groups of at most kMaxMergeRecordsPerGroup) to
// the request file of `target`, creating it if needed: each group's
// clones first (Volume::CloneBlock from `clone_source`, e.g. the arena, into
// the request file), then its header block, so a group is valid only once
// everything it names is there. Durable at the volume's next flush point
// (the caller's Sync). The request file's lock is taken with try-lock:
// kLocked when another process or host (or this volume) has it open — the
// caller counts the post as busy and goes on; never waits. kCorruption if a
// file of that name exists but is not a merge-request file of `target`.
// A clone can also fail with kLocked, without waiting: the clone source
// block's allocation group is held elsewhere (Volume::CloneBlock with
// no_wait; the want is announced, so its holder hands it over at its next
// flush point): the half-built group is taken back. `outcome` tells the
// two apart, and how many requests were posted (in complete groups).
struct MergePostOutcome {
  size_t posted = 0;       // requests, from the first, in complete groups
  bool file_busy = false;  // kLocked: the request file was open elsewhere
};
Status PostMergeRequests(Volume* vol, FileId target, const std::vector<MergeRequest>& requests,
                         File* clone_source, MergePostOutcome* outcome = nullptr);

struct MergeApplyStats {
  uint64_t request_files = 0;          // request files read and cleared
  uint64_t request_files_busy = 0;     // locked by a poster at that moment: next time
  uint64_t request_files_removed = 0;  // orphans: target inode gone (sweeps only)
  uint64_t records = 0;                // records read
  uint64_t applied = 0;                // target block now shares the requested block
  uint64_t already_shared = 0;         // of `applied`: it already did
  uint64_t failed_verification = 0;    // target block no longer holds the witness content
  uint64_t stale = 0;                  // target recreated (other generation), truncated, dedup=off
  // Shares held back because their block's allocation group is held by
  // another process or host (never waited for): the request file is kept
  // whole for the next apply.
  uint64_t busy = 0;
  uint64_t corrupt_groups = 0;         // skipped runs of bad blocks
  // Request files kept because they hold groups of a newer format version
  // (MergeScanStats::newer_groups): their other requests are applied, and
  // applied again next time (idempotent), but the file is not removed.
  uint64_t newer_files_kept = 0;
  void Add(const MergeApplyStats& o);
};

// Applies the requests posted for `target`, which the caller holds open
// (its lock): records of another generation, of blocks past the target's
// end or of a dedup=off target are stale; a record whose target block no
// longer hashes to its witness fails verification; the others become one
// Volume::ApplyBlockOps kShare each (request clone -> target block,
// verified by `verify` under both files' locks). Then the shares are made
// durable (Sync) before the request file is emptied and removed, so a
// crash at any instant re-applies at worst (sharing is idempotent). No
// request file: zero stats. A request file held elsewhere: counted busy.
// Never waits for another host: a share whose block's allocation group is
// held elsewhere is held back (Volume::BlockOpsOptions::no_wait), counted
// in `busy`, and then the request file is kept as it is, to be applied
// again (the done shares are found already shared then). A file holding a
// group of a newer format version is kept too (newer_files_kept).
Result<MergeApplyStats> ApplyMergeRequests(Volume* vol, File* target, VerifyMode verify);

}  // namespace dede
