// LogFlusher: moves write-monitor buffers into per-file write logs on the
// volume. dedupd runs it with a thread of its own (Start): the write
// monitor wakes it when a file's buffer reaches the flush size, and every
// flush point wakes it as a backstop (WakeAtFlushPoint); FlushAll() runs
// every flush interval, when a pass starts and at shutdown, FlushFile()
// when an export closes. Flushes run one at a time: two flushes of the
// same file in parallel could append its batches out of order, and the
// log's order is what makes the newest record win.
//
// The log of an exported file the thread appends to stays open while
// the appends go on: closing a file checkpoints the volume and gives back
// its cached locks (four device flushes, docs/LOCKING.md): at ten appends
// a second that was 31 fdatasyncs a second under a fast writer
// (docs/BENCHMARKS.md, session 24). A flush point closes the logs not
// appended to since the one before, so another process (`dede ls -l`)
// finds a log busy while its file is being written and for at most two
// sync intervals after; a pass of another host cannot take it anyway while
// the file is exported here. This process's own pass borrows an open log
// (LendLog) instead of finding it busy.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "kmod/writemon/write_log.h"
#include "kmod/writemon/write_monitor.h"
#include "util/mutex.h"
#include "util/status.h"
#include "volume/volume.h"

namespace dede {

struct FlusherStats {
  uint64_t flushes = 0;       // batches appended
  uint64_t bytes = 0;         // log bytes appended
  uint64_t records = 0;       // records appended
  uint64_t deferred = 0;      // batches put back (log locked elsewhere)
  uint64_t failed = 0;        // batches lost to errors (records counted dropped)
  // Batches Tick dropped without trying to append them, because the volume
  // was full at the file's last attempt (see no_space_); their entries are
  // counted dropped as well.
  uint64_t no_space_skipped = 0;
  // Logs at their size limit (write_log.h, "saturated"): saturation frames
  // written, and batches (with their entries) not written because their
  // log was saturated. Their blocks are rehashed by the next pass.
  uint64_t saturations = 0;
  uint64_t capped_batches = 0;
  uint64_t capped_entries = 0;
};

// How big a file's write log may grow before it saturates: `percent` of
// the file's size, but at least `min_bytes`; percent 0: no limit.
struct WriteLogLimit {
  uint32_t percent = 3;
  uint64_t min_bytes = uint64_t{4} << 20;
  // The limit for a file of `file_bytes` (0: none).
  uint64_t For(uint64_t file_bytes) const {
    if (percent == 0) return 0;
    return std::max(min_bytes, file_bytes / 100 * percent);
  }
};

class LogFlusher {
 public:
  LogFlusher(Volume* vol, WriteMonitor* monitor, WriteLogLimit limit = WriteLogLimit{})
      : vol_(vol), monitor_(monitor), limit_(limit) {}
  ~LogFlusher() {
    Stop();
    CloseLogs();
    WarnParkedLost();
  }
  LogFlusher(const LogFlusher&) = delete;
  LogFlusher& operator=(const LogFlusher&) = delete;

  // Starts the flusher thread, which runs Tick() whenever woken, and hooks
  // it to the monitor (WriteMonitor::SetFlushDueHook): a file that reaches
  // the flush size is appended to its log within one flush, not at the
  // next timer, so a busy file's buffer stays about flush-size (a second
  // of a fast writer is hundreds of thousands of records, whose memory the
  // write path would fault in again every second).
  void Start() EXCLUDES(wake_mu_);
  // Asks the thread for a Tick() (coalesced: many wakes before it runs
  // make one Tick). Never blocks on a flush; a no-op once stopped.
  void Wake() EXCLUDES(wake_mu_);
  // Wake(), and once that Tick() is done, close the logs kept open that
  // were not appended to since the previous flush point.
  void WakeAtFlushPoint() EXCLUDES(wake_mu_);
  // Unhooks the monitor, then lets a running Tick() finish and joins the
  // thread. Idempotent; FlushAll() still works afterwards.
  void Stop() EXCLUDES(wake_mu_);
  // The log of `id` if it is open here (kept open between appends), now
  // the caller's: a dedup pass that consumes the log and closes it. The
  // flusher's next append to it finds it busy and keeps the batch (as it
  // does with a log open in another process). nullptr if not open here.
  std::unique_ptr<File> LendLog(FileId id) EXCLUDES(mu_);
  // AppendOptOutMarker (write_log.h) through the log kept open, if it is.
  Status AppendOptOutMarker(FileId id, uint64_t size_bytes, uint64_t now_ns) EXCLUDES(mu_);
  // Closes every log kept open (volume I/O: closing checkpoints).
  void CloseLogs() EXCLUDES(mu_);
  // What a flush point does after its Tick: closes the logs not appended
  // to since the last call and marks the others idle.
  void CloseIdleLogs() EXCLUDES(mu_);

  // The file's size, which sets its log's limit; files never tracked have
  // no limit. The export table tracks a file while it is open and forgets
  // it once its last batch is flushed. Call after WriteMonitor::AddFile:
  // when the file's log is already full, the monitor is paused for it
  // (one read of the log's last block; volume I/O).
  void TrackFile(FileId id, uint64_t file_bytes) EXCLUDES(files_mu_);
  // Also closes the file's log if it was kept open.
  void ForgetFile(FileId id) EXCLUDES(mu_, files_mu_);
  const WriteLogLimit& limit() const { return limit_; }

