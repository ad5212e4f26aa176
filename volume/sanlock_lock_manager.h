// The sanlock lock backend: hosts sharing one LUN coordinate through the
// volume's lease area only (docs/LOCKING.md, "The sanlock backend").
//
//  * Host liveness is sanlock's lockspace (delta leases): each host joins
//    it with its host id; a host that stops renewing is declared dead by
//    the others' sanlock daemons after host_dead_seconds, and a host that
//    re-joins gets a new generation.
//  * The "volume" resource lease (lease slot 0) is held shared by every
//    process that opens the volume (kVolume). Holding a resource lease
//    registers the process with sanlock: if this host's lockspace cannot be
//    renewed, sanlock SIGKILLs the process (SIGTERM is restricted away)
//    before other hosts can see the host as dead. That is the fence.
//  * Every other lock (inodes, groups, host slots, shards, ...) is a record
//    in an on-disk lock table: P partitions, each guarded by its own paxos
//    resource lease that is held only while the partition is read and
//    rewritten (milliseconds). A record names its holder's host id and
//    host generation; a record whose host is dead (or has re-joined since)
//    is stale and is replaced by the next acquirer, who first replays the
//    dead host's journals (Volume, rule 2 of docs/LOCKING.md).
//  * Processes of one host exclude each other with the local OFD backend
//    first (SanlockHostLockPath); the table holds at most one record
//    per (lock, host). A record of this host whose local lock is free is
//    left by a process that died: the next local acquirer takes it over,
//    and CollectStaleRecords (dedupd runs it on a timer) marks such
//    records dead so other hosts are not kept out (and replay the dead
//    process's journal before they use what it held).
//
// Nothing here ever waits for another host's reply: a conflict is kLocked
// (wait=false) or a poll (wait=true) that ends when the holder releases or
// its lease expires.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "util/status.h"
#include "volume/block_device.h"
#include "volume/format.h"
#include "volume/lock_manager.h"

