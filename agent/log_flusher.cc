#include "agent/log_flusher.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <thread>

#include "kmod/writemon/write_log.h"
#include "util/log.h"

namespace dede {

namespace {

// `wait_s` seconds from now (at least now) on the steady clock.
std::chrono::steady_clock::time_point DeadlineAfter(double wait_s) {
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(
             std::chrono::duration<double>(std::max(0.0, wait_s)));
}

}  // namespace

Status LogFlusher::FlushLocked(FileId id, bool keep_open, bool skip_if_no_space,
                               MonitorBatch* failed) {
  MonitorBatch batch = monitor_->Take(id, std::move(spare_records_));
  spare_records_.clear();
  if (batch.empty()) {
    spare_records_ = std::move(batch.records);
    return Status::Ok();
  }
  if (skip_if_no_space && no_space_.count(id) > 0) {
    // Lost like a failed batch, without the I/O (see no_space_).
    stats_.no_space_skipped++;
    monitor_->MarkDropped(id, batch.entries(), batch.oldest_ns(), batch.dropped_records);
    spare_records_ = std::move(batch.records);
    return Status::Ok();
  }
  const uint64_t max_log_bytes = MaxLogBytes(id);
  uint64_t bytes = EncodedWriteLogBytes(batch, monitor_->algo());
  LogAppendOutcome outcome = LogAppendOutcome::kAppended;
  Status st;
  auto kept = open_logs_.find(id);
  if (kept == open_logs_.end()) {
    Result<std::unique_ptr<File>> opened = OpenOrCreateWriteLog(vol_, id);
    if (opened.ok()) {
      kept = open_logs_.emplace(id, KeptLog{std::move(opened.value())}).first;
    } else {
      st = opened.status();
    }
  }
  if (st.ok()) {
    kept->second.appended = true;
    // A batch parked when the file's export closed (its log full or held)
    // is older than this one: in the log first, or its changed-block marks
    // would land after, and cancel, this batch's records of the same
    // blocks (the file reopened and written meanwhile).
    if (auto p = parked_.find(id); p != parked_.end()) {
      LogAppendOutcome parked_outcome = LogAppendOutcome::kAppended;
      st = AppendToOpenWriteLog(vol_, kept->second.file.get(), p->second.batch,
                                p->second.max_log_bytes, &parked_outcome);
      if (st.ok()) {
        NoteParkedAppended(id, p->second.batch, parked_outcome);
        parked_.erase(p);
      }
    }
    if (st.ok()) {
      st = AppendToOpenWriteLog(vol_, kept->second.file.get(), batch, max_log_bytes, &outcome);
    }
    // Closed after an error too (the parked batch's or this one's): the
    // next append starts from what the volume says.
    if (!st.ok() || !keep_open || !Tracked(id)) open_logs_.erase(kept);
  }
  if (st.ok()) {
    if (no_space_.erase(id) > 0) monitor_->SetLogNoSpace(id, false);
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
  const bool no_space = st.code() == Status::Code::kNoSpace;
  if (failed != nullptr) {
    // The caller keeps it (an export's last flush parks it).
    *failed = std::move(batch);
    return st;
  }
  // Everything in the batch is lost, invalidations included (a lost
  // invalidation may leave a stale record in the log): the file is marked so
  // the next pass verifies everything.
  const uint64_t lost = batch.entries();
  monitor_->MarkDropped(id, lost, batch.oldest_ns(), batch.dropped_records);
  if (no_space) {
    no_space_.insert(id);
    monitor_->SetLogNoSpace(id, true);
  }
  LOG(kWarning) << "write log of file " << id.ino << "." << id.generation << ": " << lost
                << " records lost: " << st.ToString()
                << (no_space ? " (until the next flush interval tries again, its writes are "
                               "not hashed and its records are dropped without trying)"
                             : "");
  return st;
}

Status LogFlusher::Tick() {
  MutexLock l(&mu_);
  Status first;
  for (FileId id : monitor_->DueFiles(false)) {
    Status st = FlushLocked(id, /*keep_open=*/true, /*skip_if_no_space=*/true);
    if (first.ok()) first = st;
  }
  return first;
}

Status LogFlusher::FlushAll() {
  MutexLock l(&mu_);
  Status first;
  for (FileId id : monitor_->DueFiles(true)) {
    Status st = FlushLocked(id, /*keep_open=*/false, /*skip_if_no_space=*/false);
    if (first.ok()) first = st;
  }
  CloseLogsLocked();
  Status parked = AppendParked();
  if (first.ok()) first = parked;
  return first;
}

namespace {

// `batch` with every record turned into a changed block: its ranges,
// sorted and merged (a merged range keeps the latest time), no records.
void ReduceToInvalidations(MonitorBatch* batch) {
  std::vector<InvalidRange> ranges = std::move(batch->invalidated);
  for (const BlockRecord& r : batch->records) ranges.push_back({r.block, 1, r.time_ns});
  batch->records.clear();
  std::sort(ranges.begin(), ranges.end(),
            [](const InvalidRange& a, const InvalidRange& b) { return a.first < b.first; });
  std::vector<InvalidRange> merged;
  for (const InvalidRange& r : ranges) {
    if (r.count == 0) continue;
    if (!merged.empty() && r.first <= merged.back().first + merged.back().count) {
      InvalidRange& m = merged.back();
      m.count = std::max(m.first + m.count, r.first + r.count) - m.first;
      m.time_ns = std::max(m.time_ns, r.time_ns);
    } else {
      merged.push_back(r);
    }
  }
  batch->invalidated = std::move(merged);
}

}  // namespace

void LogFlusher::Park(MonitorBatch batch, uint64_t max_log_bytes) {
  auto [it, fresh] = parked_.try_emplace(batch.file);
  it->second.max_log_bytes = max_log_bytes;
  MonitorBatch& p = it->second.batch;
  if (fresh) {
    p = std::move(batch);
  } else {
    // A later batch of the same file (closed again while its log was still
    // held): its changes join the earlier ones.
    auto earliest = [](uint64_t a, uint64_t b) { return a == 0 ? b : b == 0 ? a : std::min(a, b); };
    p.invalidated.insert(p.invalidated.end(), batch.invalidated.begin(), batch.invalidated.end());
    p.records.insert(p.records.end(), batch.records.begin(), batch.records.end());
    p.first_ns = earliest(p.first_ns, batch.first_ns);
    p.last_ns = std::max(p.last_ns, batch.last_ns);
    p.dropped_since_ns = earliest(p.dropped_since_ns, batch.dropped_since_ns);
    p.dropped_records += batch.dropped_records;
  }
  ReduceToInvalidations(&p);
}

Status LogFlusher::AppendParked() {
  if (parked_.empty()) return Status::Ok();
  // A file removed since its batch was parked needs no log: appending
  // would create one again for a file that is gone (the next pass then
  // removes it as an orphan).
  std::set<std::pair<uint64_t, uint64_t>> live;
  ASSIGN_OR_RETURN(std::vector<FileInfo> files, vol_->List());
  for (const FileInfo& f : files) live.emplace(f.id.ino, f.id.generation);
  Status first;
  for (auto it = parked_.begin(); it != parked_.end();) {
    const FileId id = it->first;
    const MonitorBatch& batch = it->second.batch;
    if (!live.count({id.ino, id.generation})) {
      LOG(kInfo) << "write log of file " << id.ino << "." << id.generation
                 << ": the file was removed; its parked changes are dropped";
      it = parked_.erase(it);
      continue;
    }
    // With the file's limit: a log that reached it already says every
    // block changed, and must not grow past it.
    LogAppendOutcome outcome = LogAppendOutcome::kAppended;
    Status st = AppendToWriteLog(vol_, batch, it->second.max_log_bytes, &outcome);
    if (st.code() == Status::Code::kLocked) {
      ++it;  // still held: the next FlushAll tries again
      continue;
    }
    if (st.ok()) {
      NoteParkedAppended(id, batch, outcome);
    } else {
      // Kept for the next FlushAll (a full volume may have room then):
      // dropped, the log's older records for those blocks would stand as
      // if they still held that content, with no sign that any were lost.
      stats_.failed++;
      LOG(kWarning) << "write log of file " << id.ino << "." << id.generation << ": "
                    << batch.entries() << " parked changes not logged yet: " << st.ToString();
      if (first.ok()) first = st;
      ++it;
      continue;
    }
    it = parked_.erase(it);
  }
  return first;
}

void LogFlusher::NoteParkedAppended(FileId id, const MonitorBatch& batch,
                                    LogAppendOutcome outcome) {
  if (outcome == LogAppendOutcome::kAppended) {
    stats_.flushes++;
    stats_.bytes += EncodedWriteLogBytes(batch, monitor_->algo());
  } else {
    stats_.capped_batches++;
    stats_.capped_entries += batch.entries();
  }
  LOG(kInfo) << "write log of file " << id.ino << "." << id.generation << ": "
             << batch.invalidated.size()
             << " changed ranges logged after its export closed while the log was held";
}

Status LogFlusher::FlushParked(double wait_s) {
  const auto deadline = DeadlineAfter(wait_s);
  while (true) {
    {
      MutexLock l(&mu_);
      RETURN_IF_ERROR(AppendParked());  // a log held elsewhere is no error: kept
      if (parked_.empty()) return Status::Ok();
    }
    if (std::chrono::steady_clock::now() >= deadline) return Status::Ok();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

size_t LogFlusher::parked_files() {
  MutexLock l(&mu_);
  return parked_.size();
}

void LogFlusher::WarnParkedLost() {
  MutexLock l(&mu_);
  for (const auto& [id, parked] : parked_) {
    LOG(kWarning) << "write log of file " << id.ino << "." << id.generation << ": "
                  << parked.batch.entries()
                  << " changes parked while the log was held are not logged: it was still held "
                     "when dedupd stopped (the file's next pass misses those blocks' changes)";
  }
}

Status LogFlusher::FlushFile(FileId id, double wait_s) {
  const auto deadline = DeadlineAfter(wait_s);
  while (true) {
    {
      MutexLock l(&mu_);
      const uint64_t deferred = stats_.deferred;
      MonitorBatch failed;
      Status st = FlushLocked(id, /*keep_open=*/false, /*skip_if_no_space=*/false, &failed);
      open_logs_.erase(id);
      if (!st.ok()) {
        // Failed for good (an I/O error, a full volume). The caller forgets
        // the file in the monitor next, and with it the batch and any
        // marks of records shed or lost before: all of it is parked, as
        // changed blocks, for FlushAll to log when it can.
        MonitorBatch rest = monitor_->Take(id, {});
        if (!failed.empty()) Park(std::move(failed), MaxLogBytes(id));
        if (!rest.empty()) Park(std::move(rest), MaxLogBytes(id));
        LOG(kWarning) << "write log of file " << id.ino << "." << id.generation
                      << ": its last changes wait, as changed blocks, until they can be "
                         "logged: "
                      << st.ToString();
        return st;
      }
      if (stats_.deferred == deferred) return st;  // appended
      // Held by this process (a dedup pass consuming it, maybe on this very
      // thread, handing the disk back): waiting would be in vain.
      if (std::chrono::steady_clock::now() >= deadline || vol_->IsOpenHere(WriteLogName(id))) {
        MonitorBatch batch = monitor_->Take(id, {});
        if (!batch.empty()) {
          LOG(kInfo) << "write log of file " << id.ino << "." << id.generation
                     << " is held elsewhere: its " << batch.entries()
                     << " buffered changes wait, as changed blocks, until it is free";
          Park(std::move(batch), MaxLogBytes(id));
        }
        return Status::Ok();
      }
    }
    // Not under mu_: the other files' flushes go on meanwhile.
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

std::unique_ptr<File> LogFlusher::LendLog(FileId id) {
  MutexLock l(&mu_);
  auto it = open_logs_.find(id);
  if (it == open_logs_.end()) return nullptr;
  std::unique_ptr<File> log = std::move(it->second.file);
  open_logs_.erase(it);
  return log;
}

Status LogFlusher::AppendOptOutMarker(FileId id, uint64_t size_bytes, uint64_t now_ns) {
  MutexLock l(&mu_);
  auto kept = open_logs_.find(id);
  if (kept == open_logs_.end()) return dede::AppendOptOutMarker(vol_, id, size_bytes, now_ns);
  return AppendToOpenWriteLog(vol_, kept->second.file.get(),
                              OptOutMarkerBatch(id, size_bytes, now_ns));
}

void LogFlusher::CloseLogs() {
  MutexLock l(&mu_);
  CloseLogsLocked();
}

void LogFlusher::CloseLogsLocked() { open_logs_.clear(); }

void LogFlusher::CloseIdleLogs() {
  MutexLock l(&mu_);
  for (auto it = open_logs_.begin(); it != open_logs_.end();) {
    if (!it->second.appended) {
      it = open_logs_.erase(it);
    } else {
      it->second.appended = false;
      ++it;
    }
  }
}

bool LogFlusher::Tracked(FileId id) {
  MutexLock l(&files_mu_);
  return max_log_bytes_.count(id) > 0;
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
  MutexLock l(&mu_);
  open_logs_.erase(id);
  if (no_space_.erase(id) > 0) monitor_->SetLogNoSpace(id, false);
  MutexLock f(&files_mu_);
  max_log_bytes_.erase(id);
}

void LogFlusher::Start() {
  {
    MutexLock l(&wake_mu_);
    if (thread_.joinable() || stopping_) return;
  }
  thread_ = std::thread([this] { Run(); });
  monitor_->SetFlushDueHook([this] { Wake(); });
}

void LogFlusher::Wake() {
  {
    MutexLock l(&wake_mu_);
    if (wake_ || stopping_) return;
    wake_ = true;
  }
  wake_cv_.notify_one();
}

void LogFlusher::WakeAtFlushPoint() {
  {
    MutexLock l(&wake_mu_);
    if (stopping_) return;
    close_logs_ = true;
    if (wake_) return;
    wake_ = true;
  }
  wake_cv_.notify_one();
}

void LogFlusher::Stop() {
  // First, so no write calls Wake() on a flusher being torn down.
  if (thread_.joinable()) monitor_->SetFlushDueHook(nullptr);
  {
    MutexLock l(&wake_mu_);
    stopping_ = true;
  }
  wake_cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

// Not annotated: the wait holds wake_mu_ through its native mutex.
void LogFlusher::Run() NO_THREAD_SAFETY_ANALYSIS {
  // Named for top -H, perf and /proc/PID/task (the bench reads its CPU).
  ::pthread_setname_np(::pthread_self(), "dedupd-flush");
  for (;;) {
    bool close_logs;
    {
      std::unique_lock<std::mutex> l(wake_mu_.native());
      wake_cv_.wait(l, [this]() NO_THREAD_SAFETY_ANALYSIS { return wake_ || stopping_; });
      if (stopping_) return;
      wake_ = false;
      close_logs = close_logs_;
      close_logs_ = false;
    }
    // Errors are the batch's (its records are counted dropped, and the
    // periodic FlushAll and the status report them); the thread goes on.
    (void)Tick();
    if (close_logs) CloseIdleLogs();
  }
}

FlusherStats LogFlusher::stats() {
  MutexLock l(&mu_);
  return stats_;
}

}  // namespace dede
