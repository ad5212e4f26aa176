// LockManager: the locks (leases) that coordinate processes and hosts
// sharing one volume. Nothing else is shared between them but the disk.
//
// Contract:
//  * A lock is held by one LockManager instance (one process, or one host
//    for sanlock); Acquire of a lock this instance already holds is an
//    error (kInvalid), so callers keep their own bookkeeping straight.
//  * Exclusive excludes everyone; shared excludes exclusive holders.
//  * wait=false returns kLocked at once when another holder conflicts.
//  * If the holder dies, its locks are released (process exit for the local
//    backend; lease expiry for sanlock). Whoever acquires a lock next must
//    first replay the dead holder's journal (see docs/LOCKING.md); the
//    volume does that through IsHeldElsewhere on host-slot locks.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "util/status.h"

namespace dede {

// Lock kinds. The numbers name lock resources in every backend: never
// renumber (docs/LOCKING.md lists what each guards).
enum class LockKind : uint16_t {
  kVolume = 1,     // shared by every user of the volume, exclusive for format
  kHostSlot = 2,   // id = host slot 1..max_hosts; journal ownership, liveness
  kNamespace = 3,  // inode allocation, names, flags
  kInode = 4,      // id = inode number; the file's inode, block map, data
  kGroup = 5,      // id = allocation group; its refcount blocks
  kRecovery = 6,   // id = host slot; held while that slot's journal is replayed
  kWanted = 7,     // id = kind << 40 | id of another lock; held shared by its waiters
  kIndexShard = 8, // id = shard lo >> 16; an index shard range, its pending file and arena
  kWaiting = 9,    // id as kWanted; held shared by processes blocked in a wait for it
};

struct LockId {
  LockKind kind;
  uint64_t id;
  bool operator<(const LockId& o) const {
    return kind != o.kind ? kind < o.kind : id < o.id;
  }
  bool operator==(const LockId& o) const { return kind == o.kind && id == o.id; }
  std::string ToString() const;
};

enum class LockMode { kShared, kExclusive };

class LockManager {
 public:
  virtual ~LockManager() = default;
  virtual Status Acquire(LockId id, LockMode mode, bool wait) = 0;
  virtual Status Release(LockId id) = 0;
  // True when some other holder has the lock in any mode. Used to learn
  // whether a host slot's owner is alive.
  virtual Result<bool> IsHeldElsewhere(LockId id) = 0;
  // The locks this manager holds now (for `dede status`).
  virtual std::vector<std::pair<LockId, LockMode>> Held() = 0;

  // Gives `id` back without vouching for what it guards: the caller took
  // it, maybe from a dead holder, and could not replay the dead hosts'
  // journals (its scan failed). The next acquirer must take it as a dead
  // holder's and scan first. A backend that reports dead holders leaves
  // its record marked dead (sanlock: FORMAT.md 1.1.1); one that does not
  // just releases (its acquirers scan after every acquisition).
  virtual Status ReleaseUnclean(LockId id) { return Release(id); }
  // The volume cannot vouch for what its locks guard (poisoned: its
  // journal may hold committed changes that never reached home): keep
  // every lock held now until this manager goes (the process exits), and
  // then leave them as a process that dies does, so that whoever takes
  // them next replays that journal first. The local backend does so
  // anyway (the kernel drops the locks; its acquirers always scan); the
  // sanlock one, whose destructor otherwise releases (erases) its
  // records, marks them dead instead, host slots first (FORMAT.md 1.1.1),
  // or leaves them to this host's next collector if the table cannot be
  // written.
  virtual void Abandon() {}

  // Whether this backend sees the locks a dead holder left (the sanlock
  // lock table keeps their records until an acquirer replaces them) and
  // counts, in dead_holders_replaced(), every acquisition that did so. A
  // backend that does lets the volume skip its dead-host scan after an
  // acquisition that replaced nobody: the previous holder released the
  // lock properly, having checkpointed first (LOCKING.md rule 1). The
  // local backend cannot tell (the kernel drops a dead process's locks
  // without a trace), so the volume scans after every acquisition.
  virtual bool ReportsDeadHolders() const { return false; }
  // Monotonic, over all threads of this process.
  virtual uint64_t dead_holders_replaced() const { return 0; }

  // Repairs partition p of the lock table (fsck --repair; FORMAT.md
  // 1.1.1). A backend without a table returns 0. Under the partition's
  // lease: reads its blocks, keeps every block that decodes, and rewrites
  // each one that does not as a valid block holding only this manager's
  // own records of that partition that are missing from the kept blocks
  // (none, unless the damage struck after we took a lock there), then
  // flushes. Returns how many blocks it rewrote (0: the partition decodes).
  //
  // The records of a damaged block are lost: a process still holding one
  // of those locks would share it with the next acquirer. So the rewrite
  // is refused with kLocked (naming who) while any other process, of this
  // host or another live one, has the volume open (holds kVolume). The
  // caller must also know that every holder of a lost record is gone for
  // good and its journal replayed or about to be (fsck: every other host
  // slot free, then a dead-host scan; docs/LOCKING.md "Repairing the lock
  // table").
  virtual Result<uint32_t> RepairLockTablePartition(uint32_t /*p*/) { return uint32_t{0}; }
};

// Local backend: OFD byte-range locks on `path` (the volume file itself for
// the path backend, or a lock file keyed by the volume UUID), one byte per
// lock at offset 2^62 + kind * 2^48 + id. Several processes of one machine
// exclude each other; the kernel releases the locks of a process that dies.
Result<std::unique_ptr<LockManager>> OpenLocalLockManager(const std::string& path);

// The directory of this machine's local lock files, /run/dede (created,
// mode 0700, if missing). Fixed, so that no setting can make two processes
// that must exclude each other lock different files (a DEDE_LOCK_DIR
// variable did: a process run with another value took dedupd's lock
// records for a dead process's and replaced them).
std::string LocalLockDir();

// The local lock file of a volume whose device has no path of its own
// (an iSCSI URL) and that uses local locks only: every process of the
// machine, `<dir>/<volume uuid>.lock`.
std::string LocalVolumeLockPath(const std::string& uuid_text);

// The local lock file of a sanlock volume: shared by the processes of one
// sanlock host, which are the processes that talk to one sanlock daemon
// (SANLOCK_RUN_DIR, as libsanlock finds it: a second daemon on a machine
// is a host of its own, with its own host id, as in the multi-host tests).
// `<dir>/<uuid>.lock` for the default daemon (/run/sanlock), else
// `<dir>/<uuid>@<the daemon's run dir, '/' and '%' escaped>.lock`.
std::string SanlockHostLockPath(const std::string& uuid_text);

}  // namespace dede
