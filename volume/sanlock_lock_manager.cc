#include "volume/sanlock_lock_manager.h"

extern "C" {  // some of sanlock's headers lack their own extern "C"
#include <sanlock.h>
#include <sanlock_admin.h>
#include <sanlock_direct.h>
#include <sanlock_resource.h>
#include <sanlock_rv.h>
}
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "util/coding.h"
#include "util/log.h"
#include "util/mutex.h"
#include "volume/volume_impl.h"

namespace dede {

namespace {

constexpr uint32_t kLockspaceFlags = SANLK_LSF_ALIGN1M | SANLK_LSF_SECTOR4K;
constexpr uint32_t kResourceFlags = SANLK_RES_ALIGN1M | SANLK_RES_SECTOR4K;
constexpr uint8_t kModeShared = 1;
constexpr uint8_t kModeExclusive = 2;

std::string SanlockError(int rv) {
  const char* s = sanlock_strerror(rv);
  return std::string(s ? s : "error") + " (" + std::to_string(rv) + ")";
}

void CopyName(char* dst, const std::string& src) {
  std::memset(dst, 0, SANLK_NAME_LEN);
  std::memcpy(dst, src.data(), std::min<size_t>(src.size(), SANLK_NAME_LEN));
}

void CopyPath(char* dst, const std::string& src) {
  std::memset(dst, 0, SANLK_PATH_LEN);
  std::memcpy(dst, src.data(), std::min<size_t>(src.size(), SANLK_PATH_LEN - 1));
}

// A sanlk_resource with its one disk (the struct ends in a flexible array).
struct ResourceBuf {
  alignas(sanlk_resource) uint8_t bytes[sizeof(sanlk_resource) + sizeof(sanlk_disk)] = {};
  sanlk_resource* res() { return reinterpret_cast<sanlk_resource*>(bytes); }
};

ResourceBuf MakeResource(const std::string& ls_name, const std::string& name,
                         const std::string& path, uint64_t offset, bool shared) {
  ResourceBuf b;
  sanlk_resource* r = b.res();
  CopyName(r->lockspace_name, ls_name);
  CopyName(r->name, name);
  r->flags = kResourceFlags | (shared ? SANLK_RES_SHARED : 0);
  r->num_disks = 1;
  CopyPath(r->disks[0].path, path);
  r->disks[0].offset = offset;
  return b;
}

sanlk_lockspace MakeLockspace(const std::string& name, uint32_t host_id, const std::string& path,
                              uint64_t offset) {
  sanlk_lockspace ls;
  std::memset(&ls, 0, sizeof(ls));
  CopyName(ls.name, name);
  ls.host_id = host_id;
  ls.flags = kLockspaceFlags;
  CopyPath(ls.host_id_disk.path, path);
  ls.host_id_disk.offset = offset;
  return ls;
}

// The daemon opens the path itself, from its own working directory.
std::string AbsolutePath(const std::string& path) {
  char* real = ::realpath(path.c_str(), nullptr);
  if (!real) return path;
  std::string s(real);
  std::free(real);
  return s;
}

std::string PartitionLeaseName(uint32_t p) { return "lt-" + std::to_string(p); }
constexpr const char* kVolumeLeaseName = "volume";

// Errors of sanlock_acquire that mean "someone else holds it right now".
bool IsBusy(int rv) {
  switch (rv) {
    case SANLK_ACQUIRE_IDLIVE:
    case SANLK_ACQUIRE_OWNED:
    case SANLK_ACQUIRE_OTHER:
    case SANLK_ACQUIRE_SHRETRY:
    case SANLK_ACQUIRE_OWNED_RETRY:
    case SANLK_DBLOCK_MBAL:
    case SANLK_DBLOCK_LVER:
    case -EEXIST:
    case -EBUSY:
    case -EAGAIN:
    case -EINPROGRESS:
      return true;
    default:
      return false;
  }
}

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t NowNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

// One registration per process: the daemon ties resource leases to the
// registered connection, and SIGKILLs the process if the lockspace fails.
Mutex g_register_mu;
int g_register_fd GUARDED_BY(g_register_mu) = -1;
// Every command on the registration connection, from any SanlockImpl of
// the process (two volumes, or a reopen while the old one lives): they
// share the connection, so they share its serialisation (SanlockImpl).
Mutex g_command_mu;

Result<int> RegisterProcess() {
  MutexLock l(&g_register_mu);
  if (g_register_fd >= 0) return g_register_fd;
  int fd = sanlock_register();
  if (fd < 0) {
    return Status::Unavailable("cannot register with the sanlock daemon (is it running? "
                               "SANLOCK_RUN_DIR=" +
                               std::string(std::getenv("SANLOCK_RUN_DIR")
                                               ? std::getenv("SANLOCK_RUN_DIR")
                                               : "default") +
                               "): " + SanlockError(fd));
  }
  // The fence: if this host's lockspace fails, die at once (SIGKILL),
  // never run a SIGTERM handler that would still write to the volume.
  int rv = sanlock_restrict(fd, SANLK_RESTRICT_SIGTERM);
  if (rv < 0) {
    ::close(fd);
    return Status::IoError("sanlock_restrict: " + SanlockError(rv));
  }
  g_register_fd = fd;
  return fd;
}

// One read of partition p's blocks (one device read); `seqs` (when given)
// gets each block's header seq.
Result<std::vector<LockRecord>> ReadPartitionBlocks(BlockDevice* dev, const LeaseLayout& layout,
                                                    const Uuid& uuid, uint32_t p,
                                                    std::vector<uint64_t>* seqs) {
  BlockBuf buf = NewBlockBuf(kLockTableBlocksPerPartition);
  RETURN_IF_ERROR(dev->Read(layout.PartitionBlock(p, 0) * kBlockSize, buf.get(),
                            kLockTableBlocksPerPartition * kBlockSize));
  std::vector<LockRecord> all;
  for (uint32_t k = 0; k < kLockTableBlocksPerPartition; k++) {
    const uint8_t* blk = buf.get() + k * kBlockSize;
    ASSIGN_OR_RETURN(std::vector<LockRecord> recs,
                     DecodeLockTableBlock(blk, layout.PartitionBlock(p, k), uuid));
    if (seqs) seqs->push_back(PeekHeader(blk).seq);
    all.insert(all.end(), recs.begin(), recs.end());
  }
  return all;
}

class SanlockImpl : public SanlockLockManager {
 public:
  SanlockImpl(BlockDevice* dev, const Superblock& sb, const SanlockOptions& opts,
              std::unique_ptr<LockManager> local, std::string lease_path)
      : dev_(dev),
        sb_(sb),
        opts_(opts),
        layout_(LeaseLayoutOf(sb)),
        ls_name_(SanlockLockspaceName(sb.uuid)),
        lease_path_(std::move(lease_path)),
        local_(std::move(local)),
        part_mu_(layout_.partitions) {}

