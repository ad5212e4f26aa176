#include "volume/volume.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <thread>

#include "util/bytes.h"
#include "util/coding.h"
#include "util/log.h"
#include "volume/fsck.h"
#include "volume/lock_watch.h"
#include "volume/volume_impl.h"

namespace dede {

Status ValidateFileName(const std::string& name) {
  if (name.empty() || name.size() > kMaxNameLen) {
    return Status::Invalid("file names are 1 to 255 bytes");
  }
  if (name.find('/') != std::string::npos || name.find('\0') != std::string::npos) {
    return Status::Invalid("file name '" + name + "' contains '/' or NUL");
  }
  // An export is named in URIs (nbd+unix:///NAME): a client that resolves
  // dot segments there would ask for another export, or the default one.
  if (name == "." || name == "..") {
    return Status::Invalid("'" + name + "' is not a file name (URIs read it as a directory)");
  }
  return Status::Ok();
}

namespace {
std::string HexU64(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}
}  // namespace

BlockBuf NewBlockBuf(size_t blocks) {
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(kBlockSize, blocks * kBlockSize));
  return BlockBuf(p);
}

namespace {

// A regular file set dedup=off is never a party to a share or a clone,
// whatever stale record or index entry names it: the check is made here,
// under the files' locks, where the share is decided.
bool OptedOut(const Inode& in) {
  return in.kind == FileKind::kRegular && (in.flags & kInodeDedupOff) != 0;
}

Status OptedOutMismatch(const char* what) {
  return Status::Mismatch(std::string(what) + ": a file is set dedup=off");
}

// Blocks covered by one pointer at `level` (level 1 points at data).
uint64_t Span(uint32_t level) {
  uint64_t s = 1;
  for (uint32_t i = 1; i < level; i++) s *= kPointersPerBlock;
  return s;
}

uint64_t Capacity(uint32_t depth) { return depth == 0 ? 0 : Span(depth) * kPointersPerBlock; }

LockId InodeLock(uint64_t ino) { return LockId{LockKind::kInode, ino}; }
LockId GroupLock(uint32_t g) { return LockId{LockKind::kGroup, g}; }
const LockId kNamespaceLock{LockKind::kNamespace, 0};
const LockId kVolumeLock{LockKind::kVolume, 0};

FileInfo InfoFrom(const Inode& in) {
  FileInfo fi;
  fi.id = FileId{in.ino, in.generation};
  fi.name = in.name;
  fi.kind = in.kind;
  fi.size = in.size;
  fi.mapped_blocks = in.mapped_blocks;
  fi.dedup = !(in.flags & kInodeDedupOff);
  fi.ctime_ns = in.ctime_ns;
  fi.mtime_ns = in.mtime_ns;
  fi.owner_ino = in.owner_ino;
  return fi;
}

}  // namespace

// ====================================================================== File

class FileImpl : public File {
 public:
  FileImpl(VolumeImpl* vol, std::unique_ptr<OpenFileState> st) : vol_(vol), st_(std::move(st)) {}
  ~FileImpl() override { vol_->CloseFile(st_.get()); }

  FileId id() const override { return st_->id; }
  OpenFileState* state() { return st_.get(); }
  const VolumeImpl* volume() const { return vol_; }

  Result<FileInfo> Info() override {
    ReaderLock l(&st_->rw);
    ASSIGN_OR_RETURN(Inode in, vol_->InodeOf(st_.get()));
    return InfoFrom(in);
  }
  uint64_t size() override {
    ReaderLock l(&st_->rw);
    auto in = vol_->InodeOf(st_.get());
    return in.ok() ? in->size : 0;
  }
  Status Read(uint64_t offset, void* buf, size_t len) override {
    ReaderLock l(&st_->rw);
    return vol_->ReadData(st_.get(), offset, static_cast<uint8_t*>(buf), len);
  }
  Status Write(uint64_t offset, const void* buf, size_t len) override {
    return vol_->WriteData(st_.get(), offset, static_cast<const uint8_t*>(buf), len);
  }
  Result<std::unique_ptr<InPlaceWrite>> PrepareInPlaceWrite(uint64_t offset, size_t len) override {
    return vol_->PrepareInPlace(st_.get(), offset, len);
  }
  Status Trim(uint64_t offset, uint64_t len) override {
    return vol_->TrimData(st_.get(), offset, len);
  }
  Status Truncate(uint64_t size) override {
    WriterLock l(&st_->rw);
    return vol_->TruncateFile(st_.get(), size);
  }
  Status SetDedup(bool on) override {
    WriterLock l(&st_->rw);
    return vol_->SetFlag(st_.get(), kInodeDedupOff, !on);
  }
  Status Flush() override { return vol_->Sync(); }
  uint64_t cow_copies() override { return st_->cow_copies.load(std::memory_order_relaxed); }
  Result<uint32_t> BlockRefCount(uint64_t index) override {
    ReaderLock l(&st_->rw);
    return vol_->RefCountAt(st_.get(), index, /*may_wait=*/true);
  }
  Result<uint32_t> TryBlockRefCount(uint64_t index) override {
    ReaderLock l(&st_->rw);
    return vol_->RefCountAt(st_.get(), index, /*may_wait=*/false);
  }
  Status TakeBlockGroup(uint64_t index) override {
    ReaderLock l(&st_->rw);
    return vol_->TakeGroupOfBlock(st_.get(), index);
  }
  Status Punch(uint64_t index) override {
    WriterLock l(&st_->rw);
    return vol_->PunchBlock(st_.get(), index);
  }
  Status TryPunch(uint64_t index) override {
    WriterLock l(&st_->rw);
    return vol_->PunchBlock(st_.get(), index, /*may_wait=*/false);
  }
  Result<FileUsage> Usage() override {
    ReaderLock l(&st_->rw);
    return vol_->UsageOf(st_.get());
  }
  Result<bool> WantedElsewhere() override { return vol_->FileWantedElsewhere(st_->id.ino); }

 private:
  VolumeImpl* vol_;
  std::unique_ptr<OpenFileState> st_;
};

// ==================================================================== format

namespace {

// format --force over a volume that is still in use would erase the
// metadata under running VMs (and, with sanlock, the lockspace their
// hosts renew: every one of them fenced). Returns the old volume's local
// lock files held exclusively (kVolumeLock), to be kept while formatting.
Result<std::vector<std::unique_ptr<LockManager>>> RefuseVolumeInUse(BlockDevice* dev,
                                                                    const FormatOptions& opts) {
  BlockBuf two = NewBlockBuf(2);
  RETURN_IF_ERROR(dev->Read(0, two.get(), 2 * kBlockSize));
  std::optional<Superblock> old;
  for (uint64_t a : kSuperblockAddrs) {
    Result<Superblock> sb = DecodeSuperblock(two.get() + a * kBlockSize, a);
    if (sb.ok()) {
      old = sb.value();
      break;
    }
  }
  std::vector<std::unique_ptr<LockManager>> held;
  if (!old) return held;  // nothing readable to protect
  // Openers of a volume on a device without a path lock its local volume
  // lock file, and so do the openers of a sanlock volume using the
  // default sanlock daemon; those using this process's daemon (if another)
  // lock its host's file. A path device's own lock was taken by the
  // caller. (Processes of other daemons are other hosts: their lockspace
  // renewals are checked below.)
  const std::string uuid = UuidToString(old->uuid);
  std::vector<std::string> paths = {LocalVolumeLockPath(uuid)};
  if (SanlockHostLockPath(uuid) != paths[0]) paths.push_back(SanlockHostLockPath(uuid));
  for (const std::string& path : paths) {
    ASSIGN_OR_RETURN(auto lm, OpenLocalLockManager(path));
    Status st = lm->Acquire(kVolumeLock, LockMode::kExclusive, false);
    if (st.code() == Status::Code::kLocked) {
      return Status::Locked(dev->name() + " is in use: a process of this host has its volume " +
                            uuid + " open (stop dedupd and dede first)");
    }
    RETURN_IF_ERROR(st);
    held.push_back(std::move(lm));
  }
  auto sleep =
      opts.sleep ? opts.sleep : [](std::chrono::milliseconds d) { std::this_thread::sleep_for(d); };
  ASSIGN_OR_RETURN(std::vector<uint32_t> live, RenewingLockspaceMembers(dev, *old, sleep));
  if (!live.empty()) {
    std::string ids;
    for (uint32_t h : live) ids += (ids.empty() ? "" : ", ") + std::to_string(h);
    return Status::Locked(
        dev->name() + " is in use: host" + (live.size() > 1 ? "s " : " ") + ids + " renewed " +
        (live.size() > 1 ? "their" : "its") + " lease in the volume's sanlock " + "lockspace " +
        SanlockLockspaceName(old->uuid) + " just now. Stop dedupd there and " +
        "leave the lockspace (sanlock client rem_lockspace -s " + SanlockLockspaceName(old->uuid) +
        ":<host id>:<lease path>:" + std::to_string(LeaseLayoutOf(*old).lockspace_offset) +
        ") before formatting");
  }
  return held;
}

// sanlock reaches the lease area through `lease_path`, dede through `dev`:
// they must be one device, or the leases guard nothing (and format would
// write a lockspace into whatever the path names).
Status CheckLeasePathIsDevice(BlockDevice* dev, const std::string& lease_path, uint64_t offset) {
  BlockBuf saved = NewBlockBuf(), mark = NewBlockBuf(), seen = NewBlockBuf();
  RETURN_IF_ERROR(dev->Read(offset, saved.get(), kBlockSize));
  std::random_device rd;
  std::mt19937_64 rng((uint64_t{rd()} << 32) ^ rd());
  for (size_t i = 0; i < kBlockSize; i += 8) EncodeU64(mark.get() + i, rng());
  RETURN_IF_ERROR(dev->Write(offset, mark.get(), kBlockSize));
  RETURN_IF_ERROR(dev->Flush());
  int fd = ::open(lease_path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd < 0 && errno == EINVAL) fd = ::open(lease_path.c_str(), O_RDONLY | O_CLOEXEC);
  Status st;
  if (fd < 0) {
    st = Status::FromErrno("--lease-path " + lease_path, errno);
  } else {
    ssize_t n = ::pread(fd, seen.get(), kBlockSize, static_cast<off_t>(offset));
    const int err = errno;
    ::close(fd);
    if (n < 0) {
      st = Status::FromErrno("reading --lease-path " + lease_path, err);
    } else if (n != static_cast<ssize_t>(kBlockSize) ||
               std::memcmp(seen.get(), mark.get(), kBlockSize) != 0) {
      st = Status::Invalid("--lease-path " + lease_path + " is not " + dev->name() +
                           ": a block written through the volume's device does not read back "
                           "through it");
    }
  }
  Status put_back = dev->Write(offset, saved.get(), kBlockSize);
  if (put_back.ok()) put_back = dev->Flush();
  return st.ok() ? put_back : st;
}

}  // namespace

Status FormatVolume(BlockDevice* dev, const FormatOptions& opts, bool force) {
  FormatParams p;
  p.device_bytes = dev->size_bytes();
  p.max_hosts = opts.max_hosts;
  p.hash_algo = opts.hash_algo;
  p.inode_count = opts.inode_count;
  p.lease_slots = opts.lease_slots;
  p.journal_blocks = opts.journal_blocks;
  p.group_refblocks = opts.group_refblocks;
  p.drop_blocks = opts.drop_blocks;
  ASSIGN_OR_RETURN(Superblock sb, PlanLayout(p));
  BlockBuf buf = NewBlockBuf(256);
  if (!force) {
    RETURN_IF_ERROR(dev->Read(0, buf.get(), 2 * kBlockSize));
    for (uint64_t a : kSuperblockAddrs) {
      // A damaged or newer-version superblock still means "a volume lives
      // here": only --force overwrites it.
      if (DecodeSuperblock(buf.get() + a * kBlockSize, a).ok() ||
          PeekHeader(buf.get() + a * kBlockSize).magic == kMagicSuperblock) {
        return Status::Exists(dev->name() + " already holds a dede volume (use --force to "
                              "overwrite it)");
      }
    }
  }
  // Resolved before anything is written: a missing one used to fail only
  // after the old volume was erased.
  std::string lease_path;
  if (opts.sanlock) {
    lease_path = opts.lease_path.empty() ? dev->local_lock_path() : opts.lease_path;
    if (lease_path.empty()) {
      return Status::Invalid("sanlock needs the LUN as a path (--lease-path) for " + dev->name());
    }
  }
  // Exclude every other user of this device while we write.
  std::shared_ptr<LockManager> locks;
  if (!dev->local_lock_path().empty()) {
    ASSIGN_OR_RETURN(auto lm, OpenLocalLockManager(dev->local_lock_path()));
    locks = std::move(lm);
    RETURN_IF_ERROR(locks->Acquire(kVolumeLock, LockMode::kExclusive, false)
                        .WithContext(dev->name() + " is in use"));
  }
  std::vector<std::unique_ptr<LockManager>> old_volume_locks;
  if (force) {
    ASSIGN_OR_RETURN(old_volume_locks, RefuseVolumeInUse(dev, opts));
  }
  if (opts.sanlock && lease_path != dev->local_lock_path()) {
    RETURN_IF_ERROR(CheckLeasePathIsDevice(dev, lease_path, LeaseLayoutOf(sb).lockspace_offset));
  }
  Clock* clock = opts.clock ? opts.clock : Clock::Real();
  sb.uuid = NewRandomUuid();
  sb.created_ns = clock->NowNanos();

  // Zero everything between the superblocks and the first group's data:
  // lease area, journals, inode table; then every group's refcount blocks.
  // An all-zero inode or refcount block means "never used".
  std::memset(buf.get(), 0, 256 * kBlockSize);
  auto zero = [&](uint64_t from, uint64_t n) -> Status {
    while (n > 0) {
      uint64_t run = std::min<uint64_t>(n, 256);
      RETURN_IF_ERROR(dev->Write(from * kBlockSize, buf.get(), run * kBlockSize));
      from += run;
      n -= run;
    }
    return Status::Ok();
  };
  RETURN_IF_ERROR(zero(0, sb.group_start));
  for (uint32_t g = 0; g < sb.group_count; g++) {
    RETURN_IF_ERROR(zero(sb.GroupStart(g), sb.GroupRefBlocks(g)));
  }
  for (uint32_t h = 1; h <= sb.max_hosts; h++) RETURN_IF_ERROR(Journal::Initialize(dev, sb, h));
  RETURN_IF_ERROR(dev->Flush());
  if (opts.sanlock) {
    RETURN_IF_ERROR(InitSanlockLeases(sb, lease_path, opts.lease_io_timeout_s));
    sb.incompat_features |= kIncompatSanlock;
  }
  // Superblocks last: until they land the device is not a volume.
  for (uint64_t a : kSuperblockAddrs) {
    EncodeSuperblock(sb, a, buf.get());
    RETURN_IF_ERROR(dev->Write(a * kBlockSize, buf.get(), kBlockSize));
  }
  return dev->Flush();
}

// ====================================================================== open

Result<std::unique_ptr<Volume>> Volume::Open(BlockDevice* dev, const OpenOptions& opts) {
  if (dev->size_bytes() < 2 * kBlockSize) {
    return Status::Corruption(dev->name() + " is not a dede volume (too small)");
  }
  BlockBuf buf = NewBlockBuf(2);
  RETURN_IF_ERROR(dev->Read(0, buf.get(), 2 * kBlockSize));
  Result<Superblock> sb = DecodeSuperblock(buf.get(), 0);
  if (!sb.ok()) {
    // The backup copy stands in for a damaged primary (fsck rewrites it),
    // but a newer-version primary is refused outright.
    Result<Superblock> backup = DecodeSuperblock(buf.get() + kBlockSize, 1);
    if (!backup.ok() || sb.status().code() == Status::Code::kUnsupported) {
      if (sb.status().code() == Status::Code::kUnsupported) return sb.status();
      if (PeekHeader(buf.get()).magic != kMagicSuperblock &&
          PeekHeader(buf.get() + kBlockSize).magic != kMagicSuperblock) {
        return Status::Corruption(dev->name() + " is not a dede volume (no superblock)");
      }
      return sb.status().WithContext(dev->name());
    }
    sb = std::move(backup);
  }
  if (sb->total_blocks * kBlockSize > dev->size_bytes()) {
    return Status::Corruption(dev->name() + ": the volume is larger than the device (" +
                              std::to_string(sb->total_blocks * kBlockSize) + " > " +
                              std::to_string(dev->size_bytes()) + " bytes)");
  }
  std::shared_ptr<LockManager> locks = opts.locks;
  if (!locks && sb->UsesSanlock()) {
    ASSIGN_OR_RETURN(auto sl, SanlockLockManager::Open(dev, sb.value(), opts.sanlock));
    // Records left by a process of this host that died (a `dede` command
    // killed with Ctrl-C) keep other hosts out until a process of this host
    // marks them dead. dedupd does so every 10 s; on a host that runs only
    // dede commands, every open does. Best effort: the records stay for
    // the next try, and nothing else depends on it.
    if (!opts.read_only) {
      Result<uint64_t> collected = sl->CollectStaleRecords();
      if (!collected.ok()) {
        LOG(kWarning) << "collecting lock records of dead processes of this host: "
                      << collected.status().ToString();
      } else if (*collected > 0) {
        LOG(kInfo) << "marked " << *collected
                   << " lock records of dead processes of this host dead (for other hosts)";
      }
    }
    locks = std::move(sl);
  }
  if (!locks) {
    std::string path = dev->local_lock_path();
    if (path.empty()) path = LocalVolumeLockPath(UuidToString(sb->uuid));
    ASSIGN_OR_RETURN(auto lm, OpenLocalLockManager(path));
    locks = std::move(lm);
  }
  auto vol = std::make_unique<VolumeImpl>(dev, sb.value(), locks,
                                          opts.clock ? opts.clock : Clock::Real(), opts.read_only);
  vol->set_lock_wait(std::chrono::seconds(opts.lock_wait_s));
  vol->set_pass_damaged_journals(opts.pass_damaged_journals);
  RETURN_IF_ERROR(vol->Start(opts.host_id));
  return std::unique_ptr<Volume>(std::move(vol));
}

Result<OpenedVolume> OpenVolumeSpec(const std::string& spec, const OpenOptions& opts) {
  OpenedVolume ov;
  DeviceOptions dopts;
  dopts.iscsi_sessions = opts.iscsi_sessions;
  dopts.iscsi_initiator_name = opts.iscsi_initiator_name;
  ASSIGN_OR_RETURN(ov.device, OpenBlockDevice(spec, dopts));
  ASSIGN_OR_RETURN(ov.volume, Volume::Open(ov.device.get(), opts));
  return ov;
}

VolumeImpl::VolumeImpl(BlockDevice* dev, const Superblock& sb, std::shared_ptr<LockManager> locks,
                       Clock* clock, bool read_only)
    : dev_(dev), sb_(sb), locks_(std::move(locks)), clock_(clock), read_only_(read_only) {}

Status VolumeImpl::Start(uint32_t host_id) {
  MutexLock l(&mu_);
  RETURN_IF_ERROR(locks_->Acquire(kVolumeLock, LockMode::kShared, false)
                      .WithContext(dev_->name() + " is being formatted"));
  volume_locked_ = true;
  if (!read_only_) {
    if (host_id > sb_.max_hosts) {
      return Status::Invalid("host id " + std::to_string(host_id) + " is out of range 1.." +
                             std::to_string(sb_.max_hosts));
    }
    // kRecovery(h) before kHostSlot(h), and kept until our journal is
    // replayed: another process's dead-host scan that finds the slot held
    // goes on without replaying it, and would use what a dead previous
    // incarnation of the slot left in its journal from home blocks that
    // the replay below then overwrites. With kRecovery taken first, the
    // scan finds the slot free and waits for kRecovery, or finds it held
    // and waits for kRecovery (ScanDeadHosts), until our replay is done.
    auto take_slot = [&](uint32_t h, bool wait_for_recovery) -> Status {
      const LockId rec{LockKind::kRecovery, h};
      RETURN_IF_ERROR(wait_for_recovery ? TakeRecoveryLock(rec, LockMode::kExclusive)
                                        : locks_->Acquire(rec, LockMode::kExclusive, false));
      Status st = locks_->Acquire(LockId{LockKind::kHostSlot, h}, LockMode::kExclusive, false);
      if (!st.ok()) (void)locks_->Release(rec);
      return st;
    };
    if (host_id != 0) {
      RETURN_IF_ERROR(take_slot(host_id, true));
      host_ = host_id;
    } else {
      for (uint32_t h = 1; h <= sb_.max_hosts && host_ == 0; h++) {
        // A slot in use is passed over without touching its kRecovery (two
        // more lock-table writes, and one left held if we die right then).
        Result<bool> in_use = locks_->IsHeldElsewhere(LockId{LockKind::kHostSlot, h});
        if (in_use.ok() && *in_use) continue;
        if (!take_slot(h, false).ok()) continue;
        if (pass_damaged_journals_ && DamagedJournal(h)) {
          (void)locks_->Release(LockId{LockKind::kHostSlot, h});
          (void)locks_->Release(LockId{LockKind::kRecovery, h});
          continue;
        }
        host_ = h;
      }
      if (host_ == 0) {
        return Status::Locked("all " + std::to_string(sb_.max_hosts) +
                              " host slots of the volume are in use (or being recovered: a "
                              "replay, or a dede fsck --repair, holds their recovery locks)");
      }
    }
    slot_locked_ = true;
    // Our own journal first: a previous incarnation of this slot may have
    // died with committed transactions.
    LockId rec{LockKind::kRecovery, host_};
    auto j = Journal::Open(dev_, sb_, host_);
    Status st = j.status();
    if (st.ok()) st = j.value()->Replay().status();
    st = st.WithContext("journal of host " + std::to_string(host_));
    if (st.ok()) {
      journal_ = std::move(j.value());
      // Under kRecovery(host_): a host adopting this slot's drops checks
      // that the slot is free while holding it, so it either finished
      // before we read the list or sees us and leaves it alone.
      st = LoadDropList();
    }
    (void)locks_->Release(rec);
    if (st.code() == Status::Code::kCorruption && journal_) {
      // A host that adopted drops from this slot (AdoptDropsOf, step one)
      // and died writing the list's home block left it torn, its good
      // image committed in that host's journal: replay dead hosts'
      // journals, then read the list again. (Not with kRecovery(host_)
      // held: two hosts starting at once would each wait for the other's.)
      const Status first = st;
      RETURN_IF_ERROR(RecoverDeadHosts().WithContext(first.message()));
      RETURN_IF_ERROR(TakeRecoveryLock(rec, LockMode::kExclusive));
      st = LoadDropList();
      (void)locks_->Release(rec);
    }
    RETURN_IF_ERROR(st);
  }
  RETURN_IF_ERROR(RecoverDeadHosts());
  return AdoptOrphanDrops();
}

