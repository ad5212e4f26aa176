// WriteMonitor: DeDe's write monitor (paper section 3.1) in dedupd's write
// path. For every fully covered, 4 KiB-aligned block of a completed write it
// fingerprints the block from the caller's buffer (no extra I/O) and buffers
// a (block, fingerprint, time) record for the file. Records are buffered per
// file and coalesce: a later write of the same block replaces the record.
// Anything that changes a block without fingerprinting it (a partial-block
// write, TRIM, WRITE_ZEROES, a failed write) invalidates the block: its
// buffered record goes, and the invalidation itself is kept so that a record
// of the block already flushed to the file's write log is cancelled too.
//
// The buffer has a memory cap shared by all files. When a record would pass
// it, the file's buffer is coalesced first (rewrites of buffered blocks then
// cost nothing); if there is still no room the record is shed: counted per
// file and the file marked "records dropped since T", which reaches the
// write log so a later pass knows the log is incomplete (and may even hold
// a stale fingerprint for a block rewritten while shedding) and must verify
// everything. An invalidation that finds no room is shed the same way, but
// still removes the buffered records it covers. Correctness never depends
// on these records: every share is verified by the volume.
//
// Files with dedup=off are never hashed and have no buffer. Writes made
// while a file is off (or while no monitor ran) are not seen, so its log
// may keep stale fingerprints from before: harmless for the same reason.
//
// Threads: every method may be called from any thread. Hashing runs outside
// the monitor's lock, and so does coalescing: writes to a file go on being
// appended while its buffer is sorted or folded. Records of one block are applied in the order the
// monitor is called; callers serialise writes to the same block (dedupd's
// per-export block range lock) and call OnWrite before releasing it, so the
// buffer's order is the device's order.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "util/clock.h"
#include "util/fingerprint.h"
#include "util/mutex.h"
#include "volume/volume.h"

namespace dede {

// One fingerprinted block: `block` is the block index within the file.
struct BlockRecord {
  uint64_t block = 0;
  uint64_t time_ns = 0;  // wall clock when the write completed
  Fingerprint fp;
};

// Blocks [first, first + count) changed without a fingerprint.
struct InvalidRange {
  uint64_t first = 0;
  uint64_t count = 0;
  uint64_t time_ns = 0;
};

// A file's buffered changes, taken for the write log, coalesced:
// `records` sorted by block, one per block (latest write wins);
// `invalidated` sorted, non-overlapping, non-adjacent ranges, disjoint from
// `records`. Applying `invalidated` and then `records` to the previous state
// of the log gives the new state.
struct MonitorBatch {
  FileId file;
  std::vector<BlockRecord> records;
  std::vector<InvalidRange> invalidated;
  uint64_t first_ns = 0;  // time range of what is in the batch (0 if empty)
  uint64_t last_ns = 0;
  // Entries (records or invalidations) lost since the previous batch: shed
  // at the cap, put back over the cap, or counted by MarkDropped.
  uint64_t dropped_records = 0;
  uint64_t dropped_since_ns = 0;  // first loss since the previous batch; 0 = none
  // The file's LogTaken count when the batch was taken (for PauseForFullLog).
  uint64_t log_epoch = 0;
  bool empty() const {
    return records.empty() && invalidated.empty() && dropped_records == 0;
  }
  // Every entry the batch stands for (what is lost if it is not logged).
  uint64_t entries() const { return records.size() + invalidated.size() + dropped_records; }
  // When the oldest of those entries happened.
  uint64_t oldest_ns() const { return dropped_since_ns ? dropped_since_ns : first_ns; }
};

struct WriteMonitorOptions {
  HashAlgo algo = HashAlgo::kXxh128;
  // Cap on buffered bytes (all files): past it new records are shed. What
  // is counted is an estimate of the heap the buffers take (an op or a
  // coalesced entry is charged like a tree node, ~88 bytes); up to 16 MiB
  // of spare op chunks kept for reuse come on top.
  size_t memory_cap_bytes = size_t{64} << 20;
  // A file is due for flushing when its coalesced records would encode to
  // at least this many bytes in the write log (so a flush under sustained
  // writing appends >= 1 MiB sequentially).
  size_t flush_bytes = size_t{1} << 20;
  Clock* clock = nullptr;  // nullptr = real clock
};

struct MonitorFileStats {
  uint64_t buffered_records = 0;     // records now in memory (after coalescing so far)
  uint64_t buffered_bytes = 0;       // memory charged to the file (an estimate)
  uint64_t hashed_blocks = 0;        // blocks fingerprinted since AddFile
  uint64_t dropped_records = 0;      // entries lost since AddFile (see MonitorBatch)
  uint64_t dropped_since_ns = 0;     // first shed not yet taken in a batch; 0 = none
  bool dedup = true;
  bool log_full = false;             // paused: see PauseForFullLog
  bool log_no_space = false;         // writes invalidate: see SetLogNoSpace
  uint64_t unrecorded_blocks = 0;    // blocks written while paused, since AddFile
};

struct MonitorStats {
  uint64_t files = 0;
  uint64_t buffered_records = 0;
  uint64_t buffered_bytes = 0;
  uint64_t memory_cap_bytes = 0;
  uint64_t hashed_blocks = 0;
  uint64_t dropped_records = 0;
  uint64_t log_full_files = 0;       // files paused now (PauseForFullLog)
  uint64_t unrecorded_blocks = 0;    // blocks written while their file was paused
};

class WriteMonitor {
 public:
  explicit WriteMonitor(const WriteMonitorOptions& opts);
  ~WriteMonitor();
  WriteMonitor(const WriteMonitor&) = delete;
  WriteMonitor& operator=(const WriteMonitor&) = delete;