  ~SanlockImpl() override {
    std::vector<LockId> held;
    bool abandoned;
    {
      MutexLock l(&mu_);
      for (auto& [id, mode] : held_) held.push_back(id);
      abandoned = abandoned_;
    }
    if (!abandoned) {
      for (const LockId& id : held) (void)Release(id);
      return;
    }
    // Left as a dying process leaves them. With the local locks gone our
    // records are a dead process's (DeadProcessRecord), and the collector
    // marks them, host slots before anything else (the order a dead-host
    // scan needs). Released, they would be erased: the next acquirer would
    // replace no dead holder and skip the scan.
    // (The volume lease guards no state: released as usual.)
    {
      MutexLock l(&mu_);
      for (const LockId& id : held) {
        if (id.kind != LockKind::kVolume) held_.erase(id);
      }
    }
    for (const LockId& id : held) {
      if (id.kind != LockKind::kVolume) (void)local_->Release(id);
    }
    Result<uint64_t> marked = CollectStaleRecords();
    if (!marked.ok()) {
      LOG(kWarning) << "could not mark the lock records of an abandoned volume dead ("
                    << marked.status().ToString()
                    << "); this host's next dede process or dedupd marks them";
    }
    for (const LockId& id : held) {
      if (id.kind == LockKind::kVolume) (void)Release(id);
    }
  }

  Status Init() {
    sanlk_lockspace ls =
        MakeLockspace(ls_name_, opts_.host_id, lease_path_, layout_.lockspace_offset);
    int rv = sanlock_add_lockspace_timeout(&ls, 0, opts_.io_timeout_s);
    if (rv == -EINPROGRESS) {
      // Another process of this host is joining: wait for it. If its join
      // fails (the lockspace is gone again), join ourselves.
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(300);
      while (rv != 0 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
        rv = sanlock_inq_lockspace(&ls, 0);
        if (rv == -ENOENT) {
          rv = sanlock_add_lockspace_timeout(&ls, 0, opts_.io_timeout_s);
          if (rv == -EEXIST) rv = 0;
          if (rv != 0 && rv != -EINPROGRESS) break;
        }
      }
    } else if (rv == -EEXIST) {
      rv = sanlock_inq_lockspace(&ls, 0);
    }
    if (rv != 0) {
      return Status::Unavailable("cannot join lockspace " + ls_name_ + " as host " +
                                 std::to_string(opts_.host_id) + " on " + lease_path_ + ": " +
                                 SanlockError(rv));
    }
    // Our generation and the io_timeout the membership really runs with
    // come from our delta lease, which the join has just written: the
    // io_timeout is the daemon's default (10 s in sanlock 3.8) when we
    // passed none, or the first joiner's when another process of this host
    // had joined already. Other hosts time our death from that value, so
    // the fence (dedupd's LockspaceGuard) must too. (The daemon's host
    // list answers EAGAIN until its first renewal, 2 io_timeouts away.)
    ASSIGN_OR_RETURN(DeltaLease lease, ReadDeltaLease());
    if (lease.owner != opts_.host_id) {
      return Status::Unavailable("joined lockspace " + ls_name_ + " as host " +
                                 std::to_string(opts_.host_id) +
                                 ", but its delta lease names host " + std::to_string(lease.owner));
    }
    if (lease.io_timeout_s == 0) {
      return Status::Corruption("this host's delta lease at byte " +
                                std::to_string(OwnDeltaLeaseOffset()) + " of " + lease_path_ +
                                " records no io_timeout");
    }
    generation_ = lease.generation;
    io_timeout_s_ = lease.io_timeout_s;
    if (opts_.io_timeout_s != 0 && opts_.io_timeout_s != io_timeout_s_) {
      LOG(kWarning) << "lockspace " << ls_name_ << ": this host's membership runs with io_timeout "
                    << io_timeout_s_ << " s (what the process that joined first asked for), not "
                    << opts_.io_timeout_s
                    << " s; it changes only when the host leaves the lockspace and joins again";
    }
    ASSIGN_OR_RETURN(reg_fd_, RegisterProcess());
    return Status::Ok();
  }

  Status Acquire(LockId id, LockMode mode, bool wait) override {
    {
      MutexLock l(&mu_);
      if (held_.count(id)) return Status::Invalid(id.ToString() + " is already held here");
    }
    RETURN_IF_ERROR(local_->Acquire(id, mode, wait));
    Status st = id.kind == LockKind::kVolume ? AcquireVolumeLease(mode, wait)
                                             : AcquireRecord(id, mode, wait);
    if (!st.ok()) {
      (void)local_->Release(id);
      return st;
    }
    MutexLock l(&mu_);
    held_[id] = mode;
    return Status::Ok();
  }

  Status Release(LockId id) override {
    LockMode mode;
    {
      MutexLock l(&mu_);
      auto it = held_.find(id);
      if (it == held_.end()) return Status::Invalid(id.ToString() + " is not held here");
      mode = it->second;
      held_.erase(it);
    }
    if (id.kind == LockKind::kVolume) {
      ResourceBuf r;
      sanlk_resource* rp = VolumeLease(&r, mode);
      int rv = ReleaseLease(rp, "the volume lease");
      Status ls = local_->Release(id);
      if (rv < 0) return Status::IoError("releasing the volume lease: " + SanlockError(rv));
      return ls;
    }
    const uint32_t p = PartitionOf(id);
    if (mode == LockMode::kExclusive) {
      // Table first, local lock second: while we hold the local lock no
      // other process of this host can have put its own record there.
      Status st = UpdatePartition(p, [&](std::vector<LockRecord>* recs) {
        return EraseRecords(recs, id, [&](const LockRecord& r) {
          return r.host == opts_.host_id;
        });
      });
      Status ls = local_->Release(id);
      return st.ok() ? ls : st;
    }
    // Shared: other processes of this host may still hold it. Drop our
    // local lock, then, under the partition lease, remove the host's record
    // only if nobody here holds the lock any more (an exclusive local probe
    // succeeds). Releases and acquires of this host are serialised by the
    // partition lease, so the last one out removes the record.
    RETURN_IF_ERROR(local_->Release(id));
    return UpdatePartition(p, [&](std::vector<LockRecord>* recs) {
      bool has = false;
      for (const LockRecord& r : *recs) has |= Matches(r, id) && r.host == opts_.host_id;
      if (!has) return false;
      if (!local_->Acquire(id, LockMode::kExclusive, false).ok()) return false;
      (void)local_->Release(id);
      return EraseRecords(recs, id, [&](const LockRecord& r) { return r.host == opts_.host_id; });
    });
  }

