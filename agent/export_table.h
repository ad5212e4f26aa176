// ExportTable: the volume files dedupd serves, and what a served file does
// on each NBD command.
//
// A file becomes an Export when its first client enters it (NBD_OPT_GO):
// the table opens it on the volume, which takes the file's lock, so the
// VM is "powered on" here and no other process or host can open it. The
// lock is held while any client is connected; the last client's departure
// flushes the file's write-monitor buffer into its write log and closes the
// file (releasing the lock).
//
// Every write goes through the write monitor while the blocks it covers are
// held in the export's BlockRangeLock, so writes to the same 4 KiB block are
// applied to the volume and to the monitor in the same order (the monitor's
// latest record is the block's content) and partial-block read-modify-writes
// of one block never interleave.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "agent/log_flusher.h"
#include "agent/read_ahead.h"
#include "kmod/writemon/write_monitor.h"
#include "util/mutex.h"
#include "util/status.h"
#include "volume/volume.h"

namespace dede {

// Serialises operations that touch overlapping 4 KiB block ranges; others
// run in parallel. Waiters block their thread (they run on the worker pool,
// and a holder never waits for anything but device I/O).
class BlockRangeLock {
 public:
  void Lock(uint64_t first_block, uint64_t last_block) EXCLUDES(mu_);
  void Unlock(uint64_t first_block, uint64_t last_block) EXCLUDES(mu_);

 private:
  bool OverlapsLocked(uint64_t first, uint64_t last) REQUIRES(mu_);
  Mutex mu_;
  std::condition_variable cv_;
  std::multimap<uint64_t, uint64_t> held_ GUARDED_BY(mu_);  // first -> last
};

// Writes answered before their device write (Export::Write): until each
// is on the device, READs of its blocks wait for it, and a FLUSH waits for
// every one answered before the FLUSH arrived.
class AnsweredWrites {
 public:
  // Registers a write of blocks [first, last]; returns its ticket.
  uint64_t Add(uint64_t first_block, uint64_t last_block) EXCLUDES(mu_);
  void Done(uint64_t ticket) EXCLUDES(mu_);
  // Waits until no registered write overlaps [first, last].
  void WaitForOverlapping(uint64_t first_block, uint64_t last_block) EXCLUDES(mu_);
  // Waits until every write registered before this call is done.
  void WaitForEarlier() EXCLUDES(mu_);

 private:
  Mutex mu_;
  std::condition_variable cv_;
  uint64_t next_ticket_ GUARDED_BY(mu_) = 1;
  std::map<uint64_t, std::pair<uint64_t, uint64_t>> pending_ GUARDED_BY(mu_);  // ticket -> blocks
};

class Export {
 public:
  // `read_ahead_bytes`: the longest READ after which a sequential reader's
  // next request is prefetched (read_ahead.h); 0: never. `budget`: the
  // host's read-ahead memory (may be nullptr: unbounded). `flusher`: where
  // the opt-out marker goes, as it may hold the file's log open (nullptr:
  // straight to the log). `monitored`: the file's handle from
  // monitor->AddFile (ExportTable adds the file before it builds the Export
  // and removes it after closing it).
  Export(std::string name, std::unique_ptr<File> file, const FileInfo& info, Volume* vol,
         WriteMonitor* monitor, WriteMonitor::FileHandle monitored, size_t read_ahead_bytes = 0,
         ReadAheadBudget* budget = nullptr, LogFlusher* flusher = nullptr);
  const std::string& name() const { return name_; }
  FileId id() const { return id_; }
  uint64_t size() const { return size_; }
  bool dedup() const { return dedup_.load(); }
  // Opt-out on a running export: records the flag in the file's inode
  // (where the volume's share primitives check it) and tells the write
  // monitor, which stops hashing and drops what it buffered for the file.
  // Switching back on marks every block of the file changed, so the next
  // passes fingerprint what was written while it was off.
  Status SetDedup(bool on) EXCLUDES(dedup_mu_);
  // Copy-on-write specializations: writes that found their block shared
  // and had to copy it (since the export opened).
  uint64_t cow_copies() { return file_->cow_copies(); }