  HashAlgo algo() const { return opts_.algo; }

 private:
  // Defined in write_monitor.cc. One file's buffer: an append-only list of
  // compact ops and the coalesced state they are folded into, under its
  // own mutex.
  struct FileBuffer;

 public:
  // A monitored file as a caller that writes it keeps it (dedupd's Export,
  // for as long as it serves the file). Calls through a handle skip the
  // lookup of the file in the monitor's map, which costs a shared lock and
  // two reference-count updates per call, and dedupd makes two calls per
  // WRITE. A handle stays safe after RemoveFile: calls through it then look
  // the file up by id, as the id-taking calls do. It must not outlive the
  // monitor.
  class FileHandle {
   public:
    FileHandle() = default;
    explicit FileHandle(FileId id) : id_(id) {}  // looks the file up at every call
    FileId id() const { return id_; }

   private:
    friend class WriteMonitor;
    FileHandle(FileId id, std::shared_ptr<FileBuffer> fb) : id_(id), fb_(std::move(fb)) {}
    FileId id_;
    std::shared_ptr<FileBuffer> fb_;
  };

  // Starts monitoring `id` (or, already monitored, sets dedup) and returns
  // its handle. Calls for files never added are ignored.
  FileHandle AddFile(FileId id, bool dedup_on);
  // Stops monitoring and discards the file's buffer (take it first).
  void RemoveFile(FileId id);
  // dedup=off discards the file's buffer and stops hashing; on resumes.
  void SetDedup(FileId id, bool on);

  // A write of `len` bytes at byte `offset` completed successfully with
  // `data`. Whole aligned blocks are fingerprinted; partial edge blocks are
  // invalidated.
  // `precomputed`: FingerprintWrite(offset, data, len) of the same data,
  // hashed earlier by a caller that had it in the CPU's cache (dedupd hashes
  // a WRITE's payload as it arrives); used instead of hashing again if it
  // has one fingerprint per whole block.
  void OnWrite(const FileHandle& file, uint64_t offset, const void* data, size_t len,
               const std::vector<Fingerprint>* precomputed = nullptr);
  void OnWrite(FileId id, uint64_t offset, const void* data, size_t len,
               const std::vector<Fingerprint>* precomputed = nullptr) {
    OnWrite(FileHandle(id), offset, data, len, precomputed);
  }
  // The fingerprints OnWrite would compute for a write of `len` bytes at
  // `offset`: one per whole aligned block, in order. Hashing happens here,
  // with no lock held.
  std::vector<Fingerprint> FingerprintWrite(uint64_t offset, const void* data, size_t len) const;
  // Bytes [offset, offset+len) changed without data to hash (TRIM,
  // WRITE_ZEROES, failed write): every block it touches is invalidated.
  void OnInvalidate(const FileHandle& file, uint64_t offset, uint64_t len);
  void OnInvalidate(FileId id, uint64_t offset, uint64_t len) {
    OnInvalidate(FileHandle(id), offset, len);
  }

