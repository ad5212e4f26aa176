#include "agent/export_table.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <optional>
#include <thread>

#include "kmod/writemon/write_log.h"
#include "util/io_buffer.h"
#include "util/log.h"
#include "volume/format.h"

namespace dede {

// ------------------------------------------------------------ BlockRangeLock

// The condition variable needs the native mutex; the analysis cannot follow
// std::unique_lock, so these two are checked by hand: held_ is only touched
// with mu_ locked.
void BlockRangeLock::Lock(uint64_t first_block, uint64_t last_block) NO_THREAD_SAFETY_ANALYSIS {
  std::unique_lock<std::mutex> l(mu_.native());
  cv_.wait(l, [&]() NO_THREAD_SAFETY_ANALYSIS { return !OverlapsLocked(first_block, last_block); });
  held_.emplace(first_block, last_block);
}

void BlockRangeLock::Unlock(uint64_t first_block, uint64_t last_block) NO_THREAD_SAFETY_ANALYSIS {
  {
    std::lock_guard<std::mutex> l(mu_.native());
    auto [lo, hi] = held_.equal_range(first_block);
    for (auto it = lo; it != hi; ++it) {
      if (it->second == last_block) {
        held_.erase(it);
        break;
      }
    }
  }
  cv_.notify_all();
}

bool BlockRangeLock::OverlapsLocked(uint64_t first, uint64_t last) {
  // A handful of writes are in flight per export: a scan is cheapest.
  for (auto it = held_.begin(); it != held_.end() && it->first <= last; ++it) {
    if (it->second >= first) return true;
  }
  return false;
}

// ------------------------------------------------------------ AnsweredWrites

// As for BlockRangeLock: the condition variable needs the native mutex.
uint64_t AnsweredWrites::Add(uint64_t first_block, uint64_t last_block) NO_THREAD_SAFETY_ANALYSIS {
  std::lock_guard<std::mutex> l(mu_.native());
  const uint64_t ticket = next_ticket_++;
  pending_.emplace(ticket, std::make_pair(first_block, last_block));
  return ticket;
}

void AnsweredWrites::Done(uint64_t ticket) NO_THREAD_SAFETY_ANALYSIS {
  {
    std::lock_guard<std::mutex> l(mu_.native());
    pending_.erase(ticket);
  }
  cv_.notify_all();
}

void AnsweredWrites::WaitForOverlapping(uint64_t first_block,
                                        uint64_t last_block) NO_THREAD_SAFETY_ANALYSIS {
  std::unique_lock<std::mutex> l(mu_.native());
  cv_.wait(l, [&]() NO_THREAD_SAFETY_ANALYSIS {
    for (const auto& [ticket, blocks] : pending_) {
      if (blocks.first <= last_block && blocks.second >= first_block) return false;
    }
    return true;
  });
}

void AnsweredWrites::WaitForEarlier() NO_THREAD_SAFETY_ANALYSIS {
  std::unique_lock<std::mutex> l(mu_.native());
  const uint64_t before = next_ticket_;
  cv_.wait(l, [&]() NO_THREAD_SAFETY_ANALYSIS {
    return pending_.empty() || pending_.begin()->first >= before;
  });
}

namespace {
class RangeGuard {
 public:
  RangeGuard(BlockRangeLock* l, uint64_t offset, uint64_t len)
      : l_(l), first_(offset / kBlockSize), last_((offset + std::max<uint64_t>(len, 1) - 1) / kBlockSize) {
    l_->Lock(first_, last_);
  }
  ~RangeGuard() { l_->Unlock(first_, last_); }

