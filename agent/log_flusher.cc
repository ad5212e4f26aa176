#include "agent/log_flusher.h"

#include "kmod/writemon/write_log.h"
#include "util/log.h"

namespace dede {

Status LogFlusher::FlushLocked(FileId id) {
  MonitorBatch batch = monitor_->Take(id, std::move(spare_records_));
  spare_records_.clear();
  if (batch.empty()) {
    spare_records_ = std::move(batch.records);
    return Status::Ok();
  }
  const uint64_t max_log_bytes = MaxLogBytes(id);
  uint64_t bytes = EncodedWriteLogBytes(batch, monitor_->algo());
  LogAppendOutcome outcome = LogAppendOutcome::kAppended;
  Status st = AppendToWriteLog(vol_, batch, max_log_bytes, &outcome);
  if (st.ok()) {
    switch (outcome) {
      case LogAppendOutcome::kAppended:
        stats_.flushes++;
        stats_.bytes += bytes;
        stats_.records += batch.records.size();
        break;
      case LogAppendOutcome::kSaturated:
        stats_.saturations++;
        stats_.bytes += kBlockSize;
        stats_.capped_batches++;
        stats_.capped_entries += batch.entries();
        LOG(kWarning) << "write log of file " << id.ino << "." << id.generation
                      << " reached its limit of " << max_log_bytes
                      << " bytes: it now marks the whole file changed and takes no more "
                         "records until a dedup pass consumes it (that pass rehashes the "
                         "file)";
        break;
      case LogAppendOutcome::kAlreadySaturated:
        stats_.capped_batches++;
        stats_.capped_entries += batch.entries();
        break;
    }
    // Nothing more is worth hashing for this file until a pass takes the
    // log (WriteMonitor::LogTaken).
    if (outcome != LogAppendOutcome::kAppended) monitor_->PauseForFullLog(id, batch.log_epoch);
    spare_records_ = std::move(batch.records);
    return st;
  }
  if (st.code() == Status::Code::kLocked) {
    // A pass is consuming the log right now; keep the records for later.
    stats_.deferred++;
    monitor_->PutBack(std::move(batch));
    return Status::Ok();
  }
  stats_.failed++;
  // Everything in the batch is lost, invalidations included (a lost
  // invalidation may leave a stale record in the log): the file is marked so
  // the next pass verifies everything.
  const uint64_t lost = batch.entries();
  monitor_->MarkDropped(id, lost, batch.oldest_ns());
  LOG(kWarning) << "write log of file " << id.ino << "." << id.generation << ": " << lost
                << " records lost: " << st.ToString();
  return st;
}

Status LogFlusher::Tick() {
  MutexLock l(&mu_);
  Status first;
  for (FileId id : monitor_->DueFiles(false)) {
    Status st = FlushLocked(id);
    if (first.ok()) first = st;
  }
  return first;
}

Status LogFlusher::FlushAll() {
  MutexLock l(&mu_);
  Status first;
  for (FileId id : monitor_->DueFiles(true)) {
    Status st = FlushLocked(id);
    if (first.ok()) first = st;
  }
  return first;
}

Status LogFlusher::FlushFile(FileId id) {
  MutexLock l(&mu_);
  return FlushLocked(id);
}

uint64_t LogFlusher::MaxLogBytes(FileId id) {
  MutexLock l(&files_mu_);
  auto it = max_log_bytes_.find(id);
  return it == max_log_bytes_.end() ? 0 : it->second;
}

void LogFlusher::TrackFile(FileId id, uint64_t file_bytes) {
  const uint64_t max_log_bytes = limit_.For(file_bytes);
  {
    MutexLock l(&files_mu_);
    max_log_bytes_[id] = max_log_bytes;
  }
  if (max_log_bytes == 0) return;
  // A log left full (by this host's last session with the file, or by the
  // host the VM ran on before): the monitor need not hash anything until
  // a pass takes it. Read before the check, so a pass taking the log
  // meanwhile makes the pause a no-op. kLocked (a pass has it now) or an
  // error: record as usual; the first flush finds out.
  const uint64_t epoch = monitor_->LogEpoch(id);
  Result<bool> full = WriteLogIsSaturated(vol_, id);
  if (full.ok() && *full) monitor_->PauseForFullLog(id, epoch);
}

void LogFlusher::ForgetFile(FileId id) {
  MutexLock l(&files_mu_);
  max_log_bytes_.erase(id);
}

FlusherStats LogFlusher::stats() {
  MutexLock l(&mu_);
  return stats_;
}

}  // namespace dede
