// Private: the Volume implementation, shared by volume.cc and fsck.cc.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "util/mutex.h"
#include "volume/fsck.h"
#include "volume/journal.h"
#include "volume/volume.h"

namespace dede {

struct AlignedFree {
  void operator()(uint8_t* p) const { std::free(p); }
};
using BlockBuf = std::unique_ptr<uint8_t, AlignedFree>;
BlockBuf NewBlockBuf(size_t blocks = 1);

// State of an open file shared by the File object and the volume.
struct OpenFileState {
  FileId id;
  bool writable = false;
  // Readers and in-place writers of whole blocks hold it shared; anything
  // that changes the file's block map (allocation, COW, share, punch,
  // truncate) or does read-modify-write of a partial block holds it
  // exclusive. Lock order: OpenFileState::rw (by inode number) before
  // VolumeImpl::mu_.
  SharedMutex rw;
  // Writes that found their block shared and copied it (since open).
  std::atomic<uint64_t> cow_copies{0};
  // Where this file's data "wants" to be: block i at alloc_anchor + i,
  // counted in data blocks (VolumeImpl::DataOrdinal: the groups' data
  // areas end to end, so a file runs on across a group boundary). Set by the file's first data allocation since open, used
  // as the goal of later ones, so a file whose first writes arrive out of
  // order (several NBD requests in flight) is still laid out in file
  // order and a big read or write of it is one device request. A hint
  // only, in memory: guarded by rw held exclusively (allocation).
  bool alloc_anchor_set GUARDED_BY(rw) = false;
  int64_t alloc_anchor GUARDED_BY(rw) = 0;
};

class VolumeImpl : public Volume {
 public:
  VolumeImpl(BlockDevice* dev, const Superblock& sb, std::shared_ptr<LockManager> locks,
             Clock* clock, bool read_only);
  ~VolumeImpl() override;

  Status Start(uint32_t host_id);
  void set_lock_wait(std::chrono::seconds s) { lock_wait_ = s; }
  // OpenOptions::pass_damaged_journals; set before Start.
  void set_pass_damaged_journals(bool pass) { pass_damaged_journals_ = pass; }

  const Superblock& superblock() const override { return sb_; }
  uint32_t host_id() const override { return host_; }
  LockManager* lock_manager() const override { return locks_.get(); }
  Result<FileId> Create(const std::string& name, uint64_t size, FileKind kind,
                        uint64_t owner_ino) EXCLUDES(mu_) override;
  Result<FileInfo> Lookup(const std::string& name) EXCLUDES(mu_) override;
  Result<std::vector<FileInfo>> List() EXCLUDES(mu_) override;
  Status Remove(const std::string& name) EXCLUDES(mu_) override;
  Status RemoveOpen(std::unique_ptr<File> f) EXCLUDES(mu_) override;
  Result<std::unique_ptr<File>> OpenFile(const std::string& name) EXCLUDES(mu_) override;
  Result<std::unique_ptr<File>> OpenFileById(FileId id) EXCLUDES(mu_) override;
  Status AnnounceOpenWait(FileId id, bool on) override;
  bool IsOpenHere(const std::string& name) override EXCLUDES(mu_);
  // File::WantedElsewhere. locks_ is const and synchronises itself: no mu_.
  Result<bool> FileWantedElsewhere(uint64_t ino);
  Status CompareAndShare(File* src, uint64_t src_index, File* dst, uint64_t dst_index,
                         VerifyMode mode, const Fingerprint* witness) override;
  using Volume::CloneBlock;
  Status CloneBlock(File* src, uint64_t src_index, File* dst, uint64_t dst_index,
                    const BlockOpsOptions& options) EXCLUDES(mu_) override;
  using Volume::ApplyBlockOps;
  Status ApplyBlockOps(std::vector<BlockOp>* ops, VerifyMode mode, ReadBuffer* buffer,
                       const BlockOpsOptions& options) EXCLUDES(mu_) override;
  Status Sync() EXCLUDES(mu_) override;
  Result<VolumeStats> Stats() EXCLUDES(mu_) override;
  DropCounters drop_counters() EXCLUDES(mu_) override {
    MutexLock l(&mu_);
    return DropCounters{drops_deferred_, drops_applied_, drop_count_, drops_adopted_, groups_yielded_};
  }
  ReservationCounters reservation_counters() EXCLUDES(mu_) override {
    MutexLock l(&mu_);
    return ReservationCounters{reserved_.size(), reservations_materialized_, blocks_leaked_};
  }
  WaitCounters wait_counters() override {
    return WaitCounters{lock_waits_.load(), lock_wait_ns_.load(), lock_wait_timeouts_.load()};
  }
  FlushCounters flush_counters() override {
    return FlushCounters{held_flushes_.load(),      held_flush_ns_.load(),
                         unlocked_flushes_.load(),  checkpoints_.load(),
                         quiet_checkpoints_.load(), quiet_checkpoints_deferred_.load()};
  }

