// LogFlusher: moves write-monitor buffers into per-file write logs on the
// volume. dedupd calls Tick() every second (files whose buffer passed the
// flush size) and FlushAll() every flush interval, when an export closes
// and at shutdown. Flushes run one at a time: two flushes of the same file
// in parallel could append its batches out of order, and the log's order is
// what makes the newest record win.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

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

  // The file's size, which sets its log's limit; files never tracked have
  // no limit. The export table tracks a file while it is open and forgets
  // it once its last batch is flushed. Call after WriteMonitor::AddFile:
  // when the file's log is already full, the monitor is paused for it
  // (one read of the log's last block; volume I/O).
  void TrackFile(FileId id, uint64_t file_bytes) EXCLUDES(files_mu_);
  void ForgetFile(FileId id) EXCLUDES(files_mu_);
  const WriteLogLimit& limit() const { return limit_; }

  // Flushes files past the monitor's flush size.
  Status Tick() EXCLUDES(mu_);
  // Flushes every file with anything buffered.
  Status FlushAll() EXCLUDES(mu_);
  // Flushes one file (an export closing).
  Status FlushFile(FileId id) EXCLUDES(mu_);
  FlusherStats stats() EXCLUDES(mu_);

 private:
  Status FlushLocked(FileId id) REQUIRES(mu_);
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
  // Lock order: mu_ before files_mu_; files_mu_ is never held across I/O
  // (the export table takes it when opening and closing files). Whether a
  // log is full is the monitor's state (WriteMonitor::PauseForFullLog),
  // not kept here.
  Mutex files_mu_ ACQUIRED_AFTER(mu_);
  std::map<FileId, uint64_t> max_log_bytes_ GUARDED_BY(files_mu_);
};

}  // namespace dede