  // `hook` is called when a file's buffer reaches flush_bytes: once per
  // crossing, on the write path that crossed it, outside the file's locks,
  // so it must not block (dedupd wakes its flusher thread). A file is armed
  // again when it is taken, or when DueFiles finds it not due after all
  // (coalescing shrank it). Without it, files pass flush_bytes unnoticed
  // until someone calls DueFiles, and a busy file's buffer grows with the
  // time between calls (at 1.5 GB/s, 400k ops a second). nullptr removes
  // the hook; once this returns, the old hook is no longer running or called.
  void SetFlushDueHook(std::function<void()> hook) EXCLUDES(hook_mu_);

  // Files with anything to flush: those past flush_bytes, or when `all`,
  // every file with a non-empty buffer or shed records. Sorted by FileId.
  std::vector<FileId> DueFiles(bool all);
  // Takes the file's buffer, coalesced (see MonitorBatch); the file's
  // buffer is empty afterwards and its memory released. Coalescing runs
  // outside the file's lock, so writes go on meanwhile. Batches of one file
  // must reach its log in the order they were taken: one flusher at a time
  // per file, from Take until the append or the PutBack. `reuse`: a
  // records vector from an earlier batch whose memory the new batch's
  // records go into (cleared first), so a flusher that hands each batch's
  // vector back does not fault in fresh pages for every batch.
  MonitorBatch Take(FileId id, std::vector<BlockRecord> reuse = {});
  // Gives back a batch taken by Take() that could not be written; it is
  // older than anything buffered since and merged under it (newer records
  // of the same block win). If it does not fit under the cap, its entries
  // (records and invalidated ranges) are counted as dropped instead. Its
  // own dropped count and time are kept either way.
  void PutBack(MonitorBatch batch);
  // Counts `n` entries of `id` as lost (e.g. a batch whose log append
  // failed for good), lost since `since_ns` (0 = now). `carried` of the n
  // were counted when they were first lost (a lost batch's own
  // dropped_records): they are pending for the log again but not counted
  // twice in the totals.
  void MarkDropped(FileId id, uint64_t n, uint64_t since_ns = 0, uint64_t carried = 0);

  // The file's write log is full: the flusher appended its saturation
  // frame, or found one, for a batch taken at `log_epoch` (the batch's).
  // The log already says every block may have changed and the pass that
  // consumes it rehashes the whole file, so until then the file's writes
  // are neither hashed nor buffered (counted as unrecorded), and its
  // buffer is discarded. Ignored when LogTaken was called since the batch
  // was taken: that pass may have emptied the log.
  void PauseForFullLog(FileId id, uint64_t log_epoch);
  // A dedup pass took the file's write log to consume it: record again.
  // Must be called before the pass reads the file's blocks, so that a write
  // the pass may not see is recorded (the flag is cleared under the file's
  // mutex, which the write path takes before it skips a write).
  void LogTaken(FileId id);
  // The file's last write-log append found the volume full (`no_space`),
  // or a later one succeeded. Meanwhile the flusher drops the file's
  // batches untried until its next interval (LogFlusher), so hashing the
  // file's writes would be CPU for records that are thrown away: its
  // writes invalidate the blocks they touch instead (one op each, which a
  // sequential writer coalesces into one range), and the log takes those
  // with the first batch that fits, so the pass rehashes the blocks. A
  // random writer's ops can make the file due before then: that batch is
  // dropped untried like any other (MarkDropped: the log's next frame says
  // records were lost), and its blocks keep whatever records the log had,
  // which the volume's verification of every share makes harmless.
  void SetLogNoSpace(FileId id, bool no_space);
  // The file's LogTaken count (0 for files not monitored), for a caller
  // that checks the log itself before calling PauseForFullLog.
  uint64_t LogEpoch(FileId id);
  // Whether a write of `id` would be recorded with fingerprints now:
  // monitored, dedup=on, not paused for a full log, and its log not out of
  // space (SetLogNoSpace). A caller that hashes payloads ahead
  // (FingerprintWrite) asks first, so a file whose log is full is not
  // hashed for nothing until a pass takes its log. A hint: the answer may
  // change before OnWrite (OnWrite hashes what it was not given).
  bool Recording(const FileHandle& file);
  bool Recording(FileId id) { return Recording(FileHandle(id)); }