 private:
  BlockRangeLock* l_;
  uint64_t first_, last_;
};
}  // namespace

// -------------------------------------------------------------------- Export

Export::Export(std::string name, std::unique_ptr<File> file, const FileInfo& info, Volume* vol,
               WriteMonitor* monitor, WriteMonitor::FileHandle monitored, size_t read_ahead_bytes,
               ReadAheadBudget* budget, LogFlusher* flusher)
    : name_(std::move(name)),
      id_(info.id),
      size_(info.size),
      dedup_(info.dedup),
      file_(std::move(file)),
      vol_(vol),
      monitor_(monitor),
      monitored_(std::move(monitored)),
      flusher_(flusher),
      read_ahead_([f = file_.get()](uint64_t off, void* buf, size_t len) { return f->Read(off, buf, len); },
                  info.size, read_ahead_bytes, budget) {}

Status Export::Read(uint64_t offset, size_t len, IoBytes* out) {
  // A write answered before its device write is done: its blocks are not
  // on the device yet (nor in a read-ahead window: see Write).
  if (len > 0) {
    answered_.WaitForOverlapping(offset / kBlockSize, (offset + len - 1) / kBlockSize);
  }
  if (lost_.load()) {
    MutexLock l(&lost_mu_);
    return lost_write_;
  }
  return read_ahead_.Read(offset, len, out);
}

Status Export::SetDedup(bool on) {
  MutexLock l(&dedup_mu_);
  if (dedup_.load() == on) return Status::Ok();
  RETURN_IF_ERROR(file_->SetDedup(on));
  if (!on) {
    // The monitor stops recording (and drops what it buffered) before the
    // marker goes in and the switch is made durable: records it took during
    // that sync used to be appended behind the marker, fingerprints in the
    // log of an opted-out file. A flush that took records before this
    // appends them before the marker (the flusher appends under the lock
    // the marker takes).
    dedup_ = false;
    if (monitor_) monitor_->SetDedup(id_, false);
    // The next pass must drop the file's index entries even if it logged
    // nothing (kLocked only while a pass has the log: the switch itself
    // stands, the marker is retried once). Through the flusher, which may
    // hold the log open.
    auto mark = [this] {
      const uint64_t now = Clock::Real()->NowNanos();
      return flusher_ ? flusher_->AppendOptOutMarker(id_, size_, now)
                      : AppendOptOutMarker(vol_, id_, size_, now);
    };
    Status marked = mark();
    if (marked.code() == Status::Code::kLocked) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      marked = mark();
    }
    if (!marked.ok()) LOG(kWarning) << "export '" << name_ << "': opt-out marker: " << marked.ToString();
  }
  if (on) {
    // Recording starts before the switch is made durable, not after: once
    // file_->SetDedup took, the flag reaches the disk with the next flush
    // point even if this flush fails, and the file would then be dedup=on
    // with its writes recorded by nobody until the export closed. Records
    // of a file whose flag did not stick are harmless (a pass goes by the
    // inode's flag).
    dedup_ = true;
    if (monitor_) {
      monitor_->SetDedup(id_, true);
      if (size_ > 0) monitor_->OnInvalidate(monitored_, 0, size_);
    }
  }
  return file_->Flush();
}

Status Export::Write(uint64_t offset, const void* buf, size_t len, bool fua,
                     const std::function<void(const Status&)>& written,
                     const std::vector<Fingerprint>* fps) {
  Status st;
  {
    RangeGuard g(&ranges_, offset, len);
    if (written && !fua) {
      Result<std::unique_ptr<InPlaceWrite>> in_place = file_->PrepareInPlaceWrite(offset, len);
      if (!in_place.ok()) {
        st = in_place.status();
      } else if (*in_place) {
        // Answered first (see the header). No read-ahead window may keep
        // the old content past the answer; one read meanwhile is dropped
        // after the device write.
        read_ahead_.Invalidate(offset, len);
        const uint64_t ticket =
            answered_.Add(offset / kBlockSize, (offset + len - 1) / kBlockSize);
        answered_early_++;
        written(Status::Ok());
        st = (*in_place)->Write(buf);
        in_place->reset();
        read_ahead_.Invalidate(offset, len);
        if (!st.ok()) {
          {
            MutexLock l(&lost_mu_);
            if (lost_write_.ok()) lost_write_ = st;
          }
          lost_ = true;
        }
        answered_.Done(ticket);
        if (!st.ok()) {
          LOG(kError) << "export '" << name_ << "': write at " << offset << "+" << len
                      << " failed after it was answered: " << st.ToString()
                      << " (the volume stops taking writes; the next FLUSH reports it, and "
                         "every READ of the export fails from now on)";
        }
        if (monitor_) {
          if (st.ok()) {
            monitor_->OnWrite(monitored_, offset, buf, len, fps);
          } else {
            monitor_->OnInvalidate(monitored_, offset, len);
          }
        }
        return st;
      }
    }
    if (st.ok()) st = file_->Write(offset, buf, len);
    read_ahead_.Invalidate(offset, len);
    if (written) {
      // Answer now: fingerprinting is off the client's latency path. FUA's
      // flush point comes first, since the answer promises durability.
      if (st.ok() && fua) st = vol_->Sync();
      written(st);
      fua = false;
    }
    if (monitor_) {
      // A failed write leaves the blocks' content unknown: forget them.
      if (st.ok()) {
        monitor_->OnWrite(monitored_, offset, buf, len, fps);
      } else {
        monitor_->OnInvalidate(monitored_, offset, len);
      }
    }
  }
  if (st.ok() && fua) st = vol_->Sync();
  return st;
}