  // ---- used by FileImpl (file rw lock held by the caller as documented)
  Status ReadData(OpenFileState* f, uint64_t offset, uint8_t* buf, size_t len) EXCLUDES(mu_);
  Status WriteData(OpenFileState* f, uint64_t offset, const uint8_t* buf, size_t len) EXCLUDES(mu_);
  // The fast path of WriteData (File::PrepareInPlaceWrite).
  Result<std::unique_ptr<InPlaceWrite>> PrepareInPlace(OpenFileState* f, uint64_t offset,
                                                       size_t len) EXCLUDES(mu_);
  // Writes `buf` to the physical blocks `ptrs` (in order, runs merged);
  // a failure poisons the volume.
  Status WriteInPlace(const std::vector<uint64_t>& ptrs, const uint8_t* buf) EXCLUDES(mu_);
  Status TrimData(OpenFileState* f, uint64_t offset, uint64_t len) EXCLUDES(mu_);
  Status TruncateFile(OpenFileState* f, uint64_t size) EXCLUDES(mu_);
  Status SetFlag(OpenFileState* f, uint32_t flag, bool on) EXCLUDES(mu_);
  // may_wait false: kLocked when the block's group is held elsewhere.
  Result<uint32_t> RefCountAt(OpenFileState* f, uint64_t index, bool may_wait) EXCLUDES(mu_);
  Status TakeGroupOfBlock(OpenFileState* f, uint64_t index) EXCLUDES(mu_);
  // may_wait false: File::TryPunch.
  Status PunchBlock(OpenFileState* f, uint64_t index, bool may_wait = true) EXCLUDES(mu_);
  // Punches the last mapped block in [first, limit) and returns its index;
  // nullopt when there is none. kInvalid when limit is past the file's end.
  Result<std::optional<uint64_t>> PunchLastMappedBelow(OpenFileState* f, uint64_t first,
                                                       uint64_t limit) EXCLUDES(mu_);
  // TrimData lets the file's lock go between runs of this many punches.
  static constexpr uint64_t kTrimBlocksPerHold = 1024;
  Result<FileUsage> UsageOf(OpenFileState* f) EXCLUDES(mu_);
  Result<Inode> InodeOf(OpenFileState* f) EXCLUDES(mu_);
  void CloseFile(OpenFileState* f) EXCLUDES(mu_);

  // ---- fsck (fsck.cc)
  Result<FsckReport> Fsck(bool repair, const FsckProgressFn& progress) EXCLUDES(mu_);

 private:
  struct Cached {
    BlockBuf data;
    LockId owner;
  };

  // Block cache and journalling (mu_ held).
  Status Load(uint64_t addr, LockId owner, uint32_t magic, const char* what, uint8_t** out)
      REQUIRES(mu_);
  // Validates a block just read from `addr` (all-zero inode and refcount
  // blocks are valid: never written since format, and get a fresh header).
  Status Admit(uint8_t* b, uint64_t addr, uint32_t magic, const char* what) const;
  uint8_t* Dirty(uint64_t addr) REQUIRES(mu_);
  uint8_t* Fresh(uint64_t addr, LockId owner, uint32_t magic, uint32_t flags) REQUIRES(mu_);
  // `data_flushed`: the caller flushed the device after the last change
  // to txn_ (txn_changes_ unchanged since), so the data under its new
  // pointers is durable already.
  Status Commit(bool durable, bool data_flushed = false) REQUIRES(mu_);
  // A device flush with mu_ released for its duration (and held again on
  // return): a flush can take hundreds of milliseconds on a busy disk or
  // array, and every VM write takes mu_ (PrepareInPlace). It makes durable
  // what was written or committed before it was called, no more.
  Status FlushWithoutMu() REQUIRES(mu_);
  // A device flush holding mu_ (counted and timed: flush_counters()).
  Status FlushHoldingMu() REQUIRES(mu_);
  Status WaitLock(LockId id) REQUIRES(mu_);
  static LockId WantedLock(LockId id);
  // Held shared by processes blocked in WaitLock for `id` (they hold kWanted too).
  static LockId WaitingLock(LockId id);
  Status Checkpoint() REQUIRES(mu_);
  // Checkpoint at a quiet flush point, its first two device flushes
  // without mu_ (VM writes in place take mu_; on a busy disk a flush takes
  // 100-300 ms, and a held checkpoint made them wait for three). The
  // journal is durable already if nothing was committed since the flush
  // point's own flush began (`commits_at_flush`); the committed images go
  // home, a flush without mu_ makes them durable, and the journal's tail
  // moves only if still nothing was committed or changed meanwhile (its
  // header flushed holding mu_, as in Checkpoint). Otherwise it stops
  // there and a later quiet flush point tries again: every image it wrote
  // home was committed and its record durable, so a crash at any moment
  // finds the home blocks as a replay would leave them.
  Status CheckpointQuietly(uint64_t commits_at_flush) REQUIRES(mu_);
  // Checkpoint (same outcome: everything committed, written home, the
  // tail moved) whose device flushes run without mu_ while nothing else
  // commits or changes metadata meanwhile; if something does, Checkpoint
  // finishes the job holding it. For the checkpoint of a file's close (a
  // dedup pass closes dozens of files): held, each made every VM write of
  // the host wait for three flushes. (A create's keeps mu_: the namespace
  // lock must not be handed over in the middle of it.)
  Status CheckpointReleasingMu() REQUIRES(mu_);
  // Writes the images of dirty_ home (runs of adjacent blocks in one
  // write). Their journal records must be durable, and txn_ empty.
  Status WriteDirtyHome() REQUIRES(mu_);
  // With every image of dirty_ home and durable: moves the journal's tail
  // to its head (header flushed, then mirrored) and frees what waited for
  // it (pending_free_).
  Status MoveJournalTail() REQUIRES(mu_);
  // Room for an operation that dirties up to `blocks` metadata blocks and
  // drops up to `blocks` references: journal space (EnsureJournalRoom) and
  // free drop-list entries (may drain the list, waiting as a last resort:
  // call it before taking the groups the operation needs). may_wait false:
  // kLocked where that last resort would wait for another host's group.
  Status EnsureRoom(size_t blocks, bool may_wait = true) REQUIRES(mu_);
  Status EnsureJournalRoom(size_t blocks) REQUIRES(mu_);
  // Metadata blocks WriteData's phase 3 dirties publishing one round:
  // `old`/`target`/`fresh` as phase 1 left them, `map_cost` for the block
  // map and the inode.
  size_t PublishCost(const std::vector<uint64_t>& old, const std::vector<uint64_t>& target,
                     const std::vector<bool>& fresh, size_t map_cost) const REQUIRES(mu_);
  size_t MaxTxnBlocks() const;
  Status Poison(Status s) REQUIRES(mu_);
  Status CheckWritable() REQUIRES(mu_);