  // A READ into `out` (resized to `len`), from the read-ahead window when
  // it holds the range. Then, once the client has been answered,
  // ReadAheadAfter() with the same range may prefetch the next one.
  Status Read(uint64_t offset, size_t len, IoBytes* out);
  void ReadAheadAfter(uint64_t offset, size_t len) { read_ahead_.After(offset, len); }
  ReadAheadStats read_ahead_stats() { return read_ahead_.stats(); }
  // `fua`: durable (volume flush point) before returning. `written`, if
  // given, is called once with the outcome as soon as the client may be
  // answered, so that neither the write monitor's fingerprinting nor, for
  // an in-place write, the device write itself is on the client's latency
  // path:
  //  * An in-place write without FUA (File::PrepareInPlaceWrite: whole
  //    blocks already the file's alone, so it cannot fail for want of
  //    space) is answered before its device write, like a disk with a
  //    volatile write cache. Until it is on the device, READs of its blocks
  //    wait for it (AnsweredWrites) and so does the next Flush(). If the
  //    device write fails, the volume is poisoned: that Flush() and every
  //    later write fail with the error.
  //  * Any other write is answered once it is on the volume (durable with
  //    FUA).
  // The blocks stay range-locked until the monitor has them. Returns the
  // write's own outcome (after `written` was called, only for logging).
  // `fps`: the payload's fingerprints from FingerprintWrite, if the caller
  // hashed it already (nullptr: the monitor hashes it).
  Status Write(uint64_t offset, const void* buf, size_t len, bool fua,
               const std::function<void(const Status&)>& written = nullptr,
               const std::vector<Fingerprint>* fps = nullptr);
  // Whether the write monitor records this export's writes now (on,
  // dedup=on, and its write log not full): worth hashing a WRITE's payload
  // while it is in the CPU's cache, as it arrives, and passing the result
  // to Write().
  bool fingerprints_writes() const {
    return monitor_ != nullptr && dedup_.load() && monitor_->Recording(monitored_);
  }
  std::vector<Fingerprint> FingerprintWrite(uint64_t offset, const void* buf, size_t len) const {
    return monitor_ ? monitor_->FingerprintWrite(offset, buf, len) : std::vector<Fingerprint>{};
  }
  Status Trim(uint64_t offset, uint64_t len, bool fua);
  // no_hole: allocate and write zeros; else blocks become holes (read as 0).
  Status WriteZeroes(uint64_t offset, uint64_t len, bool fua, bool no_hole);
  // Waits for the writes answered before it (see Write), then makes the
  // volume durable (a flush point).
  Status Flush();
  // Writes answered before their device write, since the export opened.
  uint64_t writes_answered_early() const { return answered_early_.load(); }

  File* file() { return file_.get(); }

 private:
  friend class ExportTable;
  const std::string name_;
  const FileId id_;
  const uint64_t size_;
  Mutex dedup_mu_;  // serialises SetDedup calls (the inode write and the monitor)
  std::atomic<bool> dedup_;
  std::unique_ptr<File> file_;
  Volume* const vol_;
  WriteMonitor* const monitor_;  // nullptr: monitoring disabled
  const WriteMonitor::FileHandle monitored_;  // this file in monitor_
  LogFlusher* const flusher_;    // may be nullptr
  BlockRangeLock ranges_;
  AnsweredWrites answered_;
  std::atomic<uint64_t> answered_early_{0};
  // The first write that failed after it had been answered. Its blocks may
  // hold the old content or part of the new, and the client was told they
  // hold the new: from then on every READ fails with this error (writes
  // and FLUSH already do: the failure poisoned the volume). Set before the
  // write's ticket is done, so a READ that waited for the ticket sees it.
  Mutex lost_mu_;
  Status lost_write_ GUARDED_BY(lost_mu_);
  std::atomic<bool> lost_{false};
  // Every content change invalidates it after its device I/O, before it is
  // acknowledged (Write, Trim, WriteZeroes); a write answered before its
  // device I/O also invalidates it before the answer.
  ReadAhead read_ahead_;
  int clients_ = 0;  // guarded by ExportTable::mu_
};

class ExportTable {
 public:
  // `monitor` and `flusher` may be nullptr (monitoring off).
  // `read_ahead_bytes` goes to every Export (0: no read-ahead); their
  // windows together hold at most `read_ahead_memory` bytes.
  ExportTable(Volume* vol, WriteMonitor* monitor, LogFlusher* flusher,
              size_t read_ahead_bytes = 0, uint64_t read_ahead_memory = uint64_t{64} << 20);
  ~ExportTable();

  // The names clients may ask for: the volume's regular files.
  Result<std::vector<std::string>> List();
  // Enters the export for one more client; the first opens the file (and
  // takes its lock): kLocked when another process or host holds it for
  // longer than `wait_s` seconds, kNotFound when there is no such regular
  // file. A VM starting while another host's dedup pass holds its disk for
  // a moment waits (wait_s > 0) instead of failing, announcing the wait
  // (Volume::AnnounceOpenWait) so that the pass gives the disk back at its
  // next step; the pass itself never waits (0). Blocking (volume I/O,
  // sleeps): call from a worker thread.
  Result<std::shared_ptr<Export>> Acquire(const std::string& name, double wait_s = 0) EXCLUDES(mu_);
  // What NBD_OPT_INFO tells about an export, without entering it: the
  // size of the open export, or else of the regular file on the volume
  // (read without its lock, which another host's VM may hold; no wait,
  // no open, no close). kNotFound when there is no such regular file.
  // Blocking (volume I/O): call from a worker thread.
  Result<uint64_t> Describe(const std::string& name) EXCLUDES(mu_);
  // Acquire's wait, for a caller that must not hold a thread while it
  // waits (the NBD server: a sleeping worker would stall every disk's
  // I/O). Each Step() is one attempt; kLocked with retry() true means
  // "not yet": call Step() again after about kRetryInterval (not sooner).
  // The first refusal announces the wait (Volume::AnnounceOpenWait); the
  // final Step withdraws it. An open or close of the same name under way
  // in this process is retried too, with no deadline and no announcement
  // (it ends by itself); no Step blocks on it. Not thread-safe: one
  // caller at a time.
  class OpenWait {
   public:
    static constexpr std::chrono::milliseconds kRetryInterval{200};
    OpenWait(ExportTable* table, std::string name, double wait_s);
    Result<std::shared_ptr<Export>> Step() EXCLUDES(table_->mu_);
    bool retry() const { return retry_; }
    // No more Steps (the client left): withdraws the announcement.
    void Abandon();