VolumeImpl::~VolumeImpl() {
  MutexLock l(&mu_);
  if (!read_only_ && poisoned_.ok() && drop_count_ > 0) {
    // Apply what can be applied now; the rest stays in this slot's list
    // for its next owner (counted by fsck meanwhile).
    (void)DrainDrops(Drain::kNow);
  }
  for (uint32_t g : wanted_groups_) (void)locks_->Release(WantedLock(GroupLock(g)));
  wanted_groups_.clear();
  Status st = (read_only_ || !poisoned_.ok()) ? poisoned_ : Checkpoint();
  if (!st.ok()) {
    // Same as CloseFile: the locks stay held until the lock manager goes
    // (with this process), so that whoever takes them next first replays
    // our journal; abandoned, the manager then leaves them as a dead
    // process's (a plain release would, with sanlock, erase their records:
    // the next acquirer would replace no dead holder and skip the scan).
    locks_->Abandon();
    return;
  }
  (void)ReleaseCached();
  if (slot_locked_) (void)locks_->Release(LockId{LockKind::kHostSlot, host_});
  if (volume_locked_) (void)locks_->Release(kVolumeLock);
}

Status VolumeImpl::RecoverDeadHosts() {
  // A backend that reports dead holders tells us whether anything was
  // taken from a dead host since the last scan; if not, there is nothing
  // new to recover (the scan costs a lock-table read per slot and, with
  // sanlock, paxos rounds).
  const bool reports = locks_->ReportsDeadHolders();
  const uint64_t replaced = locks_->dead_holders_replaced();
  if (reports && scanned_dead_hosts_ && replaced == dead_holders_seen_) return Status::Ok();
  RETURN_IF_ERROR(ScanDeadHosts());
  scanned_dead_hosts_ = true;
  dead_holders_seen_ = replaced;
  return Status::Ok();
}

Status VolumeImpl::ScanForTaken(const std::vector<LockId>& taken) {
  Status st = RecoverDeadHosts();
  if (st.ok()) return st;
  // Kept without the scan, they would look held to every later use, which
  // then never scans: their blocks would be read from home while a dead
  // host's journal may still hold newer images of them (a block of its
  // allocated again, counts that later replay overwrites). Nothing of
  // theirs is cached or changed yet.
  ForgetTaken(taken);
  return st;
}

void VolumeImpl::ForgetTaken(const std::vector<LockId>& taken) {
  // Unclean: an acquisition may have replaced a dead holder's record, the
  // one sign (with sanlock) that its journal must be replayed before the
  // lock's blocks are read; a clean release would erase it, and the next
  // acquirer would skip the scan.
  for (const LockId& id : taken) (void)ForgetCachedLock(id, /*unclean=*/true);
}

Status VolumeImpl::ScanDeadHosts(uint32_t skip, bool may_wait) {
  // Without waiting: a kRecovery held elsewhere is kLocked at once.
  auto take = [&](LockId rec, LockMode mode) REQUIRES(mu_) -> Status {
    if (may_wait) return TakeRecoveryLock(rec, mode);
    Status st = locks_->Acquire(rec, mode, false);
    if (st.code() == Status::Code::kLocked) {
      return Status::Locked(rec.ToString() + " is held elsewhere (a replay under way)");
    }
    return st;
  };
  for (uint32_t h = 1; h <= sb_.max_hosts; h++) {
    if (h == host_ || h == skip) continue;
    ASSIGN_OR_RETURN(bool alive, locks_->IsHeldElsewhere(LockId{LockKind::kHostSlot, h}));
    LockId rec{LockKind::kRecovery, h};
    if (!alive) {
      // Most slots are unused or were left cleanly: look without the lock
      // first. A dead slot's journal no longer changes except by a
      // replayer, who empties it only after writing every home block; an
      // unclean or unreadable look takes the locked path.
      auto peek = Journal::Open(dev_, sb_, h);
      if (peek.ok()) {
        Result<bool> pending = peek.value()->HasTransactions();
        if (pending.ok() && !pending.value()) continue;
      }
    }
    if (alive) {
      // A live owner may be replaying its own journal right now: wait for it.
      ASSIGN_OR_RETURN(bool replaying, locks_->IsHeldElsewhere(rec));
      if (replaying) {
        RETURN_IF_ERROR(take(rec, LockMode::kShared));
        (void)locks_->Release(rec);
      }
      continue;
    }
    RETURN_IF_ERROR(take(rec, LockMode::kExclusive));
    // A new owner may have taken the slot while we waited for kRecovery
    // (it replays its own journal under it, then commits to it): its
    // journal is live now, not ours to replay.
    Result<bool> taken = locks_->IsHeldElsewhere(LockId{LockKind::kHostSlot, h});
    if (!taken.ok() || *taken) {
      (void)locks_->Release(rec);
      RETURN_IF_ERROR(taken.status());
      continue;
    }
    if (pass_damaged_journals_ && DamagedJournal(h)) {
      (void)locks_->Release(rec);
      continue;
    }
    Status st = ReplayJournalOf(h);
    (void)locks_->Release(rec);
    RETURN_IF_ERROR(st);
    adopt_due_ns_ = 0;  // it may have left drops behind
  }
  return Status::Ok();
}

Status VolumeImpl::TakeRecoveryLock(LockId rec, LockMode mode) {
  // Bounded like every other wait (LOCKING.md rule 3): with sanlock, a
  // process that died replaying leaves its record live until a collector
  // of its host marks it, and an unbounded wait here (under mu_) froze
  // every file of this process meanwhile.
  LockWatch watch;
  watch.deadline = LockWatch::Clock::now() + lock_wait_;
  Status st = WatchAndTake(locks_.get(), rec, mode, &watch);
  if (st.code() == Status::Code::kLocked) {
    return Status::Locked(rec.ToString() + " is still held after " +
                          std::to_string(lock_wait_.count()) +
                          " s: another process or host is replaying that slot's journal (or "
                          "a dede fsck --repair is running), or one that died doing so left its "
                          "lock record (its host's next dede command or dedupd marks it dead)");
  }
  return st;
}

bool VolumeImpl::DamagedJournal(uint32_t h) const {
  auto j = Journal::Open(dev_, sb_, h);
  if (j.ok() || j.status().code() != Status::Code::kCorruption) return false;
  LOG(kWarning) << "journal of host " << h << ": " << j.status().ToString()
                << " (passed over for fsck)";
  return true;
}

Status VolumeImpl::ReplayJournalOf(uint32_t h) {
  auto j = Journal::Open(dev_, sb_, h);
  Status st = j.status();
  if (st.ok()) {
    auto pending = j.value()->HasTransactions();
    st = pending.status();
    if (st.ok() && pending.value()) st = j.value()->Replay().status();
  }
  return st.WithContext("recovering the journal of host " + std::to_string(h));
}

Status VolumeImpl::AdoptOrphanDrops() {
  if (read_only_ || sb_.drop_blocks == 0 || !journal_) return Status::Ok();
  adopt_due_ns_ = clock_->MonotonicNanos() + kAdoptIntervalNs;
  for (uint32_t h = 1; h <= sb_.max_hosts && DropRoom() > 0; h++) {
    if (h == host_) continue;
    ASSIGN_OR_RETURN(bool alive, locks_->IsHeldElsewhere(LockId{LockKind::kHostSlot, h}));
    if (alive) continue;
    // Look without the lock first: almost every free slot's list is empty.
    // A list that does not decode is left for fsck to report and repair.
    Result<std::vector<std::vector<uint64_t>>> look = ReadDropList(h, nullptr);
    if (!look.ok()) continue;
    size_t entries = 0;
    for (const auto& blk : look.value()) entries += blk.size();
    if (entries == 0) continue;
    // fsck (--repair) opens past damaged journals to reset them; adopting
    // would replay this one first, and fail the open.
    if (pass_damaged_journals_ && DamagedJournal(h)) continue;
    // Busy means the slot's owner is starting or someone else is replaying
    // or adopting it: try again at a later flush point.
    const LockId rec{LockKind::kRecovery, h};
    if (!locks_->Acquire(rec, LockMode::kExclusive, false).ok()) continue;
    Status st = AdoptDropsOf(h);
    // Poisoned, our journal may hold h's shortened list (step one) that
    // never reached home: kRecovery(h) stays held, like every lock of a
    // poisoned volume (it goes with this process), so h's next owner,
    // which takes it before reading its list, waits for whoever replays
    // our journal first.
    if (poisoned_.ok()) (void)locks_->Release(rec);
    RETURN_IF_ERROR(st);
  }
  return Status::Ok();
}

Status VolumeImpl::AdoptDropsOf(uint32_t h) {
  // The owner takes kRecovery(h) before its slot and reads its list under
  // it (Start), so a slot still free now stays without a reader of its
  // list until we release kRecovery(h).
  ASSIGN_OR_RETURN(bool alive, locks_->IsHeldElsewhere(LockId{LockKind::kHostSlot, h}));
  if (alive) return Status::Ok();
  // A dead owner's newest list may still be in its journal; and so may a
  // dead adopter's step one, which shortened this list (it took the slot's
  // kRecovery too, and died before its checkpoint put the list home):
  // read from home without that replay, the list still held the entries
  // that adopter took, and its journal, replayed later, put its shorter
  // list back over ours, bringing back entries we had taken as well (a
  // drop applied twice: a count below its references). Every dead host's
  // journal first, as any use of a lock taken from a dead holder does.
  RETURN_IF_ERROR(ReplayJournalOf(h));
  // Never waiting (an adoption holds kRecovery(h), and fsck takes every
  // slot's in turn: a wait here could meet one there): a replay under way
  // elsewhere puts the adoption off to a later flush point.
  Status scanned = ScanDeadHosts(/*skip=*/h, /*may_wait=*/false);
  if (scanned.code() == Status::Code::kLocked) return Status::Ok();
  RETURN_IF_ERROR(scanned);
  Result<std::vector<std::vector<uint64_t>>> lists = ReadDropList(h, nullptr);
  if (!lists.ok()) return Status::Ok();  // fsck reports it; repair clears it
  std::vector<uint64_t> taken;
  std::vector<size_t> changed;
  // Each step below is one transaction: at most MaxTxnBlocks() blocks of
  // h's list changed, and of ours touched (a list may be far bigger).
  const size_t max_blocks = MaxTxnBlocks();
  size_t room = 0, own_blocks = 0;
  for (size_t i = 0; i < drop_list_.size() && own_blocks < max_blocks; i++) {
    const size_t free_slots = kDropsPerBlock - std::min<size_t>(kDropsPerBlock, drop_list_[i].size());
    if (free_slots == 0) continue;
    room += free_slots;
    own_blocks++;
  }
  for (size_t i = 0; i < lists->size() && taken.size() < room && changed.size() < max_blocks;
       i++) {
    std::vector<uint64_t>& blk = (*lists)[i];
    if (blk.empty()) continue;
    const size_t n = std::min(blk.size(), room - taken.size());
    taken.insert(taken.end(), blk.end() - static_cast<ptrdiff_t>(n), blk.end());
    blk.resize(blk.size() - n);
    changed.push_back(i);
  }
  if (taken.empty()) return Status::Ok();
  // Two steps, never one transaction: (1) the entries leave h's list and
  // that reaches its home blocks; only then (2) they enter ours. A crash
  // between the two loses them (the blocks keep a reference too many:
  // space leaks, fsck reports it and repair fixes the counts); no crash
  // can leave an entry in both lists, which would free a block still in
  // use. A replay of our journal can only ever write h's list as step (1)
  // left it, because step (1) is home before step (2) begins.
  const LockId slot{LockKind::kHostSlot, h};
  RETURN_IF_ERROR(EnsureJournalRoom(changed.size()));
  // Every block is read before any is changed: a read failing half-way
  // must not leave some of h's entries removed in the transaction, which
  // this flush point would commit with them in no list.
  std::vector<uint64_t> seqs;
  for (size_t i : changed) {
    uint8_t* b;
    RETURN_IF_ERROR(Load(sb_.DropListStart(h) + i, slot, kMagicDropList, "drop list block", &b));
    seqs.push_back(PeekHeader(b).seq);
  }
  for (size_t k = 0; k < changed.size(); k++) {
    const uint64_t addr = sb_.DropListStart(h) + changed[k];
    EncodeDropListBlock((*lists)[changed[k]], h, seqs[k], sb_.uuid, addr, Dirty(addr));
  }
  RETURN_IF_ERROR(Checkpoint());
  DropCache(slot);
  RETURN_IF_ERROR(EnsureJournalRoom(own_blocks));
  size_t next = 0;
  for (size_t i = 0; i < drop_list_.size() && next < taken.size(); i++) {
    bool touched = false;
    while (next < taken.size() && drop_list_[i].size() < kDropsPerBlock) {
      drop_list_[i].push_back(taken[next++]);
      touched = true;
    }
    if (touched) RETURN_IF_ERROR(Poison(StoreDropBlock(i)));
  }
  drop_count_ += taken.size();
  drops_adopted_ += taken.size();
  return Commit(/*durable=*/true);
}

// ================================================================ cache/txn

Status VolumeImpl::Poison(Status s) {
  if (!s.ok() && poisoned_.ok()) poisoned_ = s;
  return s;
}

Status VolumeImpl::CheckWritable() {
  if (read_only_) return Status::Invalid("the volume is open read-only");
  return poisoned_;
}

Status VolumeImpl::Load(uint64_t addr, LockId owner, uint32_t magic, const char* what,
                        uint8_t** out) {
  auto it = cache_.find(addr);
  if (it != cache_.end()) {
    if (it->second.owner == owner) {
      *out = it->second.data.get();
      return Status::Ok();
    }
    // Cached for another lock: a pointer block this process freed (the
    // cache keeps a file's blocks until it closes), its address since
    // reused by another host for the file we now ask for. Such a copy is
    // stale; read the block again. One that is still to be written home
    // cannot have been reused (freed blocks wait for our checkpoint).
    if (txn_.count(addr) || dirty_.count(addr)) {
      return Status::Corruption(std::string(what) + " at block " + std::to_string(addr) +
                                " is asked for under " + owner.ToString() +
                                " while this process has it unwritten under " +
                                it->second.owner.ToString());
    }
    cache_.erase(it);
  }
  BlockBuf b = NewBlockBuf();
  RETURN_IF_ERROR(dev_->Read(addr * kBlockSize, b.get(), kBlockSize));
  RETURN_IF_ERROR(Admit(b.get(), addr, magic, what));
  *out = b.get();
  cache_[addr] = Cached{std::move(b), owner};
  return Status::Ok();
}

Status VolumeImpl::Admit(uint8_t* b, uint64_t addr, uint32_t magic, const char* what) const {
  if ((magic == kMagicRefcountBlock || magic == kMagicInode || magic == kMagicDropList) &&
      IsAllZero(b, kBlockSize)) {
    // Never written since format: an empty refcount block, a free inode or
    // an empty drop list.
    if (magic == kMagicInode) {
      Inode in;
      in.ino = addr - sb_.inode_start + 1;
      EncodeInode(in, 0, sb_.uuid, addr, b);
    } else {
      SealBlock(b, BlockHeader{magic, kFormatMajor, kFormatMinor, 0, 0, addr}, sb_.uuid);
    }
    return Status::Ok();
  }
  return CheckBlock(b, magic, addr, sb_.uuid, what);
}

uint8_t* VolumeImpl::Dirty(uint64_t addr) {
  txn_.insert(addr);
  txn_changes_++;
  return cache_.at(addr).data.get();
}

uint8_t* VolumeImpl::Fresh(uint64_t addr, LockId owner, uint32_t magic, uint32_t flags) {
  BlockBuf b = NewBlockBuf();
  std::memset(b.get(), 0, kBlockSize);
  SealBlock(b.get(), BlockHeader{magic, kFormatMajor, kFormatMinor, flags, 0, addr}, sb_.uuid);
  uint8_t* p = b.get();
  cache_[addr] = Cached{std::move(b), owner};
  txn_.insert(addr);
  txn_changes_++;
  return p;
}

size_t VolumeImpl::MaxTxnBlocks() const {
  return std::min<size_t>(kMaxTxnBlocks, sb_.JournalRingBlocks() / 2 - 1);
}

Status VolumeImpl::EnsureJournalRoom(size_t blocks) {
  // More than one transaction holds would overflow it at the commit (and
  // poison the volume); refuse before anything changes.
  if (blocks > MaxTxnBlocks()) {
    return Status::Invalid("an operation needs " + std::to_string(blocks) +
                           " metadata blocks in one transaction; this volume's journal holds " +
                           std::to_string(MaxTxnBlocks()));
  }
  if (txn_.size() + blocks > MaxTxnBlocks()) RETURN_IF_ERROR(Commit(/*durable=*/false));
  if (journal_->free_blocks() < MaxTxnBlocks() + 1) RETURN_IF_ERROR(Checkpoint());
  return Status::Ok();
}

Status VolumeImpl::EnsureRoom(size_t blocks, bool may_wait) {
  RETURN_IF_ERROR(EnsureJournalRoom(blocks));
  if (sb_.drop_blocks == 0 || DropRoom() >= blocks) return Status::Ok();
  // The list is (nearly) full: apply what we can without waiting, then,
  // as a last resort, wait for the groups (holding no cached lock).
  RETURN_IF_ERROR(DrainDrops(Drain::kNow));
  if (DropRoom() < blocks && !may_wait) {
    return Status::Locked("the drop list is full and cannot be drained without waiting");
  }
  if (DropRoom() < blocks) RETURN_IF_ERROR(DrainDrops(Drain::kWaiting));
  if (DropRoom() < blocks) {
    return Status::NoSpace("the drop list of host " + std::to_string(host_) + " is full");
  }
  return EnsureJournalRoom(blocks);
}

// A commit that is not `durable` skips the flush after the journal write:
// it only needs to be durable before a checkpoint writes its images home or
// a Sync() returns, and both flush first.
Status VolumeImpl::Commit(bool durable, bool data_flushed) {
  if (txn_.empty()) return Status::Ok();
  RETURN_IF_ERROR(poisoned_);
  // Data written through new pointers must be durable before the pointers.
  if (!data_flushed) RETURN_IF_ERROR(Poison(FlushHoldingMu()));
  std::vector<uint64_t> homes(txn_.begin(), txn_.end());
  std::vector<const uint8_t*> images;
  for (uint64_t a : homes) {
    uint8_t* b = cache_.at(a).data.get();
    BlockHeader h = PeekHeader(b);
    h.seq++;
    SealBlock(b, h, sb_.uuid);
    images.push_back(b);
  }
  if (homes.size() + 1 > journal_->free_blocks()) {
    return Poison(Status::NoSpace("journal overflow (internal error)"));
  }
  RETURN_IF_ERROR(Poison(journal_->Append(homes, images)));
  commits_++;
  dirty_.insert(homes.begin(), homes.end());
  txn_.clear();
  if (durable) {
    RETURN_IF_ERROR(Poison(FlushHoldingMu()));
    decref_uncommitted_.clear();  // the decrements survive a crash from here on
  }
  return Status::Ok();
}

Status VolumeImpl::FlushWithoutMu() NO_THREAD_SAFETY_ANALYSIS {
  // Released and taken again by hand: the caller's MutexLock still owns
  // mu_ when this returns.
  mu_.Unlock();
  Status st = dev_->Flush();
  mu_.Lock();
  unlocked_flushes_++;
  return st;
}

Status VolumeImpl::FlushHoldingMu() {
  // Real time, whatever clock the volume was given: this is what VM writes
  // waited.
  const auto start = std::chrono::steady_clock::now();
  Status st = dev_->Flush();
  held_flushes_++;
  held_flush_ns_ += static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
  return st;
}

Status VolumeImpl::Checkpoint() {
  if (read_only_ || !journal_) return Status::Ok();
  RETURN_IF_ERROR(Commit(/*durable=*/false));
  if (dirty_.empty()) {
    if (!pending_free_.empty()) {
      full_groups_.clear();
      full_until_ns_ = 0;
    }
    pending_free_.clear();
    return Status::Ok();
  }
  // The journal must be durable before any image goes home.
  RETURN_IF_ERROR(Poison(FlushHoldingMu()));
  decref_uncommitted_.clear();
  RETURN_IF_ERROR(WriteDirtyHome());
  RETURN_IF_ERROR(Poison(FlushHoldingMu()));
  return MoveJournalTail();
}

Status VolumeImpl::WriteDirtyHome() {
  // dirty_ is ordered: gather runs of adjacent blocks into single writes.
  BlockBuf run = NewBlockBuf(64);
  for (auto it = dirty_.begin(); it != dirty_.end();) {
    uint64_t first = *it;
    size_t n = 0;
    while (it != dirty_.end() && *it == first + n && n < 64) {
      std::memcpy(run.get() + n * kBlockSize, cache_.at(*it).data.get(), kBlockSize);
      ++it;
      ++n;
    }
    RETURN_IF_ERROR(Poison(dev_->Write(first * kBlockSize, run.get(), n * kBlockSize)));
  }
  return Status::Ok();
}

Status VolumeImpl::MoveJournalTail() {
  checkpoints_++;
  RETURN_IF_ERROR(Poison(journal_->Checkpoint()));
  RETURN_IF_ERROR(Poison(FlushHoldingMu()));
  RETURN_IF_ERROR(Poison(journal_->MirrorHeader()));
  dirty_.clear();
  if (!pending_free_.empty()) {  // freed blocks are usable now
    full_groups_.clear();
    full_until_ns_ = 0;
  }
  pending_free_.clear();
  return Status::Ok();
}

Status VolumeImpl::CheckpointQuietly(uint64_t commits_at_flush) {
  if (read_only_ || !journal_ || dirty_.empty()) return Status::Ok();
  // A transaction committed since the flush point's flush began may not be
  // durable; one under way has changed cached images of dirty_ blocks
  // that are not committed. Either way: not quiet any more.
  if (commits_ != commits_at_flush || !txn_.empty()) {
    quiet_checkpoints_deferred_++;
    return Status::Ok();
  }
  RETURN_IF_ERROR(WriteDirtyHome());
  const uint64_t changes = txn_changes_;
  RETURN_IF_ERROR(Poison(FlushWithoutMu()));
  // Committed meanwhile: the ring holds records whose images are not home
  // (the tail must not pass them). Changed meanwhile: the transaction
  // under way may have freed blocks (pending_free_) that the tail's move
  // would make usable before that transaction is committed.
  if (commits_ != commits_at_flush || txn_changes_ != changes || !txn_.empty()) {
    quiet_checkpoints_deferred_++;
    return Status::Ok();
  }
  // Another thread's checkpoint (a handover, a full journal) did it all.
  if (dirty_.empty()) return Status::Ok();
  quiet_checkpoints_++;
  return MoveJournalTail();
}

