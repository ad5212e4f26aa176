// ShardMap: which shard versions make up the index right now.
//
// The index has no directory of its own: the volume's namespace is the
// directory. Shard versions are named by (depth, lo, version); the live
// partition of the fingerprint space is resolved from the names alone:
//
//   Resolve(R): the newest version at exactly R, unless both halves of R
//   resolve to real versions all newer than it (a completed split), in
//   which case the halves. A range with no version at all is an empty
//   "virtual" shard (version 0): the index has nothing there yet.
//
// A new version always gets a higher number than the one it replaces, and
// a split's halves start above their parent, so a half-finished split
// (one half missing) leaves the parent live, and a finished one hides the
// parent even before the parent's file is removed. Whether a version is
// complete is decided by its header (written last); the lock holder of a
// range checks that and removes an incomplete version (see
// agent/dedup_pass.cc, and docs/ARCHITECTURE.md "The index").
//
// Files not in the live partition are stale: superseded shard versions,
// pending files of ranges that are no longer shards (their records were
// applied before the range changed), arenas whose lo starts no live shard.
// They are removed by whoever holds the lock of their range's lo.
#pragma once

#include <chrono>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "index/shard_format.h"
#include "util/status.h"
#include "volume/volume.h"

namespace dede {

struct ShardSlot {
  ShardRange range;
  uint64_t version = 0;   // 0: virtual (no file yet)
  std::string name;       // empty when virtual
  FileId id;
};

struct IndexFile {
  std::string name;
  FileId id;
  ShardRange range;       // shard/pending: its range; arena: {0, lo}
  uint64_t version = 0;   // shard versions only
  uint64_t size = 0;
  uint64_t mapped_blocks = 0;
};

struct ShardMap {
  std::vector<ShardSlot> live;         // sorted by lo; covers every prefix
  std::vector<IndexFile> shard_files;  // every shard version file
  std::vector<IndexFile> stale_shards; // complete shard versions not live
  // Shard versions whose header does not check (an update died before its
  // header was durable, or the header is damaged): left out of the
  // partition, so they hide nothing. Removed by the range's lock holder.
  std::vector<IndexFile> incomplete;
  // Shard versions whose header is of a newer major format version (a
  // newer dede wrote them): complete for the partition (they hide what
  // they supersede, and no version of this dede takes their numbers), also
  // listed in shard_files (and live_ or stale_shards), but never read,
  // rewritten or removed by this dede (docs/FORMAT.md section 9).
  std::vector<IndexFile> newer;
  std::vector<IndexFile> pending;      // every pending file
  std::vector<IndexFile> arenas;       // every arena file

  // The live slot covering `prefix`.
  const ShardSlot& SlotFor(uint64_t prefix) const;
  bool IsLivePending(const ShardRange& r) const;
  // A pending file of exactly this range exists.
  bool IsPendingListed(const ShardRange& r) const;
  bool IsLiveArena(uint64_t lo) const;
  // A shard version of a newer major format version (`newer`).
  bool IsNewer(const std::string& name) const;
};

// Builds the map from a list of the volume's files, leaving out the shard
// versions named in `incomplete`; those named in `newer` are of a newer
// major format version.
ShardMap ResolveShardMap(const std::vector<FileInfo>& files,
                         const std::set<std::string>& incomplete = {},
                         const std::set<std::string>& newer = {});
// Lists the volume's files and reads every shard version's header: a
// version that does not check is incomplete, except one of a newer major
// format version (kUnsupported), which is `newer`; one removed meanwhile is
// left out. One held open by someone else is taken as complete (its holder is
// reading it, or writing it under the range's lock), except where the
// caller holds the lock of `locked` (ShardLockId) and the map near it
// depends on it:
//   * a version in `locked` under that same lock: nobody else writes it,
//     so its holder is only a reader, and readers open incomplete versions
//     too; taken as complete, an incomplete version would make the live
//     one look stale, and the lock holder deletes stale versions;
//   * a version under another lock whose completeness changes the live
//     slots overlapping `locked`: the upper half of a split that died
//     (under the upper half's lock) taken as complete makes the split look
//     finished and the live parent stale, and the parent's lock is the
//     lower half's, whose holder deletes it.
// Those are opened again until free (the reader's look is brief); still
// held after kLockedRangeWait, kLocked (the caller looks again later).
Result<ShardMap> LoadShardMap(Volume* vol, const ShardRange* locked = nullptr);
inline constexpr std::chrono::milliseconds kLockedRangeWait{5000};

}  // namespace dede