  Status ReleaseUnclean(LockId id) override {
    LockMode mode = LockMode::kShared;
    {
      MutexLock l(&mu_);
      auto it = held_.find(id);
      if (it == held_.end()) return Status::Invalid(id.ToString() + " is not held here");
      mode = it->second;
    }
    // The volume lease and the hints guard no state; a shared record may
    // be other processes' of this host too.
    if (mode != LockMode::kExclusive || id.kind == LockKind::kVolume ||
        id.kind == LockKind::kWanted || id.kind == LockKind::kWaiting) {
      return Release(id);
    }
    {
      MutexLock l(&mu_);
      held_.erase(id);
    }
    // Marked under the partition lease, before the local lock goes: no
    // other process of this host can have a record of it meanwhile. If the
    // table cannot be written, the record stays live, ours, with the local
    // lock free: a dead process's to this host's next collector.
    Status st = UpdatePartition(PartitionOf(id), [&](std::vector<LockRecord>* recs) {
      bool changed = false;
      for (LockRecord& r : *recs) {
        if (!Matches(r, id) || r.host != opts_.host_id || r.generation != generation_) continue;
        r.generation = kDeadProcessGeneration;
        changed = true;
      }
      return changed;
    });
    Status ls = local_->Release(id);
    return st.ok() ? ls : st;
  }

  void Abandon() override {
    MutexLock l(&mu_);
    abandoned_ = true;
  }

  std::vector<std::pair<LockId, LockMode>> Held() override {

    MutexLock l(&mu_);

    return std::vector<std::pair<LockId, LockMode>>(held_.begin(), held_.end());

  }

  Result<bool> IsHeldElsewhere(LockId id) override {
    ASSIGN_OR_RETURN(bool local_held, local_->IsHeldElsewhere(id));
    if (local_held) return true;
    if (id.kind == LockKind::kVolume) {
      return Status::Invalid("IsHeldElsewhere is not supported for the volume lease");
    }
    // Whether a host slot is held decides whether its journal is replayed:
    // that answer needs a read that cannot miss a record. The wanted and
    // waiting markers are hints, read once (a flush point asks for each
    // cached lock).
    const bool hint = id.kind == LockKind::kWanted || id.kind == LockKind::kWaiting;
    ASSIGN_OR_RETURN(
        std::vector<LockRecord> recs,
        ReadPartition(PartitionOf(id), hint ? LockTableRead::kOnce : LockTableRead::kConsistent));
    for (const LockRecord& r : recs) {
      if (!Matches(r, id) || r.host == opts_.host_id) continue;
      ASSIGN_OR_RETURN(bool live, HolderLive(r));
      if (live) return true;
    }
    return false;
  }

  // Left by a process of this host that died: our host, this generation,
  // not held by this process, and its local lock free. The local lock is
  // looked at (F_OFD_GETLK), not taken: a probe that took it made it look
  // held to the other processes of this host for a moment, and a dead-host
  // scan that asked then about a dead process's host slot went on without
  // replaying its journal; an acquirer of this host got kLocked for
  // nothing.
  bool DeadProcessRecord(const LockRecord& r) {
    if (r.host != opts_.host_id || r.generation != generation_) return false;
    const LockId id{static_cast<LockKind>(r.kind), r.id};
    {
      MutexLock l(&mu_);
      if (held_.count(id) != 0) return false;
    }
    Result<bool> held_here = local_->IsHeldElsewhere(id);
    return held_here.ok() && !*held_here;
  }

  // Records of this host's dead processes are marked dead, not erased
  // (the hints, which guard nothing, are erased). Erased, a lock that may
  // guard state whose newest version is still in the dead process's
  // journal (a group's reference counts) was taken by another host as if
  // released cleanly: that acquirer replaced no dead holder's record, so
  // it skipped the scan that replays dead hosts' journals
  // (Volume::RecoverDeadHosts), used stale home blocks, and a later scan
  // replayed the journal over its changes. A marked record (FORMAT.md
  // 1.1.1) is a dead holder's to every host: the acquirer replaces it and
  // scans first.
  //
  // That scan replays the dead process's journal only if it finds its host
  // slot dead too, so a slot record is always marked before any other
  // record of the same process becomes takeable: (A) without leases, the
  // candidates, records other than host slots whose process was dead when
  // looked at; (B) every host slot's partition, marking the slots of dead
  // processes (a candidate's process was dead before B began, so its slot
  // is among them); only if all of B succeeded, (C) the candidates, each
  // checked again under its partition's lease. A process that dies after
  // (A) waits for the next round.
  Result<uint64_t> CollectStaleRecords() override {
    uint64_t collected = 0;
    auto is_slot = [](const LockRecord& r) {
      return r.kind == static_cast<uint16_t>(LockKind::kHostSlot);
    };
    auto is_hint = [](const LockRecord& r) {
      return r.kind == static_cast<uint16_t>(LockKind::kWanted) ||
             r.kind == static_cast<uint16_t>(LockKind::kWaiting);
    };
    // (A)
    std::map<uint32_t, std::vector<LockRecord>> candidates;
    bool dead_slot_seen = false;
    for (uint32_t p = 0; p < layout_.partitions; p++) {
      ASSIGN_OR_RETURN(std::vector<LockRecord> recs, ReadPartition(p, LockTableRead::kConsistent));
      for (const LockRecord& r : recs) {
        if (!DeadProcessRecord(r)) continue;
        if (is_slot(r)) {
          dead_slot_seen = true;
        } else {
          candidates[p].push_back(r);
        }
      }
    }
    if (candidates.empty() && !dead_slot_seen) return collected;
    // (B)
    std::set<uint32_t> slot_partitions;
    for (uint32_t h = 1; h <= sb_.max_hosts; h++) {
      slot_partitions.insert(PartitionOf(LockId{LockKind::kHostSlot, h}));
    }
    for (uint32_t p : slot_partitions) {
      Status st = UpdatePartition(
          p,
          [&](std::vector<LockRecord>* recs) {
            bool changed = false;
            for (LockRecord& r : *recs) {
              if (!is_slot(r) || !DeadProcessRecord(r)) continue;
              r.generation = kDeadProcessGeneration;
              changed = true;
              collected++;
            }
            return changed;
          },
          /*max_wait_s=*/1);
      if (st.code() == Status::Code::kLocked) return collected;  // busy: no (C) this round
      RETURN_IF_ERROR(st);
    }
    // (C)
    for (const auto& entry : candidates) {
      const uint32_t p = entry.first;
      const std::vector<LockRecord>& wanted = entry.second;
      Status st = UpdatePartition(
          p,
          [&](std::vector<LockRecord>* recs) {
            bool changed = false;
            std::vector<LockRecord> keep;
            for (LockRecord r : *recs) {
              const bool candidate = std::find(wanted.begin(), wanted.end(), r) != wanted.end();
              if (!candidate || !DeadProcessRecord(r)) {
                keep.push_back(r);
                continue;
              }
              changed = true;
              collected++;
              if (is_hint(r)) continue;
              r.generation = kDeadProcessGeneration;
              keep.push_back(r);
            }
            *recs = std::move(keep);
            return changed;
          },
          /*max_wait_s=*/1);
      if (st.code() == Status::Code::kLocked) continue;  // busy: next round
      RETURN_IF_ERROR(st);
    }
    return collected;
  }