Status VolumeImpl::CheckpointReleasingMu() {
  if (read_only_ || !journal_) return Status::Ok();
  if (!txn_.empty()) {
    // As a flush point commits: the data under the transaction's new
    // pointers first; if the transaction changed meanwhile, Commit flushes
    // again, holding mu_.
    const uint64_t changes = txn_changes_;
    RETURN_IF_ERROR(Poison(FlushWithoutMu()));
    RETURN_IF_ERROR(Commit(/*durable=*/false, /*data_flushed=*/txn_changes_ == changes));
  }
  if (txn_.empty() && !dirty_.empty()) {
    const uint64_t commits = commits_;
    RETURN_IF_ERROR(Poison(FlushWithoutMu()));  // the journal, durable
    if (commits_ == commits && txn_.empty() && !dirty_.empty()) {
      RETURN_IF_ERROR(WriteDirtyHome());
      const uint64_t changes = txn_changes_;
      RETURN_IF_ERROR(Poison(FlushWithoutMu()));
      if (commits_ == commits && txn_changes_ == changes && txn_.empty() && !dirty_.empty()) {
        // Every decrement is committed (nothing changed since) and durable.
        decref_uncommitted_.clear();
        return MoveJournalTail();
      }
    }
  }
  // Nothing to write home, or metadata changed while mu_ was released:
  // the held checkpoint commits what is new and finishes (it writes home
  // again what may have been written already, which is harmless).
  return Checkpoint();
}

Status VolumeImpl::Sync() {
  MutexLock l(&mu_);
  if (read_only_) return Status::Ok();
  RETURN_IF_ERROR(poisoned_);
  if (clock_->MonotonicNanos() >= adopt_due_ns_) {
    // Housekeeping for other hosts' leftovers. Its failure (a host slot's
    // lease unreadable for a moment, a dead host's journal that does not
    // replay) is tried again when it is next due; it must neither fail
    // this flush point nor skip its device flush, which the writes before
    // it are waiting for (a client's FLUSH, an export's close before its
    // lock goes to another host). A failure that matters for this host's
    // own state poisoned the volume, which is checked next.
    Status adopted = AdoptOrphanDrops();
    if (!adopted.ok()) {
      LOG(kWarning) << "adopting the reference drops of hosts that left: " << adopted.ToString()
                    << " (tried again later)";
    }
    RETURN_IF_ERROR(poisoned_);
  }
  // Deferred drops are applied at flush points, in the same commit. One
  // that cannot be applied (its refcount block unreadable or failing its
  // check) stays in the list for a later flush point, or for fsck: like
  // the adoption above, it must neither fail this flush point nor skip
  // its device flush. Only a failure that poisoned the volume does.
  if (drop_count_ > 0) {
    Status drained = DrainDrops(Drain::kIfDue);
    RETURN_IF_ERROR(poisoned_);
    if (!drained.ok()) {
      NoteFlushPointFailure(&drain_failures_, drained,
                            "applying deferred reference drops (left in the drop list)");
    }
  }
  // A want announced for an increment held back (ApplyBlockOps no_wait)
  // is collected here: once its holder has handed the group over, take
  // it, which withdraws the announcement (NoteCached). Left standing until
  // the held-back work runs again (a dedup pass in the next window), it
  // would make the holder hand back every cached lock at each of its
  // flush points and leave the group unused (LeaveToOthers) meanwhile.
  if (!wanted_groups_.empty()) {
    const std::vector<uint32_t> wanted(wanted_groups_.begin(), wanted_groups_.end());
    for (uint32_t g : wanted) {
      if (cached_locks_.count(GroupLock(g)) || LooksBusy(g)) continue;
      Result<GroupTry> got = TryTakeGroup(g);
      if (!got.ok()) NoteBusy(g);  // tried again at a later flush point
    }
  }
  // The device flushes run without mu_ (FlushWithoutMu): held, every VM
  // write of the host waited behind each flush point's, 100-300 ms apiece
  // on a busy disk. What this flush point must make durable is what was
  // written or committed before it; changes made meanwhile are the next
  // one's.
  const bool quiet = txn_.empty();
  uint64_t commits_at_flush = 0;  // commits_ when the flush below began
  if (!quiet) {
    // The data under the transaction's new pointers first (WriteData
    // writes it before it publishes them); if the transaction changed while
    // the device flushed, Commit flushes again, holding mu_.
    const uint64_t changes = txn_changes_;
    RETURN_IF_ERROR(Poison(FlushWithoutMu()));
    RETURN_IF_ERROR(Commit(/*durable=*/false, /*data_flushed=*/txn_changes_ == changes));
  }
  {
    // In-place writes change no metadata but must be durable all the same
    // (and so must a commit EnsureRoom made without a flush, and the one
    // just above). txn_ is empty here: every decrement made so far is
    // committed, and durable once the flush is done.
    const uint64_t epoch = ++decref_epoch_;
    commits_at_flush = commits_;
    RETURN_IF_ERROR(Poison(FlushWithoutMu()));
    for (auto it = decref_uncommitted_.begin(); it != decref_uncommitted_.end();) {
      it = it->second < epoch ? decref_uncommitted_.erase(it) : std::next(it);
    }
  }
  if (quiet) {
    // Quiet (nothing committed at this flush point or the one before):
    // write the journal's images home. Other processes read the home
    // blocks of groups this one holds (dede stats, ls -l, fsck, another
    // host's Usage), and a host that goes idle holding its groups would
    // otherwise show them its state as of its last busy moment for as long
    // as it stays idle (a held group is checkpointed only when handed
    // over or when the journal fills). It also shortens the replay after
    // a crash. Busy hosts are not slowed: only quiet flush points do it.
    if (!dirty_.empty() && ++quiet_flush_points_ >= 2) {
      RETURN_IF_ERROR(CheckpointQuietly(commits_at_flush));
      quiet_flush_points_ = 0;
    }
  } else {
    quiet_flush_points_ = 0;
  }
  // Journal space is reclaimed on demand (EnsureRoom); a flush point is
  // where we hand cached locks to processes that announced they wait: all
  // of them, not only the wanted ones. (Handing back only the wanted ones
  // was tried: in the three-host cross-dedup test a host then kept groups
  // that others took without announcing, and merge requests stayed
  // unapplied; see docs/LOCKING.md rule 4.) What is pinned stays: a
  // Create between its scan and its claim keeps the namespace (it hands it
  // back itself when done), and a group with a write's reservations goes
  // at a later flush point.
  //
  // The writes before this flush point are durable by now: a failure to
  // hand locks over (a lock-table read or release that failed) must not
  // fail it, or a client's FLUSH would report its durable writes lost.
  // The hand-over is tried again at the next flush point; what poisoned
  // the volume is still reported.
  bool wanted = false;
  Status handover;
  for (const LockId& id : cached_locks_) {
    if (Pinned(id)) continue;
    Result<bool> w = locks_->IsHeldElsewhere(WantedLock(id));
    if (!w.ok()) {
      handover = w.status();
      break;
    }
    if (*w) {
      wanted = true;
      break;
    }
  }
  if (wanted) handover = ReleaseCached(Pin::kKeep);
  RETURN_IF_ERROR(poisoned_);
  if (!handover.ok()) {
    NoteFlushPointFailure(&handover_failures_, handover,
                          "handing cached locks to processes that wait for them");
  }
  return Status::Ok();
}

void VolumeImpl::NoteFlushPointFailure(FlushPointFailures* f, const Status& st, const char* what) {
  const uint64_t now = clock_->MonotonicNanos();
  f->count++;
  if (f->count == 1 || now - f->warned_ns >= kFlushPointWarnIntervalNs) {
    LOG(kWarning) << what << ": " << st.ToString() << " (tried again at a later flush point; "
                  << f->count << " such failures since open)";
    f->warned_ns = now;
  }
}

void VolumeImpl::DropCache(LockId owner) {
  for (auto it = cache_.begin(); it != cache_.end();) {
    if (it->second.owner == owner && !txn_.count(it->first) && !dirty_.count(it->first)) {
      it = cache_.erase(it);
    } else {
      ++it;
    }
  }
}

bool VolumeImpl::IsOpenHere(const std::string& name) {
  Result<FileInfo> info = Lookup(name);
  if (!info.ok()) return false;
  MutexLock l(&mu_);
  auto it = open_.find(info->id.ino);
  return it != open_.end() && it->second->id == info->id;
}

Status VolumeImpl::AnnounceOpenWait(FileId id, bool on) {
  const LockId want = WantedLock(InodeLock(id.ino));
  return on ? locks_->Acquire(want, LockMode::kShared, false) : locks_->Release(want);
}

Result<bool> VolumeImpl::FileWantedElsewhere(uint64_t ino) {
  return locks_->IsHeldElsewhere(WantedLock(InodeLock(ino)));
}

LockId VolumeImpl::WantedLock(LockId id) {
  return LockId{LockKind::kWanted, (uint64_t{static_cast<uint16_t>(id.kind)} << 40) | id.id};
}

LockId VolumeImpl::WaitingLock(LockId id) {
  return LockId{LockKind::kWaiting, (uint64_t{static_cast<uint16_t>(id.kind)} << 40) | id.id};
}

Status VolumeImpl::WaitLock(LockId id) {
  // Announce the wait (shared, so any number of waiters can): the holder
  // caches the lock and gives it back at its next flush point when it sees
  // the announcement. Do not wait forever for a holder that went idle.
  // kWaiting says a thread is blocked here: even hosts that announced a
  // want of their own (deferred drops, which can wait) leave the lock to
  // us (LeaveToOthers).
  LockId want = WantedLock(id);
  LockId blocked = WaitingLock(id);
  // Processes that were blocked before us get the first tries for a while:
  // with no queue on the disk, whoever looks first after a hand-over wins,
  // and a waiter that has backed off would lose to every newcomer.
  Result<bool> earlier = locks_->IsHeldElsewhere(blocked);
  const auto start = std::chrono::steady_clock::now();
  const auto defer_until =
      start + ((earlier.ok() && *earlier) ? kDeferToEarlierWaiters : std::chrono::milliseconds(0));
  // A group we announced already (wanted_groups_) keeps that announcement:
  // releasing ours here would withdraw it (one kWanted per process);
  // NoteCached withdraws it once the group is ours.
  const bool standing =
      id.kind == LockKind::kGroup && wanted_groups_.count(static_cast<uint32_t>(id.id)) > 0;
  bool announced = !standing && locks_->Acquire(want, LockMode::kShared, false).ok();
  bool blocked_announced = locks_->Acquire(blocked, LockMode::kShared, false).ok();
  LockWatch watch;
  watch.deadline = start + lock_wait_;
  watch.first_try = defer_until;
  Status st = WatchAndTake(locks_.get(), id, LockMode::kExclusive, &watch);
  if (st.code() == Status::Code::kLocked) {
    st = Status::Locked(id.ToString() + " is still held by another process or host after " +
                        std::to_string(lock_wait_.count()) + " s (" +
                        std::to_string(watch.tries) + " tries to take it, " +
                        std::to_string(watch.seen_free) + " looks found it free)");
  }
  if (announced) (void)locks_->Release(want);
  if (blocked_announced) (void)locks_->Release(blocked);
  const auto waited = std::chrono::steady_clock::now() - start;
  lock_waits_++;
  lock_wait_ns_ += static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count());
  if (st.code() == Status::Code::kLocked) lock_wait_timeouts_++;
  // Which lock a long wait was for (wait_counters() only counts them): an
  // operator, or the multihost bench, can tell an allocation's wait for a
  // group from a create's wait for the namespace.
  if (waited >= kLogWaitsFrom) {
    LOG(kInfo) << "volume: waited "
               << std::chrono::duration_cast<std::chrono::milliseconds>(waited).count()
               << " ms for " << id.ToString() << " held by another process or host"
               << (st.ok() ? "" : " (" + st.ToString() + ")");
  }
  return st;
}

void VolumeImpl::NoteCached(LockId id) {
  cached_locks_.insert(id);
  if (id.kind == LockKind::kGroup && wanted_groups_.erase(static_cast<uint32_t>(id.id))) {
    (void)locks_->Release(WantedLock(id));
  }
}

void VolumeImpl::AnnounceWant(uint32_t g) {
  if (!wanted_groups_.count(g) &&
      locks_->Acquire(WantedLock(GroupLock(g)), LockMode::kShared, false).ok()) {
    wanted_groups_.insert(g);
  }
}

Status VolumeImpl::ReleaseCachedLock(LockId id) {
  if (!cached_locks_.count(id)) return Status::Ok();
  const std::vector<LockId> one{id};
  RETURN_IF_ERROR(MaterializeReservations(&one));
  RETURN_IF_ERROR(Checkpoint());
  return ForgetCachedLock(id);
}

Status VolumeImpl::ForgetCachedLock(LockId id, bool unclean) {
  if (id.kind == LockKind::kGroup && GroupPinned(static_cast<uint32_t>(id.id))) {
    return Status::Corruption("internal error: " + id.ToString() +
                              " would be released with blocks reserved in it");
  }
  // Whoever takes it next reads the blocks from their home addresses (the
  // caller checkpointed).
  DropCache(id);
  cached_locks_.erase(id);
  if (id == kNamespaceLock) namespace_releases_++;
  if (id.kind == LockKind::kGroup) {
    alloc_cursor_.erase(static_cast<uint32_t>(id.id));
    full_groups_.erase(static_cast<uint32_t>(id.id));
  }
  return unclean ? locks_->ReleaseUnclean(id) : locks_->Release(id);
}

Status VolumeImpl::ReleaseCached(Pin pin) {
  if (cached_locks_.empty()) return Status::Ok();
  if (pin == Pin::kMaterialize) RETURN_IF_ERROR(MaterializeReservations(nullptr));
  RETURN_IF_ERROR(Checkpoint());
  const std::vector<LockId> ids(cached_locks_.begin(), cached_locks_.end());
  Status released;
  for (const LockId& id : ids) {
    if (pin == Pin::kKeep && Pinned(id)) continue;
    Status st = ForgetCachedLock(id);
    if (released.ok()) released = st;
  }
  return released;
}

// ============================================================ reservations

bool VolumeImpl::GroupPinned(uint32_t g) const {
  auto it = pins_.find(g);
  return it != pins_.end() && it->second > 0;
}

bool VolumeImpl::Pinned(const LockId& id) const {
  return (id == kNamespaceLock && namespace_pins_ > 0) ||
         (id.kind == LockKind::kGroup && GroupPinned(static_cast<uint32_t>(id.id)));
}

Status VolumeImpl::MaterializeReservations(const std::vector<LockId>* ids) {
  if (pins_.empty()) return Status::Ok();
  auto wanted = [&](uint32_t g) {
    return ids == nullptr || std::find(ids->begin(), ids->end(), GroupLock(g)) != ids->end();
  };
  // Room first (it may commit): one refcount block per distinct block of
  // counts touched, usually one or two per write in flight.
  std::set<uint64_t> rbs;
  for (const auto& [addr, materialized] : reserved_) {
    uint32_t g, slot;
    uint64_t rb;
    if (!materialized && sb_.LocateData(addr, &g, &rb, &slot) && wanted(g)) rbs.insert(rb);
  }
  if (rbs.empty()) return Status::Ok();
  RETURN_IF_ERROR(EnsureJournalRoom(std::min(rbs.size(), MaxTxnBlocks())));
  for (auto& [addr, materialized] : reserved_) {
    uint32_t g, slot;
    uint64_t rb;
    if (materialized || !sb_.LocateData(addr, &g, &rb, &slot) || !wanted(g)) continue;
    // Scattered reservations may touch more refcount blocks than one
    // transaction holds: each count dirties at most one.
    RETURN_IF_ERROR(EnsureJournalRoom(1));
    RETURN_IF_ERROR(CountReserved(addr, g, rb, slot));
    materialized = true;
    reservations_materialized_++;
  }
  return Status::Ok();
}

Status VolumeImpl::ClaimReservation(uint64_t addr) {
  auto it = reserved_.find(addr);
  if (it == reserved_.end()) {
    return Status::Corruption("internal error: block " + std::to_string(addr) +
                              " is not reserved");
  }
  if (!it->second) {
    uint32_t g, slot;
    uint64_t rb;
    RETURN_IF_ERROR(LocateRef(addr, &g, &rb, &slot));
    RETURN_IF_ERROR(CountReserved(addr, g, rb, slot));
  }
  reserved_.erase(it);
  return Status::Ok();
}

Status VolumeImpl::CountReserved(uint64_t addr, uint32_t g, uint64_t rb, uint32_t slot) {
  uint8_t* b;
  RETURN_IF_ERROR(Load(rb, GroupLock(g), kMagicRefcountBlock, "refcount block", &b));
  if (dede::GetRef(b, slot) != 0) {
    return Poison(Status::Corruption("internal error: reserved block " + std::to_string(addr) +
                                     " has refcount " + std::to_string(dede::GetRef(b, slot))));
  }
  dede::SetRef(Dirty(rb), slot, 1);
  UnpinGroup(g);
  return Status::Ok();
}

void VolumeImpl::UnpinGroup(uint32_t g) {
  if (--pins_[g] == 0) pins_.erase(g);
}

Status VolumeImpl::CancelReservation(uint64_t addr) {
  auto it = reserved_.find(addr);
  if (it == reserved_.end()) return Status::Ok();
  const bool materialized = it->second;
  reserved_.erase(it);
  if (materialized) return DropUnpublished(addr);
  uint32_t g;
  if (GroupOf(addr, &g)) {
    UnpinGroup(g);
    full_groups_.erase(g);  // the block is free again
  }
  return Status::Ok();
}

Status VolumeImpl::AcquireCached(LockId id) {
  if (cached_locks_.count(id)) return Status::Ok();
  Status st = locks_->Acquire(id, LockMode::kExclusive, false);
  if (st.code() == Status::Code::kLocked) {
    // Never wait while holding cached locks (deadlock): give them all back.
    RETURN_IF_ERROR(ReleaseCached());
    st = WaitLock(id);
  }
  RETURN_IF_ERROR(st);
  NoteCached(id);
  return ScanForTaken({id});
}

Status VolumeImpl::AcquireGroupsFor(const std::vector<uint64_t>& addrs) {
  std::set<uint32_t> need;
  for (uint64_t a : addrs) {
    uint32_t g;
    if (a != 0 && GroupOf(a, &g) && !cached_locks_.count(GroupLock(g))) need.insert(g);
  }
  // Taken by this call: none is used before the dead-host scan, and all go
  // back if a later step fails (ScanForTaken).
  std::vector<LockId> taken;
  for (uint32_t g : need) {
    // A free group is taken even when others announced a wait for it (no
    // LeaveToOthers here): these takes have no other way out, and joining
    // the waiters would make a pass wait with its files locked. The
    // waiters get it at our next flush point.
    Status st = locks_->Acquire(GroupLock(g), LockMode::kExclusive, false);
    if (st.code() == Status::Code::kLocked) {
      // Wait in group order holding no other cached lock. Those just taken
      // go back uncleanly, not scanned yet (ForgetTaken: a clean release,
      // as ReleaseCached makes, would erase a replaced dead holder's
      // record, and its next taker would skip the dead-host scan).
      ForgetTaken(taken);
      taken.clear();
      RETURN_IF_ERROR(ReleaseCached());
      for (uint64_t a : addrs) {
        uint32_t gg;
        if (a != 0 && GroupOf(a, &gg)) need.insert(gg);
      }
      for (uint32_t w : need) {
        if (Status wst = WaitLock(GroupLock(w)); !wst.ok()) {
          ForgetTaken(taken);
          return wst;
        }
        NoteCached(GroupLock(w));
        taken.push_back(GroupLock(w));
      }
      return ScanForTaken(taken);
    }
    if (!st.ok()) {
      ForgetTaken(taken);
      return st;
    }
    NoteCached(GroupLock(g));
    taken.push_back(GroupLock(g));
  }
  if (taken.empty()) return Status::Ok();
  return ScanForTaken(taken);
}

Status VolumeImpl::AcquireGroupOf(uint64_t addr) {
  uint32_t g;
  if (addr != 0 && GroupOf(addr, &g) && cached_locks_.count(GroupLock(g))) return Status::Ok();
  return AcquireGroupsFor({addr});
}

// =============================================================== refcounts

Status VolumeImpl::LocateRef(uint64_t addr, uint32_t* g, uint64_t* rb, uint32_t* slot) const {
  if (sb_.LocateData(addr, g, rb, slot)) return Status::Ok();
  return Status::Corruption("block pointer " + std::to_string(addr) +
                            " is outside the data area");
}

Result<uint32_t> VolumeImpl::GetRef(uint64_t addr) {
  uint32_t g, slot;
  uint64_t rb;
  RETURN_IF_ERROR(LocateRef(addr, &g, &rb, &slot));
  // Readers (ls -l, stats) must not stall a daemon that holds the group.
  if (read_only_) return PeekRef(addr);
  RETURN_IF_ERROR(AcquireGroupOf(addr));
  uint8_t* b;
  RETURN_IF_ERROR(Load(rb, GroupLock(g), kMagicRefcountBlock, "refcount block", &b));
  return dede::GetRef(b, slot);
}

Result<uint32_t> VolumeImpl::PeekRef(uint64_t addr,
                                     std::unordered_map<uint64_t, BlockBuf>* read_home) {
  uint32_t g, slot;
  uint64_t rb;
  RETURN_IF_ERROR(LocateRef(addr, &g, &rb, &slot));
  const LockId gl = GroupLock(g);
  if (!read_only_ && !LooksBusy(g)) {
    ASSIGN_OR_RETURN(GroupTry got, TryTakeGroup(g));
    (void)got;  // cached_locks_ says
  }
  if (!read_only_ && cached_locks_.count(gl)) {
    uint8_t* b;
    RETURN_IF_ERROR(Load(rb, gl, kMagicRefcountBlock, "refcount block", &b));
    return dede::GetRef(b, slot);
  }
  // Held elsewhere: the count as its holder last wrote it home. The holder
  // may be writing that block right now; a read that does not check is
  // read again, and after a few tries we wait for the group after all.
  if (read_home != nullptr) {
    auto it = read_home->find(rb);
    if (it != read_home->end()) return dede::GetRef(it->second.get(), slot);
  }
  BlockBuf b = NewBlockBuf();
  Status st;
  for (int attempt = 0; attempt < 3; attempt++) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    RETURN_IF_ERROR(dev_->Read(rb * kBlockSize, b.get(), kBlockSize));
    st = Admit(b.get(), rb, kMagicRefcountBlock, "refcount block");
    if (st.ok()) {
      const uint32_t refs = dede::GetRef(b.get(), slot);
      if (read_home != nullptr) {
        if (read_home->size() >= 4096) read_home->clear();  // at most 16 MiB
        (*read_home)[rb] = std::move(b);
      }
      return refs;
    }
  }
  if (read_only_) return st;
  return GetRef(addr);
}