  // Locks (mu_ held).
  Status AcquireCached(LockId id) REQUIRES(mu_);
  Status AcquireGroupsFor(const std::vector<uint64_t>& addrs) REQUIRES(mu_);
  // AcquireGroupsFor({addr}) without building a vector and a set when the
  // group is already held (the usual case in a batch of block operations).
  Status AcquireGroupOf(uint64_t addr) REQUIRES(mu_);
  // Checkpoints and gives back every cached lock; returns the first
  // release error (after trying the rest). What is pinned (Pinned()) is
  // either kept (kKeep: a flush point's hand-over, closing a file, where
  // nobody waits on us) or, for a group with reservations, first has them
  // counted (kMaterialize: before a wait, where keeping a group could
  // leave two hosts each waiting for the group the other kept; a Create
  // that loses the namespace meanwhile scans again).
  enum class Pin { kMaterialize, kKeep };
  Status ReleaseCached(Pin pin = Pin::kMaterialize) REQUIRES(mu_);
  // A cached lock that a flush point's hand-over keeps: the namespace
  // while a Create of this process scans (namespace_pins_), a group with
  // reservations not materialized (GroupPinned).
  bool Pinned(const LockId& id) const REQUIRES(mu_);
  Status ReleaseCachedLock(LockId id) REQUIRES(mu_);
  // Lets go of one cached lock whose blocks are home (checkpointed): drops
  // its cached blocks and allocation state, releases it. Refuses a group
  // that still has reservations not materialized (an internal error: its
  // next holder could allocate them).
  // Takes a host slot's kRecovery lock, waiting at most lock_wait_.
  Status TakeRecoveryLock(LockId rec, LockMode mode);  // locks_ only: no mu_ needed
  // `unclean`: the dead-host scan after taking it failed (LockManager::
  // ReleaseUnclean), so the next acquirer must take it as a dead holder's.
  Status ForgetCachedLock(LockId id, bool unclean = false) REQUIRES(mu_);

