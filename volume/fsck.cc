// fsck: recount everything from the block maps and compare with what is
// stored. Runs with the namespace, every allocation group and every file
// locked by this process, after a checkpoint, so the device holds the whole
// truth and nobody changes it underneath.
#include "volume/fsck.h"

#include <algorithm>
#include <cassert>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "util/bytes.h"
#include "util/coding.h"
#include "volume/volume_impl.h"

namespace dede {

namespace {
constexpr size_t kMaxListed = 1000;

// What a leaked block holds, so that a report says what lost its
// reference: the structure named by a "DD.." magic with its header's level
// and sequence number (a pointer block's level is in `flags`), or data.
std::string DescribeContent(const uint8_t* blk) {
  const BlockHeader h = PeekHeader(blk);
  char tag[5];
  std::memcpy(tag, &h.magic, 4);
  tag[4] = 0;
  const bool ours = tag[0] == 'D' && tag[1] == 'D' && std::isupper(static_cast<unsigned char>(tag[2])) &&
                    std::isupper(static_cast<unsigned char>(tag[3]));
  if (!ours) {
    // The first bytes (or the one byte it repeats) usually tell whose data
    // it was: a test's pattern, a guest's sector, a write log's frame.
    char hex[4];
    bool uniform = true;
    for (size_t i = 1; i < kBlockSize && uniform; i++) uniform = blk[i] == blk[0];
    if (uniform) {
      if (blk[0] == 0) return "zeros";
      std::snprintf(hex, sizeof hex, "%02x", blk[0]);
      return std::string("data (every byte 0x") + hex + ")";
    }
    std::string first = "data (starts";
    for (size_t i = 0; i < 16; i++) {
      std::snprintf(hex, sizeof hex, " %02x", blk[i]);
      first += hex;
    }
    return first + ")";
  }
  return std::string("a \"") + tag + "\" block (flags " + std::to_string(h.flags) + ", seq " +
         std::to_string(h.seq) + ", stamped for block " + std::to_string(h.addr) + ")";
}

// The generation of an inode that repair clears. (ino, generation) never
// repeats (FORMAT.md section 6): an earlier incarnation's write log, merge
// requests, index entries and other hosts' handles name it, and must not
// attach to the next file created there. What the inode had is not
// knowable in general: the damaged block may still say (right magic and
// number, a value below 2^63: creates go on from there), but the field may
// be the damage, and the references elsewhere (other files' names and
// contents, other hosts' memory) cannot all be found. So the floor is a
// value no incarnation reached: a generation counts creates (one each,
// from 0; each a journal commit, far longer than a nanosecond), so the
// wall clock in ns since the epoch (about 2^60.6 in 2026) is above any
// count of creates, and above what an earlier clearing by this rule plus
// the creates since came to (a clock set back by s seconds since could
// meet one only after s * 10^9 creates). A clock not set (before 2020) gives no floor:
// a random one in [2^62, 2^62 + 2^61) then, above any count of creates
// and any clock reading until 2116; it meets an earlier incarnation only
// by landing within the creates that followed an earlier random clearing
// of the same inode (chance about creates / 2^61).
constexpr uint64_t kClockSetNs = uint64_t{1'577'836'800} * 1'000'000'000;  // 2020-01-01
constexpr uint64_t kRandomGenerationBase = uint64_t{1} << 62;

uint64_t ClearedGeneration(const uint8_t* blk, uint64_t ino, uint64_t now_ns) {
  uint64_t gen = 1;
  if (PeekHeader(blk).magic == kMagicInode && DecodeU64(blk + kHeaderSize) == ino) {
    const uint64_t had = DecodeU64(blk + kHeaderSize + 8);
    if (had < uint64_t{1} << 63) gen = had + 1;  // else no count of creates: damage
  }
  uint64_t floor = now_ns;
  if (now_ns < kClockSetNs) {
    std::random_device rd;
    const uint64_t r = (uint64_t{rd()} << 32) ^ rd();
    floor = kRandomGenerationBase + (r >> 3);
  }
  return std::max(gen, floor);
}

// References found per data block: one u32 per block of each allocation
// group touched, allocated when the group is first touched. (A hash map
// cost about 70 bytes a mapped block: some 20 GB of memory to check a
// TiB of data.) Only data blocks (Superblock::LocateData) are counted.
class RefCounts {
 public:
  explicit RefCounts(const Superblock& sb)
      : sb_(sb), groups_(sb.group_count), non_cow_(sb.group_count) {}
  uint32_t& operator[](uint64_t a) {
    uint32_t g = 0;
    const uint64_t i = Index(a, &g);
    std::vector<uint32_t>& v = groups_[g];
    if (v.empty()) {
      v.assign(sb_.GroupDataBlocks(g), 0);
      non_cow_[g].assign(sb_.GroupDataBlocks(g), false);
    }
    return v[i];
  }
  // A data pointer without the COW bit names `a` (after operator[]).
  void MarkNonCow(uint64_t a) {
    uint32_t g = 0;
    const uint64_t i = Index(a, &g);
    non_cow_[g][i] = true;
  }
  // Blocks with more than one reference that a pointer without the COW
  // bit names (a write through it would change them under their other
  // users).
  std::unordered_set<uint64_t> SharedNonCow() const {
    std::unordered_set<uint64_t> out;
    for (uint32_t g = 0; g < groups_.size(); g++) {
      for (uint64_t i = 0; i < groups_[g].size(); i++) {
        if (groups_[g][i] > 1 && non_cow_[g][i]) out.insert(sb_.GroupDataStart(g) + i);
      }
    }
    return out;
  }
  uint32_t Get(uint64_t a) const {
    uint32_t g = 0;
    const uint64_t i = Index(a, &g);
    const std::vector<uint32_t>& v = groups_[g];
    return v.empty() ? 0 : v[i];
  }

 private:
  uint64_t Index(uint64_t a, uint32_t* g) const {
    uint64_t rb = 0;
    uint32_t slot = 0;
    const bool data = sb_.LocateData(a, g, &rb, &slot);
    assert(data);  // callers check data_block_ok (or the decoder did)
    (void)data;
    return (rb - sb_.GroupStart(*g)) * kRefsPerBlock + slot;
  }
  const Superblock& sb_;
  std::vector<std::vector<uint32_t>> groups_;
  std::vector<std::vector<bool>> non_cow_;
};

uint64_t SpanOf(uint32_t level) {
  uint64_t s = 1;
  for (uint32_t i = 1; i < level; i++) s *= kPointersPerBlock;
  return s;
}
}  // namespace

Result<FsckReport> CheckVolume(Volume* vol, bool repair, const FsckProgressFn& progress) {
  return static_cast<VolumeImpl*>(vol)->Fsck(repair, progress);
}

Result<FsckReport> VolumeImpl::Fsck(bool repair, const FsckProgressFn& progress) {
  auto report_progress = [&](const char* step, uint64_t done, uint64_t total) {
    if (progress) progress(FsckProgress{step, std::min(done, total), total});
  };
  MutexLock l(&mu_);
  if (repair && read_only_) return Status::Invalid("fsck --repair needs a writable volume");
  if (!open_.empty()) return Status::Invalid("fsck: close every file of this volume first");
  RETURN_IF_ERROR(poisoned_);
  FsckReport rep;
  size_t suppressed = 0;
  auto problem = [&](std::string where, std::string what, bool repaired = false) {
    if (rep.problems.size() >= kMaxListed) {
      suppressed++;
      return;
    }
    rep.problems.push_back(FsckProblem{std::move(where), std::move(what), repaired});
  };

  // ---- quiesce: hold every lock that guards metadata.
  auto take = [&](LockId id) NO_THREAD_SAFETY_ANALYSIS -> Status {
    if (cached_locks_.count(id)) return Status::Ok();
    Status st = locks_->Acquire(id, LockMode::kExclusive, false);
    if (st.code() == Status::Code::kLocked) {
      return Status::Locked(id.ToString() +
                            " is in use by another process or host; fsck needs the volume to "
                            "itself");
    }
    RETURN_IF_ERROR(st);
    cached_locks_.insert(id);
    return Status::Ok();
  };
  RETURN_IF_ERROR(take(LockId{LockKind::kNamespace, 0}));
  for (uint32_t g = 0; g < sb_.group_count; g++) RETURN_IF_ERROR(take(LockId{LockKind::kGroup, g}));
  // ---- the sanlock lock table (FORMAT.md 1.1.1). Another host may be
  // rewriting a block this moment: reread before calling one corrupt.
  //
  // --repair rewrites a damaged block (LockManager::RepairLockTablePartition,
  // under the partition's lease) only when no process but this one can hold
  // a lock recorded in it, for the records are lost (docs/LOCKING.md,
  // "Repairing the lock table"):
  //  * this process: each of its acquisitions decoded the lock's partition
  //    and wrote the record into a valid block, so a block damaged since
  //    fsck started could only hold a record of ours by later damage; the
  //    lock manager puts those back from what it holds;
  //  * other writers: every other host slot must be free (IsHeldElsewhere
  //    judges a record by sanlock's host state and generation, and this
  //    host's processes by their local locks), so each is gone: it closed
  //    (journal checkpointed) or died (its journal is replayed by the scan
  //    right after the repair). A slot record in a damaged partition cannot
  //    be read: that refuses too (Volume::Start's scan fails on it first);
  //  * readers (kVolume shared, no slot): the lock manager refuses while
  //    any other process, of this host or a live one, has the volume open.
  // A live other host may still join later: it cannot put records into a
  // damaged partition (every update decodes it first), and we hold the
  // partition's lease from the reread to the rewrite.
  bool table_repaired = false;
  if (sb_.UsesSanlock()) {
    const LeaseLayout layout = LeaseLayoutOf(sb_);
    BlockBuf blk = NewBlockBuf(1);
    // Damaged blocks by partition: (address, what is wrong).
    std::map<uint32_t, std::vector<std::pair<uint64_t, std::string>>> damaged;
    for (uint32_t p = 0; p < layout.partitions; p++) {
      for (uint32_t k = 0; k < kLockTableBlocksPerPartition; k++) {
        const uint64_t addr = layout.PartitionBlock(p, k);
        Status bad;
        for (int attempt = 0; attempt < 5; attempt++) {
          if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
          RETURN_IF_ERROR(dev_->Read(addr * kBlockSize, blk.get(), kBlockSize));
          bad = DecodeLockTableBlock(blk.get(), addr, sb_.uuid).status();
          if (bad.ok()) break;
        }
        if (!bad.ok()) damaged[p].emplace_back(addr, bad.message());
      }
    }
    Status refused;  // why no block may be rewritten
    if (repair && !damaged.empty()) {
      for (uint32_t h = 1; h <= sb_.max_hosts && refused.ok(); h++) {
        if (h == host_) continue;
        Result<bool> held = locks_->IsHeldElsewhere(LockId{LockKind::kHostSlot, h});
        if (!held.ok()) {
          refused = held.status().WithContext("cannot tell whether host slot " +
                                              std::to_string(h) + " is in use");
        } else if (held.value()) {
          refused = Status::Locked("host slot " + std::to_string(h) +
                                   " is in use by another process or host");
        }
      }
    }
    for (const auto& [p, blocks] : damaged) {
      Status why = refused;
      bool rewritten = false;
      if (repair && why.ok()) {
        Result<uint32_t> n = locks_->RepairLockTablePartition(p);
        if (!n.ok()) {
          why = n.status();
        } else if (n.value() == 0) {
          // The partition decoded under its lease (rewritten meanwhile), or
          // the backend keeps no table (a lock manager handed in by a test).
          why = Status::Unavailable("the lock manager rewrote nothing there");
        } else {
          rewritten = true;
          table_repaired = true;
        }
      }
      for (const auto& [addr, what] : blocks) {
        bool fixed = false;
        std::string said = what;
        if (rewritten) {
          RETURN_IF_ERROR(dev_->Read(addr * kBlockSize, blk.get(), kBlockSize));
          fixed = DecodeLockTableBlock(blk.get(), addr, sb_.uuid).ok();
          if (!fixed) said += "; not repaired: still damaged after the rewrite";
        } else if (repair) {
          said += "; not repaired: " + why.message();
          if (why.code() == Status::Code::kLocked) {
            said += " (its records are lost with it, and a live holder would share its lock: "
                    "stop dedupd on every other host, then run fsck --repair again)";
          }
        }
        problem("lock table partition " + std::to_string(p) + " block " + std::to_string(addr),
                said, fixed);
      }
    }
  }
  // After a rewrite, a dead holder of a lost record may have left its
  // journal unreplayed (its slot was free, so nobody else will): scan.
  RETURN_IF_ERROR(table_repaired ? ScanDeadHosts() : RecoverDeadHosts());
  // With every group held, this host's deferred drops all apply now.
  RETURN_IF_ERROR(DrainDrops(Drain::kNow));
  RETURN_IF_ERROR(Checkpoint());
  cache_.clear();  // everything is at home now; read the device afresh

  std::vector<LockId> inode_locks;
  std::vector<LockId> recovery_locks;  // other slots' kRecovery (below)
  auto release_inodes = [&]() NO_THREAD_SAFETY_ANALYSIS {
    // Checkpoint before release (LOCKING.md rule 1), also when fsck stops
    // early (a newer block, a read error) after repairs began: they may be
    // only in the running transaction or our journal, and the next holder
    // of a file reads its home blocks; our later commit would then write
    // our old images over its changes. Each repair alone leaves counts too
    // high at worst (the recount that lowers them comes last): a leak,
    // which the next fsck repairs.
    if (poisoned_.ok() && (!txn_.empty() || !dirty_.empty())) (void)Poison(Checkpoint());
    // A failed repair (poisoned: its changes may be only in our journal)
    // keeps the files' locks, as CloseFile does: whoever opens them next
    // first replays our journal, instead of reading stale home blocks.
    if (!poisoned_.ok()) return;
    for (const LockId& id : inode_locks) {
      DropCache(id);
      (void)locks_->Release(id);
    }
    for (const LockId& id : recovery_locks) (void)locks_->Release(id);
    inode_locks.clear();
    recovery_locks.clear();
  };
  struct InodeLocksGuard {
    std::function<void()> f;
    ~InodeLocksGuard() { f(); }
  } guard{release_inodes};

  BlockBuf buf = NewBlockBuf();

  // ---- file locks: every file's before any inode is read for the check
  // or anything but the lock table is repaired. A holder may change its
  // file (truncate, punch, flags) and close it until we hold the lock, so
  // an inode read before would be stale, and written back stale by a
  // repair; and a file in use stops fsck here (kLocked), before any
  // repair, rather than after it repaired other files (whose locks it
  // then gave back). Which inodes need a lock cannot change
  // meanwhile: creating and removing a file take the namespace lock, which
  // we hold. A damaged inode is locked too (its holder, if any, may be
  // about to write it whole again; repair clears it).
  std::vector<bool> inode_locked(sb_.inode_count + 1, false);
  auto lock_inode = [&](uint64_t ino, const std::string& what) NO_THREAD_SAFETY_ANALYSIS -> Status {
    const LockId il{LockKind::kInode, ino};
    Status st = locks_->Acquire(il, LockMode::kExclusive, false);
    if (st.code() == Status::Code::kLocked) {
      return Status::Locked(what +
                            " is in use by another process or host; fsck needs the volume to "
                            "itself");
    }
    RETURN_IF_ERROR(st);
    inode_locks.push_back(il);
    inode_locked[ino] = true;
    return Status::Ok();
  };
  // The listing's end (kInodeListingEndRun, format.h): the listing stops
  // at the first run of that many never-written inodes, so a file past it
  // is in no `dede ls`, create or lookup (a zeroed stretch of the table;
  // creates never leave such a run below a used inode). Its repair writes
  // cleared inodes into the never-written ones below the last such file,
  // so that the listing reaches it again.
  uint64_t unwritten_run = 0;
  uint64_t listing_end = 0;             // the listing's last inode; 0: it reads the whole table
  std::vector<uint64_t> never_written;  // from listing_end on (the rest is listed)
  std::vector<std::pair<uint64_t, std::string>> unlisted;  // used, past listing_end
  // Each file's mapped blocks as its inode says, for the progress of the
  // map walk (the walk recounts them).
  std::vector<uint64_t> scanned_mapped(sb_.inode_count + 1, 0);
  uint64_t all_mapped = 0;
  // Read 32 inode blocks at a time (a table of 65536 inodes was 65536
  // reads, each a round trip on a LUN); each is read again under its
  // file's lock below before it is checked.
  constexpr uint64_t kScanSlice = 32;
  BlockBuf slice = NewBlockBuf(kScanSlice);
  for (uint64_t ino = 1; ino <= sb_.inode_count; ino++) {
    const uint64_t addr = sb_.InodeBlock(ino);
    const uint64_t at = (ino - 1) % kScanSlice;
    if (at == 0) {
      const uint64_t n = std::min(kScanSlice, sb_.inode_count - ino + 1);
      RETURN_IF_ERROR(dev_->Read(addr * kBlockSize, slice.get(), n * kBlockSize));
    }
    const uint8_t* blk = slice.get() + at * kBlockSize;
    if (IsAllZero(blk, kBlockSize)) {
      if (listing_end == 0 && ++unwritten_run == kInodeListingEndRun) listing_end = ino;
      if (listing_end != 0) never_written.push_back(ino);
      continue;
    }
    if (listing_end == 0) unwritten_run = 0;
    auto in = DecodeInode(blk, sb_.uuid, addr);
    if (in.status().code() == Status::Code::kUnsupported) {
      return in.status().WithContext("fsck stops: inode " + std::to_string(ino) +
                                     " is newer than this dede");
    }
    const bool valid = in.ok() && in->ino == ino;
    if (valid && !in->in_use()) continue;
    if (valid && listing_end != 0) unlisted.emplace_back(ino, in->name);
    if (valid) {
      scanned_mapped[ino] = in->mapped_blocks;
      all_mapped += in->mapped_blocks;
    }
    RETURN_IF_ERROR(lock_inode(
        ino, valid ? "file '" + in->name + "'" : "inode " + std::to_string(ino) + " (damaged)"));
  }
  // The run that ends the listing, and the never-written inodes after it
  // up to the last unlisted file: what a repair fills.
  std::vector<uint64_t> to_fill;
  if (!unlisted.empty()) {
    for (uint64_t ino = listing_end - kInodeListingEndRun + 1; ino <= listing_end; ino++) {
      to_fill.push_back(ino);
    }
    for (uint64_t ino : never_written) {
      if (ino > listing_end && ino < unlisted.back().first) to_fill.push_back(ino);
    }
    // Locked like the files: a repair writes them (nobody else can, with
    // the namespace lock ours; a create takes it first).
    for (size_t i = 0; repair && i < to_fill.size(); i++) {
      RETURN_IF_ERROR(lock_inode(to_fill[i], "inode " + std::to_string(to_fill[i])));
    }
  }
  never_written.clear();
  never_written.shrink_to_fit();
  // Rule 2 (recover before reading): a holder that died since our scan
  // above left its changes to these files in its journal.
  if (Status rec = RecoverDeadHosts(); !rec.ok()) {
    // Unclean, as OpenInode does (see ForgetTaken): nothing is changed yet.
    for (const LockId& id : inode_locks) (void)locks_->ReleaseUnclean(id);
    inode_locks.clear();
    return rec;
  }

  // ---- superblocks
  {
    BlockBuf two = NewBlockBuf(2);
    RETURN_IF_ERROR(dev_->Read(0, two.get(), 2 * kBlockSize));
    BlockBuf good = NewBlockBuf();
    EncodeSuperblock(sb_, 0, good.get());
    for (uint64_t a : kSuperblockAddrs) {
      auto s = DecodeSuperblock(two.get() + a * kBlockSize, a);
      BlockBuf want = NewBlockBuf();
      EncodeSuperblock(sb_, a, want.get());
      bool same = s.ok() && std::memcmp(two.get() + a * kBlockSize + kHeaderSize,
                                        want.get() + kHeaderSize,
                                        kBlockSize - kHeaderSize) == 0;
      if (!same) {
        bool fixed = false;
        if (repair) {
          RETURN_IF_ERROR(Poison(dev_->Write(a * kBlockSize, want.get(), kBlockSize)));
          fixed = true;
        }
        problem("superblock copy at block " + std::to_string(a),
                s.ok() ? "differs from the other copy" : s.status().message(), fixed);
      }
    }
  }

  // ---- with --repair, every other slot's kRecovery, held from here until
  // the counts are compared: a live host adopting a free slot's drops
  // (AdoptDropsOf) needs no group lock, only that one, and between its two
  // steps the entries are in no list on disk (step one home, step two in
  // its journal only): read then, and with its journal read as empty just
  // before, the counts would be lowered under its later drains. (A check
  // alone changes nothing: it does not keep hosts from starting meanwhile,
  // which take their slot's kRecovery first; such a race can only show a
  // count too high, reported.)
  for (uint32_t h = 1; repair && h <= sb_.max_hosts; h++) {
    if (h == host_) continue;
    const LockId rec{LockKind::kRecovery, h};
    RETURN_IF_ERROR(TakeRecoveryLock(rec, LockMode::kExclusive));
    recovery_locks.push_back(rec);
  }

  // ---- journals: after recovery and our checkpoint, all must be empty.
  // Hosts whose journal is not: alive (the dead ones' were replayed at
  // open), their newest drop list maybe only there.
  std::vector<uint32_t> unreplayed_hosts;
  for (uint32_t h = 1; h <= sb_.max_hosts; h++) {
    auto j = Journal::Open(dev_, sb_, h);
    if (!j.ok()) {
      bool fixed = false;
      std::string said = j.status().message();
      if (repair && h == host_) {
        said += "; not repaired: it is this process's own journal";
      } else if (repair) {
        // Only a free slot's, under its kRecovery (held, above): a live
        // owner's ring holds transactions not yet home.
        Result<bool> live = locks_->IsHeldElsewhere(LockId{LockKind::kHostSlot, h});
        if (live.ok() && !*live) {
          RETURN_IF_ERROR(Poison(Journal::Reset(dev_, sb_, h)));
          fixed = true;
        } else {
          said += "; not repaired: the slot is in use (" +
                  (live.ok() ? std::string("its host is alive") : live.status().message()) + ")";
        }
      }
      problem("journal of host " + std::to_string(h), said, fixed);
      continue;
    }
    auto pending = j.value()->HasTransactions();
    if (!pending.ok()) return pending.status();
    if (pending.value() && h != host_) {
      problem("journal of host " + std::to_string(h),
              "holds transactions that were not replayed (is that host alive?)");
      unreplayed_hosts.push_back(h);
    }
  }

  // Why a count found too high by what is on disk may be right after all
  // (empty: none): lowered, a live host's later drops would take it below
  // the references, freeing a block still mapped. Left as stored (too
  // high at worst: a leak), for a later fsck to repair.
  std::string keep_reason;
  if (!unreplayed_hosts.empty()) {
    keep_reason = "host " + std::to_string(unreplayed_hosts.front()) +
                  "'s journal holds transactions, and its pending drops may be there";
  }

  // ---- files past the listing's end (found above).
  if (!unlisted.empty()) {
    bool fixed = false;
    if (repair) {
      for (uint64_t ino : to_fill) {
        const uint64_t addr = sb_.InodeBlock(ino);
        // Still never written? The dead hosts' journals, replayed since
        // the scan, may have written it (a create whose holder died).
        RETURN_IF_ERROR(dev_->Read(addr * kBlockSize, buf.get(), kBlockSize));
        if (!IsAllZero(buf.get(), kBlockSize)) continue;
        RETURN_IF_ERROR(EnsureRoom(1));
        Fresh(addr, LockId{LockKind::kInode, ino}, kMagicInode, 0);
        Inode cleared;  // not in use: a free inode the listing reads past
        cleared.ino = ino;
        cleared.generation = ClearedGeneration(buf.get(), ino, clock_->NowNanos());
        PutInode(cleared);
      }
      RETURN_IF_ERROR(Checkpoint());
      fixed = true;
    }
    for (const auto& [ino, name] : unlisted) {
      problem("inode " + std::to_string(ino) + " '" + name + "'",
              "lies past the end of the file listing (inodes " +
                  std::to_string(listing_end - kInodeListingEndRun + 1) + "-" +
                  std::to_string(listing_end) +
                  " were never written): dede ls, creates and name lookups do not see it" +
                  (fixed ? "; the never-written inodes before it were written as free ones" : ""),
              fixed);
    }
  }

  // ---- inodes and block maps: recount references.
  RefCounts refs(sb_);  // physical block -> pointers found
  struct Unshared {
    uint64_t ino, index, leaf;
    uint32_t slot;
  };
  // The block maps walked (valid inodes), for a second look at the
  // pointers without the COW bit when some name a shared block: kept as
  // a bit per block in the walk (a record per pointer cost 40 bytes a
  // mapped block).
  struct Walked {
    uint64_t ino, root, nblocks;
    uint32_t depth;
  };
  std::vector<Walked> walked;
  std::unordered_map<std::string, uint64_t> names;
  auto data_block_ok = [&](uint64_t a) {
    uint32_t g, slot;
    uint64_t rb;
    return sb_.LocateData(a, &g, &rb, &slot);
  };

  const char* const kMapsStep = "file maps";
  uint64_t mapped_walked = 0;
  report_progress(kMapsStep, 0, all_mapped * kBlockSize);
  for (uint64_t ino = 1; ino <= sb_.inode_count; ino++) {
    // Free (or never used) when read above, under the namespace lock: it
    // still is. The others are read again, now under the file's lock.
    if (!inode_locked[ino]) continue;
    if (scanned_mapped[ino] > 0) {
      report_progress(kMapsStep, mapped_walked * kBlockSize, all_mapped * kBlockSize);
      mapped_walked += scanned_mapped[ino];
    }
    uint64_t addr = sb_.InodeBlock(ino);
    RETURN_IF_ERROR(dev_->Read(addr * kBlockSize, buf.get(), kBlockSize));
    if (IsAllZero(buf.get(), kBlockSize)) continue;
    std::string where = "inode " + std::to_string(ino);
    auto in = DecodeInode(buf.get(), sb_.uuid, addr);
    // Written by a newer dede: not damage. Clearing it (or, below, cutting
    // out a newer pointer block and freeing what it maps) would destroy a
    // file this version cannot read; check with a dede that can.
    if (in.status().code() == Status::Code::kUnsupported) {
      return in.status().WithContext("fsck stops: " + where + " is newer than this dede");
    }
    if (!in.ok() || in->ino != ino) {
      bool fixed = false;
      if (repair) {
        Fresh(addr, LockId{LockKind::kInode, ino}, kMagicInode, 0);
        Inode cleared;
        cleared.ino = ino;
        cleared.generation = ClearedGeneration(buf.get(), ino, clock_->NowNanos());
        PutInode(cleared);
        RETURN_IF_ERROR(EnsureRoom(8));
        fixed = true;
      }
      problem(where, (in.ok() ? "claims number " + std::to_string(in->ino)
                              : in.status().message()) +
                         " (the file is lost)",
              fixed);
      continue;
    }
    if (!in->in_use()) continue;
    rep.files++;
    where += " '" + in->name + "'";
    LockId il{LockKind::kInode, ino};
    if (!names.emplace(in->name, ino).second) {
      problem(where, "has the same name as inode " + std::to_string(names[in->name]));
    }
    uint64_t nblocks = (in->size + kBlockSize - 1) / kBlockSize;
    uint64_t mapped = 0;
    Inode fixed_in = in.value();
    bool inode_dirty = false;
    // Recursive walk of the block map.
    std::function<Status(uint64_t, uint32_t, uint64_t, uint64_t, uint32_t)> walk =
        [&](uint64_t pa, uint32_t level, uint64_t base, uint64_t parent,
            uint32_t parent_slot) NO_THREAD_SAFETY_ANALYSIS -> Status {
      std::string pw = where + " pointer block " + std::to_string(pa);
      auto drop_parent = [&]() NO_THREAD_SAFETY_ANALYSIS -> Status {
        if (!repair) return Status::Ok();
        RETURN_IF_ERROR(EnsureRoom(8));
        if (parent == 0) {
          fixed_in.root = 0;
          fixed_in.depth = 0;
          inode_dirty = true;
        } else {
          uint8_t* pb;
          RETURN_IF_ERROR(Load(parent, il, kMagicPointerBlock, "pointer block", &pb));
          dede::SetPtr(Dirty(parent), parent_slot, 0);
        }
        return Status::Ok();
      };
      if (!data_block_ok(pa)) {
        RETURN_IF_ERROR(drop_parent());
        problem(pw, "is outside the data area", repair);
        return Status::Ok();
      }
      BlockBuf pb = NewBlockBuf();
      RETURN_IF_ERROR(dev_->Read(pa * kBlockSize, pb.get(), kBlockSize));
      auto dec = DecodePointerBlock(pb.get(), sb_.uuid, pa);
      if (dec.status().code() == Status::Code::kUnsupported) {
        return dec.status().WithContext("fsck stops: " + pw + " is newer than this dede");
      }
      if (!dec.ok() || dec->level != level) {
        RETURN_IF_ERROR(drop_parent());
        problem(pw, (dec.ok() ? "has level " + std::to_string(dec->level) + ", expected " +
                                    std::to_string(level)
                              : dec.status().message()) +
                        " (the data it mapped is lost)",
                repair);
        return Status::Ok();
      }
      rep.metadata_blocks++;
      if (refs[pa]++ > 0) {
        problem(pw, "is referenced more than once (pointer blocks are never shared)");
      }
      for (uint32_t s = 0; s < kPointersPerBlock; s++) {
        uint64_t p = dec->ptrs[s];
        if (p == 0) continue;
        uint64_t idx = base + s * SpanOf(level);
        auto clear_slot = [&]() NO_THREAD_SAFETY_ANALYSIS -> Status {
          if (!repair) return Status::Ok();
          RETURN_IF_ERROR(EnsureRoom(8));
          uint8_t* b;
          RETURN_IF_ERROR(Load(pa, il, kMagicPointerBlock, "pointer block", &b));
          dede::SetPtr(Dirty(pa), s, 0);
          return Status::Ok();
        };
        if (level > 1) {
          if (PtrCow(p)) problem(pw, "slot " + std::to_string(s) + ": COW bit on a map pointer");
          RETURN_IF_ERROR(walk(PtrAddr(p), level - 1, idx, pa, s));
          continue;
        }
        std::string dw = where + " block " + std::to_string(idx);
        if (idx >= nblocks) {
          RETURN_IF_ERROR(clear_slot());
          problem(dw, "is mapped beyond the end of the file", repair);
          continue;
        }
        if (!data_block_ok(PtrAddr(p))) {
          RETURN_IF_ERROR(clear_slot());
          problem(dw, "points outside the data area (" + std::to_string(PtrAddr(p)) + ")",
                  repair);
          continue;
        }
        refs[PtrAddr(p)]++;
        mapped++;
        if (!PtrCow(p)) refs.MarkNonCow(PtrAddr(p));
      }
      return Status::Ok();
    };
    if (in->depth > 0) {
      walked.push_back(Walked{ino, in->root, nblocks, in->depth});
      RETURN_IF_ERROR(walk(in->root, in->depth, 0, 0, 0));
    }
    rep.mapped_blocks += mapped;
    if (mapped != in->mapped_blocks) {
      problem(where, "records " + std::to_string(in->mapped_blocks) + " mapped blocks, found " +
                         std::to_string(mapped),
              repair);
      fixed_in.mapped_blocks = mapped;
      inode_dirty = true;
    }
    if (repair && inode_dirty) {
      RETURN_IF_ERROR(EnsureRoom(8));
      uint8_t* b;
      RETURN_IF_ERROR(Load(addr, il, kMagicInode, "inode", &b));
      PutInode(fixed_in);
    }
  }

  report_progress(kMapsStep, all_mapped * kBlockSize, all_mapped * kBlockSize);
  scanned_mapped.clear();
  scanned_mapped.shrink_to_fit();

  // ---- unshared pointers must be the only reference to their block.
  // The pointers without the COW bit to blocks with more than one
  // reference: found by walking the maps again (from home, as the first
  // walk read them; what it reported or cut out is skipped), only when
  // there are any (the check used to read every leaf again: 30 s for 2 GiB).
  std::vector<Unshared> unshared;
  if (const std::unordered_set<uint64_t> bad = refs.SharedNonCow(); !bad.empty()) {
    BlockBuf pbuf = NewBlockBuf();
    std::function<Status(uint64_t, uint64_t, uint32_t, uint64_t, uint64_t)> rewalk =
        [&](uint64_t ino, uint64_t pa, uint32_t level, uint64_t base, uint64_t nblocks)
            NO_THREAD_SAFETY_ANALYSIS -> Status {
      if (!data_block_ok(pa)) return Status::Ok();
      RETURN_IF_ERROR(dev_->Read(pa * kBlockSize, pbuf.get(), kBlockSize));
      auto dec = DecodePointerBlock(pbuf.get(), sb_.uuid, pa);
      if (!dec.ok() || dec->level != level) return Status::Ok();
      const auto& ptrs = dec->ptrs;  // a copy of its own: pbuf is read again below
      for (uint32_t s = 0; s < kPointersPerBlock; s++) {
        const uint64_t p = ptrs[s];
        if (p == 0) continue;
        const uint64_t idx = base + s * SpanOf(level);
        if (level > 1) {
          RETURN_IF_ERROR(rewalk(ino, PtrAddr(p), level - 1, idx, nblocks));
          continue;
        }
        if (idx < nblocks && !PtrCow(p) && bad.count(PtrAddr(p))) {
          unshared.push_back(Unshared{ino, idx, pa, s});
        }
      }
      return Status::Ok();
    };
    for (const Walked& w : walked) {
      RETURN_IF_ERROR(rewalk(w.ino, w.root, w.depth, 0, w.nblocks));
    }
  }
  for (const Unshared& u : unshared) {
    uint8_t* leaf = nullptr;
    BlockBuf lb = NewBlockBuf();
    RETURN_IF_ERROR(dev_->Read(u.leaf * kBlockSize, lb.get(), kBlockSize));
    uint64_t p = dede::GetPtr(lb.get(), u.slot);
    if (refs.Get(PtrAddr(p)) > 1) {
      if (repair) {
        RETURN_IF_ERROR(EnsureRoom(8));
        RETURN_IF_ERROR(Load(u.leaf, LockId{LockKind::kInode, u.ino}, kMagicPointerBlock,
                             "pointer block", &leaf));
        dede::SetPtr(Dirty(u.leaf), u.slot, p | kPtrCow);
      }
      problem("inode " + std::to_string(u.ino) + " block " + std::to_string(u.index),
              "unshared (non-COW) pointer to block " + std::to_string(PtrAddr(p)) + ", which has " +
                  std::to_string(refs.Get(PtrAddr(p))) + " references",
              repair);
    }
  }

  // ---- drop lists: each entry is a reference a block map gave up whose
  // count its host has not decremented yet (LOCKING.md "Deferred drops").
  if (sb_.drop_blocks > 0) {
    for (uint32_t h = 1; h <= sb_.max_hosts; h++) {
      const uint64_t start = sb_.DropListStart(h);
      for (uint32_t i = 0; i < sb_.drop_blocks; i++) {
        const uint64_t addr = start + i;
        RETURN_IF_ERROR(dev_->Read(addr * kBlockSize, buf.get(), kBlockSize));
        auto e = DecodeDropListBlock(buf.get(), sb_, h, addr);
        if (e.ok()) {
          for (uint64_t a : *e) refs[a]++;
          continue;
        }
        if (e.status().code() == Status::Code::kUnsupported) {
          // A newer dede's block: its entries cannot be read here, so no
          // count can be judged too high; never cleared (FORMAT.md §9).
          return e.status().WithContext("drop list of host " + std::to_string(h) + " block " +
                                        std::to_string(addr));
        }
        // Cleared, its entries are lost: the recount below then finds
        // their blocks' counts too high, and repair lowers them.
        bool fixed = false;
        ASSIGN_OR_RETURN(bool alive, h == host_
                                         ? Result<bool>(true)
                                         : locks_->IsHeldElsewhere(LockId{LockKind::kHostSlot, h}));
        if (alive) {
          // Its entries are in its memory (its list blocks stay cached):
          // it drains them later, counts lowered now would go too low.
          if (keep_reason.empty()) {
            keep_reason = "host " + std::to_string(h) +
                          " is alive and its drop list could not be read; its pending drops are "
                          "in its memory";
          }
        } else if (repair) {
          EncodeDropListBlock({}, h, PeekHeader(buf.get()).seq + 1, sb_.uuid, addr, buf.get());
          RETURN_IF_ERROR(Poison(dev_->Write(addr * kBlockSize, buf.get(), kBlockSize)));
          fixed = true;
        }
        problem("drop list of host " + std::to_string(h) + " block " + std::to_string(addr),
                e.status().message() + (fixed ? " (cleared)" : ""), fixed);
      }
    }
  }

  // ---- stored reference counts against the recount.
  constexpr size_t kMaxDescribed = 64;  // leaked blocks whose content is read
  size_t described = 0;
  BlockBuf content = NewBlockBuf();
  const char* const kCountsStep = "reference counts";
  uint64_t data_area = 0, data_compared = 0;
  for (uint32_t g = 0; g < sb_.group_count; g++) data_area += sb_.GroupDataBlocks(g);
  report_progress(kCountsStep, 0, data_area * kBlockSize);
  BlockBuf group_refs;
  for (uint32_t g = 0; g < sb_.group_count; g++) {
    uint64_t count = sb_.GroupDataBlocks(g);
    uint64_t data_start = sb_.GroupDataStart(g);
    report_progress(kCountsStep, data_compared * kBlockSize, data_area * kBlockSize);
    data_compared += count;
    ASSIGN_OR_RETURN(const uint32_t ref_blocks, ReadGroupRefBlocks(g, &group_refs));
    for (uint32_t r = 0; r < ref_blocks; r++) {
      uint64_t rb = sb_.GroupStart(g) + r;
      const uint8_t* blk = group_refs.get() + uint64_t{r} * kBlockSize;
      bool zero = IsAllZero(blk, kBlockSize);
      Status st = zero ? Status::Ok()
                       : CheckBlock(blk, kMagicRefcountBlock, rb, sb_.uuid, "refcount block");
      bool rewrite = false;
      std::vector<bool> kept(kRefsPerBlock, false);  // slots left as stored
      if (!st.ok()) {
        // Rebuilt from the recount, its counts would be what is on disk,
        // too low by the pending drops keep_reason names.
        const bool hold = !keep_reason.empty();
        problem("refcount block " + std::to_string(rb) + " of group " + std::to_string(g),
                st.message() + (hold ? " (not rebuilt: " + keep_reason + ")"
                                     : " (rebuilt from the block maps)"),
                repair && !hold);
        rewrite = !hold;
      }
      uint64_t n = std::min<uint64_t>(kRefsPerBlock, count - uint64_t{r} * kRefsPerBlock);
      for (uint32_t s = 0; s < n && st.ok(); s++) {
        uint64_t a = data_start + uint64_t{r} * kRefsPerBlock + s;
        uint32_t stored = zero ? 0 : dede::GetRef(blk, s);
        const uint32_t found = refs.Get(a);
        if (stored != found) {
          std::string what = "refcount " + std::to_string(stored) + " stored, " +
                             std::to_string(found) + " references found";
          // Too high by the lists on disk, maybe right by a live host's
          // list still in its journal (its pending drops): lowered, its
          // later drops would take the count to zero under a mapped block.
          // Left as stored (too high at worst: a leak); a later fsck, once
          // that host has checkpointed (or stopped), repairs it.
          const bool keep = stored > found && !keep_reason.empty();
          if (keep) {
            what += " (not lowered: " + keep_reason + ")";
            kept[s] = true;
          }
          if (found == 0) {
            what += " (leaked";
            if (described < kMaxDescribed) {
              described++;
              RETURN_IF_ERROR(dev_->Read(a * kBlockSize, content.get(), kBlockSize));
              what += "; holds " + DescribeContent(content.get());
            }
            what += ")";
          }
          problem("block " + std::to_string(a), what, repair && !keep);
          rewrite = rewrite || !keep;
        }
      }
      if (rewrite && repair) {
        RETURN_IF_ERROR(EnsureRoom(8));
        uint8_t* b = Fresh(rb, LockId{LockKind::kGroup, g}, kMagicRefcountBlock, 0);
        for (uint32_t s = 0; s < n; s++) {
          const uint32_t found = refs.Get(data_start + uint64_t{r} * kRefsPerBlock + s);
          dede::SetRef(b, s, kept[s] ? dede::GetRef(blk, s) : found);
        }
      }
    }
  }
  report_progress(kCountsStep, data_area * kBlockSize, data_area * kBlockSize);
  if (suppressed > 0) {
    rep.problems.push_back(
        FsckProblem{"fsck", std::to_string(suppressed) + " more problems not listed", repair});
  }
  if (repair) RETURN_IF_ERROR(Checkpoint());
  release_inodes();
  inode_locks.clear();
  RETURN_IF_ERROR(ReleaseCached());
  cache_.clear();
  return rep;
}

}  // namespace dede