Status VolumeImpl::LoadRefOf(uint64_t addr, uint8_t** b, uint64_t* rb, uint32_t* slot) {
  uint32_t g;
  RETURN_IF_ERROR(LocateRef(addr, &g, rb, slot));
  RETURN_IF_ERROR(AcquireGroupOf(addr));
  return Load(*rb, GroupLock(g), kMagicRefcountBlock, "refcount block", b);
}

Result<bool> VolumeImpl::RefSaturated(uint64_t addr) {
  uint8_t* b;
  uint64_t rb;
  uint32_t slot;
  RETURN_IF_ERROR(LoadRefOf(addr, &b, &rb, &slot));
  return dede::GetRef(b, slot) == UINT32_MAX;
}

Status VolumeImpl::RefusedIfSaturated(uint64_t addr, const char* what) {
  ASSIGN_OR_RETURN(const bool saturated, RefSaturated(addr));
  if (!saturated) return Status::Ok();
  return Status::Mismatch(std::string(what) + ": block " + std::to_string(addr) +
                          " has the most references a count holds");
}

Status VolumeImpl::AddRef(uint64_t addr, int delta) {
  uint8_t* b;
  uint64_t rb;
  uint32_t slot;
  RETURN_IF_ERROR(LoadRefOf(addr, &b, &rb, &slot));
  uint32_t r = dede::GetRef(b, slot);
  if (delta < 0 && r == 0) {
    return Status::Corruption("refcount of block " + std::to_string(addr) + " would go negative");
  }
  if (delta > 0 && r == UINT32_MAX) {
    return Status::NoSpace("refcount of block " + std::to_string(addr) + " is saturated");
  }
  r = delta > 0 ? r + 1 : r - 1;
  dede::SetRef(Dirty(rb), slot, r);
  if (delta < 0) {
    decref_uncommitted_[addr] = decref_epoch_;
    if (r == 0) pending_free_.insert(addr);
  }
  return Status::Ok();
}

// ============================================================ deferred drops

size_t VolumeImpl::DropRoom() const {
  return size_t{sb_.drop_blocks} * kDropsPerBlock - drop_count_;
}

Result<std::vector<std::vector<uint64_t>>> VolumeImpl::ReadDropList(uint32_t h, BlockBuf* raw) const {
  const uint64_t start = sb_.DropListStart(h);
  BlockBuf all = NewBlockBuf(sb_.drop_blocks);
  RETURN_IF_ERROR(dev_->Read(start * kBlockSize, all.get(), uint64_t{sb_.drop_blocks} * kBlockSize));
  std::vector<std::vector<uint64_t>> lists(sb_.drop_blocks);
  for (uint32_t i = 0; i < sb_.drop_blocks; i++) {
    ASSIGN_OR_RETURN(lists[i],
                     DecodeDropListBlock(all.get() + uint64_t{i} * kBlockSize, sb_, h, start + i));
  }
  if (raw) *raw = std::move(all);
  return lists;
}

Status VolumeImpl::LoadDropList() {
  drop_list_.assign(sb_.drop_blocks, {});
  drop_count_ = 0;
  if (sb_.drop_blocks == 0) return Status::Ok();
  BlockBuf all;
  Result<std::vector<std::vector<uint64_t>>> lists = ReadDropList(host_, &all);
  if (!lists.ok()) {
    return lists.status().WithContext("the drop list of host " + std::to_string(host_) +
                                      " (dede fsck --repair clears it)");
  }
  drop_list_ = std::move(lists.value());
  const uint64_t start = sb_.DropListStart(host_);
  for (uint32_t i = 0; i < sb_.drop_blocks; i++) {
    drop_count_ += drop_list_[i].size();
    BlockBuf b = NewBlockBuf();
    std::memcpy(b.get(), all.get() + uint64_t{i} * kBlockSize, kBlockSize);
    RETURN_IF_ERROR(Admit(b.get(), start + i, kMagicDropList, "drop list block"));
    cache_[start + i] = Cached{std::move(b), LockId{LockKind::kHostSlot, host_}};
  }
  return Status::Ok();
}

Status VolumeImpl::StoreDropBlock(size_t i) {
  const uint64_t addr = sb_.DropListStart(host_) + i;
  uint8_t* b;
  RETURN_IF_ERROR(Load(addr, LockId{LockKind::kHostSlot, host_}, kMagicDropList,
                       "drop list block", &b));
  EncodeDropListBlock(drop_list_[i], host_, PeekHeader(b).seq, sb_.uuid, addr, Dirty(addr));
  return Status::Ok();
}

bool VolumeImpl::GroupOf(uint64_t addr, uint32_t* g) const {
  uint32_t slot;
  uint64_t rb;
  return sb_.LocateData(addr, g, &rb, &slot);
}

bool VolumeImpl::GroupHeld(uint64_t addr) const {
  uint32_t g;
  return GroupOf(addr, &g) && cached_locks_.count(GroupLock(g)) > 0;
}

bool VolumeImpl::LooksBusy(uint32_t g) {
  auto it = busy_until_.find(g);
  return it != busy_until_.end() && clock_->MonotonicNanos() < it->second;
}

void VolumeImpl::NoteBusy(uint32_t g) {
  busy_until_[g] = clock_->MonotonicNanos() + 100'000'000;
}

Status VolumeImpl::PrepareDrop(uint64_t addr) {
  uint32_t g;
  if (addr == 0 || (GroupOf(addr, &g) && cached_locks_.count(GroupLock(g)))) return Status::Ok();
  return PrepareDrops({addr});
}

Status VolumeImpl::PrepareDrops(const std::vector<uint64_t>& addrs) {
  if (sb_.drop_blocks == 0) return AcquireGroupsFor(addrs);
  for (uint64_t a : addrs) {
    uint32_t g;
    if (a == 0 || !GroupOf(a, &g) || LooksBusy(g)) continue;
    // Busy: DropRef defers the drop.
    ASSIGN_OR_RETURN(GroupTry got, TryTakeGroup(g));
    (void)got;
  }
  return Status::Ok();
}

Result<bool> VolumeImpl::LeaveToOthers(uint32_t g) {
  const LockId gl = GroupLock(g);
  // Someone announced a wait: its holder handed the group back for them
  // at its flush point. Taking it first would starve them (our own writes
  // take home groups again within microseconds, a waiter polls every few
  // ms), so leave it. Hosts that announced a want of their own (deferred
  // drops) do not leave it to each other, or two of them would each wait
  // for ever; they do leave it to a process blocked waiting (kWaiting),
  // or two such hosts could pass it between them while the blocked one
  // runs out of time.
  if (wanted_groups_.count(g)) return locks_->IsHeldElsewhere(WaitingLock(gl));
  return locks_->IsHeldElsewhere(WantedLock(gl));
}

Result<VolumeImpl::GroupTry> VolumeImpl::TryTakeGroup(uint32_t g) {
  const LockId gl = GroupLock(g);
  if (cached_locks_.count(gl)) return GroupTry::kTaken;
  ASSIGN_OR_RETURN(bool leave, LeaveToOthers(g));
  if (leave) {
    groups_yielded_++;
    NoteBusy(g);
    return GroupTry::kBusy;
  }
  Status st = locks_->Acquire(gl, LockMode::kExclusive, false);
  if (st.code() == Status::Code::kLocked) {
    NoteBusy(g);
    return GroupTry::kBusy;
  }
  RETURN_IF_ERROR(st);
  NoteCached(gl);
  busy_until_.erase(g);
  RETURN_IF_ERROR(ScanForTaken({gl}));
  return GroupTry::kTaken;
}

Status VolumeImpl::DropRef(uint64_t addr) {
  uint32_t g;
  if (!GroupOf(addr, &g)) {
    return Status::Corruption("block pointer " + std::to_string(addr) +
                              " is outside the data area");
  }
  if (sb_.drop_blocks == 0 || cached_locks_.count(GroupLock(g))) return AddRef(addr, -1);
  for (size_t i = 0; i < drop_list_.size(); i++) {
    if (drop_list_[i].size() >= kDropsPerBlock) continue;
    drop_list_[i].push_back(addr);
    drop_count_++;
    drops_deferred_++;
    return Poison(StoreDropBlock(i));
  }
  // EnsureRoom keeps room for every drop an operation makes.
  return Poison(Status::NoSpace("the drop list of host " + std::to_string(host_) +
                                " is full (internal error)"));
}

Status VolumeImpl::DropUnpublished(uint64_t addr) {
  uint32_t g;
  if (GroupOf(addr, &g) && !cached_locks_.count(GroupLock(g))) {
    // Never waits: a failed write's error path must not start a wait of
    // its own (it often comes from one that timed out). Without drop
    // lists DropRef would wait for the group: only a free one is taken.
    if (sb_.drop_blocks != 0) {
      (void)PrepareDrop(addr);
    } else if (!LooksBusy(g)) {
      (void)TryTakeGroup(g);
    }
    if (!cached_locks_.count(GroupLock(g)) && (sb_.drop_blocks == 0 || DropRoom() == 0)) {
      // DropRef would overflow the list, which poisons the volume (every
      // later write of the host fails) for want of one block's space, or
      // (no drop lists) wait for the group. Left counted with no
      // reference, the block is a leak: fsck --repair frees it.
      blocks_leaked_++;
      LOG(kWarning) << "volume: block " << addr << " of a failed write could not be given back"
                    << " (its group held elsewhere, "
                    << (sb_.drop_blocks == 0
                            ? std::string("the volume has no drop lists")
                            : "the drop list of host " + std::to_string(host_) + " full")
                    << "); left allocated until fsck --repair frees it";
      return Status::Ok();
    }
  }
  return DropRef(addr);
}

Status VolumeImpl::DrainDrops(Drain how) {
  if (drop_count_ == 0 || read_only_) return Status::Ok();
  RETURN_IF_ERROR(poisoned_);
  const bool wait = how == Drain::kWaiting;
  // Rule 3: never wait holding cached locks.
  if (wait) RETURN_IF_ERROR(ReleaseCached());
  std::map<uint32_t, std::vector<uint64_t>> by_group;
  for (const auto& blk : drop_list_) {
    for (uint64_t a : blk) {
      uint32_t g;
      if (GroupOf(a, &g)) by_group[g].push_back(a);
    }
  }
  // Held elsewhere: ask the holder to hand the group back at its next
  // flush point (AnnounceWant); we look again at ours. Nobody waits.
  Status left;  // kIfDue: the first drop left for a later flush point
  for (const auto& [g, addrs] : by_group) {
    const LockId gl = GroupLock(g);
    // At a flush point, a group found busy (or whose drops failed) lately
    // is not tried again yet: each try costs a client's FLUSH lock-table
    // I/O, or a read that fails again.
    if (how == Drain::kIfDue && LooksBusy(g)) {
      if (!cached_locks_.count(gl)) AnnounceWant(g);
      continue;
    }
    if (!cached_locks_.count(gl)) {
      if (wait) {
        RETURN_IF_ERROR(WaitLock(gl));
        NoteCached(gl);
        busy_until_.erase(g);
        RETURN_IF_ERROR(ScanForTaken({gl}));
      } else {
        Result<GroupTry> got = TryTakeGroup(g);
        if (!got.ok() || *got == GroupTry::kBusy) {
          // Any failure to get the lock is retried later too: a flush
          // must not fail for a drop that can wait.
          if (!got.ok()) NoteBusy(g);
          AnnounceWant(g);
          continue;
        }
      }
    }
    for (uint64_t a : addrs) {
      RETURN_IF_ERROR(EnsureJournalRoom(2));
      if (Status st = AddRef(a, -1); !st.ok()) {
        // AddRef changed nothing; the drops applied before it are whole
        // (each decrement with its entry's removal, in one transaction).
        if (how != Drain::kIfDue || !poisoned_.ok()) return st;
        NoteBusy(g);
        if (left.ok()) left = st.WithContext("the drop of block " + std::to_string(a));
        break;
      }
      for (size_t i = 0; i < drop_list_.size(); i++) {
        auto it = std::find(drop_list_[i].begin(), drop_list_[i].end(), a);
        if (it == drop_list_[i].end()) continue;
        drop_list_[i].erase(it);
        drop_count_--;
        drops_applied_++;
        RETURN_IF_ERROR(Poison(StoreDropBlock(i)));
        break;
      }
    }
    if (wait) {
      // Not held through the wait for the next group: nothing of ours
      // reaches a flush point meanwhile to hand it over.
      RETURN_IF_ERROR(Checkpoint());
      RETURN_IF_ERROR(ForgetCachedLock(gl));
    }
  }
  return left;
}

Result<uint32_t> VolumeImpl::ReadGroupRefBlocks(uint32_t g, BlockBuf* buf) const {
  // One read per group (32 refcount blocks, 127 MiB of data area, in a full
  // one) instead of one per 4 MiB: 264,000 round trips for 1 TiB otherwise.
  if (!*buf) *buf = NewBlockBuf(sb_.group_refblocks);
  const uint32_t n = sb_.GroupRefBlocks(g);
  RETURN_IF_ERROR(dev_->Read(sb_.GroupStart(g) * kBlockSize, buf->get(), uint64_t{n} * kBlockSize));
  return n;
}

Status VolumeImpl::PrefetchGroup(uint32_t g) {
  uint64_t first = sb_.GroupStart(g);
  uint32_t n = sb_.GroupRefBlocks(g);
  bool all_cached = true;
  for (uint32_t r = 0; r < n && all_cached; r++) all_cached = cache_.count(first + r) > 0;
  if (all_cached) return Status::Ok();
  BlockBuf buf;
  RETURN_IF_ERROR(ReadGroupRefBlocks(g, &buf).status());
  for (uint32_t r = 0; r < n; r++) {
    uint64_t addr = first + r;
    if (cache_.count(addr)) continue;
    BlockBuf b = NewBlockBuf();
    std::memcpy(b.get(), buf.get() + uint64_t{r} * kBlockSize, kBlockSize);
    RETURN_IF_ERROR(Admit(b.get(), addr, kMagicRefcountBlock, "refcount block"));
    cache_[addr] = Cached{std::move(b), GroupLock(g)};
  }
  return Status::Ok();
}

void VolumeImpl::TakeBlock(uint64_t addr, uint64_t rb, uint32_t slot, bool reserve) {
  if (reserve) {
    uint32_t g;
    if (GroupOf(addr, &g)) pins_[g]++;
    reserved_[addr] = false;
  } else {
    dede::SetRef(Dirty(rb), slot, 1);
  }
}

Status VolumeImpl::UndoAllocate(std::vector<uint64_t>* out, bool reserve) {
  for (uint64_t a : *out) RETURN_IF_ERROR(reserve ? CancelReservation(a) : AddRef(a, -1));
  out->clear();
  return Status::Ok();
}

Status VolumeImpl::AllocateFromGroup(uint32_t g, size_t n, bool meta, bool reserve,
                                     std::vector<uint64_t>* out) {
  if (full_groups_.count(g)) return Status::Ok();
  RETURN_IF_ERROR(PrefetchGroup(g));
  const uint64_t data_start = sb_.GroupDataStart(g);
  const uint64_t count = sb_.GroupDataBlocks(g);
  // Data fills the group upwards from a next-fit cursor; block-map blocks
  // come from the top downwards, so they do not split runs of file data.
  GroupCursor& gc = alloc_cursor_[g];
  const uint64_t start = meta ? gc.meta : gc.data;
  for (uint64_t scanned = 0; scanned < count && out->size() < n; scanned++) {
    uint64_t idx = meta ? (start + count - scanned) % count : (start + scanned) % count;
    uint64_t addr = data_start + idx;
    uint64_t rb = sb_.GroupStart(g) + idx / kRefsPerBlock;
    uint32_t slot = static_cast<uint32_t>(idx % kRefsPerBlock);
    if (dede::GetRef(cache_.at(rb).data.get(), slot) != 0 || pending_free_.count(addr) ||
        (!reserved_.empty() && reserved_.count(addr))) {
      continue;
    }
    TakeBlock(addr, rb, slot, reserve);
    out->push_back(addr);
    if (meta) {
      gc.meta = (idx + count - 1) % count;
    } else {
      gc.data = (idx + 1) % count;
    }
  }
  if (out->size() < n) full_groups_.insert(g);  // until blocks are freed here
  return Status::Ok();
}

int64_t VolumeImpl::DataOrdinal(uint64_t addr) const {
  uint32_t g, slot;
  uint64_t rb;
  if (!sb_.LocateData(addr, &g, &rb, &slot)) return -1;
  const uint64_t per_group = uint64_t{sb_.group_refblocks} * kRefsPerBlock;
  return static_cast<int64_t>(uint64_t{g} * per_group + (addr - sb_.GroupDataStart(g)));
}

uint64_t VolumeImpl::DataBlockAt(int64_t ordinal) const {
  if (ordinal < 0) return 0;
  const uint64_t per_group = uint64_t{sb_.group_refblocks} * kRefsPerBlock;
  const uint64_t g = static_cast<uint64_t>(ordinal) / per_group;
  const uint64_t idx = static_cast<uint64_t>(ordinal) % per_group;
  if (g >= sb_.group_count || idx >= sb_.GroupDataBlocks(static_cast<uint32_t>(g))) return 0;
  return sb_.GroupDataStart(static_cast<uint32_t>(g)) + idx;
}

bool VolumeImpl::DataBlockFree(uint32_t g, uint64_t idx) const {
  const uint64_t rb = sb_.GroupStart(g) + idx / kRefsPerBlock;
  const uint32_t slot = static_cast<uint32_t>(idx % kRefsPerBlock);
  const uint64_t addr = sb_.GroupDataStart(g) + idx;
  return dede::GetRef(cache_.at(rb).data.get(), slot) == 0 && !pending_free_.count(addr) &&
         (reserved_.empty() || !reserved_.count(addr));
}

Status VolumeImpl::AllocateRunAt(uint32_t g, uint64_t idx, size_t n, bool reserve,
                                 std::vector<uint64_t>* out) {
  RETURN_IF_ERROR(PrefetchGroup(g));
  const uint64_t data_start = sb_.GroupDataStart(g);
  const uint64_t count = sb_.GroupDataBlocks(g);
  uint64_t taken = 0;
  for (uint64_t i = idx; i < count && out->size() < n; i++, taken++) {
    if (!DataBlockFree(g, i)) break;
    TakeBlock(data_start + i, sb_.GroupStart(g) + i / kRefsPerBlock,
              static_cast<uint32_t>(i % kRefsPerBlock), reserve);
    out->push_back(data_start + i);
  }
  if (taken > 0) {
    // The cursor moves past the run, so other allocations do not fill the
    // gaps a file's goals may still want (they go further on).
    GroupCursor& gc = alloc_cursor_[g];
    if (idx + taken > gc.data) gc.data = (idx + taken) % count;
  }
  return Status::Ok();
}

Status VolumeImpl::Allocate(size_t n, std::vector<uint64_t>* out, bool meta, AllocHint hint,
                            bool reserve) {
  reserve = reserve && !meta;
  Status st = AllocateOrFail(n, out, meta, hint, reserve);
  if (!st.ok() && !out->empty()) {
    // A failure after part of the run was taken (a wait for the next group
    // that timed out, a read error): give that part back. Kept, the caller
    // (which only returns the error) never cancelled it: reserved, the
    // blocks pinned their group for good (never handed over, other hosts'
    // waits for it timing out) and leaked at the next materialization.
    (void)UndoAllocate(out, reserve);
  }
  return st;
}

Status VolumeImpl::AllocateOrFail(size_t n, std::vector<uint64_t>* out, bool meta, AllocHint hint,
                                  bool reserve) {
  out->clear();
  if (!meta && hint.goal != 0) {
    uint32_t g, slot;
    uint64_t rb;
    if (sb_.LocateData(hint.goal, &g, &rb, &slot)) {
      ASSIGN_OR_RETURN(GroupTry got, TryTakeGroup(g));
      if (got == GroupTry::kTaken) {
        RETURN_IF_ERROR(AllocateRunAt(g, hint.goal - sb_.GroupDataStart(g), n, reserve, out));
      }
    }
  }
  // With `lead`, the first group that gets a say is first asked for the
  // run `lead` blocks past its cursor.
  bool lead_tried = meta || hint.goal != 0 || hint.lead == 0;
  auto from_group = [&](uint32_t g) REQUIRES(mu_) -> Status {
    if (!lead_tried && !full_groups_.count(g)) {
      lead_tried = true;
      RETURN_IF_ERROR(PrefetchGroup(g));
      // The first free stretch of lead + n blocks from the cursor on; the
      // run takes its last n.
      const uint64_t count = sb_.GroupDataBlocks(g);
      const uint64_t want = hint.lead + n;
      uint64_t start = alloc_cursor_[g].data, len = 0;
      for (uint64_t i = start; i < count && len < want; i++) {
        if (DataBlockFree(g, i)) {
          len++;
        } else {
          start = i + 1;
          len = 0;
        }
      }
      if (len == want) RETURN_IF_ERROR(AllocateRunAt(g, start + hint.lead, n, reserve, out));
    }
    return AllocateFromGroup(g, n, meta, reserve, out);
  };
  // Prefer groups we already hold.
  for (const LockId& id : cached_locks_) {
    if (id.kind != LockKind::kGroup || out->size() >= n) continue;
    RETURN_IF_ERROR(from_group(static_cast<uint32_t>(id.id)));
  }
  // (Blocks freed here wait for a checkpoint, which the walk below makes.)
  if (out->size() < n && clock_->MonotonicNanos() < full_until_ns_ && pending_free_.empty()) {
    RETURN_IF_ERROR(UndoAllocate(out, reserve));
    return Status::NoSpace("the volume is full (every allocation group was full a moment ago)");
  }
  // Then this host's share of the groups, so hosts rarely meet; groups held
  // by someone else are skipped, not waited for.
  uint32_t first = static_cast<uint32_t>(uint64_t{host_ - 1} * sb_.group_count / sb_.max_hosts);
  for (uint32_t i = 0; i < sb_.group_count && out->size() < n; i++) {
    uint32_t g = (first + i) % sb_.group_count;
    if (cached_locks_.count(GroupLock(g))) continue;
    ASSIGN_OR_RETURN(GroupTry got, TryTakeGroup(g));
    if (got == GroupTry::kBusy) continue;
    RETURN_IF_ERROR(from_group(g));
  }
  if (out->size() < n) {
    // Every group we could take without waiting is full or busy. Give back
    // what we hold (rule: never wait holding cached locks) and wait for the
    // groups in order until enough space turns up.
    RETURN_IF_ERROR(UndoAllocate(out, reserve));
    RETURN_IF_ERROR(ReleaseCached());
    for (uint32_t g = 0; g < sb_.group_count && out->size() < n; g++) {
      RETURN_IF_ERROR(WaitLock(GroupLock(g)));
      NoteCached(GroupLock(g));
      RETURN_IF_ERROR(ScanForTaken({GroupLock(g)}));
      RETURN_IF_ERROR(AllocateFromGroup(g, n, meta, reserve, out));
      // A group that gave nothing (full) is not held through the next
      // wait: its waiters would wait for all of ours, and nothing reaches
      // a flush point meanwhile to hand it over. (One that gave part of
      // the run is kept, in group order, so no two hosts wait on each
      // other.)
      if (out->empty()) {
        RETURN_IF_ERROR(Checkpoint());
        RETURN_IF_ERROR(ForgetCachedLock(GroupLock(g)));
      }
    }
  }
  if (out->size() < n) {
    RETURN_IF_ERROR(UndoAllocate(out, reserve));
    full_until_ns_ = clock_->MonotonicNanos() + kFullBackoffNs;
    return Status::NoSpace("the volume is full");
  }
  return Status::Ok();
}

