// Volume: the dede shared-disk volume, DeDe's "existing file system".
//
// Everything above volume/ sees only these abstractions: named files of
// 4 KiB blocks addressed by (file, block index), file locks (a File object
// *is* the file's lock), read/write, compare_and_share, clone_block, the
// reference count of the block behind a file position, and punch. No
// physical block address crosses this interface.
//
// Durability: a File write returns once the data is on the device (maybe
// in its volatile cache); the metadata that makes it reachable sits in the
// host's running journal transaction. Volume::Sync() (and File::Flush())
// is the flush point: when it returns OK, every earlier write and metadata
// change survives a crash of this process or host. A failed device write
// or journal commit poisons the volume: later writes return the same error.
//
// Threads: a Volume and its Files may be used from several threads. Data
// I/O to blocks a file owns exclusively runs outside the volume's metadata
// mutex, with no metadata I/O.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "util/clock.h"
#include "util/fingerprint.h"
#include "util/status.h"
#include "volume/block_device.h"
#include "volume/format.h"
#include "volume/lock_manager.h"
#include "volume/sanlock_lock_manager.h"

namespace dede {

struct FormatOptions {
  uint32_t max_hosts = 8;
  HashAlgo hash_algo = HashAlgo::kXxh128;
  uint64_t inode_count = 0;     // 0 = automatic
  uint32_t lease_slots = 0;     // 0 = automatic
  uint64_t journal_blocks = 0;  // 0 = automatic
  uint32_t group_refblocks = 32;
  // Blocks of each host's deferred-drop list; -1 = automatic (1/32 of the
  // journal), 0 = none (every reference drop waits for its group, as on
  // volumes formatted before drop lists).
  int64_t drop_blocks = -1;
  Clock* clock = nullptr;       // nullptr = real clock
  // Initialise a sanlock lockspace and lease table in the lease area; every
  // opener must then use the sanlock backend (hosts sharing a LUN).
  bool sanlock = false;
  std::string lease_path;  // sanlock's path to the device; empty = the device's path
  uint32_t lease_io_timeout_s = 0;  // recorded in the lockspace; 0 = sanlock's default
  // How `force` waits while it watches an old sanlock volume's lockspace
  // for renewals; nullptr = std::this_thread::sleep_for. Tests inject.
  std::function<void(std::chrono::milliseconds)> sleep;
};

// Writes a fresh, empty volume. Refuses (kExists) a device that already
// holds a dede superblock unless `force`. Even with `force`, refuses
// (kLocked) a volume still in use: a process of this host holds its local
// lock file, or (sanlock) a host's delta lease in its lockspace is renewed
// during the longest a healthy renewal takes (about 44 s with the default
// io_timeout).
// With `sanlock`, the lease path must be the device itself: a block
// written through the device must read back through the path (the block
// is put back after). Nothing of the old volume is changed on error.
Status FormatVolume(BlockDevice* dev, const FormatOptions& opts, bool force);

struct OpenOptions {
  // Host slot (1..max_hosts) whose journal this process writes. 0 picks the
  // first free slot.
  uint32_t host_id = 0;
  // Lock backend; nullptr = local OFD locks (see OpenLocalLockManager), or
  // the sanlock backend with `sanlock` when the volume was formatted for it.
  std::shared_ptr<LockManager> locks;
  SanlockOptions sanlock;
  Clock* clock = nullptr;
  bool read_only = false;  // no journal, no writes (info, export, fsck w/o repair)
  // How long a wait for a volume lock another process holds may take
  // before it fails with kLocked (docs/LOCKING.md rule 3). Tests shorten it.
  uint32_t lock_wait_s = 60;
  // OpenVolumeSpec: iSCSI sessions to open (DeviceOptions::iscsi_sessions).
  uint32_t iscsi_sessions = 1;
  // OpenVolumeSpec: DeviceOptions::iscsi_initiator_name (empty: default).
  std::string iscsi_initiator_name;
  // For fsck only: a free host slot whose two journal headers are both
  // damaged is passed over (not replayed by the dead-host scan, not taken
  // as this process's slot) instead of failing the open, so that fsck can
  // report it and --repair reset it (Journal::Reset). What that journal
  // held is lost either way: without a header its tail cannot be found.
  bool pass_damaged_journals = false;
};

// Identifies one incarnation of a file: (ino, generation) never repeats.
struct FileId {
  uint64_t ino = 0;
  uint64_t generation = 0;
  bool operator==(const FileId& o) const { return ino == o.ino && generation == o.generation; }
  // Any total order, so per-file state can live in ordered maps keyed by id.
  bool operator<(const FileId& o) const {
    return ino != o.ino ? ino < o.ino : generation < o.generation;
  }
};

struct FileInfo {
  FileId id;
  std::string name;
  FileKind kind = FileKind::kRegular;
  uint64_t size = 0;
  uint64_t mapped_blocks = 0;  // blocks with data (shared or not)
  bool dedup = true;
  uint64_t ctime_ns = 0;
  uint64_t mtime_ns = 0;
  uint64_t owner_ino = 0;
};

// Per-file sharing figures (walks the file's block map).
struct FileUsage {
  uint64_t mapped_blocks = 0;
  uint64_t shared_blocks = 0;   // mapped blocks whose refcount > 1
  uint64_t unique_blocks = 0;   // mapped blocks whose refcount == 1
  uint64_t saved_bytes = 0;     // sum over shared blocks of 4K * (1 - 1/refcount)
  uint64_t metadata_blocks = 0; // pointer blocks + the inode
};

struct VolumeStats {
  uint64_t total_blocks = 0;
  uint64_t data_blocks = 0;      // capacity of the data groups
  uint64_t free_blocks = 0;      // refcount 0
  uint64_t used_blocks = 0;      // refcount > 0 (data + pointer blocks)
  uint64_t pointer_blocks = 0;   // block-map blocks of all files
  uint64_t shared_blocks = 0;    // physical blocks with refcount > 1
  // References dropped by a block map but not yet from the block's count
  // (hosts' drop lists; docs/LOCKING.md "Deferred drops"): a block whose
  // only references are pending drops is still in used_blocks.
  uint64_t pending_drops = 0;
  uint64_t logical_blocks = 0;   // sum of mapped data pointers of all files
  uint64_t files = 0;
  uint64_t inodes_total = 0;
  uint64_t fixed_metadata_blocks = 0;  // superblocks, leases, journals, inodes, refcounts
};

enum class VerifyMode {
  kByteCompare,  // compare the destination block with the source block
  kHashWitness,  // both blocks must hash to `witness` (only with SHA-256)
};

class Volume;

// A whole-block write found to need no allocation, no copy and no
// metadata change (File::PrepareInPlaceWrite): every block it covers is
// already the file's alone. Until it is destroyed it holds the file's
// lock against anything that could change that (a share, a truncate, a
// trim), so Write() can only fail with a device error, which poisons the
// volume like any failed data write (later operations and flush points
// fail with it). Prepared, written and destroyed on one thread.
class InPlaceWrite {
 public:
  virtual ~InPlaceWrite() = default;
  // Writes the prepared range from `buf` (its length); once only.
  virtual Status Write(const void* buf) = 0;
};

// An open file; holding one holds the file's lock (exclusively) until it is
// destroyed. Offsets are bytes; Read/Write accept any offset and length
// (partial blocks read-modify-write). Block-level calls take a block index.
class File {
 public:
  virtual ~File() = default;
  virtual FileId id() const = 0;
  virtual Result<FileInfo> Info() = 0;
  virtual uint64_t size() = 0;

