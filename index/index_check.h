// What the index holds, and whether it is intact: the figures `dede stats`
// prints about the index and the index part of `dede fsck`.
//
// SummarizeIndex reads only shard headers, pending frame headers and the
// arenas' block maps: it is cheap enough for every `dede stats`.
//
// CheckIndex reads every live shard version completely, every pending file
// and every write log, and reports each problem with what it is and where
// (file name, block or byte offset):
//
//   * a live shard version with a bad or incomplete header (an update that
//     died before writing it), a header that does not match the file's
//     name, a file shorter than its header says (truncated), corrupt entry
//     blocks (bad magic, checksum or count; entries out of order, outside
//     the shard's range, naming a file-table slot or an arena block that
//     does not exist), a corrupt file table;
//   * stale index files: superseded shard versions, pending files of ranges
//     that are not live shards, arenas of ranges that have no usable shard
//     version (left behind by an update or split that died);
//   * pending files with a bad frame (a frame of a newer format version is
//     no damage: such files, and shard versions of a newer format, are
//     listed in `newer` and left alone);
//   * write logs with corrupt frames (bytes skipped), and orphan write logs
//     whose file is gone.
//
// Nothing in the index is needed to read any file: entries are hints (a
// Unique entry names a block that once had the fingerprint) or name arena
// blocks, and the arena is just one more reference to blocks the files
// themselves reference. Repair (`repair` = true) therefore only removes:
//
//   * a damaged live shard version (its entries are lost as hints; files
//     keep all their data), and then the arena of its range, which no
//     usable version describes any more (only the arena's references go:
//     every file still references its blocks, shared ones stay shared);
//   * stale shard versions, stale pending files and stale arenas;
//   * the frames of a pending file from its first bad frame on (the frames
//     before it are intact and kept).
//
// Each repair is done holding the range's index shard lock
// (LockKind::kIndexShard), so it does not race a dedup pass; a range whose
// lock is held elsewhere is reported busy and left alone. Write logs are
// never changed by repair: a dedup pass skips their bad frames (counting
// them) and consumes the rest, after which the logs are empty; orphan logs
// are removed by the next pass too.
//
// After a repair the index has lost the removed entries; `dede dedup
// --rescan` rebuilds it from the files' contents (every block of every file
// is read and fingerprinted, as if freshly logged). Without it, blocks
// written after the repair are still deduplicated against each other and
// against whatever the index still holds.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "util/status.h"
#include "volume/volume.h"

namespace dede {

struct IndexSummary {
  // Live shards (ranges of the fingerprint space with a shard version).
  uint64_t shards = 0;
  uint64_t empty_ranges = 0;      // live ranges with no version yet
  uint64_t busy_shards = 0;       // version file held elsewhere: not counted
  uint64_t unreadable_shards = 0; // bad or incomplete header
  // Entries of the live shards whose headers were read.
  uint64_t entries = 0;
  uint64_t unique_entries = 0;    // hints naming one (file, block)
  uint64_t shared_entries = 0;    // naming an arena block
  // Every shard version file (live or stale) and every pending file:
  // their mapped blocks.
  uint64_t shard_files = 0;
  uint64_t shard_blocks = 0;
  uint64_t pending_files = 0;
  uint64_t pending_blocks = 0;
  uint64_t pending_records = 0;   // records parked for the next rewrite
  uint64_t busy_pending = 0;
  // Arenas: mapped blocks are references to blocks files share (the data
  // is the files'; an arena adds no data of its own except `arena_only`).
  uint64_t arena_files = 0;
  uint64_t arena_blocks = 0;
  uint64_t arena_pointer_blocks = 0;  // the arenas' block maps (pointer blocks)
  uint64_t arena_only_blocks = 0;     // referenced by the arena alone (garbage
                                      // the next pass of that shard drops)
  uint64_t busy_arenas = 0;           // block maps not walked
  // Superseded versions, pending files and arenas of ranges not live.
  uint64_t stale_files = 0;

  uint64_t index_blocks() const { return shard_blocks + pending_blocks; }
  uint64_t index_bytes() const { return index_blocks() * kBlockSize; }
};

Result<IndexSummary> SummarizeIndex(Volume* vol);

// The volume's space as `dede stats` reports it (dedupd records it after
// each pass for `dede report`): what the VM files hold (logical), the
// distinct data blocks they use (physical; dede's own files and arena-only
// garbage not counted) and the difference.
struct SpaceSummary {
  VolumeStats stats;
  IndexSummary index;
  uint64_t regular_files = 0;
  uint64_t logical_blocks = 0;
  uint64_t internal_files = 0;
  uint64_t log_files = 0;
  uint64_t log_blocks = 0;
  uint64_t physical_blocks = 0;
  uint64_t logical_bytes() const { return logical_blocks * kBlockSize; }
  uint64_t physical_bytes() const { return physical_blocks * kBlockSize; }
  uint64_t saved_bytes() const {
    return logical_bytes() > physical_bytes() ? logical_bytes() - physical_bytes() : 0;
  }
};
Result<SpaceSummary> SummarizeSpace(Volume* vol);

struct IndexProblem {
  // What kind of file it is about, and who fixes it.
  enum class Kind {
    kShardDamaged,   // fixed by repair (version removed)
    kStaleFile,      // fixed by repair (file removed)
    kPendingDamaged, // fixed by repair (cut at the bad frame)
    kWriteLog,       // fixed by the next dedup pass, never by repair
  };
  Kind kind = Kind::kShardDamaged;
  std::string file;   // the volume file's name
  std::string where;  // "<file> block 2", "<file> byte 8192", "<file>"
  std::string what;
  bool repaired = false;
};

struct IndexCheckReport {
  std::vector<IndexProblem> problems;
  // Files held open elsewhere (a running pass or dedupd): not checked.
  std::vector<std::string> busy;
  // Shard versions and pending files of a newer major format version (a
  // newer dede wrote them; docs/FORMAT.md section 9): not checked, not
  // problems, never repaired.
  std::vector<std::string> newer;
  uint64_t shards_checked = 0;
  uint64_t entry_blocks_checked = 0;
  uint64_t entries_checked = 0;
  uint64_t pending_files_checked = 0;
  uint64_t logs_checked = 0;
  uint64_t log_frames_checked = 0;
  bool clean() const { return problems.empty(); }
};

// `repair` needs a writable volume. Only I/O errors (and a volume that
// cannot be listed) fail; damage is reported. The check runs without the
// ranges' locks (a pass may be updating the index meanwhile); the repair
// takes each range's lock and first looks again at what the check found
// there, leaving alone what changed since (reported "not repaired").
// `before_repair` (tests) runs between the check and the repair.
Result<IndexCheckReport> CheckIndex(Volume* vol, bool repair,
                                    const std::function<void()>& before_repair = nullptr);

}  // namespace dede