  // Flushes files past the monitor's flush size; keeps the logs of
  // tracked files open. A file whose last append found the volume full
  // is not tried again here: its batch is dropped (counted) until
  // FlushAll or FlushFile tries again.
  Status Tick() EXCLUDES(mu_);
  // Flushes every file with anything buffered, then closes every log kept
  // open: afterwards every log is on the volume for anyone to open.
  Status FlushAll() EXCLUDES(mu_);
  // Flushes one file (an export closing) and closes its log. While its log
  // is held by another process or host (a pass consuming it, `dede ls -l`
  // reading it), tries again for up to `wait_s` seconds (not when this
  // process holds it: its pass). Then the batch is *parked*: taken from
  // the monitor (the caller forgets the file there) and kept here as
  // invalidations, which FlushAll appends once the log is free. Dropping
  // it would leave the log's older records for those blocks standing, as
  // if they still held that content; the holder (a pass) may even write
  // such records back. A batch whose append fails for good (an I/O error,
  // a full volume) is parked the same way, with the marks of records the
  // monitor shed, and the error returned; a parked batch stays until it
  // is logged or its file is removed.
  Status FlushFile(FileId id, double wait_s = 0) EXCLUDES(mu_);
  // At shutdown, after the exports closed: appends the parked batches,
  // trying again every 100 ms for up to `wait_s` while a log is held
  // elsewhere (a pass gathering a log holds it for seconds; a single try
  // lost the batch whenever it fell in those seconds). A failure for good
  // (a full volume, an I/O error) is returned at once. What is still
  // parked after that is what WarnParkedLost reports.
  Status FlushParked(double wait_s) EXCLUDES(mu_);
  // Files with a parked batch (tests, status).
  size_t parked_files() EXCLUDES(mu_);
  // Logs a warning for each batch still parked (its log was never free
  // again before dedupd stopped): those blocks' changes are not logged.
  void WarnParkedLost() EXCLUDES(mu_);
  FlusherStats stats() EXCLUDES(mu_);

 private:
  // `keep_open`: leave the log open afterwards if the file is tracked.
  // `skip_if_no_space`: a file in no_space_ has its batch dropped, not
  // appended.
  // `failed` (may be nullptr): where a batch whose append failed for good
  // goes, instead of being dropped and counted in the monitor.
  Status FlushLocked(FileId id, bool keep_open, bool skip_if_no_space,
                     MonitorBatch* failed = nullptr) REQUIRES(mu_);
  bool Tracked(FileId id) EXCLUDES(files_mu_);
  void CloseLogsLocked() REQUIRES(mu_);

  // The tracked file's log limit (0: none, or not tracked).
  uint64_t MaxLogBytes(FileId id) EXCLUDES(files_mu_);
  Volume* const vol_;
  WriteMonitor* const monitor_;
  const WriteLogLimit limit_;
  // Held across the log append (volume I/O): it serialises flushes only;
  // the write path never takes it.
  Mutex mu_;
  FlusherStats stats_ GUARDED_BY(mu_);
  // The last appended batch's records vector, handed to the next Take so
  // its memory is reused rather than faulted in afresh.
  std::vector<BlockRecord> spare_records_ GUARDED_BY(mu_);
  // Logs kept open between appends (see the top of this file).
  struct KeptLog {
    std::unique_ptr<File> file;
    bool appended = true;  // since the last CloseIdleLogs
  };
  std::map<FileId, KeptLog> open_logs_ GUARDED_BY(mu_);
  // Files whose last append failed because the volume is full. Retrying
  // at every flush size would cost an open, a failed allocation and a
  // close (a checkpoint: four device flushes) per megabyte of log, about
  // ten times a second under a fast writer, and the VM's writes would wait
  // behind those flushes. Tick drops their batches instead; FlushAll (each
  // flush interval, before a pass, at shutdown) and FlushFile still try,
  // and an append that succeeds takes the file out.
  std::set<FileId> no_space_ GUARDED_BY(mu_);
  // Parked batches (FlushFile), reduced to invalidated ranges: every block
  // a record described becomes a changed block. By the time the log is
  // free another host may have logged newer records for those blocks, and
  // an older fingerprint appended after them would win; an invalidation
  // only has the next pass rehash the block. Appended by FlushAll, or
  // before the file's next batch if it is open here again (FlushLocked).
  struct ParkedBatch {
    MonitorBatch batch;
    uint64_t max_log_bytes = 0;  // the file's log limit when it was parked
  };
  std::map<FileId, ParkedBatch> parked_ GUARDED_BY(mu_);
  void Park(MonitorBatch batch, uint64_t max_log_bytes) REQUIRES(mu_);
  // Appends the parked batches whose logs are free now.
  Status AppendParked() REQUIRES(mu_);
  // Counts and logs a parked batch that reached its log.
  void NoteParkedAppended(FileId id, const MonitorBatch& batch, LogAppendOutcome outcome)
      REQUIRES(mu_);
  // Lock order: mu_ before files_mu_; files_mu_ is never held across I/O
  // (the export table takes it when opening and closing files). Whether a
  // log is full is the monitor's state (WriteMonitor::PauseForFullLog),
  // not kept here.
  Mutex files_mu_ ACQUIRED_AFTER(mu_);
  std::map<FileId, uint64_t> max_log_bytes_ GUARDED_BY(files_mu_);
  // The thread's wake-up; a leaf (the monitor's hook takes it on the
  // write path, so it is never held across anything that blocks).
  Mutex wake_mu_;
  std::condition_variable wake_cv_;  // with wake_mu_
  bool wake_ GUARDED_BY(wake_mu_) = false;
  bool close_logs_ GUARDED_BY(wake_mu_) = false;  // WakeAtFlushPoint
  bool stopping_ GUARDED_BY(wake_mu_) = false;
  std::thread thread_;  // started and joined by whoever calls Start/Stop
  void Run() EXCLUDES(wake_mu_);
};

}  // namespace dede