  // Reservations (reserved_). A reserved block is allocated in memory
  // only: its count stays 0 until ClaimReservation sets it in the
  // transaction that publishes the pointer to it.
  bool GroupPinned(uint32_t g) const REQUIRES(mu_);
  // Sets count 1 in the running transaction for every reservation of the
  // groups in `ids` (all groups when `ids` is null) that is not
  // materialized yet, so the groups can be handed over; ClaimReservation
  // then finds the count set.
  Status MaterializeReservations(const std::vector<LockId>* ids) REQUIRES(mu_);
  // Turns reservation `addr` into a reference (count 1) in the running
  // transaction; the caller publishes the pointer in the same one.
  Status ClaimReservation(uint64_t addr) REQUIRES(mu_);
  // Gives reservation `addr` back (a write that failed before publishing):
  // a materialized one is dropped like any reference.
  Status CancelReservation(uint64_t addr) REQUIRES(mu_);
  // Claim's and Materialize's common step: reserved block `addr` (slot
  // `slot` of refcount block `rb`, group `g`) gets count 1 in the running
  // transaction (poisons if it was not 0), and no longer pins its group.
  Status CountReserved(uint64_t addr, uint32_t g, uint64_t rb, uint32_t slot) REQUIRES(mu_);
  void UnpinGroup(uint32_t g) REQUIRES(mu_);
  // Records a cached lock just taken; for a group, withdraws this
  // process's announcement for it (wanted_groups_): it got what it waited
  // for.
  void NoteCached(LockId id) REQUIRES(mu_);
  // Announces, without waiting, that this process wants group g
  // (kWanted(group) shared, kept in wanted_groups_): its holder hands it
  // over at its next flush point, and keeps leaving it to us until we take
  // it (TryTakeGroup). A failed announcement is only a lost hint.
  void AnnounceWant(uint32_t g) REQUIRES(mu_);
  Status RecoverDeadHosts() REQUIRES(mu_);
  // `skip`: a slot whose kRecovery the caller holds (0: none). Without
  // `may_wait`, a kRecovery held elsewhere is kLocked at once.
  Status ScanDeadHosts(uint32_t skip = 0, bool may_wait = true) REQUIRES(mu_);
  void DropCache(LockId owner) REQUIRES(mu_);

  // Inodes and block maps (mu_ held; caller holds the inode's lock).
  Result<Inode> GetInode(uint64_t ino) REQUIRES(mu_);
  void PutInode(const Inode& in) REQUIRES(mu_);
  Result<uint64_t> GetPtr(const Inode& in, uint64_t index) REQUIRES(mu_);
  // Sets the pointer for `index`, building the path (may allocate pointer
  // blocks and grow the tree). Updates `in` (root/depth); caller PutInode.
  Status SetPtr(Inode* in, uint64_t index, uint64_t value) REQUIRES(mu_);
  // Builds the block-map path down to `index` (grows the tree, adds empty
  // pointer blocks) without mapping anything there. Every step leaves a
  // valid map, so an operation that will map `index` does this first, as
  // a step of its own: a pointer block that cannot be allocated (a full
  // volume) then fails the operation before its first change, instead of
  // half-way (which poisons the volume). The blocks the path lacks are
  // allocated in one call before the map changes, so an allocation that
  // checkpoints before waiting meets none of this path's changes. Updates
  // `in` (root/depth), also on failure; the caller stores it (PutInode)
  // either way.
  Status EnsureMapPath(Inode* in, uint64_t index) REQUIRES(mu_);
  // EnsureMapPath for each block k of a write round (file blocks `first`
  // + k) with fresh[k], once per leaf, storing `in` after each (also on
  // failure): what a later path's allocation checkpoints is consistent.
  Status BuildMapPaths(Inode* in, uint64_t first, const std::vector<bool>& fresh) REQUIRES(mu_);
  // Locates (leaf block address, slot) for index, or leaf 0 if unmapped.
  // A pointer block of the map of `owner` (its inode lock), checked to be
  // of `level`; kCorruption if not.
  Result<uint8_t*> LoadPointerBlock(uint64_t addr, uint32_t level, LockId owner) REQUIRES(mu_);
  // The child block address in `slot` of the pointer block `b` at `addr`;
  // kCorruption if the pointer has reserved bits set.
  Result<uint64_t> ChildPointer(const uint8_t* b, uint64_t addr, uint32_t slot, LockId owner);
  Status FindLeaf(const Inode& in, uint64_t index, uint64_t* leaf, uint32_t* slot)
      REQUIRES(mu_);
  // The largest mapped block index below `limit`, if any: walks the map,
  // so holes cost nothing (truncating a thin 2 TiB disk looked up each of
  // its half a billion block indexes).
  Result<std::optional<uint64_t>> LastMappedBelow(const Inode& in, uint64_t limit) REQUIRES(mu_);
  Result<std::optional<uint64_t>> LastMappedIn(uint64_t addr, uint32_t level, uint64_t base,
                                               uint64_t limit, LockId owner) REQUIRES(mu_);
  Status FreeTree(Inode* in, uint64_t keep_blocks) REQUIRES(mu_);
  Status FreeSubtree(uint64_t addr, uint32_t level, uint64_t base, uint64_t keep_blocks,
                     LockId owner, bool* now_empty) REQUIRES(mu_);