// ================================================================== inodes

Result<Inode> VolumeImpl::GetInode(uint64_t ino) {
  if (ino == 0 || ino > sb_.inode_count) {
    return Status::NotFound("inode " + std::to_string(ino) + " does not exist");
  }
  uint8_t* b;
  RETURN_IF_ERROR(Load(sb_.InodeBlock(ino), InodeLock(ino), kMagicInode, "inode", &b));
  ASSIGN_OR_RETURN(Inode in, DecodeInode(b, sb_.uuid, sb_.InodeBlock(ino)));
  if (in.ino != ino) {
    return Status::Corruption("inode at block " + std::to_string(sb_.InodeBlock(ino)) +
                              " claims number " + std::to_string(in.ino));
  }
  return in;
}

void VolumeImpl::PutInode(const Inode& in) {
  uint64_t addr = sb_.InodeBlock(in.ino);
  uint8_t* b = Dirty(addr);
  EncodeInode(in, PeekHeader(b).seq, sb_.uuid, addr, b);
}

Result<Inode> VolumeImpl::ReadInodeUncached(uint64_t ino) {
  {
    MutexLock l(&mu_);
    if (OwnsInode(ino)) return GetInode(ino);
  }
  BlockBuf b = NewBlockBuf();
  uint64_t addr = sb_.InodeBlock(ino);
  RETURN_IF_ERROR(dev_->Read(addr * kBlockSize, b.get(), kBlockSize));
  RETURN_IF_ERROR(Admit(b.get(), addr, kMagicInode, "inode"));
  return DecodeInode(b.get(), sb_.uuid, addr);
}

bool VolumeImpl::OwnsInode(uint64_t ino) {
  return open_.count(ino) || cache_.count(sb_.InodeBlock(ino));
}

Result<std::vector<Inode>> VolumeImpl::ScanInodes() {
  // Up to the first run of kInodeListingEndRun never-written inode blocks
  // (format.h), a slice at a time: a volume of a few files reads a little
  // over the run (1.1 MiB), where whole aligned 1 MiB chunks read 2 MiB.
  constexpr uint64_t kSlice = 32;  // inode blocks per read (128 KiB)
  std::vector<Inode> out;
  BlockBuf buf = NewBlockBuf(kSlice);
  uint64_t unwritten_run = 0;  // never-written inode blocks since the last written one
  for (uint64_t first = 1; first <= sb_.inode_count && unwritten_run < kInodeListingEndRun;
       first += kSlice) {
    uint64_t n = std::min(kSlice, sb_.inode_count - first + 1);
    RETURN_IF_ERROR(dev_->Read(sb_.InodeBlock(first) * kBlockSize, buf.get(), n * kBlockSize));
    for (uint64_t i = 0; i < n; i++) {
      uint64_t ino = first + i;
      const uint8_t* b = buf.get() + i * kBlockSize;
      Inode in;
      {
        MutexLock l(&mu_);
        if (cache_.count(sb_.InodeBlock(ino))) {
          ASSIGN_OR_RETURN(in, GetInode(ino));
          unwritten_run = 0;
          out.push_back(in);
          continue;
        }
      }
      if (IsAllZero(b, kBlockSize)) {
        in.ino = ino;
        unwritten_run++;
      } else {
        unwritten_run = 0;
        ASSIGN_OR_RETURN(in, DecodeInode(b, sb_.uuid, sb_.InodeBlock(ino)));
      }
      out.push_back(in);
      // Exactly there, not at the slice's end: fsck reports what is past it.
      if (unwritten_run == kInodeListingEndRun) break;
    }
  }
  return out;
}

// =============================================================== namespace

Result<FileId> VolumeImpl::Create(const std::string& name, uint64_t size, FileKind kind,
                                  uint64_t owner_ino) {
  RETURN_IF_ERROR(ValidateFileName(name));
  if (kind == FileKind::kNone) return Status::Invalid("file kind 'none'");
  if (size > kMaxFileBytes) {
    return Status::Invalid("file size " + std::to_string(size) + " is past the limit of " +
                           std::to_string(kMaxFileBytes) + " bytes (1 EiB)");
  }
  // The scan runs without mu_, so another thread's flush point may hand
  // the namespace lock to another host meanwhile; that host may then have
  // created a file (in a free inode we saw, or with our name). The claim
  // below sees such a hand-over and scans again. A handful of tries is
  // plenty: a hand-over needs another host to want the lock each time.
  constexpr int kTries = 50;
  for (int attempt = 0; attempt < kTries; attempt++) {
    uint64_t releases;
    {
      MutexLock l(&mu_);
      RETURN_IF_ERROR(CheckWritable());
      RETURN_IF_ERROR(AcquireCached(kNamespaceLock));
      releases = namespace_releases_;
      namespace_pins_++;
    }
    Result<std::vector<Inode>> scanned = ScanInodes();
    MutexLock l(&mu_);
    namespace_pins_--;
    ASSIGN_OR_RETURN(std::vector<Inode> inodes, std::move(scanned));
    // Stale (the namespace went to another host during the scan, because
    // this process had to wait for something): look again.
    if (namespace_releases_ != releases || !cached_locks_.count(kNamespaceLock)) continue;
    std::vector<uint64_t> free_inos;
    for (const Inode& in : inodes) {
      if (in.in_use() && in.name == name) return Status::Exists("file '" + name + "' exists");
      if (!in.in_use()) free_inos.push_back(in.ino);
    }
    if (inodes.size() < sb_.inode_count) free_inos.push_back(inodes.size() + 1);
    if (free_inos.empty()) return Status::NoSpace("no free inodes");
    // A cleared inode can still be locked for a moment: Remove clears it
    // and hands the namespace back before its remover closes the file.
    // Take the first free inode nobody holds rather than fail the create.
    uint64_t free_ino = 0;
    for (uint64_t ino : free_inos) {
      if (opening_.count(ino)) continue;  // an open's lock (it will find no file)
      // Held here: a file this process removes (RemoveOpen) until it is
      // closed. Asked for again, a lock this process holds is not kLocked
      // but an error, which failed the create.
      if (open_.count(ino) || cached_locks_.count(InodeLock(ino))) continue;
      Status st = locks_->Acquire(InodeLock(ino), LockMode::kExclusive, false);
      if (st.ok()) {
        free_ino = ino;
        break;
      }
      if (st.code() != Status::Code::kLocked) {
        return st.WithContext("allocating inode " + std::to_string(ino));
      }
    }
    if (free_ino == 0) {
      return Status::Locked("every free inode is held by another process or host (files "
                            "being removed); try again");
    }
    // mu_ is held from here to the end: the namespace lock stays ours.
    uint64_t generation = 0;
    Status st = CreateInode(free_ino, name, size, kind, owner_ino, &generation);
    DropCache(InodeLock(free_ino));
    (void)locks_->Release(InodeLock(free_ino));
    RETURN_IF_ERROR(st);
    name_hint_[name] = free_ino;
    // Namespace changes are rare; do not make other processes wait for ours.
    RETURN_IF_ERROR(ReleaseCachedLock(kNamespaceLock));
    return FileId{free_ino, generation};
  }
  return Status::Locked("creating '" + name + "': the namespace lock kept moving to other hosts "
                        "during " + std::to_string(kTries) + " tries");
}

Status VolumeImpl::CreateInode(uint64_t ino, const std::string& name, uint64_t size,
                               FileKind kind, uint64_t owner_ino, uint64_t* generation) {
  // Journal room only: EnsureRoom may wait for groups, giving back every
  // cached lock first, the namespace lock included. No drop happens here.
  RETURN_IF_ERROR(EnsureJournalRoom(4));
  ASSIGN_OR_RETURN(Inode in, GetInode(ino));
  if (in.in_use()) {
    // Only a stale scan could choose an inode in use; the namespace check
    // in Create rules that out, so this is damage or a bug: never reuse it.
    return Status::Corruption("inode " + std::to_string(ino) + " ('" + in.name +
                              "') was chosen for a new file but is in use");
  }
  in.generation++;
  in.flags = kInodeInUse;
  in.kind = kind;
  in.depth = 0;
  in.root = 0;
  in.size = size;
  in.mapped_blocks = 0;
  in.ctime_ns = in.mtime_ns = clock_->NowNanos();
  in.owner_ino = owner_ino;
  in.name = name;
  PutInode(in);
  *generation = in.generation;
  return Checkpoint();
}

Result<Inode> VolumeImpl::ReadInodeFresh(uint64_t ino) {
  {
    MutexLock l(&mu_);
    if (cache_.count(sb_.InodeBlock(ino))) return GetInode(ino);
  }
  BlockBuf buf = NewBlockBuf(1);
  RETURN_IF_ERROR(dev_->Read(sb_.InodeBlock(ino) * kBlockSize, buf.get(), kBlockSize));
  if (IsAllZero(buf.get(), kBlockSize)) {
    Inode in;
    in.ino = ino;
    return in;
  }
  return DecodeInode(buf.get(), sb_.uuid, sb_.InodeBlock(ino));
}

Result<FileInfo> VolumeImpl::Lookup(const std::string& name) {
  uint64_t hint = 0;
  {
    MutexLock l(&mu_);
    auto it = name_hint_.find(name);
    if (it != name_hint_.end()) hint = it->second;
  }
  if (hint != 0) {
    // Names are unique (the namespace lock): if the hinted inode is in use
    // under this name, it is the file.
    Result<Inode> in = ReadInodeFresh(hint);
    if (in.ok() && in->in_use() && in->name == name) return InfoFrom(*in);
  }
  ASSIGN_OR_RETURN(std::vector<Inode> inodes, ScanInodes());
  std::optional<FileInfo> found;
  MutexLock l(&mu_);
  name_hint_.clear();
  for (const Inode& in : inodes) {
    if (!in.in_use()) continue;
    name_hint_[in.name] = in.ino;
    if (in.name == name) found = InfoFrom(in);
  }
  if (found) return *found;
  return Status::NotFound("no file named '" + name + "'");
}

Result<std::vector<FileInfo>> VolumeImpl::List() {
  ASSIGN_OR_RETURN(std::vector<Inode> inodes, ScanInodes());
  std::vector<FileInfo> out;
  MutexLock l(&mu_);
  name_hint_.clear();
  for (const Inode& in : inodes) {
    if (!in.in_use()) continue;
    out.push_back(InfoFrom(in));
    name_hint_[in.name] = in.ino;
  }
  return out;
}

Status VolumeImpl::Remove(const std::string& name) {
  {
    MutexLock l(&mu_);
    RETURN_IF_ERROR(CheckWritable());
  }
  ASSIGN_OR_RETURN(FileInfo fi, Lookup(name));
  ASSIGN_OR_RETURN(std::unique_ptr<File> f, OpenInode(fi.id.ino, fi.id.generation, name));
  return RemoveOpen(std::move(f));
}

Status VolumeImpl::RemoveOpen(std::unique_ptr<File> f) {
  auto* impl = dynamic_cast<FileImpl*>(f.get());
  if (impl == nullptr || impl->volume() != this) {
    return Status::Invalid("RemoveOpen: the file is not open on this volume");
  }
  {
    MutexLock l(&mu_);
    RETURN_IF_ERROR(CheckWritable());
  }
  auto* st = impl->state();
  {
    WriterLock wl(&st->rw);
    RETURN_IF_ERROR(TruncateFile(st, 0));
    MutexLock l(&mu_);
    // Room first: EnsureRoom may give back every cached lock to wait.
    RETURN_IF_ERROR(EnsureRoom(2));
    RETURN_IF_ERROR(AcquireCached(kNamespaceLock));
    ASSIGN_OR_RETURN(Inode in, GetInode(st->id.ino));
    Inode cleared;
    cleared.ino = in.ino;
    cleared.generation = in.generation;  // the next create bumps it
    PutInode(cleared);
    RETURN_IF_ERROR(ReleaseCachedLock(kNamespaceLock));
  }
  return Status::Ok();
}

Result<std::unique_ptr<File>> VolumeImpl::OpenFile(const std::string& name) {
  ASSIGN_OR_RETURN(FileInfo fi, Lookup(name));
  return OpenInode(fi.id.ino, fi.id.generation, name);
}

Result<std::unique_ptr<File>> VolumeImpl::OpenFileById(FileId id) {
  return OpenInode(id.ino, id.generation, "inode " + std::to_string(id.ino));
}

Result<std::unique_ptr<File>> VolumeImpl::OpenInode(uint64_t ino, uint64_t generation,
                                                    const std::string& name) {
  {
    MutexLock l(&mu_);
    if (ino == 0 || ino > sb_.inode_count) return Status::NotFound("no such file: " + name);
    // A failed write or commit (maybe in a close, which cannot report it)
    // poisoned the volume: say so, rather than trip over the locks it kept.
    if (!poisoned_.ok()) return poisoned_;
    if (open_.count(ino) || opening_.count(ino)) {
      return Status::Locked("file '" + name + "' is already open here");
    }
    opening_.insert(ino);
  }
  // The file's lock is taken without mu_: with sanlock, a lock record a
  // dead host left makes the acquirer wait for that host's partition
  // lease (up to 8 io_timeouts + 60 s), and every other file's reads and
  // writes need mu_.
  Status st = locks_->Acquire(InodeLock(ino),
                              read_only_ ? LockMode::kShared : LockMode::kExclusive, false);
  MutexLock l(&mu_);
  opening_.erase(ino);
  if (st.code() == Status::Code::kLocked) {
    return Status::Locked("file '" + name + "' is in use by another process or host");
  }
  RETURN_IF_ERROR(st);
  Status rec = poisoned_.ok() ? RecoverDeadHosts() : poisoned_;
  auto in = rec.ok() ? GetInode(ino) : Result<Inode>(rec);
  if (!in.ok() || !in->in_use() || in->generation != generation) {
    DropCache(InodeLock(ino));
    // Unclean when the scan failed (see ForgetTaken).
    (void)(rec.ok() ? locks_->Release(InodeLock(ino)) : locks_->ReleaseUnclean(InodeLock(ino)));
    if (!in.ok()) return in.status();
    return Status::NotFound("file '" + name + "' no longer exists");
  }
  auto state = std::make_unique<OpenFileState>();
  state->id = FileId{ino, generation};
  state->writable = !read_only_;
  open_[ino] = state.get();
  return std::unique_ptr<File>(new FileImpl(this, std::move(state)));
}

void VolumeImpl::CloseFile(OpenFileState* f) {
  MutexLock l(&mu_);
  // The next holder reads this file's metadata from its home blocks; and a
  // process that closes files hands back its groups, so an idle process never
  // holds up another one.
  Status st = read_only_ ? Status::Ok() : CheckpointReleasingMu();
  open_.erase(f->id.ino);
  if (!st.ok() || !poisoned_.ok()) {
    // Committed changes may still sit only in our journal. Handing the lock
    // back would let another process read stale home blocks (and a later
    // replay of our journal would overwrite its work), so keep every lock
    // until this process goes away and someone replays the journal.
    return;
  }
  // Another file's write may be between allocation and publication: its
  // groups go at a later flush point or close.
  (void)ReleaseCached(Pin::kKeep);
  DropCache(InodeLock(f->id.ino));
  (void)locks_->Release(InodeLock(f->id.ino));
}

Result<Inode> VolumeImpl::InodeOf(OpenFileState* f) {
  MutexLock l(&mu_);
  return GetInode(f->id.ino);
}

Status VolumeImpl::SetFlag(OpenFileState* f, uint32_t flag, bool on) {
  MutexLock l(&mu_);
  RETURN_IF_ERROR(CheckWritable());
  RETURN_IF_ERROR(EnsureRoom(2));
  ASSIGN_OR_RETURN(Inode in, GetInode(f->id.ino));
  in.flags = on ? (in.flags | flag) : (in.flags & ~flag);
  PutInode(in);
  return Status::Ok();
}

// =============================================================== block map

// A pointer block's checksum says it is the block written at its address,
// not that it sits where the walk found it: its level must be the one its
// parent implies, and a child pointer may carry no reserved bits, before
// anything is read through it or dropped (docs/FORMAT.md, pointer blocks).
Result<uint8_t*> VolumeImpl::LoadPointerBlock(uint64_t addr, uint32_t level, LockId owner) {
  uint8_t* b;
  RETURN_IF_ERROR(Load(addr, owner, kMagicPointerBlock, "pointer block", &b));
  if (PeekHeader(b).flags != level) {
    return Status::Corruption("pointer block at block " + std::to_string(addr) + " of inode " +
                              std::to_string(owner.id) + " has level " +
                              std::to_string(PeekHeader(b).flags) + ", expected " +
                              std::to_string(level));
  }
  return b;
}

Result<uint64_t> VolumeImpl::ChildPointer(const uint8_t* b, uint64_t addr, uint32_t slot,
                                          LockId owner) {
  const uint64_t raw = dede::GetPtr(b, slot);
  if (raw & kPtrReserved) {
    return Status::Corruption("pointer block at block " + std::to_string(addr) + " of inode " +
                              std::to_string(owner.id) + " slot " + std::to_string(slot) +
                              ": reserved bits set in " + HexU64(raw));
  }
  return PtrAddr(raw);
}

Status VolumeImpl::FindLeaf(const Inode& in, uint64_t index, uint64_t* leaf, uint32_t* slot) {
  *leaf = 0;
  if (in.depth == 0 || index >= Capacity(in.depth)) return Status::Ok();
  const LockId owner = InodeLock(in.ino);
  uint64_t addr = in.root;
  for (uint32_t level = in.depth; level >= 1; level--) {
    ASSIGN_OR_RETURN(uint8_t * b, LoadPointerBlock(addr, level, owner));
    uint32_t s = static_cast<uint32_t>((index / Span(level)) % kPointersPerBlock);
    if (level == 1) {
      *leaf = addr;
      *slot = s;
      return Status::Ok();
    }
    ASSIGN_OR_RETURN(uint64_t next, ChildPointer(b, addr, s, owner));
    if (next == 0) return Status::Ok();
    addr = next;
  }
  return Status::Ok();
}

Result<uint64_t> VolumeImpl::GetPtr(const Inode& in, uint64_t index) {
  uint64_t leaf;
  uint32_t slot;
  RETURN_IF_ERROR(FindLeaf(in, index, &leaf, &slot));
  if (leaf == 0) return uint64_t{0};
  const uint64_t p = dede::GetPtr(cache_.at(leaf).data.get(), slot);
  // Every read, write and share of file data goes through here. A data
  // pointer is the one reference to disk that carries no checksum of its
  // target: one that named metadata (an inode, a journal, the lease area)
  // would have a VM's in-place write land on it.
  uint32_t g, rslot;
  uint64_t rb;
  if (p != 0 && ((p & kPtrReserved) != 0 || !sb_.LocateData(PtrAddr(p), &g, &rb, &rslot))) {
    return Status::Corruption("block " + std::to_string(index) + " of inode " +
                              std::to_string(in.ino) + ": pointer block " + std::to_string(leaf) +
                              " slot " + std::to_string(slot) + " holds " + HexU64(p) +
                              ", not a data block");
  }
  return p;
}

Status VolumeImpl::EnsureMapPath(Inode* in, uint64_t index) {
  const LockId owner = InodeLock(in->ino);
  // Every pointer block the path lacks is allocated in one call before the
  // map changes. An allocation that reaches its last resort checkpoints the
  // running transaction before it waits (ReleaseCached): allocated one at
  // a time, a later one's wait made durable a root grown only in `*in`,
  // which the caller had not stored yet (a crash there leaked it).
  uint32_t depth = in->depth;
  while (index >= Capacity(depth)) depth++;
  size_t need = depth - in->depth;
  if (need > 0) {
    // Index is past what the old tree covers: below the new top, whose
    // slot for it is not slot 0 (the old tree), the whole path is new.
    need += depth - 1;
  } else {
    uint64_t addr = in->root;
    for (uint32_t level = depth; level > 1; level--) {
      ASSIGN_OR_RETURN(uint8_t * b, LoadPointerBlock(addr, level, owner));
      uint32_t s = static_cast<uint32_t>((index / Span(level)) % kPointersPerBlock);
      ASSIGN_OR_RETURN(uint64_t next, ChildPointer(b, addr, s, owner));
      if (next == 0) {
        need = level - 1;
        break;
      }
      addr = next;
    }
  }
  if (need == 0) return Status::Ok();
  std::vector<uint64_t> a;
  RETURN_IF_ERROR(Allocate(need, &a, /*meta=*/true));
  size_t used = 0;
  auto take = [&]() -> Result<uint64_t> {
    if (used < a.size()) return a[used++];
    return Status::Corruption("internal error: the block-map path to block " +
                              std::to_string(index) + " of inode " + std::to_string(in->ino) +
                              " needs more than the " + std::to_string(a.size()) +
                              " pointer blocks counted");
  };
  // Grow the tree until it covers index.
  while (index >= Capacity(in->depth)) {
    ASSIGN_OR_RETURN(const uint64_t top, take());
    uint32_t level = in->depth + 1;
    uint8_t* b = Fresh(top, owner, kMagicPointerBlock, level);
    if (in->root != 0) dede::SetPtr(b, 0, in->root);
    in->root = top;
    in->depth = static_cast<uint8_t>(level);
  }
  uint64_t addr = in->root;
  for (uint32_t level = in->depth; level > 1; level--) {
    ASSIGN_OR_RETURN(uint8_t * b, LoadPointerBlock(addr, level, owner));
    uint32_t s = static_cast<uint32_t>((index / Span(level)) % kPointersPerBlock);
    ASSIGN_OR_RETURN(uint64_t next, ChildPointer(b, addr, s, owner));
    if (next == 0) {
      ASSIGN_OR_RETURN(next, take());
      Fresh(next, owner, kMagicPointerBlock, level - 1);
      dede::SetPtr(Dirty(addr), s, next);
    }
    addr = next;
  }
  if (used < a.size()) {
    // A miscount (an internal error) costs nothing but the log line: the
    // blocks left over were never linked, and go back in this transaction.
    LOG(kWarning) << "volume: the block-map path to block " << index << " of inode " << in->ino
                  << " used " << used << " of the " << a.size()
                  << " pointer blocks counted (internal error; the rest given back)";
    std::vector<uint64_t> rest(a.begin() + static_cast<std::ptrdiff_t>(used), a.end());
    RETURN_IF_ERROR(UndoAllocate(&rest, /*reserve=*/false));
  }
  return Status::Ok();
}