  virtual Status Read(uint64_t offset, void* buf, size_t len) = 0;
  virtual Status Write(uint64_t offset, const void* buf, size_t len) = 0;
  // Prepares Write(offset, len) if it would be an in-place write (see
  // InPlaceWrite); nullptr if not (partial blocks, holes, shared blocks):
  // then call Write(). Lets a server answer a client before the device
  // write, knowing it can no longer fail for want of space.
  virtual Result<std::unique_ptr<InPlaceWrite>> PrepareInPlaceWrite(uint64_t offset,
                                                                    size_t len) = 0;
  // Frees every whole block in the range (reads back zeros); zeroes the
  // partial blocks at its edges.
  virtual Status Trim(uint64_t offset, uint64_t len) = 0;
  // Truncate or extend (extension is a hole).
  virtual Status Truncate(uint64_t size) = 0;
  virtual Status SetDedup(bool on) = 0;
  // Flush point for the whole volume (Volume::Sync).
  virtual Status Flush() = 0;
  // Copy-on-write specializations since this File was opened: writes that
  // found their block shared with another file (or the arena) and had to
  // copy it first. Counted in memory only (DeDe's cost of sharing a hot
  // block; see the policy's stable-after).
  virtual uint64_t cow_copies() = 0;

  // Reference count of the physical block behind block `index` (0: hole).
  // >1 means the block is referenced from somewhere else too. Exact: takes
  // the block's allocation group, waiting (bounded) for another host to
  // hand it back. Usage() does not wait: while another host holds a group,
  // it counts from what that host last wrote home (docs/LOCKING.md).
  virtual Result<uint32_t> BlockRefCount(uint64_t index) = 0;
  // BlockRefCount that never waits for another process or host: kLocked
  // when the block's allocation group is held elsewhere (nothing is
  // announced: the caller can do without the answer until later).
  virtual Result<uint32_t> TryBlockRefCount(uint64_t index) = 0;
  // Takes, without waiting, the allocation group of the physical block
  // behind block `index`, for work that must not wait for it later (a
  // split's moves of arena references): Ok when this process holds it now
  // (or the block is a hole); kLocked when another process or host holds
  // it, and then the want is announced (as for a held-back increment,
  // docs/LOCKING.md "Increments without waiting"), so the holder hands the
  // group over at its next flush point and one of ours takes it.
  virtual Status TakeBlockGroup(uint64_t index) = 0;
  // Drop this file's reference to block `index` (it becomes a hole).
  virtual Status Punch(uint64_t index) = 0;
  // Punch that never waits for another process or host (background work:
  // a dedup pass's arena punches; docs/LOCKING.md "Increments without
  // waiting"). A punch needs room in this host's drop list first, and
  // Punch drains a full list waiting for the groups of its entries (up to
  // OpenOptions::lock_wait_s, holding the volume mutex every write of this
  // process needs). TryPunch instead answers kLocked, with nothing
  // changed, when the list is full and cannot be drained without waiting,
  // or (a volume without drop lists) when the block's group is held
  // elsewhere; the want is announced then, so the holder hands the group
  // over at its next flush point.
  virtual Status TryPunch(uint64_t index) = 0;
  virtual Result<FileUsage> Usage() = 0;
  // Does another process or host wait to open this file (it announced so
  // with Volume::AnnounceOpenWait)? One look at the lock table; never waits.
  virtual Result<bool> WantedElsewhere() = 0;
};

class Volume {
 public:
  // Replays the journals of dead host slots, then loads the superblock.
  // `dev` must outlive the volume.
  static Result<std::unique_ptr<Volume>> Open(BlockDevice* dev, const OpenOptions& opts);
  virtual ~Volume() = default;