  // Reference counts and allocation (mu_ held).
  // The group, refcount block and slot of data block `addr`; kCorruption
  // if `addr` is not a data block.
  Status LocateRef(uint64_t addr, uint32_t* g, uint64_t* rb, uint32_t* slot) const;
  Result<uint32_t> GetRef(uint64_t addr) REQUIRES(mu_);
  // Like GetRef, but never waits for another host: exact if this process
  // holds the block's group or can take it now, else the count its holder
  // last wrote home (stale by at most that holder's uncheckpointed work).
  // For answers that are safe either way: statistics (File::Usage;
  // docs/LOCKING.md "Counts read without the group"). `read_home`, if
  // given, keeps the refcount blocks read from home (groups not held, or a
  // read-only volume) for later calls: a walk over a file's blocks reads
  // each once, not once per block.
  Result<uint32_t> PeekRef(uint64_t addr,
                           std::unordered_map<uint64_t, BlockBuf>* read_home = nullptr)
      REQUIRES(mu_);
  Status AddRef(uint64_t addr, int delta) REQUIRES(mu_);
  // The refcount block holding `addr`'s count (its group taken, the block
  // cached), its address and `addr`'s slot in it.
  Status LoadRefOf(uint64_t addr, uint8_t** b, uint64_t* rb, uint32_t* slot) REQUIRES(mu_);
  // Whether `addr`'s count is at its most (UINT32_MAX): AddRef(+1) fails.
  Result<bool> RefSaturated(uint64_t addr) REQUIRES(mu_);
  // kMismatch (naming `what`) if `addr`'s count is at its most: a share or
  // clone from it fails alone, before any change, instead of poisoning.
  Status RefusedIfSaturated(uint64_t addr, const char* what) REQUIRES(mu_);