  Result<uint32_t> RepairLockTablePartition(uint32_t p) override {
    if (p >= layout_.partitions) {
      return Status::Invalid("lock table partition " + std::to_string(p) + " does not exist");
    }
    uint32_t rewritten = 0;
    // Holding the lease, nobody else writes the partition: a block that
    // fails to decode now is damaged, not torn by a rewrite in flight.
    RETURN_IF_ERROR(WithPartitionLease(p, 600, [&]() -> Status {
      BlockBuf buf = NewBlockBuf(kLockTableBlocksPerPartition);
      RETURN_IF_ERROR(dev_->Read(layout_.PartitionBlock(p, 0) * kBlockSize, buf.get(),
                                 kLockTableBlocksPerPartition * kBlockSize));
      std::vector<uint32_t> damaged;
      std::vector<LockRecord> kept;
      for (uint32_t k = 0; k < kLockTableBlocksPerPartition; k++) {
        auto recs = DecodeLockTableBlock(buf.get() + k * kBlockSize, layout_.PartitionBlock(p, k),
                                         sb_.uuid);
        if (recs.ok()) {
          kept.insert(kept.end(), recs->begin(), recs->end());
        } else if (recs.status().code() == Status::Code::kUnsupported) {
          // A newer dede's block is not damage: never rewritten here.
          return recs.status();
        } else {
          damaged.push_back(k);
        }
      }
      if (damaged.empty()) return Status::Ok();
      RETURN_IF_ERROR(CheckNobodyElseHasVolume());
      // Our own records normally live in blocks that decode: each was
      // written by a leased update that first decoded the whole partition.
      // Damage that struck later may have taken one: put those back.
      std::vector<LockRecord> mine;
      {
        MutexLock l(&mu_);
        for (const auto& held : held_) {
          const LockId id = held.first;
          if (id.kind == LockKind::kVolume || PartitionOf(id) != p) continue;
          bool present = std::any_of(kept.begin(), kept.end(), [&](const LockRecord& kr) {
            return Matches(kr, id) && kr.host == opts_.host_id;
          });
          if (present) continue;
          mine.push_back(
              OwnRecord(id, held.second == LockMode::kExclusive ? kModeExclusive : kModeShared));
        }
      }
      if (mine.size() > damaged.size() * size_t{kLockRecordsPerBlock}) {
        return Status::NoSpace("lock table partition " + std::to_string(p) +
                               ": no room to restore this process's " +
                               std::to_string(mine.size()) + " records");
      }
      BlockBuf out = NewBlockBuf(1);
      for (size_t i = 0; i < damaged.size(); i++) {
        const uint32_t k = damaged[i];
        const uint64_t addr = layout_.PartitionBlock(p, k);
        size_t from = std::min(mine.size(), i * kLockRecordsPerBlock);
        size_t to = std::min(mine.size(), from + kLockRecordsPerBlock);
        std::vector<LockRecord> part(mine.begin() + from, mine.begin() + to);
        // Past whatever sequence the damaged header still shows.
        const uint64_t seq = PeekHeader(buf.get() + k * kBlockSize).seq + 1;
        EncodeLockTableBlock(part, seq, addr, sb_.uuid, out.get());
        RETURN_IF_ERROR(dev_->Write(addr * kBlockSize, out.get(), kBlockSize));
        LOG(kWarning) << "sanlock: rewrote damaged lock table block " << addr << " (partition "
                      << p << ") with " << part.size() << " records of this process";
      }
      // Durable before the lease goes: the next holder reads it.
      RETURN_IF_ERROR(dev_->Flush());
      rewritten = static_cast<uint32_t>(damaged.size());
      return Status::Ok();
    }));
    return rewritten;
  }

  Result<std::vector<LockRecord>> ListRecords() override {
    std::vector<LockRecord> all;
    for (uint32_t p = 0; p < layout_.partitions; p++) {
      ASSIGN_OR_RETURN(std::vector<LockRecord> recs, ReadPartition(p, LockTableRead::kConsistent));
      all.insert(all.end(), recs.begin(), recs.end());
    }
    return all;
  }

  // Whether this host's membership is alive (see the header): the lease is
  // ours and was renewed within 4 io_timeouts.
  Result<uint64_t> CheckLockspace() override {
    ASSIGN_OR_RETURN(DeltaLease lease, ReadOwnDeltaLease());
    struct timespec ts;
    ::clock_gettime(CLOCK_MONOTONIC, &ts);
    const uint64_t now = static_cast<uint64_t>(ts.tv_sec);
    const uint64_t io = io_timeout_s();
    // Renewed every 2 io_timeouts; allow two renewals to be late.
    if (now > lease.stamp + 4 * io) {
      return Status::Unavailable("this host's delta lease was last renewed " +
                                 std::to_string(now - lease.stamp) + " s ago");
    }
    const uint64_t now_ns = uint64_t(ts.tv_sec) * 1'000'000'000ull + uint64_t(ts.tv_nsec);
    const uint64_t stamp_ns = lease.stamp * 1'000'000'000ull;
    return now_ns > stamp_ns ? now_ns - stamp_ns : 0;
  }

  uint32_t sanlock_host_id() const override { return opts_.host_id; }
  uint64_t generation() const override { return generation_; }
  uint32_t io_timeout_s() const override { return io_timeout_s_; }
  Counters counters() const override {
    MutexLock l(&mu_);
    return counters_;
  }
  bool ReportsDeadHolders() const override { return true; }
  uint64_t dead_holders_replaced() const override {
    MutexLock l(&mu_);
    return counters_.stale_taken_over;
  }

 private:
  struct DeltaLease {
    uint64_t owner = 0;
    uint64_t generation = 0;
    uint64_t stamp = 0;         // last renewal, CLOCK_MONOTONIC seconds of this host
    uint32_t io_timeout_s = 0;  // what the membership runs with
  };

  uint64_t OwnDeltaLeaseOffset() const {
    return layout_.lockspace_offset + uint64_t{opts_.host_id - 1} * kBlockSize;
  }

  // Reads this host's delta lease straight from the LUN through the
  // volume's own device, not through the daemon: a daemon busy retrying
  // acquisitions answers commands late, but keeps renewing. The delta
  // lease is sanlock's leader record (sanlock's format, little-endian):
  // magic u32 at 0 (0x12212010), owner_id u64 at 32, owner_generation u64
  // at 40, timestamp u64 at 152 = the renewing host's CLOCK_MONOTONIC
  // seconds, the same clock as ours (same host), io_timeout u16 at 174.
  Result<DeltaLease> ReadDeltaLease() {
    BlockBuf buf = NewBlockBuf(1);
    RETURN_IF_ERROR(dev_->Read(OwnDeltaLeaseOffset(), buf.get(), kBlockSize)
                        .WithContext("reading this host's delta lease"));
    const uint8_t* p = buf.get();
    if (DecodeU32(p) != 0x12212010u) {
      return Status::Unavailable("this host's delta lease at byte " +
                                 std::to_string(OwnDeltaLeaseOffset()) +
                                 " has no sanlock delta lease magic");
    }
    DeltaLease lease;
    lease.owner = DecodeU64(p + 32);
    lease.generation = DecodeU64(p + 40);
    lease.stamp = DecodeU64(p + 152);
    lease.io_timeout_s = DecodeU16(p + 174);
    return lease;
  }

