// LogFlusher: moves write-monitor buffers into per-file write logs on the
// volume. dedupd calls Tick() every second (files whose buffer passed the
// flush size) and FlushAll() every flush interval, when an export closes
// and at shutdown. Flushes run one at a time: two flushes of the same file
// in parallel could append its batches out of order, and the log's order is
// what makes the newest record win.
#pragma once

#include <atomic>
#include <cstdint>

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
};

class LogFlusher {
 public:
  LogFlusher(Volume* vol, WriteMonitor* monitor) : vol_(vol), monitor_(monitor) {}

  // Flushes files past the monitor's flush size.
  Status Tick() EXCLUDES(mu_);
  // Flushes every file with anything buffered.
  Status FlushAll() EXCLUDES(mu_);
  // Flushes one file (an export closing).
  Status FlushFile(FileId id) EXCLUDES(mu_);
  FlusherStats stats() EXCLUDES(mu_);

 private:
  Status FlushLocked(FileId id) REQUIRES(mu_);
  Volume* const vol_;
  WriteMonitor* const monitor_;
  // Held across the log append (volume I/O): it serialises flushes only;
  // the write path never takes it.
  Mutex mu_;
  FlusherStats stats_ GUARDED_BY(mu_);
  // The last appended batch's records vector, handed to the next Take so
  // its memory is reused rather than faulted in afresh.
  std::vector<BlockRecord> spare_records_ GUARDED_BY(mu_);
};

}  // namespace dede