  virtual const Superblock& superblock() const = 0;
  virtual uint32_t host_id() const = 0;
  // The lock backend this volume coordinates through; layers above lock
  // their own resources (index shards, merge requests) with it.
  virtual LockManager* lock_manager() const = 0;

  // Namespace. Names are 1..255 bytes, no '/' and no NUL, not "." or ".."
  // (ValidateFileName).
  // `owner_ino` names the file an internal file belongs to (a write log's
  // VM file); 0 for none. It is recorded, not enforced.
  virtual Result<FileId> Create(const std::string& name, uint64_t size,
                                FileKind kind = FileKind::kRegular, uint64_t owner_ino = 0) = 0;
  virtual Result<FileInfo> Lookup(const std::string& name) = 0;
  virtual Result<std::vector<FileInfo>> List() = 0;
  // Fails with kLocked when the file is open here or elsewhere.
  virtual Status Remove(const std::string& name) = 0;
  // Removes the file `f` (opened on this volume) without letting go of
  // its lock first, then closes it. What Remove(name) after a close would
  // do, minus the moment in between where another process or host could
  // open the file, append to it and close it again, only to see its
  // appends removed (merge-request posts do exactly that). `f` is closed
  // whatever the outcome.
  virtual Status RemoveOpen(std::unique_ptr<File> f) = 0;
  // Takes the file's lock; kLocked if another process/host holds it (or
  // this volume already has it open), kNotFound if there is no such file.
  virtual Result<std::unique_ptr<File>> OpenFile(const std::string& name) = 0;
  virtual Result<std::unique_ptr<File>> OpenFileById(FileId id) = 0;
  // An opener that got kLocked and keeps retrying (a VM starting while
  // another host's dedup pass borrows its disk) announces the wait with
  // `on` true and withdraws it with `on` false (kWanted on the file's lock,
  // shared, so any number may wait). A holder that can let go early (a
  // pass that only borrowed the file) sees it with File::WantedElsewhere()
  // and closes the file; the opener still only retries, and nobody waits
  // on the announcement itself.
  virtual Status AnnounceOpenWait(FileId id, bool on) = 0;
  // Whether the file named `name` is open in this process (OpenFile then
  // fails with kLocked "already open here"): a caller that would retry a
  // kLocked open can tell a holder that may let go soon (another process
  // or host) from one it would wait for in vain (this process, maybe on
  // the caller's own thread).
  virtual bool IsOpenHere(const std::string& name) = 0;