  // The same, failing unless the lease is still ours (host id, generation).
  Result<DeltaLease> ReadOwnDeltaLease() {
    ASSIGN_OR_RETURN(DeltaLease lease, ReadDeltaLease());
    if (lease.owner != opts_.host_id || lease.generation != generation_) {
      return Status::Unavailable("this host's delta lease is not ours any more (owner " +
                                 std::to_string(lease.owner) + " generation " +
                                 std::to_string(lease.generation) + ")");
    }
    return lease;
  }

  static bool Matches(const LockRecord& r, LockId id) {
    return r.kind == static_cast<uint16_t>(id.kind) && r.id == id.id;
  }

  template <typename Pred>
  static bool EraseRecords(std::vector<LockRecord>* recs, LockId id, Pred pred) {
    size_t before = recs->size();
    recs->erase(std::remove_if(recs->begin(), recs->end(),
                               [&](const LockRecord& r) { return Matches(r, id) && pred(r); }),
                recs->end());
    return recs->size() != before;
  }

  uint32_t PartitionOf(LockId id) const {
    return static_cast<uint32_t>(
        Mix((uint64_t{static_cast<uint16_t>(id.kind)} << 56) ^ id.id) % layout_.partitions);
  }

  Result<sanlk_host> HostInfo(uint64_t host_id) {
    sanlk_host* hss = nullptr;
    int count = 0;
    int rv = sanlock_get_hosts(ls_name_.c_str(), host_id, &hss, &count, 0);
    // -EAGAIN: the daemon has not read the lockspace's hosts yet (just
    // joined); it does at its first renewal, 2 io_timeouts after the join.
    const int tries = 10 * (3 * static_cast<int>(io_timeout_s_) + 5);
    for (int i = 0; rv == -EAGAIN && i < tries; i++) {
      std::free(hss);
      hss = nullptr;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      rv = sanlock_get_hosts(ls_name_.c_str(), host_id, &hss, &count, 0);
    }
    if (rv < 0) {
      std::free(hss);
      return Status::Unavailable("sanlock_get_hosts(" + ls_name_ + ", host " +
                                 std::to_string(host_id) + "): " + SanlockError(rv));
    }
    sanlk_host h{};
    bool found = false;
    for (int i = 0; i < count; i++) {
      if (hss[i].host_id == host_id) {
        h = hss[i];
        found = true;
      }
    }
    std::free(hss);
    if (!found) {
      // Never seen alive by our daemon: its delta lease is free.
      h.host_id = host_id;
      h.flags = SANLK_HOST_FREE;
    }
    return h;
  }

  // A record's holder still holds it unless its host is dead, left the
  // lockspace, or has re-joined since (new generation).
  Result<bool> HolderLive(const LockRecord& r) {
    if (r.generation == kDeadProcessGeneration) return false;
    ASSIGN_OR_RETURN(sanlk_host h, HostInfo(r.host));
    LeaseHostState state = LeaseHostState::kUnknown;
    switch (h.flags & SANLK_HOST_MASK) {
      case SANLK_HOST_FREE:
        state = LeaseHostState::kFree;
        break;
      case SANLK_HOST_LIVE:
        state = LeaseHostState::kLive;
        break;
      case SANLK_HOST_FAIL:
        state = LeaseHostState::kFail;
        break;
      case SANLK_HOST_DEAD:
        state = LeaseHostState::kDead;
        break;
      default:
        state = LeaseHostState::kUnknown;
        break;
    }
    return RecordHolderLive(r.generation, state, h.generation);
  }

  // kLocked unless this process is the only one, on any host, that has
  // the volume open. Every opener holds kVolume: locally an OFD lock (other
  // processes of this host), and the shared resource lease `volume`, whose
  // owners sanlock lists from the lease's per-host mode blocks on disk.
  // Another host's owner counts while its host is LIVE, FAIL or UNKNOWN
  // with the generation that took the lease (the HolderLive rule): sanlock
  // releases the lease of a process that exits or dies, and a DEAD host's
  // processes were fenced.
  Status CheckNobodyElseHasVolume() {
    const LockId volume{LockKind::kVolume, 0};
    ASSIGN_OR_RETURN(bool local, local_->IsHeldElsewhere(volume));
    if (local) return Status::Locked("another process of this host has the volume open");
    ResourceBuf r;
    sanlk_resource* rp = VolumeLease(&r, LockMode::kShared);
    sanlk_host* owners = nullptr;
    int count = 0;
    // Its own connection to the daemon, like sanlock_get_hosts: no g_command_mu.
    int rv = sanlock_read_resource_owners(rp, 0, &owners, &count);
    if (rv < 0) {
      std::free(owners);
      return Status::IoError("reading the owners of the volume lease: " + SanlockError(rv));
    }
    std::vector<sanlk_host> hosts(owners, owners + std::max(count, 0));
    std::free(owners);
    for (const sanlk_host& h : hosts) {
      if (h.host_id == opts_.host_id) continue;  // this host: the local check above
      LockRecord owner;
      owner.host = static_cast<uint32_t>(h.host_id);
      owner.generation = h.generation;
      ASSIGN_OR_RETURN(bool live, HolderLive(owner));
      if (live) return Status::Locked("host " + std::to_string(h.host_id) + " has the volume open");
    }
    return Status::Ok();
  }

  sanlk_resource* VolumeLease(ResourceBuf* buf, LockMode mode) const {
    *buf = MakeResource(ls_name_, kVolumeLeaseName, lease_path_, layout_.SlotOffset(0),
                        mode == LockMode::kShared);
    return buf->res();
  }

  Status AcquireVolumeLease(LockMode mode, bool wait) {
    ResourceBuf r;
    // Held exclusively only while the volume is being formatted.
    return AcquireLease(VolumeLease(&r, mode), "the volume lease", wait ? 600 : 5);
  }