  // Deferred drops (docs/LOCKING.md "Deferred drops"). Before an operation
  // changes anything, PrepareDrops tries (never waits) to take the groups
  // of the blocks it will drop references to; on a volume without drop
  // lists it takes them the old way (waiting). DropRef then decrements the
  // count if this process holds the group, else appends the block to this
  // host's drop list in the running transaction (EnsureRoom made room).
  Status PrepareDrops(const std::vector<uint64_t>& addrs) REQUIRES(mu_);
  // PrepareDrops({addr}), with the same fast path as AcquireGroupOf.
  Status PrepareDrop(uint64_t addr) REQUIRES(mu_);
  // PrepareDrop that never waits: on a volume without drop lists (where a
  // drop needs its group), kLocked, with the want announced, when the
  // block's group is held elsewhere.
  Status TryPrepareDrop(uint64_t addr) REQUIRES(mu_);
  // Takes the allocation group of data block `addr` without waiting: Ok
  // when this process holds it now; kLocked, with the want announced
  // (AnnounceWant), when another process or host holds it.
  Status TakeGroupNoWait(uint64_t addr) REQUIRES(mu_);
  Status DropRef(uint64_t addr) REQUIRES(mu_);
  // DropRef for a block a failed write counted but never published (a
  // reservation a wait materialized, or one claimed before its pointer
  // failed). Its group is taken if it is free; when it is held elsewhere
  // and the drop list is full, the block is left counted (a leak for fsck
  // --repair, counted in blocks_leaked_) instead of overflowing the list.
  Status DropUnpublished(uint64_t addr) REQUIRES(mu_);
  // Applies the drop list's entries whose groups this process holds or can
  // take without waiting. Groups still held elsewhere are announced with
  // kWanted so their holder hands them back at its next flush point.
  enum class Drain {
    kIfDue,    // at a flush point: groups found busy lately are not tried; a
               // drop that fails is left in the list (the error is returned
               // after the rest are applied) and its group noted busy
    kNow,      // try every group now
    kWaiting,  // wait for every group in ascending order, holding no cached lock
  };
  Status DrainDrops(Drain how) REQUIRES(mu_);
  // Reads and decodes host `h`'s whole drop list from the device (one
  // read); `raw` (optional) receives the blocks as read.
  Result<std::vector<std::vector<uint64_t>>> ReadDropList(uint32_t h, BlockBuf* raw) const;
  Status LoadDropList() REQUIRES(mu_);
  size_t DropRoom() const REQUIRES(mu_);
  // Takes over the drop lists of slots whose host is gone (died, or left
  // with entries it could not apply), as far as our list has room, so a
  // host that never comes back does not pin those blocks for ever. Called
  // between operations only (Start, Sync): it commits. Never waits.
  Status AdoptOrphanDrops() REQUIRES(mu_);
  // RecoverDeadHosts for locks just taken (NoteCached) whose blocks are
  // about to be used; if the scan fails, `taken` are given back.
  Status ScanForTaken(const std::vector<LockId>& taken) REQUIRES(mu_);
  // Gives back locks taken by an operation that failed before using them.
  void ForgetTaken(const std::vector<LockId>& taken) REQUIRES(mu_);
  // One slot's part of AdoptOrphanDrops; the caller holds kRecovery(h).
  Status AdoptDropsOf(uint32_t h) REQUIRES(mu_);
  // Replays host h's journal if it holds transactions; the caller holds
  // kRecovery(h) and has seen h's slot free.
  Status ReplayJournalOf(uint32_t h) REQUIRES(mu_);
  // True if host h's journal headers are both damaged (Journal::Open says
  // kCorruption); logged. For pass_damaged_journals_.
  bool DamagedJournal(uint32_t h) const;
  // True if this process holds the group of data block `addr`.
  bool GroupHeld(uint64_t addr) const REQUIRES(mu_);
  // The group of data block `addr`; false if it is not a data block.
  bool GroupOf(uint64_t addr, uint32_t* g) const;
  // A group another host held when last tried is not tried again before
  // its entry's time (each try is a paxos round with sanlock, and the
  // holder hands a wanted group back only at its next flush point).
  bool LooksBusy(uint32_t g) REQUIRES(mu_);
  void NoteBusy(uint32_t g) REQUIRES(mu_);
  // Takes kGroup(g) without waiting, for work that has another way out
  // when the group is busy (allocate elsewhere, defer a drop, read the
  // count from home). kBusy (and NoteBusy) when another process holds it,
  // or when somebody announced a wait for it
  // (kWanted held elsewhere) and we did not announce one ourselves: the
  // group then goes to whoever announced (the reserving hand-over,
  // docs/LOCKING.md rule 4). Errors other than kLocked are returned.
  enum class GroupTry { kTaken, kBusy };
  // Whether a take of kGroup(g) that could wait or go elsewhere should
  // leave it to others: a want announced elsewhere, or, when we announced
  // one ourselves, a process blocked waiting for it (docs/LOCKING.md rule 4).
  Result<bool> LeaveToOthers(uint32_t g) REQUIRES(mu_);
  Result<GroupTry> TryTakeGroup(uint32_t g) REQUIRES(mu_);
  // Re-encodes drop_list_[i] into its block in the running transaction.
  Status StoreDropBlock(size_t i) REQUIRES(mu_);
  // Allocates n blocks (refcount 1), contiguous where possible. `meta`
  // blocks (block maps) come from the top of a group, data from the bottom.
  // Data placement hints (both optional): `goal`, a physical block where
  // the run should start (taken as far as the blocks there are free, in a
  // group this process holds or can take without waiting); else `lead`,
  // free blocks to leave before the run in the first group tried (room for
  // the part of a file before the block being allocated, which may be
  // written a moment later).
  struct AllocHint {
    uint64_t goal;  // 0: none
    uint64_t lead;
  };
  // With `reserve` (data only), the blocks are reserved (reserved_), not
  // counted: the caller claims or cancels each one later.
  Status Allocate(size_t n, std::vector<uint64_t>* out, bool meta = false,
                  AllocHint hint = AllocHint{0, 0}, bool reserve = false)
      REQUIRES(mu_);
  Status AllocateOrFail(size_t n, std::vector<uint64_t>* out, bool meta, AllocHint hint,
                        bool reserve) REQUIRES(mu_);
  // Takes the free blocks at data index idx, idx+1, ... of group g (held)
  // until n are taken, one is not free or the group ends; moves the
  // group's data cursor past them.
  Status AllocateRunAt(uint32_t g, uint64_t idx, size_t n, bool reserve,
                       std::vector<uint64_t>* out) REQUIRES(mu_);
  // Data index idx of group g (its refcount blocks cached: PrefetchGroup)
  // is unreferenced, not reserved and not freed since the last checkpoint.
  bool DataBlockFree(uint32_t g, uint64_t idx) const REQUIRES(mu_);
  // Allocation's last step for one free block: count 1 in the running
  // transaction, or a reservation.
  void TakeBlock(uint64_t addr, uint64_t rb, uint32_t slot, bool reserve) REQUIRES(mu_);
  // Gives back blocks Allocate took (count or reservation) when it fails.
  Status UndoAllocate(std::vector<uint64_t>* out, bool reserve) REQUIRES(mu_);
  // Data block `addr` as an ordinal over all groups' data areas laid end
  // to end (-1 if it is not a data block), and back (0 if out of range).
  int64_t DataOrdinal(uint64_t addr) const;
  uint64_t DataBlockAt(int64_t ordinal) const;
  Status AllocateFromGroup(uint32_t g, size_t n, bool meta, bool reserve,
                           std::vector<uint64_t>* out) REQUIRES(mu_);
  Status PrefetchGroup(uint32_t g) REQUIRES(mu_);
  // Reads all of group `g`'s refcount blocks (sb_.GroupRefBlocks(g)) from
  // the device in one read into `*buf`, allocated on first use for a full
  // group (sb_.group_refblocks), so one buffer serves a walk over every
  // group. Returns how many blocks were read; they are not validated
  // (an all-zero block is a group never written since format).
  Result<uint32_t> ReadGroupRefBlocks(uint32_t g, BlockBuf* buf) const;

  // One block of a file becomes `value` (hole, COW ref...), releasing the
  // old block's reference. Caller holds the file exclusively.
  Status ReplaceBlock(Inode* in, uint64_t index, uint64_t value) REQUIRES(mu_);