  // DeDe's primitives across two open files (they may be the same file).
  //
  // CompareAndShare: atomically, under both files' locks, check that block
  // `dst_index` of `dst` holds the same content as block `src_index` of
  // `src` (kByteCompare) or that both hash to `witness` (kHashWitness), then
  // make dst's pointer a copy-on-write reference to src's physical block and
  // release dst's old block. kMismatch (nothing changed) when the content
  // differs or either block is a hole; OK when shared or already shared.
  virtual Status CompareAndShare(File* src, uint64_t src_index, File* dst, uint64_t dst_index,
                                 VerifyMode mode, const Fingerprint* witness = nullptr) = 0;
  // CloneBlock: dst's block `dst_index` becomes a COW reference to src's
  // block `src_index` (no content check; a hole clones as a hole).
  //
  // Both primitives work on whole blocks only: an index whose block is not
  // entirely inside its file (the partial last block) is kInvalid. That
  // keeps the invariant that bytes past EOF in a last block read as zero.
  // (Below: an overload that never waits for another host.)
  Status CloneBlock(File* src, uint64_t src_index, File* dst, uint64_t dst_index) {
    return CloneBlock(src, src_index, dst, dst_index, BlockOpsOptions{});
  }

  // Many block operations at once, each with the semantics of the call it
  // names, atomic with respect to writers of the files involved (their
  // locks are all held for the batch), applied in order (an operation sees
  // what earlier ones did). The blocks the batch compares or hashes are
  // read once, sorted by address and merged into large device reads: this
  // is what makes verification cheap when many blocks are shared at once.
  // Each operation's outcome is in its `result` (kMismatch: not done); the
  // call itself fails only on errors that stop the batch (I/O, journal).
  // An error before any change leaves everything as it was; an error
  // half-way through applying an operation poisons the volume (like a
  // failed commit), so none of the running transaction ever commits.
  struct BlockOp {
    enum class Kind {
      kShare,        // CompareAndShare(src, src_index, dst, dst_index, mode, &witness)
      kCloneIfHash,  // CloneBlock(src -> dst) if src's content hashes to `witness`
                     // (the volume's algorithm); kMismatch if not or a hole
      kPunchIfZero,  // dst's block becomes a hole if it reads all zeros
    };
    Kind kind = Kind::kShare;
    File* src = nullptr;
    uint64_t src_index = 0;
    File* dst = nullptr;
    uint64_t dst_index = 0;
    Fingerprint witness;
    Status result;
    bool changed = false;  // OK and something changed (not already shared / a hole)
  };
  // Memory ApplyBlockOps reads a batch's blocks into, kept by a caller that
  // sends many batches (a dedup pass) and passed to every call. Reading into
  // pages used before is what makes the comparisons cheap: in a VM the
  // first touch of a page the device just filled costs several µs (~7 µs
  // per 4 KiB page measured on the benchmark machine, against 0.05 µs to
  // compare it), and a fresh buffer per batch pays that for every block.
  // It grows to the largest batch seen and is freed with the object. One
  // call at a time may use a buffer.
  class ReadBuffer {
   public:
    ReadBuffer() = default;
    ~ReadBuffer();
    ReadBuffer(const ReadBuffer&) = delete;
    ReadBuffer& operator=(const ReadBuffer&) = delete;
    size_t blocks() const { return blocks_; }