   private:
    ExportTable* const table_;
    const std::string name_;
    const std::chrono::steady_clock::time_point start_, deadline_;
    bool waited_ = false;
    bool retry_ = false;
    std::optional<FileId> announced_;  // the file whose open wait we announced
  };
  // One client left; the last one flushes the file's records and closes it.
  void Release(const std::shared_ptr<Export>& e) EXCLUDES(mu_);
  // Closes every export (shutdown, after all clients are gone).
  void CloseAll() EXCLUDES(mu_);
  std::vector<std::shared_ptr<Export>> Snapshot() EXCLUDES(mu_);
  // What `dede status` and the metrics show of one open export, read under
  // mu_ (an export's file may be closed the moment it leaves the table).
  struct ExportStatus {
    std::string name;
    FileId id;
    int clients = 0;  // a dedup pass or merge-request job borrowing it counts
    bool dedup = false;
    uint64_t cow_copies = 0;
    uint64_t writes_answered_early = 0;
    ReadAheadStats read_ahead;
  };
  std::vector<ExportStatus> StatusOfOpen() EXCLUDES(mu_);
  // Is the holder of `e` (one Acquire) its only client: no VM uses it?
  bool SoleClient(const std::shared_ptr<Export>& e) EXCLUDES(mu_);
  // Counters summed over every export served since start, open or closed.
  struct Totals {
    uint64_t cow_copies = 0;  // copy-on-write specializations
    uint64_t writes_answered_early = 0;  // Export::writes_answered_early
    ReadAheadStats read_ahead;
  };
  Totals totals() EXCLUDES(mu_);
  const ReadAheadBudget& read_ahead_budget() const { return read_ahead_budget_; }
  // The open export of `name` entered for one more client, or nullptr when
  // it is not open (nothing is opened). Release() it like an Acquire: while
  // held, its file stays open even if every VM client leaves.
  std::shared_ptr<Export> AcquireIfOpen(const std::string& name) EXCLUDES(mu_);

 private:
  // One attempt to enter or open `name`. Never waits for this process's
  // own open or close of the same name: sets *busy_here and returns
  // kLocked (the caller tries again; see OpenWait::Step).
  Result<std::shared_ptr<Export>> TryAcquire(const std::string& name, bool* busy_here)
      EXCLUDES(mu_);
  // Opens the file of an export no client has (TryAcquire's second half,
  // with `name` in opening_names_).
  Result<std::shared_ptr<Export>> OpenExport(const std::string& name) EXCLUDES(mu_);
  // The regular file `name` names (no lock taken); kNotFound, worded for
  // a client, when there is none.
  Result<FileInfo> LookupExportFile(const std::string& name);
  void Close(const std::shared_ptr<Export>& e) EXCLUDES(mu_);
  Volume* const vol_;
  WriteMonitor* const monitor_;
  LogFlusher* const flusher_;
  const size_t read_ahead_bytes_;
  // Before exports_: every Export's window returns its bytes here.
  ReadAheadBudget read_ahead_budget_;
  // mu_ is never held across volume I/O. Opening and closing an export
  // happen outside it, marked by name (opening_names_, closing_names_):
  // an open can wait long for its file's lock (with sanlock, a dead
  // host's lease: minutes), a close seconds for its write log and a
  // sync, and neither may hold up another export's open or anything of
  // the data path. Two clients racing for one new export open it once
  // (the second waits for the first's open, then enters or retries it);
  // an open of an export that is still closing waits for that close.
  Mutex mu_;
  std::map<std::string, std::shared_ptr<Export>> exports_ GUARDED_BY(mu_);
  // Names whose Close has not finished (their file is still open here);
  // closed_cv_ (with mu_) is signalled as each finishes.
  std::multiset<std::string> closing_names_ GUARDED_BY(mu_);
  // Names whose open is under way (not yet in exports_).
  std::set<std::string> opening_names_ GUARDED_BY(mu_);
  // With mu_: signalled as each open or close finishes.
  std::condition_variable closed_cv_;
  // Exports taken out of exports_ whose Close has not yet folded their
  // counts into closed_ (Close does it under mu_), so the totals never
  // lose a closing export's counts.
  std::vector<std::shared_ptr<Export>> closing_ GUARDED_BY(mu_);
  Totals closed_ GUARDED_BY(mu_);
};

// How long an export's close waits for its write log when another process
// or a pass holds it (LogFlusher::FlushFile).
inline constexpr double kCloseLogWaitS = 5;

// The NBD error number for a failed volume operation.
uint32_t NbdErrorFor(const Status& s);

}  // namespace dede