Status Export::Trim(uint64_t offset, uint64_t len, bool fua) {
  Status st;
  {
    RangeGuard g(&ranges_, offset, len);
    st = file_->Trim(offset, len);
    read_ahead_.Invalidate(offset, len);
    if (monitor_) monitor_->OnInvalidate(monitored_, offset, len);
  }
  if (st.ok() && fua) st = vol_->Sync();
  return st;
}

Status Export::WriteZeroes(uint64_t offset, uint64_t len, bool fua, bool no_hole) {
  if (!no_hole) return Trim(offset, len, fua);
  static constexpr size_t kChunk = 1 << 20;
  // Aligned, so that an O_DIRECT device writes it as it is (a plain
  // vector's storage went through the path device's bounce buffer, a copy
  // and an allocation per chunk). Never freed: reachable till exit.
  static const uint8_t* const zeros = [] {
    auto* p = static_cast<uint8_t*>(std::aligned_alloc(kIoAlign, kChunk));
    if (p == nullptr) throw std::bad_alloc();
    std::memset(p, 0, kChunk);
    return p;
  }();
  Status st;
  {
    RangeGuard g(&ranges_, offset, len);
    for (uint64_t done = 0; done < len && st.ok();) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, len - done));
      st = file_->Write(offset + done, zeros, n);
      done += n;
    }
    read_ahead_.Invalidate(offset, len);
    // Zero blocks are never worth sharing: drop, don't hash.
    if (monitor_) monitor_->OnInvalidate(monitored_, offset, len);
  }
  if (st.ok() && fua) st = vol_->Sync();
  return st;
}

Status Export::Flush() {
  answered_.WaitForEarlier();
  return vol_->Sync();
}

// --------------------------------------------------------------- ExportTable

ExportTable::ExportTable(Volume* vol, WriteMonitor* monitor, LogFlusher* flusher,
                         size_t read_ahead_bytes, uint64_t read_ahead_memory)
    : vol_(vol),
      monitor_(monitor),
      flusher_(flusher),
      read_ahead_bytes_(read_ahead_bytes),
      read_ahead_budget_(read_ahead_memory) {}

ExportTable::~ExportTable() { CloseAll(); }

