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
  uint64_t max_log_bytes = 0;
  {
    MutexLock l(&files_mu_);
    auto it = files_.find({id.ino, id.generation});
    if (it != files_.end()) max_log_bytes = it->second.max_log_bytes;
  }
  uint64_t bytes = EncodedWriteLogBytes(batch, monitor_->algo());
  LogAppendOutcome outcome = LogAppendOutcome::kAppended;
  Status st = AppendToWriteLog(vol_, batch, max_log_bytes, &outcome);
  if (st.ok()) {
    const uint64_t entries =
        batch.records.size() + batch.invalidated.size() + batch.dropped_records;
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
        stats_.capped_entries += entries;
        LOG(kWarning) << "write log of file " << id.ino << "." << id.generation
                      << " reached its limit of " << max_log_bytes
                      << " bytes: it now marks the whole file changed and takes no more "
                         "records until a dedup pass consumes it (that pass rehashes the "
                         "file)";
        break;
      case LogAppendOutcome::kAlreadySaturated:
        stats_.capped_batches++;
        stats_.capped_entries += entries;
        break;
    }
    {
      MutexLock l(&files_mu_);
      auto it = files_.find({id.ino, id.generation});
      if (it != files_.end()) it->second.saturated = outcome != LogAppendOutcome::kAppended;
    }
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
  uint64_t lost = batch.records.size() + batch.invalidated.size() + batch.dropped_records;
  uint64_t since = batch.dropped_since_ns ? batch.dropped_since_ns : batch.first_ns;
  monitor_->MarkDropped(id, lost, since);
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

void LogFlusher::TrackFile(FileId id, uint64_t file_bytes) {
  MutexLock l(&files_mu_);
  TrackedFile& f = files_[{id.ino, id.generation}];
  f.max_log_bytes = limit_.For(file_bytes);
}

void LogFlusher::ForgetFile(FileId id) {
  MutexLock l(&files_mu_);
  files_.erase({id.ino, id.generation});
}

bool LogFlusher::Saturated(FileId id) {
  MutexLock l(&files_mu_);
  auto it = files_.find({id.ino, id.generation});
  return it != files_.end() && it->second.saturated;
}

FlusherStats LogFlusher::stats() {
  MutexLock l(&mu_);
  return stats_;
}

}  // namespace dede