Status VolumeImpl::BuildMapPaths(Inode* in, uint64_t first, const std::vector<bool>& fresh) {
  Status st;
  uint64_t leaf = UINT64_MAX;  // indexes of one leaf share its path
  for (size_t k = 0; k < fresh.size() && st.ok(); k++) {
    if (!fresh[k] || (first + k) / kPointersPerBlock == leaf) continue;
    leaf = (first + k) / kPointersPerBlock;
    st = EnsureMapPath(in, first + k);
    // Stored after each path (a grown map too, when it failed part-way):
    // the next one's allocation may checkpoint.
    PutInode(*in);
  }
  return st;
}

Status VolumeImpl::SetPtr(Inode* in, uint64_t index, uint64_t value) {
  if (value == 0) {
    if (in->depth == 0 || index >= Capacity(in->depth)) return Status::Ok();
  } else {
    RETURN_IF_ERROR(EnsureMapPath(in, index));
  }
  const LockId owner = InodeLock(in->ino);
  uint64_t addr = in->root;
  for (uint32_t level = in->depth; level >= 1; level--) {
    ASSIGN_OR_RETURN(uint8_t * b, LoadPointerBlock(addr, level, owner));
    uint32_t s = static_cast<uint32_t>((index / Span(level)) % kPointersPerBlock);
    if (level == 1) {
      dede::SetPtr(Dirty(addr), s, value);
      return Status::Ok();
    }
    ASSIGN_OR_RETURN(const uint64_t next, ChildPointer(b, addr, s, owner));
    if (next == 0) return Status::Ok();  // clearing a pointer in an absent subtree
    addr = next;
  }
  return Status::Ok();
}

Status VolumeImpl::ReplaceBlock(Inode* in, uint64_t index, uint64_t value) {
  ASSIGN_OR_RETURN(uint64_t old, GetPtr(*in, index));
  if (old == value) return Status::Ok();
  // The new block's count is the caller's business; only the old one's
  // reference is dropped here (deferred if its group is held elsewhere).
  if (old != 0) RETURN_IF_ERROR(PrepareDrop(PtrAddr(old)));
  RETURN_IF_ERROR(SetPtr(in, index, value));
  // The map names `value` now. An old reference that cannot be dropped
  // leaves the running transaction half-applied: no caller can undo it
  // (giving `value` back would leave the map naming a free block), so it
  // must never commit.
  if (old != 0) {
    if (Status st = DropRef(PtrAddr(old)); !st.ok()) return Poison(st);
  }
  if (old == 0 && value != 0) in->mapped_blocks++;
  if (old != 0 && value == 0) in->mapped_blocks--;
  return Status::Ok();
}

Result<std::optional<uint64_t>> VolumeImpl::LastMappedBelow(const Inode& in, uint64_t limit) {
  if (in.depth == 0 || limit == 0) return std::optional<uint64_t>();
  return LastMappedIn(in.root, in.depth, 0, std::min(limit, Capacity(in.depth)), InodeLock(in.ino));
}

// Indexes [base, limit) of the pointer block at `addr` (of `level`, whose
// slots each cover Span(level) indexes from `base` on).
Result<std::optional<uint64_t>> VolumeImpl::LastMappedIn(uint64_t addr, uint32_t level,
                                                         uint64_t base, uint64_t limit,
                                                         LockId owner) {
  RETURN_IF_ERROR(LoadPointerBlock(addr, level, owner).status());
  const uint64_t span = Span(level);
  for (uint64_t s = std::min<uint64_t>((limit - 1 - base) / span, kPointersPerBlock - 1) + 1;
       s-- > 0;) {
    // (Re-read from the cache: loading a child may move cache entries.)
    const uint64_t p = dede::GetPtr(cache_.at(addr).data.get(), static_cast<uint32_t>(s));
    if (p == 0) continue;
    const uint64_t child_base = base + s * span;
    if (level == 1) return std::optional<uint64_t>(child_base);
    ASSIGN_OR_RETURN(const uint64_t child, ChildPointer(cache_.at(addr).data.get(), addr,
                                                        static_cast<uint32_t>(s), owner));
    ASSIGN_OR_RETURN(
        std::optional<uint64_t> found,
        LastMappedIn(child, level - 1, child_base, std::min(limit, child_base + span), owner));
    if (found) return found;
  }
  return std::optional<uint64_t>();
}

Status VolumeImpl::FreeSubtree(uint64_t addr, uint32_t level, uint64_t base, uint64_t keep_blocks,
                               LockId owner, bool* now_empty) {
  RETURN_IF_ERROR(LoadPointerBlock(addr, level, owner).status());
  bool empty = true;
  for (uint32_t s = 0; s < kPointersPerBlock; s++) {
    uint64_t p = dede::GetPtr(cache_.at(addr).data.get(), s);
    if (p == 0) continue;
    uint64_t child_base = base + s * Span(level);
    if (level == 1) {
      // Data pointers beyond keep_blocks were punched before this runs.
      empty = false;
      continue;
    }
    if (child_base + Span(level) <= keep_blocks) {
      empty = false;
      continue;
    }
    bool child_empty = false;
    ASSIGN_OR_RETURN(const uint64_t child,
                     ChildPointer(cache_.at(addr).data.get(), addr, s, owner));
    RETURN_IF_ERROR(FreeSubtree(child, level - 1, child_base, keep_blocks, owner, &child_empty));
    if (child_empty) {
      RETURN_IF_ERROR(EnsureRoom(8));
      RETURN_IF_ERROR(PrepareDrops({child}));
      // The reference first: a DropRef that fails changes nothing, and a
      // slot cleared before it would commit at the next flush point with
      // the block's count never dropped (a leaked pointer block).
      RETURN_IF_ERROR(DropRef(child));
      dede::SetPtr(Dirty(addr), s, 0);
    } else {
      empty = false;
    }
  }
  *now_empty = empty;
  return Status::Ok();
}

Status VolumeImpl::FreeTree(Inode* in, uint64_t keep_blocks) {
  if (in->depth == 0) return Status::Ok();
  bool empty = false;
  RETURN_IF_ERROR(FreeSubtree(in->root, in->depth, 0, keep_blocks, InodeLock(in->ino), &empty));
  if (empty) {
    RETURN_IF_ERROR(EnsureRoom(8));
    RETURN_IF_ERROR(PrepareDrops({in->root}));
    RETURN_IF_ERROR(DropRef(in->root));
    in->root = 0;
    in->depth = 0;
  }
  return Status::Ok();
}

// ==================================================================== data

Status VolumeImpl::ReadData(OpenFileState* f, uint64_t offset, uint8_t* buf, size_t len) {
  if (len == 0) return Status::Ok();
  uint64_t first = offset / kBlockSize, last = (offset + len - 1) / kBlockSize;
  std::vector<uint64_t> ptrs;
  {
    MutexLock l(&mu_);
    ASSIGN_OR_RETURN(Inode in, GetInode(f->id.ino));
    if (offset > in.size || len > in.size - offset) {
      return Status::Invalid("read of " + std::to_string(len) + " bytes at " +
                             std::to_string(offset) + " is past the end of '" + in.name + "' (" +
                             std::to_string(in.size) + " bytes)");
    }
    ptrs.reserve(last - first + 1);
    for (uint64_t i = first; i <= last; i++) {
      ASSIGN_OR_RETURN(uint64_t p, GetPtr(in, i));
      ptrs.push_back(PtrAddr(p));
    }
  }
  BlockBuf tmp;
  size_t i = 0;
  while (i < ptrs.size()) {
    uint64_t blk = first + i;
    uint64_t bstart = blk * kBlockSize;
    size_t skip = offset > bstart ? static_cast<size_t>(offset - bstart) : 0;
    size_t take = std::min<uint64_t>(kBlockSize - skip, offset + len - (bstart + skip));
    uint8_t* dst = buf + (bstart + skip - offset);
    if (ptrs[i] == 0) {
      std::memset(dst, 0, take);
      i++;
      continue;
    }
    if (skip != 0 || take != kBlockSize) {
      if (!tmp) tmp = NewBlockBuf();
      RETURN_IF_ERROR(dev_->Read(ptrs[i] * kBlockSize, tmp.get(), kBlockSize));
      std::memcpy(dst, tmp.get() + skip, take);
      i++;
      continue;
    }
    // A run of whole blocks that are physically contiguous: one read.
    size_t n = 1;
    while (i + n < ptrs.size() && ptrs[i + n] == ptrs[i] + n &&
           (first + i + n + 1) * kBlockSize <= offset + len) {
      n++;
    }
    RETURN_IF_ERROR(dev_->Read(ptrs[i] * kBlockSize, dst, n * kBlockSize));
    i += n;
  }
  return Status::Ok();
}

namespace {

// Holds the file's rw lock shared from PrepareInPlace to its destruction
// (not a scoped lock: the analysis cannot follow it).
class InPlaceWriteImpl : public InPlaceWrite {
 public:
  InPlaceWriteImpl(VolumeImpl* vol, OpenFileState* f) NO_THREAD_SAFETY_ANALYSIS : vol_(vol), f_(f) {
    f_->rw.LockShared();
  }
  ~InPlaceWriteImpl() override NO_THREAD_SAFETY_ANALYSIS { f_->rw.UnlockShared(); }
  // The physical blocks, looked up after the lock was taken.
  std::vector<uint64_t>* ptrs() { return &ptrs_; }
  Status Write(const void* buf) override {
    if (written_) return Status::Invalid("in-place write used twice");
    written_ = true;
    return vol_->WriteInPlace(ptrs_, static_cast<const uint8_t*>(buf));
  }

 private:
  VolumeImpl* const vol_;
  OpenFileState* const f_;
  std::vector<uint64_t> ptrs_;
  bool written_ = false;
};

}  // namespace

Result<std::unique_ptr<InPlaceWrite>> VolumeImpl::PrepareInPlace(OpenFileState* f, uint64_t offset,
                                                                 size_t len) {
  if (len == 0 || offset % kBlockSize != 0 || len % kBlockSize != 0) {
    return std::unique_ptr<InPlaceWrite>();  // not whole blocks: never in place
  }
  const uint64_t first = offset / kBlockSize, last = (offset + len - 1) / kBlockSize;
  // The lock first (the prepared write keeps it), then the pointers: no
  // share, truncate or trim can change them until the write is done.
  auto w = std::make_unique<InPlaceWriteImpl>(this, f);
  std::vector<uint64_t>* ptrs = w->ptrs();
  ptrs->reserve(last - first + 1);
  {
    MutexLock l(&mu_);
    RETURN_IF_ERROR(CheckWritable());
    ASSIGN_OR_RETURN(Inode in, GetInode(f->id.ino));
    if (offset > in.size || len > in.size - offset) {
      return Status::Invalid("write past the end of '" + in.name + "'");
    }
    for (uint64_t i = first; i <= last; i++) {
      ASSIGN_OR_RETURN(uint64_t p, GetPtr(in, i));
      if (p == 0 || PtrCow(p)) return std::unique_ptr<InPlaceWrite>();
      ptrs->push_back(PtrAddr(p));
    }
  }
  return std::unique_ptr<InPlaceWrite>(std::move(w));
}

Status VolumeImpl::WriteInPlace(const std::vector<uint64_t>& ptrs, const uint8_t* buf) {
  size_t i = 0;
  while (i < ptrs.size()) {
    size_t n = 1;
    while (i + n < ptrs.size() && ptrs[i + n] == ptrs[i] + n) n++;
    Status st = dev_->Write(ptrs[i] * kBlockSize, buf + i * kBlockSize, n * kBlockSize);
    if (!st.ok()) {
      MutexLock l(&mu_);
      return Poison(st);
    }
    i += n;
  }
  return Status::Ok();
}

size_t VolumeImpl::PublishCost(const std::vector<uint64_t>& old, const std::vector<uint64_t>& target,
                               const std::vector<bool>& fresh, size_t map_cost) const {
  // Claiming the new blocks dirties their refcount blocks (each counted
  // once); every old COW block's drop may dirty one more or take a drop
  // list entry (counted each).
  std::set<uint64_t> refblocks;
  size_t drops = 0;
  for (size_t k = 0; k < target.size(); k++) {
    if (!fresh[k]) continue;
    uint32_t g, slot;
    uint64_t rb;
    if (LocateRef(target[k], &g, &rb, &slot).ok()) refblocks.insert(rb);
    drops += old[k] != 0;
  }
  return refblocks.size() + drops + map_cost;
}

Status VolumeImpl::WriteData(OpenFileState* f, uint64_t offset, const uint8_t* buf, size_t len) {
  if (len == 0) return Status::Ok();
  // Past any file's end; and the block arithmetic below must not wrap.
  if (offset > UINT64_MAX - len) return Status::Invalid("write range wraps around");
  uint64_t first = offset / kBlockSize, last = (offset + len - 1) / kBlockSize;
  bool partial = offset % kBlockSize != 0 || (offset + len) % kBlockSize != 0;
  {
    // Fast path: whole blocks already owned exclusively are written in place
    // with no metadata I/O and only a shared file lock.
    MutexLock l(&mu_);
    RETURN_IF_ERROR(CheckWritable());
  }
  if (!partial) {
    ASSIGN_OR_RETURN(std::unique_ptr<InPlaceWrite> w, PrepareInPlace(f, offset, len));
    if (w) return w->Write(buf);
  }

  // Slow path: allocation, copy-on-write, or partial blocks.
  WriterLock wl(&f->rw);
  BlockBuf scratch;  // for partial blocks only; whole blocks go from `buf`
  for (uint64_t r0 = first; r0 <= last;) {
    // Phase 1 (mu_): look at up to 256 blocks, size the round so its
    // metadata fits one transaction, then allocate where needed.
    std::vector<uint64_t> old, target;
    std::vector<bool> fresh;
    size_t nblk;
    size_t map_cost;
    {
      MutexLock l(&mu_);
      RETURN_IF_ERROR(CheckWritable());
      ASSIGN_OR_RETURN(Inode in, GetInode(f->id.ino));
      if (offset > in.size || len > in.size - offset) {
        return Status::Invalid("write past the end of '" + in.name + "'");
      }
      nblk = std::min<uint64_t>(256, last + 1 - r0);
      for (size_t k = 0; k < nblk; k++) {
        ASSIGN_OR_RETURN(uint64_t p, GetPtr(in, r0 + k));
        old.push_back(p);
      }
      // Dirtied per round: one refcount block per old COW block (worst
      // case), the refcount blocks of the new blocks, the block map and
      // the inode. `cost` assumes the new blocks are contiguous (the usual
      // case, and what phase 1 dirties at most); `worst` that each has a
      // refcount block of its own (free space fragmented by dedup), which
      // phase 3 must still fit in one transaction: it counts the real ones
      // (PublishCost). `map_cost`: along each of (at most) two leaf paths
      // every pointer block may be new (the tree may also grow to cover
      // the write: a first write far into a fresh file), and a new one
      // dirties its refcount block too; plus the inode and one to spare.
      uint32_t depth = std::max<uint32_t>(in.depth, 1);
      while (Capacity(depth) <= last) depth++;
      map_cost = 2 * (2 * (depth + 1)) + 2;
      auto cows = [&](size_t n) {
        size_t cow = 0;
        for (size_t k = 0; k < n; k++) cow += (old[k] != 0 && PtrCow(old[k]));
        return cow;
      };
      auto cost = [&](size_t n) { return cows(n) + n / kRefsPerBlock + 2 + map_cost; };
      auto worst = [&](size_t n) { return cows(n) + n + map_cost; };
      while (nblk > 1 && (cost(nblk) > MaxTxnBlocks() / 2 || worst(nblk) > MaxTxnBlocks())) {
        nblk /= 2;
      }
      old.resize(nblk);
      target.assign(nblk, 0);
      fresh.assign(nblk, false);
      RETURN_IF_ERROR(EnsureRoom(cost(nblk)));
      // The groups of the COW blocks: their counts tell whether a block is
      // ours alone. A group held elsewhere is not waited for: its blocks
      // are copied (a last reference merely costs a copy).
      std::vector<uint64_t> cow;
      for (size_t k = 0; k < nblk; k++) {
        if (old[k] != 0 && PtrCow(old[k])) cow.push_back(PtrAddr(old[k]));
      }
      RETURN_IF_ERROR(PrepareDrops(cow));
      size_t need = 0;
      for (size_t k = 0; k < nblk; k++) {
        if (old[k] != 0 && PtrCow(old[k]) && GroupHeld(PtrAddr(old[k]))) {
          ASSIGN_OR_RETURN(uint32_t refs, GetRef(PtrAddr(old[k])));
          if (refs == 1 && !decref_uncommitted_.count(PtrAddr(old[k]))) {
            // Last reference, durably: take the block back without a copy.
            RETURN_IF_ERROR(SetPtr(&in, r0 + k, PtrAddr(old[k])));
            old[k] = PtrAddr(old[k]);
          }
        }
        if (old[k] == 0 || PtrCow(old[k])) {
          fresh[k] = true;
          need++;
        } else {
          target[k] = old[k];
        }
      }
      PutInode(in);
      // The new blocks' map paths now, each a complete step stored with
      // the inode, before their blocks are reserved: an allocation's last
      // resort checkpoints before it waits. In phase 3 it met a half-
      // published round (counts and pointers without the inode's root
      // and mapped count: a crash there leaked blocks and left the count
      // wrong); here it meets only finished steps, and no reservation of
      // ours that its wait would have to count early (materialize).
      RETURN_IF_ERROR(BuildMapPaths(&in, r0, fresh));
      if (need > 0) {
        size_t k0 = 0;
        while (!fresh[k0]) k0++;
        const uint64_t index0 = r0 + k0;  // file block of the first new block
        AllocHint hint{0, 0};
        if (f->alloc_anchor_set) {
          hint.goal = DataBlockAt(f->alloc_anchor + static_cast<int64_t>(index0));
        } else if (index0 < 4096) {
          // The first allocation of a file near its start: leave room for
          // the blocks before it, which other requests may be writing.
          hint.lead = index0;
        }
        // Reserved, not counted: a flush point of another thread before
        // phase 3 must not commit counts whose pointers are not published
        // yet (a crash would leak the blocks).
        std::vector<uint64_t> got;
        RETURN_IF_ERROR(Allocate(need, &got, /*meta=*/false, hint, /*reserve=*/true));
        // The first allocation anchors the file; one that missed its goal
        // (a block map or another file is there, or the group is busy)
        // anchors it again where it landed, so the next blocks follow it
        // instead of missing too.
        if (!f->alloc_anchor_set || got[0] != hint.goal) {
          f->alloc_anchor = DataOrdinal(got[0]) - static_cast<int64_t>(index0);
          f->alloc_anchor_set = true;
        }
        size_t j = 0;
        for (size_t k = 0; k < nblk; k++) {
          if (fresh[k]) target[k] = got[j++];
        }
      }
    }
    // Phase 2 (no mu_): write every block to its target; whole blocks
    // straight from the caller's buffer, partial ones merged in `scratch`
    // with the old content (or zeros).
    Status io;
    std::vector<const uint8_t*> src(nblk);
    for (size_t k = 0; k < nblk && io.ok(); k++) {
      uint64_t bstart = (r0 + k) * kBlockSize;
      uint64_t lo = std::max<uint64_t>(offset, bstart);
      uint64_t hi = std::min<uint64_t>(offset + len, bstart + kBlockSize);
      if (hi - lo == kBlockSize) {
        src[k] = buf + (lo - offset);
        continue;
      }
      if (!scratch) scratch = NewBlockBuf(2);
      uint8_t* blk = scratch.get() + (k == 0 ? 0 : kBlockSize);  // at most head and tail
      if (old[k] == 0) {
        std::memset(blk, 0, kBlockSize);
      } else {
        io = dev_->Read(PtrAddr(old[k]) * kBlockSize, blk, kBlockSize);
      }
      std::memcpy(blk + (lo - bstart), buf + (lo - offset), hi - lo);
      src[k] = blk;
    }
    // A failed read of an old block (above) comes before any write of
    // this round: nothing changed, so the write fails alone. A failed
    // write may have changed a block in place: that poisons.
    bool write_failed = false;
    for (size_t k = 0; k < nblk && io.ok();) {
      size_t n = 1;
      while (k + n < nblk && target[k + n] == target[k] + n &&
             src[k + n] == src[k] + n * kBlockSize) {
        n++;
      }
      io = dev_->Write(target[k] * kBlockSize, src[k], n * kBlockSize);
      write_failed = !io.ok();
      k += n;
    }
    // Phase 3 (mu_): count and publish the new blocks in one transaction.
    // On failure, blocks not yet published are given back.
    MutexLock l(&mu_);
    Status st = io;
    if (write_failed) (void)Poison(io);
    // Poisoned by another thread since phase 1: its transaction never
    // commits, so publishing into it would answer Ok for a lost write.
    if (st.ok()) st = poisoned_;
    // Other threads used the transaction and the drop list since phase 1.
    if (st.ok()) st = EnsureRoom(PublishCost(old, target, fresh, map_cost));
    if (st.ok()) {
      std::vector<uint64_t> drops;
      for (size_t k = 0; k < nblk; k++) {
        if (fresh[k] && old[k] != 0) drops.push_back(PtrAddr(old[k]));
      }
      st = PrepareDrops(drops);
    }
    Inode in;
    bool loaded = false;
    if (st.ok()) {
      auto got = GetInode(f->id.ino);
      st = got.status();
      if (st.ok()) in = got.value();
      loaded = st.ok();
    }
    const uint64_t root_before = in.root;
    const uint8_t depth_before = in.depth;
    // Phase 1 built the paths and nothing of ours changes this file's map
    // meanwhile (f->rw): this walk allocates nothing. Were a pointer block
    // missing, it would still be allocated here, before the round's first
    // change, never between two of its steps.
    if (st.ok()) st = BuildMapPaths(&in, r0, fresh);
    size_t published = 0;  // blocks [0, published) are in the map
    for (; published < nblk && st.ok(); published++) {
      if (!fresh[published]) continue;
      st = ClaimReservation(target[published]);
      if (st.ok()) st = ReplaceBlock(&in, r0 + published, target[published]);
      if (!st.ok()) break;
    }
    if (!st.ok()) {
      for (size_t u = published; u < nblk; u++) {
        if (!fresh[u]) continue;
        // (A claimed block's pointer was not published: DropUnpublished.)
        const Status back =
            reserved_.count(target[u]) ? CancelReservation(target[u]) : DropUnpublished(target[u]);
        if (!back.ok()) {
          // Its count could not be lowered (a refcount block unreadable;
          // a failed drop-list update poisons the volume besides): the
          // block stays counted with no reference, a leak that fsck
          // --repair frees. Counted and logged, never silent; the write's
          // own error is what the caller gets.
          blocks_leaked_++;
          LOG(kWarning) << "volume: block " << target[u] << " of a failed write could not be"
                        << " given back (" << back.ToString()
                        << "); left allocated until fsck --repair frees it";
        }
      }
      // A map that grew before an allocation failed is stored too (an
      // empty level is a valid map): left out, its new pointer blocks
      // leaked.
      if (loaded && (published > 0 || in.root != root_before || in.depth != depth_before)) {
        PutInode(in);
      }
      return st;
    }
    in.mtime_ns = clock_->NowNanos();
    PutInode(in);
    for (size_t k = 0; k < nblk; k++) {
      if (fresh[k] && old[k] != 0) f->cow_copies.fetch_add(1, std::memory_order_relaxed);
    }
    r0 += nblk;
  }
  return Status::Ok();
}