  Status AcquireRecord(LockId id, LockMode mode, bool wait) {
    const uint32_t p = PartitionOf(id);
    const uint8_t want = mode == LockMode::kExclusive ? kModeExclusive : kModeShared;
    auto start = std::chrono::steady_clock::now();
    while (true) {
      std::string holder;
      Status decide;
      uint64_t taken_over = 0;
      Status st = UpdatePartition(p, [&](std::vector<LockRecord>* recs) {
        bool changed = false;
        bool have_own = false;
        std::vector<LockRecord> keep;
        for (const LockRecord& r : *recs) {
          if (!Matches(r, id)) {
            keep.push_back(r);
            continue;
          }
          if (r.host == opts_.host_id) {
            // Ours: the local lock we hold in `mode` says what it can be.
            // Same generation and both shared: another process here holds
            // it too; keep it. Anything else is left by a dead process.
            if (r.generation == generation_ && r.mode == kModeShared && want == kModeShared) {
              have_own = true;
              keep.push_back(r);
            } else {
              changed = true;
              taken_over++;
            }
            continue;
          }
          Result<bool> live = HolderLive(r);
          if (!live.ok()) {
            decide = live.status();
            return false;
          }
          if (!live.value()) {
            changed = true;  // a dead host's record: ours to replace
            taken_over++;
            continue;
          }
          if (want == kModeExclusive || r.mode == kModeExclusive) {
            holder = "host " + std::to_string(r.host);
            decide = Status::Locked(id.ToString() + " is held by " + holder);
            return false;
          }
          keep.push_back(r);
        }
        if (!have_own) {
          keep.push_back(OwnRecord(id, want));
          changed = true;
        }
        if (keep.size() > uint64_t{kLockRecordsPerBlock} * kLockTableBlocksPerPartition) {
          decide = Status::NoSpace("lock table partition " + std::to_string(p) +
                                   " is full (" + std::to_string(recs->size()) + " records)");
          return false;
        }
        *recs = std::move(keep);
        return changed;
      });
      RETURN_IF_ERROR(st);
      if (decide.ok()) {
        LOG(kDebug) << "sanlock: acquired " << id.ToString() << " in "
                    << std::chrono::duration<double, std::milli>(
                           std::chrono::steady_clock::now() - start)
                           .count()
                    << " ms";
        MutexLock l(&mu_);
        counters_.acquires++;
        counters_.stale_taken_over += taken_over;
        counters_.acquire_ns += static_cast<uint64_t>(
            std::chrono::duration_cast<std::chrono::nanoseconds>(
                std::chrono::steady_clock::now() - start)
                .count());
        return Status::Ok();
      }
      if (decide.code() != Status::Code::kLocked || !wait) return decide;
      RETURN_IF_ERROR(WaitUntilLooksFree(id, want));
    }
  }

  // Waits for a conflicting record to go by reading the partition without
  // its lease (one read of 4 blocks): polling with leased updates would
  // run a paxos round per poll and slow the holder's own release. The
  // answer is only a hint; the leased update decides.
  Status WaitUntilLooksFree(LockId id, uint8_t want) {
    const uint32_t p = PartitionOf(id);
    int delay_ms = 20;
    while (true) {
      std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
      delay_ms = std::min(delay_ms * 2, 250);
      Result<std::vector<LockRecord>> recs = ReadPartition(p, LockTableRead::kOnce);
      if (!recs.ok()) return Status::Ok();  // let the leased update report it
      bool conflict = false;
      for (const LockRecord& r : *recs) {
        if (!Matches(r, id) || r.host == opts_.host_id) continue;
        if (want != kModeExclusive && r.mode != kModeExclusive) continue;
        ASSIGN_OR_RETURN(bool live, HolderLive(r));
        conflict |= live;
      }
      if (!conflict) return Status::Ok();
    }
  }

  Result<std::vector<LockRecord>> ReadPartition(uint32_t p, LockTableRead how) {
    return ReadLockTablePartition(dev_, layout_, sb_.uuid, p, how);
  }

  Result<std::vector<LockRecord>> ReadPartitionOnce(uint32_t p, std::vector<uint64_t>* seqs) {
    return ReadPartitionBlocks(dev_, layout_, sb_.uuid, p, seqs);
  }

  // A lease left held on disk would keep every other host out until this
  // one takes it again: ReleaseSanlockLease takes it back and releases it
  // when sanlock could not write it free.
  int ReleaseLease(sanlk_resource* rp, const std::string& what) {
    auto release = [&] {
      MutexLock c(&g_command_mu);
      return sanlock_release(reg_fd_, -1, 0, 1, &rp);
    };
    auto acquire = [&] {
      MutexLock c(&g_command_mu);
      return sanlock_acquire(reg_fd_, -1, 0, 1, &rp, nullptr);
    };
    auto pause = [] { std::this_thread::sleep_for(std::chrono::milliseconds(100)); };
    LeaseReleaseResult r = ReleaseSanlockLease(release, acquire, pause);
    if (r.rv < 0) {
      LOG(kError) << "sanlock: releasing " << what << " failed: " << SanlockError(r.rv);
    } else if (r.left_to_daemon) {
      LOG(kWarning) << "sanlock: releasing " << what
                    << " timed out; the daemon finishes the release";
    } else if (r.retakes > 0) {
      LOG(kWarning) << "sanlock: released " << what << " after taking it back " << r.retakes
                    << " time(s)";
    }
    if (r.rv < 0 || r.left_to_daemon || r.retakes > 0) {
      MutexLock l(&mu_);
      counters_.release_retries++;
    }
    return r.rv;
  }

  // Retries while another holder has the lease: a partition lease is held
  // for milliseconds, and one whose holder died is freed by sanlock when
  // that host is declared dead.
  Status AcquireLease(sanlk_resource* rp, const std::string& what, int max_wait_s) {
    static thread_local std::mt19937 rng(std::random_device{}());
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(max_wait_s);
    int delay_ms = 1;
    while (true) {
      int rv;
      {
        MutexLock c(&g_command_mu);
        rv = sanlock_acquire(reg_fd_, -1, 0, 1, &rp, nullptr);
      }
      if (rv == 0) return Status::Ok();
      if (!IsBusy(rv)) return Status::IoError("acquiring " + what + ": " + SanlockError(rv));
      {
        MutexLock l(&mu_);
        counters_.lease_retries++;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return Status::Locked(what + " stayed busy for " + std::to_string(max_wait_s) +
                              " s: " + SanlockError(rv));
      }
      std::uniform_int_distribution<int> jitter(delay_ms, 2 * delay_ms);
      std::this_thread::sleep_for(std::chrono::milliseconds(jitter(rng)));
      delay_ms = std::min(delay_ms * 2, 50);
    }
  }