   private:
    friend class VolumeImpl;
    uint8_t* data_ = nullptr;  // 4 KiB-aligned, blocks_ blocks
    size_t blocks_ = 0;
  };
  // How one ApplyBlockOps call treats allocation groups held elsewhere.
  struct BlockOpsOptions {
    // Never wait for another process or host (issue 5; docs/LOCKING.md
    // "Increments without waiting"). A share or clone adds a reference to
    // its source block, and the count lives in the block's allocation
    // group. By default a group held elsewhere is waited for (announced,
    // bounded by OpenOptions::lock_wait_s). With `no_wait` such an
    // operation is not applied: its result is kLocked, `changed` false,
    // and nothing changed for it; the wait is announced instead (kWanted,
    // kept until this process gets the group), so the holder hands the
    // group over at its next flush point and a later call finds it free.
    // A later operation of the batch that involves a block position such
    // an operation would have changed is kLocked too (it was planned on
    // what that one would have left). The decision is made before the
    // operation changes anything. The other operations are applied as
    // usual. A full drop list that cannot be drained without waiting
    // holds operations back the same way.
    bool no_wait = false;
  };
  // Without `buffer`, each call allocates (and frees) its own.
  virtual Status ApplyBlockOps(std::vector<BlockOp>* ops, VerifyMode mode, ReadBuffer* buffer,
                               const BlockOpsOptions& options) = 0;
  Status ApplyBlockOps(std::vector<BlockOp>* ops, VerifyMode mode, ReadBuffer* buffer) {
    return ApplyBlockOps(ops, mode, buffer, BlockOpsOptions{});
  }
  Status ApplyBlockOps(std::vector<BlockOp>* ops, VerifyMode mode) {
    return ApplyBlockOps(ops, mode, nullptr, BlockOpsOptions{});
  }
  // CloneBlock with `options`: with `no_wait` (dedup passes: a split's
  // moves of arena references, merge-request posts) the clone never waits
  // for another process or host. It is held back (kLocked, nothing
  // changed; the want announced) when the source block's allocation group
  // is held elsewhere, when the drop list is full and cannot be drained
  // without waiting (only a clone over a mapped block drops a reference),
  // or, on a volume without drop lists, when the destination's old block
  // is in a group held elsewhere.
  virtual Status CloneBlock(File* src, uint64_t src_index, File* dst, uint64_t dst_index,
                            const BlockOpsOptions& options) = 0;

  // Flush point (see top of file).
  virtual Status Sync() = 0;
  virtual Result<VolumeStats> Stats() = 0;

  // This process's deferred reference drops (docs/LOCKING.md "Deferred
  // drops"): counted since open, and pending in its host's list now.
  // `adopted` counts entries taken over from the lists of hosts that are
  // gone (they are then applied, and counted, like our own).
  struct DropCounters {
    uint64_t deferred = 0;
    uint64_t applied = 0;
    uint64_t pending = 0;
    uint64_t adopted = 0;
    // Tries to take a group without waiting that left it to another
    // process which had announced a wait for it (the reserving hand-over).
    uint64_t yielded = 0;
  };
  virtual DropCounters drop_counters() = 0;

  // Waits of this process for a volume lock another process or host held
  // (a group, the namespace, an inode): how many, their total time, and
  // how many ran out of time. Since open; never blocks.
  struct WaitCounters {
    uint64_t waits = 0;
    uint64_t wait_ns = 0;
    uint64_t timeouts = 0;
  };
  virtual WaitCounters wait_counters() = 0;

  // Blocks writes of this process hold between allocating them and
  // publishing the pointers to them (reserved: a crash in between frees
  // them), and how many reservations a wait that had to give back their
  // group turned into ordinary allocations first (a crash between that
  // and the publication leaks those; fsck --repair frees them). Since
  // open; never blocks on another host. `leaked`: blocks a failed write
  // could not give back (their group held elsewhere and the drop list
  // full), left allocated with no reference rather than overflowing the
  // list, which would poison the volume; fsck --repair frees them.
  struct ReservationCounters {
    uint64_t reserved_now = 0;
    uint64_t materialized = 0;
    uint64_t leaked = 0;
  };
  virtual ReservationCounters reservation_counters() = 0;

  // Device flushes of this process's metadata path since open: those made
  // holding the volume mutex, which every VM write takes (a commit whose
  // transaction changed during the flush point's own flush, a checkpoint
  // of a full journal or before a handover, a checkpoint's header), with
  // their total time, and those made without it (a flush point's); and
  // checkpoints (the journal's images written home, its tail moved): all,
  // those of quiet flush points, and quiet ones stopped because metadata
  // changed during their unlocked flush (a later one does it). Never
  // blocks.
  struct FlushCounters {
    uint64_t held = 0;
    uint64_t held_ns = 0;
    uint64_t unlocked = 0;
    uint64_t checkpoints = 0;
    uint64_t quiet_checkpoints = 0;
    uint64_t quiet_checkpoints_deferred = 0;
  };
  virtual FlushCounters flush_counters() = 0;
};

// Friendly wrapper used by the tools: open a device spec and the volume.
struct OpenedVolume {
  std::unique_ptr<BlockDevice> device;
  std::unique_ptr<Volume> volume;
};
Result<OpenedVolume> OpenVolumeSpec(const std::string& spec, const OpenOptions& opts);

// Whether `name` may name a file: 1 to 255 bytes, no '/' and no NUL, not
// "." or ".." (kInvalid saying which rule it breaks). Create checks it; a tool can
// check first, to report a usage error before opening the volume.
Status ValidateFileName(const std::string& name);

}  // namespace dede