Status VolumeImpl::TrimData(OpenFileState* f, uint64_t offset, uint64_t len) {
  if (len == 0) return Status::Ok();
  if (offset > UINT64_MAX - len) return Status::Invalid("trim range wraps around");
  uint64_t first_full = (offset + kBlockSize - 1) / kBlockSize;
  uint64_t end_full = (offset + len) / kBlockSize;  // exclusive
  // Zero the partial edges through the ordinary write path.
  static const std::vector<uint8_t> kZeros(kBlockSize, 0);
  uint64_t head_end = std::min(offset + len, first_full * kBlockSize);
  if (head_end > offset) RETURN_IF_ERROR(WriteData(f, offset, kZeros.data(), head_end - offset));
  uint64_t tail_start = std::max(end_full * kBlockSize, head_end);
  if (offset + len > tail_start && end_full >= first_full) {
    RETURN_IF_ERROR(WriteData(f, tail_start, kZeros.data(), offset + len - tail_start));
  }
  // Mapped blocks only, from the end of the range down (a hole costs
  // nothing: a guest's fstrim of a thin disk sends discards of gigabytes
  // that are mostly holes), and the file's lock is let go every
  // kTrimBlocksPerHold punches so that the disk's READs, which take it
  // shared, are not held up for the whole range.
  uint64_t i = end_full;
  while (i > first_full) {
    WriterLock wl(&f->rw);
    for (uint64_t n = 0; n < kTrimBlocksPerHold && i > first_full; n++) {
      ASSIGN_OR_RETURN(std::optional<uint64_t> next, PunchLastMappedBelow(f, first_full, i));
      if (!next) return Status::Ok();
      i = *next;
    }
  }
  return Status::Ok();
}

Status VolumeImpl::PunchBlock(OpenFileState* f, uint64_t index, bool may_wait) {
  // One block: a lookup of its pointer (a walk down from it, as a trim
  // does, would scan the holes below an unmapped block).
  MutexLock l(&mu_);
  RETURN_IF_ERROR(CheckWritable());
  // Without may_wait (File::TryPunch), a full drop list that cannot be
  // drained without waiting is kLocked here, before any change.
  RETURN_IF_ERROR(EnsureRoom(16, may_wait));
  ASSIGN_OR_RETURN(Inode in, GetInode(f->id.ino));
  if (index >= (in.size + kBlockSize - 1) / kBlockSize) {
    return Status::Invalid("block " + std::to_string(index) + " is past the end of '" + in.name +
                           "'");
  }
  ASSIGN_OR_RETURN(uint64_t p, GetPtr(in, index));
  if (p == 0) return Status::Ok();
  // (With drop lists the drop itself never waits: it is deferred.)
  if (!may_wait) RETURN_IF_ERROR(TryPrepareDrop(PtrAddr(p)));
  RETURN_IF_ERROR(ReplaceBlock(&in, index, 0));
  PutInode(in);
  return Status::Ok();
}

Result<std::optional<uint64_t>> VolumeImpl::PunchLastMappedBelow(OpenFileState* f, uint64_t first,
                                                                 uint64_t limit) {
  MutexLock l(&mu_);
  RETURN_IF_ERROR(CheckWritable());
  RETURN_IF_ERROR(EnsureRoom(16));
  ASSIGN_OR_RETURN(Inode in, GetInode(f->id.ino));
  const uint64_t blocks = (in.size + kBlockSize - 1) / kBlockSize;
  if (limit > blocks) {
    return Status::Invalid("block " + std::to_string(limit - 1) + " is past the end of '" +
                           in.name + "'");
  }
  ASSIGN_OR_RETURN(std::optional<uint64_t> last, LastMappedBelow(in, limit));
  if (!last || *last < first) return std::optional<uint64_t>();
  RETURN_IF_ERROR(ReplaceBlock(&in, *last, 0));
  PutInode(in);
  return last;
}

Status VolumeImpl::TruncateFile(OpenFileState* f, uint64_t size) {
  if (size > kMaxFileBytes) {
    return Status::Invalid("file size " + std::to_string(size) + " is past the limit of " +
                           std::to_string(kMaxFileBytes) + " bytes (1 EiB)");
  }
  uint64_t old_size;
  {
    MutexLock l(&mu_);
    RETURN_IF_ERROR(CheckWritable());
    ASSIGN_OR_RETURN(Inode in, GetInode(f->id.ino));
    old_size = in.size;
  }
  uint64_t keep = (size + kBlockSize - 1) / kBlockSize;
  uint64_t old_blocks = (old_size + kBlockSize - 1) / kBlockSize;
  // A grow exposes the bytes past the old end of the block it ends in:
  // they must read as zeros, whatever a shrink left there or a cloned or
  // shared block carries from another file. A shrink leaves them (nothing
  // reads past the end of a file, and the next grow zeroes them). Zeroing
  // them at the shrink would have to happen on the device before the
  // transaction that cuts the file, and a shrink that then failed or
  // crashed before its commit would leave the file at its old size with
  // those bytes zeroed. (The caller holds the file exclusively, so this
  // cannot go through WriteData, which takes the file lock itself.)
  const uint64_t edge = old_size;
  if (size > old_size && edge % kBlockSize != 0) {
    MutexLock l(&mu_);
    ASSIGN_OR_RETURN(Inode in, GetInode(f->id.ino));
    const uint64_t eblk = edge / kBlockSize;
    ASSIGN_OR_RETURN(uint64_t p, GetPtr(in, eblk));
    if (p != 0) {
      BlockBuf blk = NewBlockBuf();
      RETURN_IF_ERROR(dev_->Read(PtrAddr(p) * kBlockSize, blk.get(), kBlockSize));
      const bool tail_zero =
          IsAllZero(blk.get() + edge % kBlockSize, kBlockSize - edge % kBlockSize);
      std::memset(blk.get() + edge % kBlockSize, 0, kBlockSize - edge % kBlockSize);
      uint64_t target = PtrAddr(p);
      if (tail_zero) {
        // Nothing to clear (the usual case): keep the block, shared or not.
      } else if (PtrCow(p)) {
        RETURN_IF_ERROR(EnsureRoom(16));
        std::vector<uint64_t> got;
        RETURN_IF_ERROR(Allocate(1, &got));
        target = got[0];
      }
      if (!tail_zero) {
        RETURN_IF_ERROR(Poison(dev_->Write(target * kBlockSize, blk.get(), kBlockSize)));
      }
      if (target != PtrAddr(p)) {
        RETURN_IF_ERROR(ReplaceBlock(&in, eblk, target));
        PutInode(in);
      }
    }
  }
  // From the end down, mapped blocks only (one step per block, each under
  // its own hold of mu_ and room in the journal).
  for (uint64_t i = old_blocks; i > keep;) {
    MutexLock l(&mu_);
    RETURN_IF_ERROR(EnsureRoom(16));
    ASSIGN_OR_RETURN(Inode in, GetInode(f->id.ino));
    ASSIGN_OR_RETURN(std::optional<uint64_t> last, LastMappedBelow(in, i));
    if (!last || *last < keep) break;
    RETURN_IF_ERROR(ReplaceBlock(&in, *last, 0));
    PutInode(in);
    i = *last;
  }
  MutexLock l(&mu_);
  // A grow drops nothing: journal room only (a full drop list must not
  // make it wait; FreeTree asks for its own room before each drop).
  RETURN_IF_ERROR(size < old_size ? EnsureRoom(16) : EnsureJournalRoom(16));
  ASSIGN_OR_RETURN(Inode in, GetInode(f->id.ino));
  if (size < old_size) RETURN_IF_ERROR(FreeTree(&in, keep));
  in.size = size;
  in.mtime_ns = clock_->NowNanos();
  PutInode(in);
  return Status::Ok();
}

Result<uint32_t> VolumeImpl::RefCountAt(OpenFileState* f, uint64_t index, bool may_wait) {
  MutexLock l(&mu_);
  ASSIGN_OR_RETURN(Inode in, GetInode(f->id.ino));
  ASSIGN_OR_RETURN(uint64_t p, GetPtr(in, index));
  if (p == 0) return uint32_t{0};
  // Exact, taking the group: the pass decides garbage on it, and the group
  // it takes here is the one its next drops land in, which then need no
  // deferral. A count read from the home block of a group another host
  // holds could be stale (its holder's journal may hold newer counts), so
  // without waiting there is no answer.
  const uint64_t addr = PtrAddr(p);
  uint32_t g;
  if (!may_wait && !read_only_ && GroupOf(addr, &g) && !cached_locks_.count(GroupLock(g))) {
    GroupTry got = GroupTry::kBusy;
    if (!LooksBusy(g)) {
      ASSIGN_OR_RETURN(got, TryTakeGroup(g));
    }
    if (got == GroupTry::kBusy) {
      return Status::Locked("allocation group " + std::to_string(g) + " of block " +
                            std::to_string(addr) + " is held by another process or host");
    }
  }
  return GetRef(addr);
}

Status VolumeImpl::TakeGroupOfBlock(OpenFileState* f, uint64_t index) {
  MutexLock l(&mu_);
  if (read_only_) return Status::Ok();  // no group is ever taken
  ASSIGN_OR_RETURN(Inode in, GetInode(f->id.ino));
  ASSIGN_OR_RETURN(uint64_t p, GetPtr(in, index));
  if (p == 0) return Status::Ok();
  const uint64_t addr = PtrAddr(p);
  uint32_t g;
  if (!GroupOf(addr, &g)) {
    return Status::Corruption("block pointer " + std::to_string(addr) + " of '" + in.name +
                              "' is outside the data area");
  }
  return TakeGroupNoWait(addr);
}

Status VolumeImpl::TryPrepareDrop(uint64_t addr) {
  // With drop lists a drop whose group is busy is deferred: never a wait.
  if (sb_.drop_blocks != 0) return PrepareDrop(addr);
  if (addr == 0) return Status::Ok();
  return TakeGroupNoWait(addr);
}

Status VolumeImpl::TakeGroupNoWait(uint64_t addr) {
  uint32_t g;
  if (!GroupOf(addr, &g)) {
    return Status::Corruption("block pointer " + std::to_string(addr) +
                              " is outside the data area");
  }
  if (cached_locks_.count(GroupLock(g))) return Status::Ok();
  GroupTry got = GroupTry::kBusy;
  if (!LooksBusy(g)) {
    ASSIGN_OR_RETURN(got, TryTakeGroup(g));
  }
  if (got == GroupTry::kTaken) return Status::Ok();
  AnnounceWant(g);
  return Status::Locked("allocation group " + std::to_string(g) + " of block " +
                        std::to_string(addr) + " is held by another process or host");
}

Result<FileUsage> VolumeImpl::UsageOf(OpenFileState* f) {
  MutexLock l(&mu_);
  ASSIGN_OR_RETURN(Inode in, GetInode(f->id.ino));
  FileUsage u;
  u.metadata_blocks = 1;
  uint64_t nblocks = (in.size + kBlockSize - 1) / kBlockSize;
  // Refcount blocks read from home, once each: per block, a 40 GiB disk
  // took minutes (`dede ls -l` on a read-only open), holding the file's
  // lock meanwhile, so its VM could not start.
  std::unordered_map<uint64_t, BlockBuf> read_home;
  // Walk leaf by leaf rather than index by index: sparse files are cheap.
  std::function<Status(uint64_t, uint32_t, uint64_t)> walk =
      [&](uint64_t addr, uint32_t level, uint64_t base) NO_THREAD_SAFETY_ANALYSIS -> Status {
    RETURN_IF_ERROR(LoadPointerBlock(addr, level, InodeLock(in.ino)).status());
    u.metadata_blocks++;
    for (uint32_t s = 0; s < kPointersPerBlock; s++) {
      uint64_t p = dede::GetPtr(cache_.at(addr).data.get(), s);
      uint64_t idx = base + s * Span(level);
      if (p == 0 || idx >= nblocks) continue;
      if (level > 1) {
        ASSIGN_OR_RETURN(const uint64_t child,
                         ChildPointer(cache_.at(addr).data.get(), addr, s, InodeLock(in.ino)));
        RETURN_IF_ERROR(walk(child, level - 1, idx));
        continue;
      }
      ASSIGN_OR_RETURN(uint32_t refs, PeekRef(PtrAddr(p), &read_home));
      u.mapped_blocks++;
      if (refs > 1) {
        u.shared_blocks++;
        u.saved_bytes += kBlockSize - kBlockSize / refs;
      } else {
        u.unique_blocks++;
      }
    }
    return Status::Ok();
  };
  if (in.depth > 0) RETURN_IF_ERROR(walk(in.root, in.depth, 0));
  return u;
}

// ======================================================= DeDe's primitives

namespace {
// Files of one volume in inode order, so two-file operations lock in order.
std::pair<OpenFileState*, OpenFileState*> Ordered(OpenFileState* a, OpenFileState* b) {
  return a->id.ino <= b->id.ino ? std::make_pair(a, b) : std::make_pair(b, a);
}
}  // namespace

Status VolumeImpl::CompareAndShare(File* src, uint64_t src_index, File* dst, uint64_t dst_index,
                                   VerifyMode mode, const Fingerprint* witness) {
  auto* s = static_cast<FileImpl*>(src)->state();
  auto* d = static_cast<FileImpl*>(dst)->state();
  if (mode == VerifyMode::kHashWitness) {
    if (witness == nullptr) return Status::Invalid("hash witness missing");
    if (sb_.hash_algo != HashAlgo::kSha256) {
      return Status::Invalid("hash witnesses need a volume formatted with --hash sha256");
    }
  }
  auto [lo, hi] = Ordered(s, d);
  WriterLock l1(&lo->rw);
  std::unique_ptr<WriterLock> l2;
  if (hi != lo) l2 = std::make_unique<WriterLock>(&hi->rw);
  uint64_t sp, dp;
  {
    MutexLock l(&mu_);
    RETURN_IF_ERROR(CheckWritable());
    ASSIGN_OR_RETURN(Inode sin, GetInode(s->id.ino));
    ASSIGN_OR_RETURN(Inode din, GetInode(d->id.ino));
    if (!WholeBlockInside(src_index, sin.size) || !WholeBlockInside(dst_index, din.size)) {
      return Status::Invalid("compare_and_share: only whole blocks inside both files can be "
                             "shared");
    }
    if (OptedOut(sin) || OptedOut(din)) return OptedOutMismatch("compare_and_share");
    ASSIGN_OR_RETURN(sp, GetPtr(sin, src_index));
    ASSIGN_OR_RETURN(dp, GetPtr(din, dst_index));
  }
  if (sp == 0 || dp == 0) return Status::Mismatch("compare_and_share: a block is a hole");
  if (PtrAddr(sp) == PtrAddr(dp)) return Status::Ok();
  // Both file locks are held exclusively: neither block can change while we
  // compare (writers need the file lock), so the check and the swap are
  // atomic with respect to every writer.
  BlockBuf a = NewBlockBuf(2);
  RETURN_IF_ERROR(dev_->Read(PtrAddr(sp) * kBlockSize, a.get(), kBlockSize));
  RETURN_IF_ERROR(dev_->Read(PtrAddr(dp) * kBlockSize, a.get() + kBlockSize, kBlockSize));
  if (mode == VerifyMode::kByteCompare) {
    if (std::memcmp(a.get(), a.get() + kBlockSize, kBlockSize) != 0) {
      return Status::Mismatch("compare_and_share: contents differ");
    }
  } else {
    if (!(ComputeFingerprint(sb_.hash_algo, a.get(), kBlockSize) == *witness) ||
        !(ComputeFingerprint(sb_.hash_algo, a.get() + kBlockSize, kBlockSize) == *witness)) {
      return Status::Mismatch("compare_and_share: content does not match the witness");
    }
  }
  MutexLock l(&mu_);
  RETURN_IF_ERROR(EnsureRoom(32));
  // Past this point a failure (a metadata read error) would leave the share
  // half-done in the running transaction: poison instead (ApplyBlockOps).
  // The group locks first: failing to get one (another host holds it)
  // changes nothing.
  RETURN_IF_ERROR(AcquireGroupsFor({PtrAddr(sp)}));
  RETURN_IF_ERROR(RefusedIfSaturated(PtrAddr(sp), "compare_and_share"));
  RETURN_IF_ERROR(PrepareDrops({PtrAddr(dp)}));
  auto apply = [&]() REQUIRES(mu_) -> Status {
    ASSIGN_OR_RETURN(Inode sin, GetInode(s->id.ino));
    RETURN_IF_ERROR(AddRef(PtrAddr(sp), +1));
    if (!PtrCow(sp)) RETURN_IF_ERROR(SetPtr(&sin, src_index, sp | kPtrCow));
    PutInode(sin);
    ASSIGN_OR_RETURN(Inode din, GetInode(d->id.ino));
    RETURN_IF_ERROR(ReplaceBlock(&din, dst_index, PtrAddr(sp) | kPtrCow));
    PutInode(din);
    return Status::Ok();
  };
  return Poison(apply());
}

Status VolumeImpl::CloneBlock(File* src, uint64_t src_index, File* dst, uint64_t dst_index,
                              const BlockOpsOptions& options) {
  const bool may_wait = !options.no_wait;
  auto* s = static_cast<FileImpl*>(src)->state();
  auto* d = static_cast<FileImpl*>(dst)->state();
  auto [lo, hi] = Ordered(s, d);
  WriterLock l1(&lo->rw);
  std::unique_ptr<WriterLock> l2;
  if (hi != lo) l2 = std::make_unique<WriterLock>(&hi->rw);
  MutexLock l(&mu_);
  RETURN_IF_ERROR(CheckWritable());
  ASSIGN_OR_RETURN(Inode sin, GetInode(s->id.ino));
  // Only whole blocks: the bytes past EOF in a file's last block are always
  // zero, and a clone into or out of a partial block would break that.
  if (!WholeBlockInside(src_index, sin.size)) {
    return Status::Invalid("clone_block: source block is not a whole block inside the file");
  }
  ASSIGN_OR_RETURN(uint64_t sp, GetPtr(sin, src_index));
  {
    ASSIGN_OR_RETURN(Inode din, GetInode(d->id.ino));
    if (!WholeBlockInside(dst_index, din.size)) {
      return Status::Invalid("clone_block: destination block is not a whole block inside the "
                             "file");
    }
    if (OptedOut(sin) || OptedOut(din)) return OptedOutMismatch("clone_block");
    ASSIGN_OR_RETURN(uint64_t dp, GetPtr(din, dst_index));
    if (sp != 0 && PtrAddr(dp) == PtrAddr(sp)) return Status::Ok();
    // Room before any change (it may commit, or give every cached lock
    // back to wait; the inodes read above stay as they are: both files'
    // locks are held). Only a clone over a mapped block drops a reference:
    // a clone into a hole (a split's new arena block, a merge request's)
    // asks for no drop-list room, so a full drop list never holds it up.
    // Without may_wait a full list that cannot be drained without waiting
    // is kLocked here.
    if (dp != 0) {
      RETURN_IF_ERROR(EnsureRoom(32, may_wait));
    } else {
      RETURN_IF_ERROR(EnsureJournalRoom(32));
    }
    if (sp != 0 && dp == 0) {
      // The destination's map path first, before the group locks (an
      // allocation that waits gives cached locks back): a full volume
      // fails the clone here, with nothing changed, instead of poisoning
      // the volume half-way (a merge post or an arena clone into a new
      // part of its file, on a nearly full volume). Even without may_wait
      // this allocation may wait, when every group is full or busy (the
      // allocator's last resort, docs/LOCKING.md); and a clone held back
      // after it keeps the grown (empty) map path.
      Status path = EnsureMapPath(&din, dst_index);
      PutInode(din);
      RETURN_IF_ERROR(path);
      // (A clone within one file: the source's copy of the inode predates
      // the growth.)
      if (d->id.ino == s->id.ino) {
        ASSIGN_OR_RETURN(sin, GetInode(s->id.ino));
      }
    }
    if (sp != 0) {
      // Without may_wait, a source group held elsewhere is kLocked, the
      // want announced (docs/LOCKING.md "Increments without waiting").
      RETURN_IF_ERROR(may_wait ? AcquireGroupsFor({PtrAddr(sp)}) : TakeGroupNoWait(PtrAddr(sp)));
      RETURN_IF_ERROR(RefusedIfSaturated(PtrAddr(sp), "clone_block"));
    }
    RETURN_IF_ERROR(may_wait ? PrepareDrops({PtrAddr(dp)}) : TryPrepareDrop(PtrAddr(dp)));
  }
  // A failure past this point would leave the clone half-done: poison.
  auto apply = [&]() REQUIRES(mu_) -> Status {
    if (sp != 0) {
      RETURN_IF_ERROR(AddRef(PtrAddr(sp), +1));
      if (!PtrCow(sp)) {
        RETURN_IF_ERROR(SetPtr(&sin, src_index, sp | kPtrCow));
        PutInode(sin);
      }
    }
    ASSIGN_OR_RETURN(Inode din, GetInode(d->id.ino));
    RETURN_IF_ERROR(ReplaceBlock(&din, dst_index, sp == 0 ? 0 : (PtrAddr(sp) | kPtrCow)));
    PutInode(din);
    return Status::Ok();
  };
  return Poison(apply());
}