  // Under partition p's lease: read its records, let `fn` change them
  // (returns true if it did), write back the blocks that changed, flush.
  // A partition lease held by a host that died stays busy until sanlock
  // declares that host dead (8 io_timeouts + 60 s): lock operations wait
  // that long; background work (max_wait_s small) skips the partition.
  template <typename Fn>
  Status UpdatePartition(uint32_t p, Fn fn, int max_wait_s = 600) {
    return WithPartitionLease(p, max_wait_s, [&]() -> Status {
      std::vector<uint64_t> seqs;
      ASSIGN_OR_RETURN(std::vector<LockRecord> recs, ReadPartitionOnce(p, &seqs));
      std::vector<LockRecord> before = recs;
      if (!fn(&recs)) return Status::Ok();
      BlockBuf buf = NewBlockBuf(1);
      for (uint32_t k = 0; k < kLockTableBlocksPerPartition; k++) {
        size_t from = std::min<size_t>(recs.size(), size_t{k} * kLockRecordsPerBlock);
        size_t to = std::min<size_t>(recs.size(), from + kLockRecordsPerBlock);
        std::vector<LockRecord> part(recs.begin() + from, recs.begin() + to);
        size_t bfrom = std::min<size_t>(before.size(), size_t{k} * kLockRecordsPerBlock);
        size_t bto = std::min<size_t>(before.size(), bfrom + kLockRecordsPerBlock);
        if (std::equal(part.begin(), part.end(), before.begin() + bfrom, before.begin() + bto) &&
            part.size() == bto - bfrom) {
          continue;
        }
        const uint64_t addr = layout_.PartitionBlock(p, k);
        EncodeLockTableBlock(part, seqs[k] + 1, addr, sb_.uuid, buf.get());
        RETURN_IF_ERROR(dev_->Write(addr * kBlockSize, buf.get(), kBlockSize));
      }
      // Durable before the lease goes: the next holder reads it.
      return dev_->Flush();
    });
  }

  // Runs fn holding partition p's sanlock lease (and part_mu_[p]); the
  // lease is released when fn returns, except after an I/O error that a
  // device flush cannot fence (below). fn's error wins; a failed release
  // is reported when fn succeeded.
  template <typename Fn>
  Status WithPartitionLease(uint32_t p, int max_wait_s, Fn fn) {
    MutexLock pl(&part_mu_[p]);
    ResourceBuf r = MakeResource(ls_name_, PartitionLeaseName(p), lease_path_,
                                 layout_.SlotOffset(1 + p), false);
    sanlk_resource* rp = r.res();
    RETURN_IF_ERROR(AcquireLease(rp, "lock-table lease " + PartitionLeaseName(p), max_wait_s));
    Status st = fn();
    if (st.code() == Status::Code::kIoError) {
      // A lock-table write that failed may still land later (an iSCSI
      // command lost with its connection). The device's next command
      // first makes sure none can (the LU reset, iscsi_device.cc
      // FenceLostCommands); issued before the lease goes, so no stale
      // block of ours can overwrite the next holder's update.
      // If a lost command is still not known to have finished after that
      // (the target refused the reset, or never answered it), nothing says
      // the stale block cannot land: the lease stays held (sanlock frees it
      // when this process ends), and the partition waits, rather than have
      // another host's records overwritten. Any other failure (a flush
      // that failed, and fails from then on) releases it as before: no
      // write of ours is in flight, and keeping it would stall every host
      // that needs the partition.
      (void)dev_->Flush();
      if (dev_->counters().unfenced_commands > 0) {
        LOG(kError) << "lock-table partition " << p << ": after " << st.ToString()
                    << ", a lost write could not be fenced; keeping lease " << PartitionLeaseName(p)
                    << " until this process ends: restart it once the storage is healthy";
        return st;
      }
    }
    // fn's changes are durable whatever the release answers: a lock taken
    // or released stays so. Failing here would have a caller of Acquire
    // report a lock it holds in the table as not taken (kept from every
    // host until this process ends). ReleaseLease logged the failure; the
    // lease stays ours on disk until our next use of the partition takes
    // it back ("already local").
    (void)ReleaseLease(rp, "lock-table lease " + PartitionLeaseName(p));
    return st;
  }

  // A record of this process holding `id` in `mode`.
  LockRecord OwnRecord(LockId id, uint8_t mode) const {
    LockRecord rec;
    rec.kind = static_cast<uint16_t>(id.kind);
    rec.mode = mode;
    rec.host = opts_.host_id;
    rec.id = id.id;
    rec.generation = generation_;
    rec.since_ns = NowNs();
    return rec;
  }