  Status CreateInode(uint64_t ino, const std::string& name, uint64_t size, FileKind kind,
                     uint64_t owner_ino, uint64_t* generation) REQUIRES(mu_);
  Result<Inode> ReadInodeUncached(uint64_t ino) EXCLUDES(mu_);
  // Inodes 1.. up to the listing's end (kInodeListingEndRun, format.h), in
  // order: the cached ones as cached, never-written ones as free inodes.
  Result<std::vector<Inode>> ScanInodes() EXCLUDES(mu_);
  // The inode as it is now: from the cache, else read from the device.
  Result<Inode> ReadInodeFresh(uint64_t ino) EXCLUDES(mu_);
  Result<std::unique_ptr<File>> OpenInode(uint64_t ino, uint64_t generation,
                                          const std::string& name) EXCLUDES(mu_);
  bool OwnsInode(uint64_t ino) REQUIRES(mu_);

  BlockDevice* const dev_;
  const Superblock sb_;
  const std::shared_ptr<LockManager> locks_;
  Clock* const clock_;
  const bool read_only_;
  uint32_t host_ = 0;
  bool volume_locked_ = false;
  bool slot_locked_ = false;

  // Lock order: OpenFileState::rw before mu_. Device I/O for file data is
  // done without mu_; metadata block I/O (cache misses, commits) under it.
  Mutex mu_;
  std::unique_ptr<Journal> journal_ GUARDED_BY(mu_);
  // RecoverDeadHosts' memo (backends that report dead holders only).
  bool scanned_dead_hosts_ GUARDED_BY(mu_) = false;
  uint64_t dead_holders_seen_ GUARDED_BY(mu_) = 0;
  std::unordered_map<uint64_t, Cached> cache_ GUARDED_BY(mu_);
  std::set<uint64_t> txn_ GUARDED_BY(mu_);      // modified since the last commit
  std::set<uint64_t> dirty_ GUARDED_BY(mu_);    // committed, not yet written home
  // Transactions appended to the journal since open: tells a checkpoint
  // that released mu_ for a flush whether the ring grew meanwhile.
  uint64_t commits_ GUARDED_BY(mu_) = 0;
  // Freed since the last checkpoint: not reusable until then, or a replay
  // of an older transaction could overwrite the new owner's data.
  std::unordered_set<uint64_t> pending_free_ GUARDED_BY(mu_);
  // Refcount decremented in the running transaction: a write through a COW
  // pointer to such a block must still copy (the decrement may not survive
  // a crash, and then the block is still shared on disk).
  // Each with the decref epoch it was made in: a flush without mu_ makes
  // durable only the decrements made before it started (the epochs before
  // the one it opened); those made meanwhile stay.
  std::unordered_map<uint64_t, uint64_t> decref_uncommitted_ GUARDED_BY(mu_);
  uint64_t decref_epoch_ GUARDED_BY(mu_) = 0;
  // Bumped by every change to txn_ (Dirty, Fresh): tells a flush made
  // without mu_ whether the transaction changed while it ran.
  uint64_t txn_changes_ GUARDED_BY(mu_) = 0;
  // Data blocks a write took between its allocation (WriteData phase 1)
  // and the transaction that publishes the pointers to them (phase 3),
  // while it writes their data without mu_: address -> materialized.
  // Other threads' flush points commit in between. So the count of a
  // reserved block stays 0 (allocations skip it through this map) and is
  // set in the transaction that publishes its pointer: a crash in between
  // leaves a free block, not a leaked one. A group with reservations not
  // materialized stays held (Sync does not hand it over; ForgetCachedLock
  // refuses it); a wait that must give back every group materializes
  // them first (count 1 now, as before reservations existed).
  std::unordered_map<uint64_t, bool> reserved_ GUARDED_BY(mu_);
  std::map<uint32_t, size_t> pins_ GUARDED_BY(mu_);  // group -> reservations not materialized
  uint64_t reservations_materialized_ GUARDED_BY(mu_) = 0;  // since open (diagnostics)
  // Blocks failed writes left counted with no reference (DropUnpublished),
  // since open: fsck --repair frees them.
  uint64_t blocks_leaked_ GUARDED_BY(mu_) = 0;
  std::set<LockId> cached_locks_ GUARDED_BY(mu_);  // namespace and groups
  // Times the namespace lock left cached_locks_. Any thread's flush point
  // may hand it to another host while Create scans the inode table without
  // mu_; a Create that sees this change between its scan and its inode
  // claim scans again (its view of free inodes and names may be stale).
  uint64_t namespace_releases_ GUARDED_BY(mu_) = 0;
  // Creates scanning right now: Sync does not hand the namespace lock over
  // meanwhile (a wait elsewhere in this process still may: then they scan
  // again).
  int namespace_pins_ GUARDED_BY(mu_) = 0;
  // Consecutive flush points with nothing to commit (Sync checkpoints a
  // quiet volume's journal).
  int quiet_flush_points_ GUARDED_BY(mu_) = 0;
  // This host's drop list: drop_list_[i] holds the entries of block
  // sb_.DropListStart(host_) + i (cached, owned by the host-slot lock,
  // which this process holds for the volume's lifetime: nobody else
  // changes them). drop_count_ = all entries.
  std::vector<std::vector<uint64_t>> drop_list_ GUARDED_BY(mu_);
  size_t drop_count_ GUARDED_BY(mu_) = 0;
  uint64_t drops_deferred_ GUARDED_BY(mu_) = 0;  // since open (diagnostics)
  uint64_t drops_applied_ GUARDED_BY(mu_) = 0;
  uint64_t drops_adopted_ GUARDED_BY(mu_) = 0;
  uint64_t groups_yielded_ GUARDED_BY(mu_) = 0;  // TryTakeGroup left a group to a waiter
  // WaitLock's statistics (wait_counters()); atomic so that reading them
  // does not wait for a thread that waits under mu_.
  std::atomic<uint64_t> lock_waits_{0}, lock_wait_ns_{0}, lock_wait_timeouts_{0};
  // flush_counters(); atomic for the same reason (a held flush is slow).
  std::atomic<uint64_t> held_flushes_{0}, held_flush_ns_{0}, unlocked_flushes_{0};
  std::atomic<uint64_t> checkpoints_{0}, quiet_checkpoints_{0}, quiet_checkpoints_deferred_{0};
  // AdoptOrphanDrops runs at Start and then at most once per interval at
  // a flush point (monotonic ns; 0 = at the next one).
  uint64_t adopt_due_ns_ GUARDED_BY(mu_) = 0;
  static constexpr uint64_t kAdoptIntervalNs = 60'000'000'000;
  // Groups whose kWanted this process holds (shared): announced for
  // deferred drops (DrainDrops) and for increments held back by
  // ApplyBlockOps' no_wait, in one set because the lock backends keep one
  // kWanted per process and group (a second set's release would withdraw
  // the first's announcement). Released when the group is taken
  // (NoteCached) and at close.
  std::set<uint32_t> wanted_groups_ GUARDED_BY(mu_);
  // Housekeeping at a flush point that failed without failing it (Sync):
  // how often, and when it was last logged (monotonic ns; one warning per
  // interval for each kind).
  struct FlushPointFailures {
    uint64_t count = 0;
    uint64_t warned_ns = 0;
  };
  FlushPointFailures drain_failures_ GUARDED_BY(mu_);     // DrainDrops
  FlushPointFailures handover_failures_ GUARDED_BY(mu_);  // handing cached locks over
  static constexpr uint64_t kFlushPointWarnIntervalNs = 10'000'000'000;
  void NoteFlushPointFailure(FlushPointFailures* f, const Status& st, const char* what)
      REQUIRES(mu_);
  // LooksBusy/NoteBusy: group -> monotonic ns before which it is not tried.
  std::map<uint32_t, uint64_t> busy_until_ GUARDED_BY(mu_);
  std::chrono::seconds lock_wait_{60};  // bound on waiting for a volume lock
  bool pass_damaged_journals_ = false;  // set before Start, read-only after
  // How long WaitLock leaves a lock to processes that were blocked on it
  // before this wait began (no queue on the disk: this is what keeps a
  // waiter that backed off from losing every hand-over to newcomers).
  static constexpr std::chrono::milliseconds kDeferToEarlierWaiters{200};
  // WaitLock logs which lock a wait this long was for.
  static constexpr std::chrono::milliseconds kLogWaitsFrom{100};
  std::map<uint64_t, OpenFileState*> open_ GUARDED_BY(mu_);  // by inode number
  // Inodes whose OpenInode is taking the file's lock, outside mu_ (with
  // sanlock that can wait out a dead host's lease: no other file's I/O may
  // wait behind it). Keeps a second open of the same inode, and Create's
  // pick of a free inode, away from a lock this process is acquiring.
  std::set<uint64_t> opening_ GUARDED_BY(mu_);
  struct GroupCursor {
    uint64_t data = 0;  // next data index to try (upwards)
    uint64_t meta = 0;  // next block-map index to try (downwards; 0 wraps to the top)
  };
  std::map<uint32_t, GroupCursor> alloc_cursor_ GUARDED_BY(mu_);
  // Groups a scan found full; cleared when freed blocks become reusable.
  std::set<uint32_t> full_groups_ GUARDED_BY(mu_);
  // An allocation that went through every group (taking, and waiting for,
  // each) and found the volume full: until this monotonic time, others
  // look only in the groups held already and fail at once. Each such walk
  // takes and gives back every group lock under mu_ (with sanlock, paxos
  // rounds; with a group held elsewhere, a wait of up to lock_wait_), so
  // VMs writing into a full volume stalled every disk of the process.
  // Cleared when blocks freed here become reusable; another host's frees
  // are seen once it passes.
  uint64_t full_until_ns_ GUARDED_BY(mu_) = 0;
  static constexpr uint64_t kFullBackoffNs = 2'000'000'000;
  Status poisoned_ GUARDED_BY(mu_);
  // Where a name was last seen (a hint: Lookup re-reads that inode and
  // falls back to a full scan when it no longer carries the name), so a
  // lookup costs one inode read instead of a scan of the inode table.
  std::unordered_map<std::string, uint64_t> name_hint_ GUARDED_BY(mu_);
};

}  // namespace dede