  // Unknown files report zeros and dedup = false.
  MonitorFileStats FileStats(FileId id);
  MonitorStats Stats();

 private:
  // Defined in write_monitor.cc: a change as the write path appends it (a
  // record, or an invalidated block range), kept in chunks recycled through
  // the monitor's pool.
  struct Op;
  struct ChunkPool;
  class OpList;

  std::shared_ptr<FileBuffer> Find(FileId id) EXCLUDES(mu_);
  // The handle's buffer while its file is monitored; else the file's
  // buffer found by id (kept alive in `found`), or nullptr.
  FileBuffer* Resolve(const FileHandle& file, std::shared_ptr<FileBuffer>* found) EXCLUDES(mu_);
  // Adds the ops of one call to `fb` (appended while under the cap; else
  // applied one by one to the coalesced state, shed when there is no room).
  void Append(FileBuffer* fb, const Op* ops, size_t n, size_t hashed);
  // Append's path once the cap is reached. Takes fb's restructure_mu.
  void AppendAtCap(FileBuffer* fb, const Op* ops, size_t n, size_t hashed);
  // AppendAtCap under the file's locks; true when the hook is to be called.
  bool AppendAtCapLocked(FileBuffer* fb, const Op* ops, size_t n, size_t hashed);
  // Coalesces fb's ops (a sort when they are all records, else into the
  // tree) with fb's mu released, so writes keep appending. The caller holds
  // fb's restructure_mu (not annotated: FileBuffer is defined in the .cc).
  void CoalesceOutsideLock(FileBuffer* fb);
  // Pending ops at which Append coalesces `fb`: coalesce_ops_ times its
  // backoff, at most max_coalesce_ops_.
  size_t CoalesceAt(const FileBuffer& fb) const;
  // True (and the write counted as unrecorded) when the file is paused for
  // its full log; checked again under the file's mutex before skipping.
  bool SkipForFullLog(FileBuffer* fb, uint64_t blocks);
  // Counts `blocks` written to `fb` without a record (its log is full).
  // The caller holds fb's mu (not annotated: FileBuffer is defined in the
  // .cc), so LogTaken happens-after the write it counts.
  void CountUnrecorded(FileBuffer* fb, uint64_t blocks);
  // Whether the ops just added took fb's buffer to its DueBound since it
  // was last taken or found not due; marks it so. Caller holds fb's mu.
  bool ReachedFlushBytes(FileBuffer* fb);
  // The log bytes bound (every op counted as a new entry) at which fb is
  // due without coalescing it first: flush_bytes, or, while coalescing fb
  // has not paid lately (it backed off) and its ops are not simply
  // sequential, backed_off_due_bytes_, since its ops are then trusted to
  // shrink by less than an eighth. Caller holds fb's mu.
  uint64_t DueBound(const FileBuffer* fb) const;
  void CallFlushDueHook() EXCLUDES(hook_mu_);
  // Charges `bytes` to the shared budget if it stays within the cap.
  bool Reserve(uint64_t bytes);
  void Release(uint64_t bytes);

  // Destroyed last: every buffer returns its chunks here.
  const std::unique_ptr<ChunkPool> pool_;
  const WriteMonitorOptions opts_;
  Clock* const clock_;
  const size_t record_bytes_;   // WriteLogRecordBytes(algo)
  const size_t range_bytes_;    // WriteLogRangeBytes()
  const size_t coalesce_ops_;   // pending ops at which Append coalesces
  const size_t max_coalesce_ops_;  // the same, however far backed off
  const uint64_t backed_off_due_bytes_;  // see DueBound
  // Guards the map only: the write path takes it shared, just long enough
  // to find the file; AddFile/RemoveFile take it exclusively.
  SharedMutex mu_;
  std::map<FileId, std::shared_ptr<FileBuffer>> files_ GUARDED_BY(mu_);
  std::atomic<uint64_t> buffered_bytes_{0};  // all files; see Reserve
  std::atomic<uint64_t> hashed_blocks_{0};
  std::atomic<uint64_t> dropped_records_{0};
  std::atomic<uint64_t> unrecorded_blocks_{0};
  // A leaf, held while the hook runs (so SetFlushDueHook can wait it out).
  Mutex hook_mu_;
  std::function<void()> flush_due_hook_ GUARDED_BY(hook_mu_);
};

}  // namespace dede