namespace dede {

struct SanlockOptions {
  // Path through which sanlock reaches the lease area: the LUN's block
  // device on a real host; the volume file for the path backend; in tests
  // the file backing the tgtd LUN. Empty: the device's own path if it has
  // one.
  std::string lease_path;
  // This host's id in the lockspace (1..max_hosts). Every process of one
  // host uses the same id; the sanlock daemon holds the delta lease.
  uint32_t host_id = 0;
  // sanlock's io_timeout for this host's lockspace membership (seconds).
  // A host is declared dead ~8 io_timeouts (+ the daemon's watchdog fire
  // timeout) after its last renewal. 0 = the daemon's default (10 s).
  uint32_t io_timeout_s = 0;
};

// sanlock's lockspace name for a volume: "dede-" + the UUID's hex digits.
// Largest io_timeout dede accepts (seconds). A host is declared dead about
// 8 io_timeouts after its last renewal; past this, a dead host would keep
// every lock it held for most of an hour.
inline constexpr uint32_t kMaxLeaseIoTimeoutS = 300;

std::string SanlockLockspaceName(const Uuid& uuid);

// What this host's sanlock daemon last knew of another host (sanlock's
// SANLK_HOST_* states, and the generation it last read in its delta lease).
enum class LeaseHostState { kLive, kFail, kUnknown, kFree, kDead };

// Whether the holder of a lock-table record (written by that host while it
// had joined with `record_generation`) may still hold it, given our
// daemon's view of its host. A newer generation in our view: the host has
// re-joined since, the record is stale. A newer generation in the record:
// the host joined after our daemon last read its lease (it reads them at
// its renewals, 2 io_timeouts and more apart), so a FREE or DEAD there is
// out of date, and the record live (taken as stale, a just-started host's
// slot could be taken by another process, its drop list adopted while it
// holds it). Otherwise FREE or DEAD: stale; LIVE, FAIL (may still be
// writing) or UNKNOWN (not watched long enough): live.
bool RecordHolderLive(uint64_t record_generation, LeaseHostState state, uint64_t host_generation);

// Releases one sanlock lease through `release` (sanlock_release).
// sanlock drops the lease from this process before it writes it free on
// disk, so a release that failed cannot be tried again by releasing (the
// retry answers -1, "no resource"). What a failed release's answer means:
//  - SANLK_AIO_TIMEOUT: the daemon goes on writing the lease free in a
//    thread of its own (an acquire meanwhile answers EAGAIN, i.e. busy):
//    released as far as this process can tell (`left_to_daemon`).
//  - -1 at the first release: this process did not hold it (rv -1).
//  - anything else (an I/O error): the leader on disk may still name this
//    host, keeping every other host out until this one takes the lease
//    again. `acquire` takes it back (sanlock sees its own leader: "already
//    local"; or a normal acquire if the write did land) and `release`
//    writes it free, up to `attempts` rounds with `pause` before each. An
//    acquire answering busy means another host holds it now, or the daemon
//    is releasing it: no longer ours, released. -EEXIST (held on this
//    host: still by us, if the failed release never reached the daemon,
//    or by another process here) is settled by releasing again: 0, or -1
//    (not ours), is released.
struct LeaseReleaseResult {
  int rv = 0;  // 0: released; else the last sanlock error
  int retakes = 0;
  bool left_to_daemon = false;
};
LeaseReleaseResult ReleaseSanlockLease(const std::function<int()>& release,
                                       const std::function<int()>& acquire,
                                       const std::function<void()>& pause, int attempts = 3);

// The host ids whose sanlock delta lease in `sb`'s lockspace (read through
// `dev`) is renewed while we watch: the leases are read, `sleep` is called
// for the longest a healthy renewal may take of the slowest member (4
// io_timeouts + 4 s; its io_timeout as recorded in its lease), and they
// are read again. A host
// whose daemon is still joined renews (sanlock does, with or without a
// dedupd); one that left or died does not. Empty for a volume without
// sanlock leases, or a lockspace no host ever joined (no wait then).
Result<std::vector<uint32_t>> RenewingLockspaceMembers(
    BlockDevice* dev, const Superblock& sb,
    const std::function<void(std::chrono::milliseconds)>& sleep);

// Writes the lockspace and the resource leases (volume + partition
// leases) through `lease_path` with sanlock's direct I/O (no daemon
// needed). The caller has zeroed the lease area (which empties the lock
// table). kInvalid if the volume has fewer than 3 lease slots.
// io_timeout_s is recorded in the lockspace (0: sanlock's default, 10 s).
Status InitSanlockLeases(const Superblock& sb, const std::string& lease_path,
                         uint32_t io_timeout_s);

// Reads partition `p` of the lock table through `dev` without the
// partition's lease (liveness checks, listings, waits).
//
// kConsistent: a read that cannot miss a record. A leased update rewrites
// the blocks it changes in ascending order, and records only ever move to
// a lower block (an erase closes the gap) or are appended, so every state
// between two of its writes shows each record at least once (maybe
// twice). But one read of the blocks is not one instant: it can see a
// lower block before an update and a higher one after it, and a record
// that moved down is then in neither. So the read is repeated until two in
// a row show every block at the same seq (each rewrite bumps its block's):
// had the first seen such a mix, the update would have rewritten the lower
// block before the second read. kUnavailable if the partition changed
// under 50 reads in a row. kOnce: one read, for hints.
// A torn block (kCorruption) is read again, up to 5 times.
enum class LockTableRead { kOnce, kConsistent };
Result<std::vector<LockRecord>> ReadLockTablePartition(BlockDevice* dev, const LeaseLayout& layout,
                                                       const Uuid& uuid, uint32_t p,
                                                       LockTableRead how);

class SanlockLockManager : public LockManager {
 public:
  // Joins the lockspace (or finds it joined by another process of this
  // host), registers this process with the daemon and learns this host's
  // generation. The device is the volume's own (lock-table I/O goes
  // through it, like all other metadata I/O).
  static Result<std::unique_ptr<SanlockLockManager>> Open(BlockDevice* dev, const Superblock& sb,
                                                          const SanlockOptions& opts);

  // Collects this host's table records whose local lock is free (left by
  // a process of this host that died): the wanted/waiting hints are
  // removed, every other record is marked dead (its generation set to
  // kDeadProcessGeneration), so that other hosts are not kept out and
  // whoever takes the lock next replays the dead process's journal first.
  // Returns how many it collected.
  virtual Result<uint64_t> CollectStaleRecords() = 0;
  // Every record in the lock table (diagnostics, `dede locks`, tests).
  virtual Result<std::vector<LockRecord>> ListRecords() = 0;
  // Whether this host's lockspace membership is alive: reads our delta
  // lease from the LUN (through the volume's device) and checks it is ours
  // (host id, generation) and was renewed within 4 io_timeouts. Fails if
  // the daemon stopped renewing or our path to the LUN is gone. Returns how
  // long ago (nanoseconds of CLOCK_MONOTONIC, i.e. std::chrono::
  // steady_clock) the lease was last renewed: at least the true age (the
  // lease stores whole seconds), so a fence timed from it comes early,
  // never late.
  virtual Result<uint64_t> CheckLockspace() = 0;
  virtual uint32_t sanlock_host_id() const = 0;
  virtual uint64_t generation() const = 0;
  // The io_timeout this host's lockspace membership runs with (seconds;
  // read from our delta lease when we joined: what other hosts time our
  // death from, whatever we asked for).
  virtual uint32_t io_timeout_s() const = 0;
  // Counters since Open (benchmarks): table acquisitions and the time they
  // took, and partition-lease retries.
  struct Counters {
    uint64_t acquires = 0;
    uint64_t acquire_ns = 0;
    uint64_t lease_retries = 0;  // busy volume or lock-table leases
    uint64_t release_retries = 0;  // releases sanlock could not finish at once
    uint64_t stale_taken_over = 0;
  };
  virtual Counters counters() const = 0;
};

}  // namespace dede