  BlockDevice* dev_;
  const Superblock sb_;
  const SanlockOptions opts_;
  const LeaseLayout layout_;
  const std::string ls_name_;
  const std::string lease_path_;
  std::unique_ptr<LockManager> local_;  // thread-safe itself
  int reg_fd_ = -1;                     // set once by Init
  uint64_t generation_ = 0;             // set once by Init
  uint32_t io_timeout_s_ = 10;          // set once by Init, from our delta lease
  // One per partition: threads of this process take a partition's lease
  // one at a time (sanlock grants it once per host). Lock order: a
  // partition mutex, then mu_ or local_'s own mutex; never two partitions.
  std::vector<Mutex> part_mu_;
  // sanlock serves one command at a time per registered process and
  // answers on the registration socket in order: two threads talking on
  // reg_fd_ at once read each other's replies (seen under load as a
  // release "failing" with an acquire's -243 while the lease stayed held,
  // wedging its partition). Every command on reg_fd_ holds g_command_mu
  // (process-wide: reg_fd_ is the process's one registration); it is
  // taken last (after a partition mutex) and nothing is taken under it.
  // The daemon would refuse a second concurrent command (-EBUSY) anyway,
  // so this costs no parallelism.
  mutable Mutex mu_;
  std::map<LockId, LockMode> held_ GUARDED_BY(mu_);
  bool abandoned_ GUARDED_BY(mu_) = false;  // Abandon(): the destructor marks, not releases
  Counters counters_ GUARDED_BY(mu_);
};

}  // namespace

LeaseReleaseResult ReleaseSanlockLease(const std::function<int()>& release,
                                       const std::function<int()>& acquire,
                                       const std::function<void()>& pause, int attempts) {
  LeaseReleaseResult r;
  auto done = [&r](int rv) {
    if (rv == SANLK_AIO_TIMEOUT) {
      r.left_to_daemon = true;
      rv = 0;
    }
    r.rv = rv;
    return rv == 0;
  };
  const int first = release();
  if (done(first) || first == -1) return r;
  for (int round = 0; round < attempts; round++) {
    pause();
    const int arv = acquire();
    if (arv == -EEXIST) {
      // Held on this host: by this process still (a release that failed
      // before the daemon dropped it: a transport error) or by another
      // process here that took it since. Releasing tells which: 0, it
      // was ours and is free now; -1, it is not ours.
      const int again = release();
      if (again == -1 || done(again)) {
        r.rv = 0;
        return r;
      }
      continue;
    }
    if (IsBusy(arv)) {
      r.rv = 0;
      return r;
    }
    if (arv < 0) {
      r.rv = arv;
      continue;
    }
    r.retakes++;
    if (done(release())) return r;
  }
  return r;
}

bool RecordHolderLive(uint64_t record_generation, LeaseHostState state, uint64_t host_generation) {
  if (host_generation > record_generation) return false;
  if (record_generation > host_generation) return true;
  return state != LeaseHostState::kFree && state != LeaseHostState::kDead;
}

std::string SanlockLockspaceName(const Uuid& uuid) {
  static const char* kHex = "0123456789abcdef";
  std::string s = "dede-";
  for (uint8_t b : uuid) {
    s += kHex[b >> 4];
    s += kHex[b & 15];
  }
  return s;
}

Result<std::vector<uint32_t>> RenewingLockspaceMembers(
    BlockDevice* dev, const Superblock& sb,
    const std::function<void(std::chrono::milliseconds)>& sleep) {
  const LeaseLayout layout = LeaseLayoutOf(sb);
  std::vector<uint32_t> live;
  if (!sb.UsesSanlock() || layout.partitions == 0) return live;
  // Host h's delta lease is sector h - 1 of the lockspace (sanlock's leader
  // record: magic u32 at 0, owner generation u64 at 40, timestamp u64 at
  // 152, io_timeout u16 at 174; see ReadDeltaLease).
  struct Stamp {
    bool present = false;
    uint64_t generation = 0, timestamp = 0;
    uint32_t io_timeout_s = 0;
  };
  const uint32_t n = sb.max_hosts;
  auto read = [&](std::vector<Stamp>* out) -> Status {
    BlockBuf buf = NewBlockBuf(n);
    RETURN_IF_ERROR(dev->Read(layout.lockspace_offset, buf.get(), uint64_t{n} * kBlockSize)
                        .WithContext("reading the sanlock lockspace's delta leases"));
    out->assign(n, Stamp{});
    for (uint32_t i = 0; i < n; i++) {
      const uint8_t* p = buf.get() + uint64_t{i} * kBlockSize;
      if (DecodeU32(p) != 0x12212010u) continue;
      (*out)[i] = Stamp{true, DecodeU64(p + 40), DecodeU64(p + 152), DecodeU16(p + 174)};
    }
    return Status::Ok();
  };
  std::vector<Stamp> before, after;
  RETURN_IF_ERROR(read(&before));
  uint32_t slowest = 0;
  bool any = false;
  for (const Stamp& st : before) {
    if (!st.present || st.timestamp == 0) continue;  // never joined, or left
    any = true;
    slowest = std::max(slowest, st.io_timeout_s == 0 ? 10u : st.io_timeout_s);
  }
  if (!any) return live;
  // As long as a healthy renewal may take (dedupd's guard allows the same:
  // renewed about every 2 io_timeouts + 1 s, a write taking up to one more).
  sleep(std::chrono::milliseconds(uint64_t{4 * slowest + 4} * 1000));
  RETURN_IF_ERROR(read(&after));
  for (uint32_t i = 0; i < n; i++) {
    if (!after[i].present || after[i].timestamp == 0) continue;
    if (!before[i].present || after[i].timestamp != before[i].timestamp ||
        after[i].generation != before[i].generation) {
      live.push_back(i + 1);
    }
  }
  return live;
}

Status InitSanlockLeases(const Superblock& sb, const std::string& path, uint32_t io_timeout_s) {
  const std::string lease_path = AbsolutePath(path);
  LeaseLayout layout = LeaseLayoutOf(sb);
  if (layout.partitions == 0) {
    return Status::Invalid("sanlock needs at least 3 lease slots (the volume has " +
                           std::to_string(sb.lease_slots) + ")");
  }
  const std::string name = SanlockLockspaceName(sb.uuid);
  sanlk_lockspace ls = MakeLockspace(name, 0, lease_path, layout.lockspace_offset);
  int rv = sanlock_direct_write_lockspace(&ls, 0, 0, io_timeout_s);
  if (rv < 0) {
    return Status::IoError("writing the sanlock lockspace on " + lease_path + ": " +
                           SanlockError(rv));
  }
  auto write_resource = [&](const std::string& rname, uint32_t slot) -> Status {
    ResourceBuf r = MakeResource(name, rname, lease_path, layout.SlotOffset(slot), false);
    int wrv = sanlock_direct_write_resource(r.res(), 0, static_cast<int>(sb.max_hosts), 0);
    if (wrv < 0) {
      return Status::IoError("writing sanlock lease " + rname + " on " + lease_path + ": " +
                             SanlockError(wrv));
    }
    return Status::Ok();
  };
  RETURN_IF_ERROR(write_resource(kVolumeLeaseName, 0));
  for (uint32_t p = 0; p < layout.partitions; p++) {
    RETURN_IF_ERROR(write_resource(PartitionLeaseName(p), 1 + p));
  }
  return Status::Ok();
}

Result<std::vector<LockRecord>> ReadLockTablePartition(BlockDevice* dev, const LeaseLayout& layout,
                                                       const Uuid& uuid, uint32_t p,
                                                       LockTableRead how) {
  constexpr int kTornRetries = 5;
  constexpr int kChangedRetries = 50;
  int torn = 0;
  std::optional<std::pair<std::vector<uint64_t>, std::vector<LockRecord>>> previous;
  for (int attempt = 0; attempt < kChangedRetries; attempt++) {
    std::vector<uint64_t> seqs;
    auto r = ReadPartitionBlocks(dev, layout, uuid, p, &seqs);
    if (!r.ok()) {
      // A block being rewritten may read torn: try again a few times.
      if (r.status().code() != Status::Code::kCorruption || ++torn >= kTornRetries) {
        return r.status();
      }
      previous.reset();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    if (how == LockTableRead::kOnce) return r;
    if (previous && previous->first == seqs) return std::move(previous->second);
    previous.emplace(std::move(seqs), std::move(r).value());
  }
  return Status::Unavailable("lock table partition " + std::to_string(p) +
                             " changed under each of " + std::to_string(kChangedRetries) +
                             " reads without its lease");
}

Result<std::unique_ptr<SanlockLockManager>> SanlockLockManager::Open(BlockDevice* dev,
                                                                     const Superblock& sb,
                                                                     const SanlockOptions& o) {
  SanlockOptions opts = o;
  LeaseLayout layout = LeaseLayoutOf(sb);
  if (layout.partitions == 0) {
    return Status::Invalid("the volume has too few lease slots for sanlock");
  }
  if (opts.host_id < 1 || opts.host_id > sb.max_hosts) {
    return Status::Invalid("the volume uses sanlock leases: this host needs a host id in 1.." +
                           std::to_string(sb.max_hosts) +
                           " (dedupd --host-id N; DEDE_HOST_ID=N for dede)");
  }
  std::string lease_path =
      AbsolutePath(opts.lease_path.empty() ? dev->local_lock_path() : opts.lease_path);
  if (lease_path.empty()) {
    return Status::Invalid(
        "the volume uses sanlock leases: name the LUN as a path for sanlock "
        "(dedupd --lease-path PATH; DEDE_LEASE_PATH=PATH for dede)");
  }
  ASSIGN_OR_RETURN(auto local, OpenLocalLockManager(SanlockHostLockPath(UuidToString(sb.uuid))));
  auto m = std::make_unique<SanlockImpl>(dev, sb, opts, std::move(local), lease_path);
  RETURN_IF_ERROR(m->Init());
  return std::unique_ptr<SanlockLockManager>(std::move(m));
}

}  // namespace dede
