// fsck: a full consistency check of a volume.
//
// Walks every metadata block (superblocks, journal headers, inodes, block
// maps, refcount tables), verifies checksums, recounts every data block's
// references from the block maps and compares with the stored refcounts,
// checks that unshared pointers point at blocks with refcount 1, that
// mapped-block counts and sizes agree, and that names are unique. Each
// problem is reported with where it is. Repair fixes what is safe: stored
// refcounts are set to the recounted truth (leaked blocks freed, missing
// references added), inode counters recomputed, damaged inodes of files
// cleared, duplicate superblock copy rewritten, a journal whose headers
// are both damaged reset (ring zeroed, then fresh headers: Journal::Reset;
// open the volume with OpenOptions::pass_damaged_journals to get this far),
// and (sanlock) damaged lock-table blocks rewritten as
// valid ones under their partition's lease, only while no other process
// on any host has the volume open or holds a host slot (their records are
// lost; docs/LOCKING.md "Repairing the lock table"); else such a block is
// reported not repaired, with the reason.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "util/status.h"

namespace dede {

class Volume;

struct FsckProblem {
  std::string where;  // "inode 7 'vm1' block 12", "refcount of block 40312"
  std::string what;
  bool repaired = false;
};

struct FsckReport {
  std::vector<FsckProblem> problems;
  uint64_t files = 0;
  uint64_t mapped_blocks = 0;
  uint64_t metadata_blocks = 0;
  bool clean() const { return problems.empty(); }
};

// Where a check is, for a progress display. The two long steps report in
// bytes of the volume: "file maps" (the file data the block maps walked so
// far map, of all the files' mapped data) and "reference counts" (the
// data area whose stored counts were compared, of the whole data area).
// Each step reports done = 0 first and done = total last.
struct FsckProgress {
  const char* step;
  uint64_t done;
  uint64_t total;
};
// Called on fsck's thread with the volume's mutex held: it must not call
// into the volume, and should return quickly.
using FsckProgressFn = std::function<void(const FsckProgress&)>;

// The caller must have the volume to itself: fsck takes the namespace lock,
// every group lock and every file's lock (all before it reads an inode for
// the check or repairs anything), and fails with kLocked (naming the lock
// or file) when another process or host holds one. Journals of dead hosts
// are replayed first.
Result<FsckReport> CheckVolume(Volume* vol, bool repair, const FsckProgressFn& progress = {});

}  // namespace dede