Volume::ReadBuffer::~ReadBuffer() { std::free(data_); }

Status VolumeImpl::ApplyBlockOps(std::vector<BlockOp>* ops, VerifyMode mode, ReadBuffer* buffer,
                                 const BlockOpsOptions& options) {
  using Kind = BlockOp::Kind;
  if (ops->empty()) return Status::Ok();
  if (mode == VerifyMode::kHashWitness && sb_.hash_algo != HashAlgo::kSha256) {
    return Status::Invalid("hash witnesses need a volume formatted with --hash sha256");
  }
  auto state = [](File* f) { return f ? static_cast<FileImpl*>(f)->state() : nullptr; };
  // Every file of the batch, locked exclusively in inode order.
  std::vector<OpenFileState*> files;
  files.reserve(2 * ops->size());
  for (const BlockOp& op : *ops) {
    if (op.src) files.push_back(state(op.src));
    files.push_back(state(op.dst));
  }
  std::sort(files.begin(), files.end(),
            [](OpenFileState* a, OpenFileState* b) { return a->id.ino < b->id.ino; });
  files.erase(std::unique(files.begin(), files.end()), files.end());
  std::vector<std::unique_ptr<WriterLock>> held;
  for (OpenFileState* f : files) held.push_back(std::make_unique<WriterLock>(&f->rw));
  auto file_of = [&](File* f) -> uint32_t {
    const uint64_t ino = state(f)->id.ino;
    auto it = std::lower_bound(files.begin(), files.end(), ino,
                               [](OpenFileState* a, uint64_t i) { return a->id.ino < i; });
    return static_cast<uint32_t>(it - files.begin());
  };

  // The files' inodes, decoded once for the batch. Only this call changes
  // them while it runs (it holds every file's lock), and it stores each
  // change as it makes it, so these copies stay equal to the cached blocks.
  std::vector<Inode> inodes(files.size());
  // Plan: every position's pointer now (`now`); later operations see
  // earlier ones through `after` (evaluated below, once the contents are
  // known). Nodes of an unordered_map do not move: each operation keeps
  // pointers to its two positions.
  struct Pos {
    uint64_t ino, index;
    bool operator==(const Pos& o) const { return ino == o.ino && index == o.index; }
  };
  struct PosHash {
    size_t operator()(const Pos& p) const {
      return std::hash<uint64_t>()(p.ino * 0x9E3779B97F4A7C15ull ^ p.index);
    }
  };
  struct Ptrs {
    uint64_t now = 0, after = 0;
  };
  std::unordered_map<Pos, Ptrs, PosHash> pos;
  pos.reserve(2 * ops->size());
  struct OpPlan {
    uint32_t src_file = 0, dst_file = 0;
    Ptrs* src = nullptr;
    Ptrs* dst = nullptr;
  };
  std::vector<OpPlan> plan(ops->size());
  std::vector<uint64_t> addrs;
  addrs.reserve(2 * ops->size());
  {
    MutexLock l(&mu_);
    RETURN_IF_ERROR(CheckWritable());
    for (size_t i = 0; i < files.size(); i++) {
      ASSIGN_OR_RETURN(inodes[i], GetInode(files[i]->id.ino));
    }
    auto position = [&](const Inode& in, uint64_t index, Ptrs** out) REQUIRES(mu_) -> Status {
      auto [it, fresh] = pos.try_emplace(Pos{in.ino, index});
      if (fresh) {
        ASSIGN_OR_RETURN(it->second.now, GetPtr(in, index));
        it->second.after = it->second.now;
        if (it->second.now) addrs.push_back(PtrAddr(it->second.now));
      }
      *out = &it->second;
      return Status::Ok();
    };
    for (size_t k = 0; k < ops->size(); k++) {
      BlockOp& op = (*ops)[k];
      OpPlan& p = plan[k];
      op.result = Status::Ok();
      op.changed = false;
      const bool two = op.kind != Kind::kPunchIfZero;
      if (two && op.src == nullptr) {
        op.result = Status::Invalid("block op without a source");
        continue;
      }
      p.dst_file = file_of(op.dst);
      const Inode& din = inodes[p.dst_file];
      bool whole = WholeBlockInside(op.dst_index, din.size);
      if (two) {
        p.src_file = file_of(op.src);
        whole = whole && WholeBlockInside(op.src_index, inodes[p.src_file].size);
      }
      if (!whole) {
        op.result = Status::Invalid("block ops work on whole blocks inside their files only");
        continue;
      }
      if (two && (OptedOut(din) || OptedOut(inodes[p.src_file]))) {
        op.result = OptedOutMismatch("block op");
        continue;
      }
      RETURN_IF_ERROR(position(din, op.dst_index, &p.dst));
      if (two) RETURN_IF_ERROR(position(inodes[p.src_file], op.src_index, &p.src));
    }
  }

  // Read every block involved once, merging neighbours into big reads.
  std::sort(addrs.begin(), addrs.end());
  addrs.erase(std::unique(addrs.begin(), addrs.end()), addrs.end());
  constexpr uint64_t kMaxRun = 256;  // blocks per read
  constexpr uint64_t kMaxGap = 8;    // unneeded blocks worth reading over
  struct Run {
    uint64_t first, count, at;  // at: block offset in `data`
  };
  std::vector<Run> runs;
  uint64_t total = 0;
  for (size_t i = 0; i < addrs.size();) {
    size_t j = i + 1;
    while (j < addrs.size() && addrs[j] - addrs[j - 1] <= kMaxGap + 1 &&
           addrs[j] - addrs[i] < kMaxRun) {
      j++;
    }
    runs.push_back(Run{addrs[i], addrs[j - 1] - addrs[i] + 1, total});
    total += runs.back().count;
    i = j;
  }
  // One buffer for the batch: many differently sized buffers fragment the
  // heap badly (and the process keeps the pages). The caller's buffer, when
  // it has one, is reused across batches (see ReadBuffer).
  BlockBuf owned;
  uint8_t* data;
  const uint64_t need = std::max<uint64_t>(total, 1);
  if (buffer != nullptr) {
    if (buffer->blocks_ < need) {
      std::free(buffer->data_);
      buffer->data_ = NewBlockBuf(need).release();
      buffer->blocks_ = buffer->data_ ? need : 0;
      if (buffer->data_ == nullptr) return Status::NoSpace("out of memory for a block batch");
    }
    data = buffer->data_;
  } else {
    owned = NewBlockBuf(need);
    data = owned.get();
  }
  for (const Run& r : runs) {
    RETURN_IF_ERROR(dev_->Read(r.first * kBlockSize, data + r.at * kBlockSize,
                               r.count * kBlockSize));
  }
  auto content = [&](uint64_t addr) -> const uint8_t* {
    auto it = std::upper_bound(runs.begin(), runs.end(), addr,
                               [](uint64_t a, const Run& r) { return a < r.first; });
    const Run& r = *(it - 1);
    return data + (r.at + addr - r.first) * kBlockSize;
  };

  // Decide, in order, on the pointers as the earlier decisions left them.
  std::vector<std::pair<uint64_t, uint64_t>> decided(ops->size(), {0, 0});  // (sp, dp) seen
  for (size_t k = 0; k < ops->size(); k++) {
    BlockOp& op = (*ops)[k];
    if (!op.result.ok()) continue;
    const OpPlan& p = plan[k];
    const uint64_t dp = p.dst->after;
    if (op.kind == Kind::kPunchIfZero) {
      if (dp == 0) continue;  // already a hole
      if (!IsAllZero(content(PtrAddr(dp)), kBlockSize)) {
        op.result = Status::Mismatch("punch_if_zero: block is not all zeros");
        continue;
      }
      decided[k] = {0, dp};
      p.dst->after = 0;
      continue;
    }
    const uint64_t sp = p.src->after;
    if (sp == 0 || (op.kind == Kind::kShare && dp == 0)) {
      op.result = Status::Mismatch("a block is a hole");
      continue;
    }
    if (dp != 0 && PtrAddr(sp) == PtrAddr(dp)) continue;  // already shared
    const uint8_t* a = content(PtrAddr(sp));
    bool same;
    if (op.kind == Kind::kCloneIfHash) {
      same = ComputeFingerprint(sb_.hash_algo, a, kBlockSize) == op.witness;
    } else if (mode == VerifyMode::kByteCompare) {
      same = std::memcmp(a, content(PtrAddr(dp)), kBlockSize) == 0;
    } else {
      same = ComputeFingerprint(sb_.hash_algo, a, kBlockSize) == op.witness &&
             ComputeFingerprint(sb_.hash_algo, content(PtrAddr(dp)), kBlockSize) == op.witness;
    }
    if (!same) {
      op.result = Status::Mismatch(op.kind == Kind::kCloneIfHash
                                       ? "clone_if_hash: content does not match"
                                       : "compare_and_share: contents differ");
      continue;
    }
    decided[k] = {sp, dp};
    p.src->after = sp | kPtrCow;
    p.dst->after = PtrAddr(sp) | kPtrCow;
  }

  // Apply the decisions. The file locks are still held, so the pointers
  // are what the decisions saw. Each operation is its own step, as if made
  // alone: room in the journal first, then its changes, then the inodes it
  // changed go back into their blocks, so a commit (which only ever happens
  // in EnsureRoom or a lock release, between operations) sees whole
  // operations. mu_ is held for up to kOpsPerLock operations at a time
  // (other files' writers wait for it meanwhile). An operation that fails
  // half-way (a metadata read error after its refcount changed) cannot be
  // undone in the running transaction: the volume is poisoned, so that
  // transaction never commits and a reopen (journal replay) sees none of
  // it.
  constexpr size_t kOpsPerLock = 64;
  // Stores an inode whose block map the operation changed (root, depth or
  // mapped blocks); an unchanged one is not rewritten.
  struct MapShape {
    uint64_t root, mapped;
    uint8_t depth;
    explicit MapShape(const Inode& in) : root(in.root), mapped(in.mapped_blocks), depth(in.depth) {}
    bool Same(const Inode& in) const {
      return root == in.root && mapped == in.mapped_blocks && depth == in.depth;
    }
  };
  auto store = [&](const Inode& in, const MapShape& before) REQUIRES(mu_) -> Status {
    if (before.Same(in)) return Status::Ok();
    uint8_t* b;
    RETURN_IF_ERROR(Load(sb_.InodeBlock(in.ino), InodeLock(in.ino), kMagicInode, "inode", &b));
    PutInode(in);
    return Status::Ok();
  };
  //
  // With options.no_wait, an operation whose source block's group is held
  // elsewhere is held back (kLocked) before it changes anything, and so is
  // every later operation that involves a position a held-back one would
  // have changed: the decisions above assumed every earlier operation
  // applied, and the pointer checks below would otherwise find a pointer
  // that an operation held back did not change (and poison the volume).
  // An operation that involves only positions untouched by held-back ones
  // finds exactly the pointers it was decided on.
  const bool no_wait = options.no_wait;
  std::unordered_set<const Ptrs*> held_back;  // positions held-back operations involve
  std::set<uint32_t> busy_groups;             // found held elsewhere during this call
  auto hold_back = [&](BlockOp& op, const OpPlan& p, const char* why) {
    op.result = Status::Locked(std::string("block op: ") + why);
    op.changed = false;
    if (p.src != nullptr) held_back.insert(p.src);
    if (p.dst != nullptr) held_back.insert(p.dst);
  };
  size_t k = 0;
  while (k < ops->size()) {
    MutexLock l(&mu_);
    for (size_t n = 0; n < kOpsPerLock && k < ops->size(); k++) {
      BlockOp& op = (*ops)[k];
      const OpPlan& p = plan[k];
      const uint64_t sp = decided[k].first;
      const uint64_t dp = decided[k].second;
      // (Operations refused while planning have no positions.)
      if (!held_back.empty() && p.dst != nullptr &&
          (held_back.count(p.dst) || (p.src != nullptr && held_back.count(p.src)))) {
        hold_back(op, p, "an earlier operation on one of its blocks was held back");
        continue;
      }
      if (!op.result.ok() || (sp == 0 && dp == 0)) continue;
      n++;
      RETURN_IF_ERROR(CheckWritable());
      uint32_t src_group = 0;
      const bool src_in_group = op.kind != Kind::kPunchIfZero && GroupOf(PtrAddr(sp), &src_group);
      // The destination's map path (a clone into a hole), as a step of its
      // own before the operation's first change and before its group locks
      // (an allocation that waits gives cached locks back): a pointer block
      // the volume has no room for fails this operation alone, where it
      // used to poison the volume half-way. False: the operation failed.
      auto map_path = [&]() REQUIRES(mu_) -> Result<bool> {
        if (op.kind == Kind::kPunchIfZero || dp != 0) return true;
        Inode& din = inodes[plan[k].dst_file];
        const MapShape before(din);
        Status path = EnsureMapPath(&din, op.dst_index);
        RETURN_IF_ERROR(store(din, before));
        if (path.ok()) return true;
        if (path.code() == Status::Code::kNoSpace) {
          op.result = path;
          op.changed = false;
          // Later operations on either position assumed this one (the
          // source's planned pointer carries the copy-on-write bit).
          if (p.src != nullptr) held_back.insert(p.src);
          held_back.insert(p.dst);
          return false;
        }
        if (path.code() == Status::Code::kLocked) {
          hold_back(op, p, path.message().c_str());
          return false;
        }
        return path;
      };
      if (no_wait) {
        if (src_in_group && busy_groups.count(src_group)) {
          hold_back(op, p, "the source block's allocation group is held elsewhere");
          continue;
        }
        // Drop-list room only for an operation that drops a reference
        // (a clone into a hole, such as a new arena block, drops none).
        if (Status room = dp != 0 ? EnsureRoom(32, /*may_wait=*/false) : EnsureJournalRoom(32);
            !room.ok()) {
          if (room.code() != Status::Code::kLocked) return room;
          hold_back(op, p, room.message().c_str());
          continue;
        }
        ASSIGN_OR_RETURN(const bool mapped, map_path());
        if (!mapped) continue;
        if (src_in_group && !cached_locks_.count(GroupLock(src_group))) {
          bool taken = false;
          if (!LooksBusy(src_group)) {
            ASSIGN_OR_RETURN(GroupTry got, TryTakeGroup(src_group));
            taken = got == GroupTry::kTaken;
          }
          if (!taken) {
            // Ask the holder to hand it over at its flush point; the group
            // then waits for us (TryTakeGroup's reserving hand-over).
            AnnounceWant(src_group);
            busy_groups.insert(src_group);
            hold_back(op, p, "the source block's allocation group is held elsewhere");
            continue;
          }
        }
      } else {
        RETURN_IF_ERROR(EnsureRoom(32));
        ASSIGN_OR_RETURN(const bool mapped, map_path());
        if (!mapped) continue;
        // Group locks before any change: not getting one changes nothing.
        if (op.kind != Kind::kPunchIfZero) RETURN_IF_ERROR(AcquireGroupOf(PtrAddr(sp)));
      }
      // A source block with as many references as a count holds (2^32 - 1:
      // 16 TiB of one 4 KiB pattern) cannot take one more: this operation
      // fails alone, before any change (it poisoned the volume, at every
      // pass that planned the share again).
      if (op.kind != Kind::kPunchIfZero) {
        // A failed read here, after earlier operations of the batch changed
        // blocks, poisons as the increment's own read did.
        Result<bool> saturated = RefSaturated(PtrAddr(sp));
        if (!saturated.ok()) {
          return Poison(
              saturated.status().WithContext("applying block operation " + std::to_string(k)));
        }
        if (*saturated) {
          op.result = Status::Mismatch("block op: block " + std::to_string(PtrAddr(sp)) +
                                       " has the most references a count holds");
          op.changed = false;
          if (p.src != nullptr) held_back.insert(p.src);
          held_back.insert(p.dst);
          continue;
        }
      }
      // (The destination's old block is only dropped: never waited for,
      // unless the volume has no drop lists: then a drop needs its group,
      // and with no_wait one held elsewhere holds the operation back.)
      if (no_wait) {
        Status drop = TryPrepareDrop(PtrAddr(dp));
        if (drop.code() == Status::Code::kLocked) {
          hold_back(op, p, drop.message().c_str());
          continue;
        }
        RETURN_IF_ERROR(drop);
      } else {
        RETURN_IF_ERROR(PrepareDrop(PtrAddr(dp)));
      }
      Inode& din = inodes[plan[k].dst_file];
      auto apply = [&]() REQUIRES(mu_) -> Status {
        ASSIGN_OR_RETURN(uint64_t cur_dp, GetPtr(din, op.dst_index));
        if (cur_dp != dp) {
          return Status::Corruption("block op: destination pointer changed under lock");
        }
        if (op.kind == Kind::kPunchIfZero) {
          const MapShape before(din);
          RETURN_IF_ERROR(ReplaceBlock(&din, op.dst_index, 0));
          return store(din, before);
        }
        Inode& sin = inodes[plan[k].src_file];  // may be din: the same file
        ASSIGN_OR_RETURN(uint64_t cur_sp, GetPtr(sin, op.src_index));
        if (PtrAddr(cur_sp) != PtrAddr(sp)) {
          return Status::Corruption("block op: source pointer changed under lock");
        }
        RETURN_IF_ERROR(AddRef(PtrAddr(sp), +1));
        const MapShape sbefore(sin);
        if (!PtrCow(cur_sp)) RETURN_IF_ERROR(SetPtr(&sin, op.src_index, cur_sp | kPtrCow));
        RETURN_IF_ERROR(store(sin, sbefore));
        const MapShape dbefore(din);
        RETURN_IF_ERROR(ReplaceBlock(&din, op.dst_index, PtrAddr(sp) | kPtrCow));
        return store(din, dbefore);
      };
      Status st = apply();
      if (!st.ok()) return Poison(st.WithContext("applying block operation " + std::to_string(k)));
      op.changed = true;
    }
  }
  return Status::Ok();
}

// =================================================================== stats

Result<VolumeStats> VolumeImpl::Stats() {
  VolumeStats st;
  st.total_blocks = sb_.total_blocks;
  st.data_blocks = sb_.DataBlocks();
  st.inodes_total = sb_.inode_count;
  st.fixed_metadata_blocks = sb_.group_start;
  for (uint32_t g = 0; g < sb_.group_count; g++) st.fixed_metadata_blocks += sb_.GroupRefBlocks(g);
  // A group's refcount blocks in one read, then the ones this process has
  // cached (newer than home) copied over them.
  BlockBuf buf;
  std::vector<bool> cached;
  for (uint32_t g = 0; g < sb_.group_count; g++) {
    uint64_t count = sb_.GroupDataBlocks(g);
    ASSIGN_OR_RETURN(const uint32_t ref_blocks, ReadGroupRefBlocks(g, &buf));
    cached.assign(ref_blocks, false);
    {
      MutexLock l(&mu_);
      for (uint32_t r = 0; r < ref_blocks; r++) {
        auto it = cache_.find(sb_.GroupStart(g) + r);
        if (it == cache_.end()) continue;
        std::memcpy(buf.get() + uint64_t{r} * kBlockSize, it->second.data.get(), kBlockSize);
        cached[r] = true;
      }
    }
    for (uint32_t r = 0; r < ref_blocks; r++) {
      uint64_t rb = sb_.GroupStart(g) + r;
      uint8_t* b = buf.get() + uint64_t{r} * kBlockSize;
      if (!cached[r]) RETURN_IF_ERROR(Admit(b, rb, kMagicRefcountBlock, "refcount block"));
      for (uint32_t s = 0; s < kRefsPerBlock && uint64_t{r} * kRefsPerBlock + s < count; s++) {
        uint32_t refs = dede::GetRef(b, s);
        if (refs == 0) st.free_blocks++;
        if (refs > 0) st.used_blocks++;
        if (refs > 1) st.shared_blocks++;
      }
    }
  }
  if (sb_.drop_blocks > 0) {
    for (uint32_t h = 1; h <= sb_.max_hosts; h++) {
      if (h == host_ && !read_only_) {
        MutexLock l(&mu_);
        st.pending_drops += drop_count_;
        continue;
      }
      ASSIGN_OR_RETURN(auto lists, ReadDropList(h, nullptr));
      for (const auto& e : lists) st.pending_drops += e.size();
    }
  }
  ASSIGN_OR_RETURN(std::vector<Inode> inodes, ScanInodes());
  for (const Inode& in : inodes) {
    if (!in.in_use()) continue;
    st.files++;
    st.logical_blocks += in.mapped_blocks;
  }
  // Pointer blocks are the used blocks that no file maps as data: every
  // data reference is counted in some refcount, so used = distinct data
  // blocks + pointer blocks. Count them by walking the maps.
  std::function<Status(uint64_t, uint32_t)> walk = [&](uint64_t addr, uint32_t level) -> Status {
    st.pointer_blocks++;
    if (level == 1) return Status::Ok();
    BlockBuf pb = NewBlockBuf();
    bool cached = false;
    {
      MutexLock l(&mu_);
      auto it = cache_.find(addr);
      if (it != cache_.end()) {
        std::memcpy(pb.get(), it->second.data.get(), kBlockSize);
        cached = true;
      }
    }
    if (!cached) {
      RETURN_IF_ERROR(dev_->Read(addr * kBlockSize, pb.get(), kBlockSize));
      RETURN_IF_ERROR(CheckBlock(pb.get(), kMagicPointerBlock, addr, sb_.uuid, "pointer block"));
    }
    if (PeekHeader(pb.get()).flags != level) {
      return Status::Corruption("pointer block at block " + std::to_string(addr) + " has level " +
                                std::to_string(PeekHeader(pb.get()).flags) + ", expected " +
                                std::to_string(level));
    }
    for (uint32_t s = 0; s < kPointersPerBlock; s++) {
      uint64_t p = dede::GetPtr(pb.get(), s);
      if (p) RETURN_IF_ERROR(walk(PtrAddr(p), level - 1));
    }
    return Status::Ok();
  };
  for (const Inode& in : inodes) {
    if (in.in_use() && in.depth > 0) RETURN_IF_ERROR(walk(in.root, in.depth));
  }
  return st;
}

}  // namespace dede