Result<std::vector<std::string>> ExportTable::List() {
  ASSIGN_OR_RETURN(std::vector<FileInfo> files, vol_->List());
  std::vector<std::string> names;
  for (const FileInfo& f : files) {
    if (f.kind == FileKind::kRegular) names.push_back(f.name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

Result<uint64_t> ExportTable::Describe(const std::string& name) {
  {
    MutexLock l(&mu_);
    auto it = exports_.find(name);
    if (it != exports_.end()) return it->second->size();
  }
  ASSIGN_OR_RETURN(FileInfo found, LookupExportFile(name));
  return found.size;
}

Result<FileInfo> ExportTable::LookupExportFile(const std::string& name) {
  Result<FileInfo> found = vol_->Lookup(name);
  if (!found.ok() || found->kind != FileKind::kRegular) {
    if (found.ok() || found.status().code() == Status::Code::kNotFound) {
      return Status::NotFound("no export named '" + name + "' on this volume");
    }
    return found.status();
  }
  return found;
}

Result<std::shared_ptr<Export>> ExportTable::Acquire(const std::string& name, double wait_s) {
  OpenWait w(this, name, wait_s);
  while (true) {
    Result<std::shared_ptr<Export>> e = w.Step();
    if (!w.retry()) return e;
    // Holding nothing: other exports open meanwhile.
    std::this_thread::sleep_for(OpenWait::kRetryInterval);
  }
}

ExportTable::OpenWait::OpenWait(ExportTable* table, std::string name, double wait_s)
    : table_(table),
      name_(std::move(name)),
      start_(std::chrono::steady_clock::now()),
      deadline_(start_ + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                             std::chrono::duration<double>(std::max(0.0, wait_s)))) {}

void ExportTable::OpenWait::Abandon() {
  if (announced_) (void)table_->vol_->AnnounceOpenWait(*announced_, false);
  announced_.reset();
  retry_ = false;
}

Result<std::shared_ptr<Export>> ExportTable::OpenWait::Step() {
  Volume* vol = table_->vol_;
  bool busy_here = false;
  Result<std::shared_ptr<Export>> e = table_->TryAcquire(name_, &busy_here);
  if (busy_here) {
    // Opened or closed by this process this moment: not a refusal (no
    // deadline, nothing announced); the next Step enters or opens it.
    retry_ = true;
    return e;
  }
  retry_ = !e.ok() && e.status().code() == Status::Code::kLocked &&
           std::chrono::steady_clock::now() < deadline_;
  if (retry_) {
    if (!waited_) {
      // A pass that only borrowed the disk hands it back when it sees this.
      Result<FileInfo> info = vol->Lookup(name_);
      if (info.ok() && vol->AnnounceOpenWait(info->id, true).ok()) announced_ = info->id;
      LOG(kInfo) << "export '" << name_ << "' is held elsewhere: waiting up to "
                 << std::chrono::duration<double>(deadline_ - start_).count() << " s for it";
    }
    waited_ = true;
    return e;
  }
  if (announced_) (void)vol->AnnounceOpenWait(*announced_, false);
  announced_.reset();
  if (waited_) {
    // A VM start held up by another host's pass is worth knowing.
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    LOG(kInfo) << "export '" << name_ << "': " << (e.ok() ? "opened" : "gave up") << " after " << s
               << " s waiting for its lock, held elsewhere";
  }
  return e;
}

Result<std::shared_ptr<Export>> ExportTable::TryAcquire(const std::string& name, bool* busy_here) {
  {
    // An export of this name still closing holds its file open, and one
    // being opened will be in the table in a moment: the caller tries
    // again (a close takes seconds at most; an open, the time its file's
    // lock takes), then enters it or opens it anew. Not waited for here:
    // with sanlock an open can wait minutes for a dead host's lease, and
    // a few clients of that one disk (a VM's retries, a probe) blocked in
    // here held every thread of the NBD open pool, every other disk's
    // open queued behind them.
    MutexLock l(&mu_);
    if (closing_names_.count(name) != 0 || opening_names_.count(name) != 0) {
      *busy_here = true;
      return Status::Locked("export '" + name + "' is being opened or closed here");
    }
    auto it = exports_.find(name);
    if (it != exports_.end()) {
      it->second->clients_++;
      return it->second;
    }
    opening_names_.insert(name);
  }
  Result<std::shared_ptr<Export>> e = OpenExport(name);
  {
    MutexLock l(&mu_);
    opening_names_.erase(name);
    if (e.ok()) exports_[name] = *e;
  }
  closed_cv_.notify_all();
  return e;
}

Result<std::shared_ptr<Export>> ExportTable::OpenExport(const std::string& name) {
  RETURN_IF_ERROR(LookupExportFile(name).status());
  Result<std::unique_ptr<File>> file = vol_->OpenFile(name);
  if (!file.ok()) {
    if (file.status().code() == Status::Code::kLocked) {
      return Status::Locked("export '" + name +
                            "' is in use by another dedupd or host (its VM runs there)");
    }
    return file.status().WithContext("opening export '" + name + "'");
  }
  ASSIGN_OR_RETURN(FileInfo info, (*file)->Info());
  WriteMonitor::FileHandle monitored;
  if (monitor_) monitored = monitor_->AddFile(info.id, info.dedup);
  auto e = std::make_shared<Export>(name, std::move(*file), info, vol_, monitor_,
                                    std::move(monitored), read_ahead_bytes_, &read_ahead_budget_,
                                    flusher_);
  if (flusher_) flusher_->TrackFile(info.id, info.size);
  e->clients_ = 1;
  LOG(kInfo) << "export '" << name << "' opened (" << info.size << " bytes, dedup "
             << (info.dedup ? "on" : "off") << ")";
  return e;
}

void ExportTable::Release(const std::shared_ptr<Export>& e) {
  {
    MutexLock l(&mu_);
    if (--e->clients_ > 0) return;
    auto it = exports_.find(e->name_);
    // CloseAll (shutdown) may have closed it already.
    if (it == exports_.end() || it->second != e) return;
    exports_.erase(it);
    closing_.push_back(e);
    closing_names_.insert(e->name_);
  }
  Close(e);
}

void ExportTable::Close(const std::shared_ptr<Export>& e) {
  // Writes already answered may still be feeding the monitor: they hold
  // their block ranges until it has their records. Wait for all of them.
  e->ranges_.Lock(0, UINT64_MAX);
  e->read_ahead_.Stop();
  if (flusher_) {
    // A pass or `dede ls -l` may hold the log for a moment; what cannot be
    // logged now is parked in the flusher as changed blocks (FlushFile),
    // not lost with the monitor's buffer below.
    Status st = flusher_->FlushFile(e->id(), kCloseLogWaitS);
    if (!st.ok()) LOG(kWarning) << "export '" << e->name() << "': " << st.ToString();
  }
  if (flusher_) flusher_->ForgetFile(e->id());
  if (monitor_) monitor_->RemoveFile(e->id());
  {
    // Final: Stop() ran, and every write has released its range (Lock
    // above).
    MutexLock l(&mu_);
    AddReadAheadStats(&closed_.read_ahead, e->read_ahead_stats());
    closed_.cow_copies += e->cow_copies();
    closed_.writes_answered_early += e->writes_answered_early();
    closing_.erase(std::remove(closing_.begin(), closing_.end(), e), closing_.end());
  }
  // The next holder (maybe on another host) must find everything on disk.
  Status st = vol_->Sync();
  if (!st.ok()) LOG(kError) << "export '" << e->name() << "': flush on close: " << st.ToString();
  e->ranges_.Unlock(0, UINT64_MAX);
  e->file_.reset();
  {
    MutexLock l(&mu_);
    auto it = closing_names_.find(e->name_);
    if (it != closing_names_.end()) closing_names_.erase(it);
  }
  closed_cv_.notify_all();
  LOG(kInfo) << "export '" << e->name() << "' closed";
}

void ExportTable::CloseAll() NO_THREAD_SAFETY_ANALYSIS {
  std::map<std::string, std::shared_ptr<Export>> all;
  {
    // Opens under way finish first (their exports are closed with the
    // rest), and so do closes that Release began.
    std::unique_lock<std::mutex> l(mu_.native());
    closed_cv_.wait(l, [&]() NO_THREAD_SAFETY_ANALYSIS {
      return opening_names_.empty() && closing_names_.empty();
    });
    all.swap(exports_);
    for (auto& [name, e] : all) {
      closing_.push_back(e);
      closing_names_.insert(name);
    }
  }
  for (auto& [name, e] : all) Close(e);
}

bool ExportTable::SoleClient(const std::shared_ptr<Export>& e) {
  MutexLock l(&mu_);
  return e->clients_ == 1;
}

std::vector<ExportTable::ExportStatus> ExportTable::StatusOfOpen() {
  // Under mu_: a listed export's file is open (see totals()).
  MutexLock l(&mu_);
  std::vector<ExportStatus> out;
  for (const auto& [name, e] : exports_) {
    ExportStatus x;
    x.name = name;
    x.id = e->id();
    x.clients = e->clients_;
    x.dedup = e->dedup();
    x.cow_copies = e->cow_copies();
    x.writes_answered_early = e->writes_answered_early();
    x.read_ahead = e->read_ahead_stats();
    out.push_back(std::move(x));
  }
  return out;
}

ExportTable::Totals ExportTable::totals() {
  // Under mu_ throughout: a listed export's file is open (Close resets it
  // only after taking the export off closing_), and a closing export is
  // counted either here or in closed_, never both, never neither.
  // ReadAhead::mu_ is a leaf below mu_.
  MutexLock l(&mu_);
  Totals t = closed_;
  auto add = [&t](const std::shared_ptr<Export>& e) {
    t.cow_copies += e->cow_copies();
    t.writes_answered_early += e->writes_answered_early();
    AddReadAheadStats(&t.read_ahead, e->read_ahead_stats());
  };
  for (const auto& [name, e] : exports_) add(e);
  for (const auto& e : closing_) add(e);
  return t;
}

std::shared_ptr<Export> ExportTable::AcquireIfOpen(const std::string& name) {
  MutexLock l(&mu_);
  auto it = exports_.find(name);
  if (it == exports_.end()) return nullptr;
  it->second->clients_++;
  return it->second;
}

std::vector<std::shared_ptr<Export>> ExportTable::Snapshot() {
  MutexLock l(&mu_);
  std::vector<std::shared_ptr<Export>> out;
  for (auto& [name, e] : exports_) out.push_back(e);
  return out;
}

uint32_t NbdErrorFor(const Status& s) {
  // Not ENOTSUP (95) for kUnsupported (a file with inode flags this
  // version does not know): the spec keeps it for WRITE_ZEROES with
  // FAST_ZERO, which dedupd does not advertise, and qemu takes it on a
  // discard for "discards are not supported" and stops sending them.
  switch (s.code()) {
    case Status::Code::kOk: return 0;
    case Status::Code::kNoSpace: return 28;   // ENOSPC
    case Status::Code::kInvalid:
      return 22;                              // EINVAL
    default: return 5;                        // EIO
  }
}

}  // namespace dede
