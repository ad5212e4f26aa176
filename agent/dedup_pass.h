// DedupPass: one out-of-band deduplication pass of this host (DeDe section
// 3.2-3.3): gather the write logs of files this process holds or can lock,
// sort their records by fingerprint, merge them shard by shard with the
// index, and apply the transitions
//
//   absent          -> Unique(F, b)          add the hint
//   Unique(G, c)    -> Shared(arena a)       verify both blocks, share them
//                                            through arena block a; if G is
//                                            held elsewhere, verify F:b only
//                                            and post a merge request for
//                                            G:c to G's holder (merge/)
//   Shared(a)       -> Shared(a)             verify F:b, make it a COW
//                                            reference to arena block a
//   garbage         -> gone                  arena blocks only the arena
//                                            references; Unique hints of
//                                            deleted, recreated, truncated,
//                                            rewritten or dedup=off files
//
// Correctness never rests on a record or an entry: every share is the
// volume's compare_and_share (byte comparison, or a SHA-256 witness by
// policy) under the files' locks, and a block's fingerprint is re-checked
// (under the export's block-range lock inside dedupd) before it becomes an
// arena block, so an arena block's content always matches its entry.
//
// A consumed write log is truncated only after every index version and
// pending file holding its records is durable.
#pragma once

#include <atomic>
#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>

#include "agent/export_table.h"
#include "merge/merge_request.h"
#include "util/clock.h"
#include "util/io_budget.h"
#include "util/status.h"
#include "volume/volume.h"

namespace dede {

struct DedupOptions {
  // Rewrite every shard that has pending work or stale entries to collect,
  // ignoring the batching fraction.
  bool force = false;
  // A shard is rewritten when its pending records exceed this fraction of
  // its entries (DeDe: past it, a sequential rewrite beats random updates).
  double rewrite_fraction = 0.05;
  // An update of a shard that took longer than this splits the shard's
  // range in two at its next update.
  uint64_t split_threshold_ms = 30000;
  // Shards with fewer entries than this are never split.
  uint64_t split_min_entries = 4096;
  // Read and fingerprint every block of every file (not only what the
  // logs name): rebuilds a lost or damaged index.
  bool rescan = false;
  // Records held in memory before they are merged into the index (~48
  // bytes each, plus what a shard's merge holds per record), so a pass
  // after days of writes does not hold every record at once: the
  // gathering of logs, and a rescan, stop there and leave the other logs
  // and blocks to another round of the pass (RunDedupPass).
  size_t max_records = size_t{4} << 20;
  // Blocks the logs say changed without a fingerprint (partial writes)
  // are read and hashed by the pass, at most this many per pass.
  uint64_t rehash_limit = 1u << 20;
  // Block operations (shares, clones, punches) sent to the volume per batch:
  // their reads are merged, and the files involved wait for the batch. The
  // pass sorts all of a shard's operations by block before cutting them
  // into batches, so a smaller batch reads just as densely; it holds up to
  // 2 x batch_ops blocks in memory (16 MiB at 2,048), and every page of
  // that is touched for the first time at some cost (see
  // Volume::ReadBuffer).
  size_t batch_ops = 2048;
  // kHashWitness only on SHA-256 volumes.
  VerifyMode verify = VerifyMode::kByteCompare;
  // Checked between shards: when it becomes true the pass stops early with
  // kUnavailable (everything done so far is durable and consistent; the
  // logs are kept and consumed by a later pass).
  const std::atomic<bool>* cancel = nullptr;
  // Checked between shards like `cancel`, but a stop keeps the pass's work:
  // the records not merged yet are parked in their shards' pending files
  // (one short append per shard) and the logs are consumed, so the next
  // pass resumes where this one stopped. The pass returns OK with
  // stats.stopped set. Used when a dedup window ends. (If a shard's lock is
  // held elsewhere while parking, the pass ends as if cancelled instead:
  // nothing is lost, the logs stay.)
  const std::atomic<bool>* stop = nullptr;
  // Selective sharing (policy stable-after): a record whose block was
  // written less than this long ago is neither merged nor shared this pass;
  // it goes back into its file's log for a later pass, so hot blocks do not
  // churn through copy-on-write. 0: every record is used.
  uint64_t stable_after_ns = 0;
  // Shards (by their range's lo) whose pending files hold records parked
  // because an allocation group was busy elsewhere (records_parked_busy),
  // or whose rewrite held an arena punch back (arena_punches_busy); the
  // pass visits them even with nothing new for them.
  // The pass rewrites these at its next visit whatever the batching
  // fraction says, so the held-back records get their turn as soon as the
  // holder has handed the group over, and it updates the set: a shard
  // rewritten leaves it, one that parks busy records joins it. dedupd keeps
  // it across its passes; nullptr: parked records wait for the batching
  // fraction like any other (a hint only: nothing is lost either way).
  std::set<uint64_t>* busy_parked_shards = nullptr;
  // Before it ends, the pass rewrites the shards that parked such records
  // again, up to this many times, the first after busy_revisit_delay_ms
  // and each later one after twice the pause before it (1.5 + 3 + 6 s by
  // default): the holder of the group hands it over at its next flush
  // point (dedupd's --sync-interval, 1 s by default). No lock of the pass
  // is held during a pause; cancel and stop end it. 0: no revisits.
  uint32_t busy_revisits = 3;
  uint64_t busy_revisit_delay_ms = 1500;
  // Wall clock for stable_after_ns and shard headers; nullptr: the real one.
  Clock* clock = nullptr;
  // Throttling: the pass's threads charge their device I/O to `io_budget`
  // (util/io_budget.h) and call `settle_io` where they hold no volume lock,
  // which sleeps as long as the rate cap needs, calling `between` (when
  // given) every ~250 ms of a long sleep (IoThrottle::Settle).
  IoBudget* io_budget = nullptr;
  std::function<void(const std::function<void()>& between)> settle_io;
  // Called now and then with a one-line status (progress on a terminal).
  std::function<void(const std::string&)> progress;
  // Called with a file's id when the pass has taken its write log (locked
  // it to consume it), before it reads any of the file's blocks: dedupd
  // resumes the write monitor for a file paused because its log was full
  // (WriteMonitor::LogTaken).
  std::function<void(FileId)> log_taken;
  // Called before the pass opens a file's write log: the log, open, if
  // this process holds it open already (dedupd's flusher keeps busy logs
  // open between appends, LogFlusher::LendLog), handed to the pass, which
  // then closes it; nullptr, and the pass opens the log itself.
  std::function<std::unique_ptr<File>(FileId)> borrow_log;
};

struct DedupStats {
  // Gathering.
  uint64_t logs_consumed = 0;
  uint64_t files_busy = 0;          // file or its log held elsewhere: skipped
  uint64_t files_dedup_off = 0;     // records dropped, entries collected
  uint64_t orphan_logs_removed = 0;
  uint64_t log_records = 0;
  uint64_t log_corrupt_frames = 0;
  uint64_t log_dropped_records = 0;  // the monitor shed these: not in the log
  uint64_t logs_saturated = 0;       // logs that reached their size limit (whole file rehashed)
  // Logs describing more than max_records blocks at once: read in bounded
  // memory as if saturated (their files rehashed, within rehash_limit per
  // pass, instead of their records held).
  uint64_t logs_over_budget = 0;
  uint64_t blocks_rehashed = 0;      // changed without a record (or rescanned): read and hashed
  uint64_t files_rescanned = 0;
  // Bounded memory (DedupOptions::max_records): a round of the pass stops
  // reading logs (and rescanning) once it holds that many records;
  // RunDedupPass runs another round for the rest, each a pass of its own.
  // Statistics are summed over the rounds.
  uint64_t rounds = 0;
  uint64_t logs_left_over = 0;  // of the last round: not read (0 once all were)
  // Transitions.
  uint64_t zero_blocks_freed = 0;
  // Zero-block punches held back (the drop list full of drops in groups
  // held elsewhere: never waited for, docs/LOCKING.md "Increments without
  // waiting"); a block from a write log is logged again for a later pass.
  uint64_t zero_blocks_busy = 0;
  uint64_t unique_added = 0;         // absent -> unique
  uint64_t shared_new = 0;           // unique -> shared
  uint64_t shared_hits = 0;          // shared -> shared
  // Of shared_new: the entry's own block G:c shared with the new arena
  // block by this pass (not when G:c was stale, its group busy, or its
  // file held elsewhere: then a merge request asks the holder, whose
  // apply releases it).
  uint64_t indexed_shared = 0;
  uint64_t already_shared = 0;       // records whose block already was the arena's
  uint64_t stale_records = 0;        // record's block changed since: dropped
  uint64_t stale_entries = 0;        // Unique hint no longer true: replaced
  // A record's file held elsewhere and its entry never Shared this pass
  // (no arena block to offer the holder): skipped. Against a Shared entry
  // such a record gets a merge request instead.
  uint64_t busy_targets = 0;
  // Records whose share or clone needed an allocation group another
  // process or host holds (never waited for; docs/LOCKING.md "Increments
  // without waiting"), merge requests whose post was held back (a busy
  // request file or clone source), and records of files held elsewhere
  // in a group parked so: kept in their shard's pending file for a later
  // pass.
  uint64_t records_parked_busy = 0;  // each park counted (a revisit may park again)
  uint64_t shards_revisited = 0;     // rewritten again for their parked records
  // Merge requests (DeDe 3.3.2): Unique(G, c) with G held elsewhere. The
  // record's block still becomes the arena block; G:c is left to G's
  // holder through a request in G's request file (so is a parked record
  // of a file held elsewhere whose entry is Shared).
  uint64_t merge_requests_posted = 0;  // records posted (one post per target per shard update)
  // Posts held back: the request file stayed locked through ~2 s of
  // retries, or a clone's source group was held elsewhere (never waited
  // for); the requests not posted are kept in the shard's pending file as
  // records, posted again by the pass's revisit or a later pass.
  uint64_t merge_posts_busy = 0;
  // Requests for the files this pass holds, applied at its start and again
  // at its end (those other hosts posted while it ran).
  uint64_t merge_requests_applied = 0;
  uint64_t merge_requests_failed_verification = 0;  // target block changed: dropped
  uint64_t merge_requests_busy = 0;    // group held elsewhere: kept for the next apply
  uint64_t merge_requests_stale = 0;   // target recreated, truncated or dedup=off: dropped
  uint64_t merge_corrupt_groups = 0;   // skipped runs of bad request blocks
  uint64_t merge_files_removed = 0;    // request files whose target inode is gone
  uint64_t gc_arena_blocks = 0;      // arena blocks dropped (no one else refers)
  uint64_t gc_unique_entries = 0;    // stale Unique hints removed
  uint64_t arena_blocks_swept = 0;   // arena blocks no entry named (damage, crashes)
  // Reference counts of arena blocks the pass did not read because their
  // allocation group was held elsewhere (never waited for): those entries
  // are kept, and those blocks left for a later pass's check.
  uint64_t gc_checks_busy = 0;
  // Arena punches held back (the drop list full of drops in groups held
  // elsewhere, or, on a volume without drop lists, the block's group held
  // elsewhere: never waited for under the volume mutex, docs/LOCKING.md
  // "Increments without waiting"): the block stays the arena's, named by
  // no entry, until the shard's next rewrite sweeps it.
  uint64_t arena_punches_busy = 0;
  // A split's moves of arena references held back (the block's group
  // handed over to another host since the split took it): the entry is
  // dropped from the upper half (the files keep sharing the block).
  uint64_t split_clones_busy = 0;
  // Index.
  uint64_t shards_rewritten = 0;
  uint64_t shards_deferred = 0;      // below the batching fraction
  uint64_t shards_split = 0;
  // Splits put off to a later update: an allocation group of an arena
  // block the upper half would move was held elsewhere (never waited for).
  uint64_t splits_deferred_busy = 0;
  uint64_t shard_waits = 0;          // a shard was being updated elsewhere: waited
  // Index update concurrency (issue 5: do more shards let more hosts
  // update the index at once?). Every interval this pass held a shard
  // lock to merge into, rewrite or split a shard, in wall-clock time (the
  // pass's Clock::NowNanos), so the spans of several hosts' passes can be
  // laid side by side; the first kMaxShardSpans are kept, all are summed.
  // (A fixed array: the stats stay trivially copyable, the index bench
  // hands them from a child process through shared memory.)
  struct ShardSpan {
    uint64_t start_ns = 0;
    uint64_t end_ns = 0;
  };
  static constexpr size_t kMaxShardSpans = 256;
  uint64_t shard_lock_ns = 0;  // sum of every span's length
  uint64_t shard_lock_spans = 0;  // every span, kept or not
  std::array<ShardSpan, kMaxShardSpans> shard_span_list{};
  size_t shard_span_count = 0;
  void AddShardSpan(uint64_t start_ns, uint64_t end_ns) {
    shard_lock_ns += end_ns - start_ns;
    shard_lock_spans++;
    if (shard_span_count < kMaxShardSpans) shard_span_list[shard_span_count++] = {start_ns, end_ns};
  }
  std::span<const ShardSpan> shard_spans() const {
    return {shard_span_list.data(), shard_span_count};
  }
  // File blocks this pass made point elsewhere and gave up: records and
  // indexed blocks shared with an arena block, zero blocks punched, merge
  // requests applied (what `dede report` calls reclaimed). Not counted:
  // garbage arena blocks collected (space a VM's overwrite had already
  // made unreachable), and a share left to another host's apply (counted
  // there, once). Each is freed unless something else still refers to it
  // (a file's block shared with the arena is copy-on-write: a rewrite of
  // it goes to a new block, so a record's block is its file's alone).
  uint64_t blocks_released() const {
    return shared_hits + indexed_shared + zero_blocks_freed + merge_requests_applied;
  }
  uint64_t pending_records_written = 0;
  uint64_t pending_records_applied = 0;
  uint64_t entries_scanned = 0;      // old entries merge-scanned
  uint64_t entries_written = 0;
  uint64_t index_bytes_read = 0;
  uint64_t index_bytes_written = 0;
  uint64_t corrupt_shard_blocks = 0;
  uint64_t incomplete_versions_removed = 0;
  uint64_t stale_files_removed = 0;
  // Index files (shard versions, pending files) and merge-request files of
  // a newer major format version (a newer dede on the volume): never read,
  // rewritten or removed here (docs/FORMAT.md section 9). A shard left
  // alone so is not updated by this pass: its records are dropped (hints).
  // Counted at each encounter.
  uint64_t newer_format_left_alone = 0;
  uint64_t files_given_back = 0;  // borrowed files handed to a client waiting to open them
  // Scheduling.
  bool stopped = false;                // stopped by DedupOptions::stop (work parked)
  uint64_t records_parked_at_stop = 0; // records parked in pending files by the stop
  uint64_t young_records_deferred = 0; // younger than stable_after: back into the logs
  uint64_t young_ranges_deferred = 0;  // changed ranges too young to rehash: back into the logs
  uint64_t rehash_ranges_deferred = 0; // changed ranges past the rehash limit: back into the logs
  // Time.
  uint64_t gather_ns = 0;
  uint64_t merge_ns = 0;
  uint64_t total_ns = 0;

  // Adds another round's figures: sums; `stopped` if either stopped;
  // logs_left_over becomes the other's; `rounds` is left to the caller.
  void Add(const DedupStats& o);
};

// The counters of DedupStats that rounds sum (DedupStats::Add) and
// `dede dedup --json` prints, by their JSON names: every uint64_t member
// but rounds, logs_left_over, the shard spans and the times. A static
// check of the struct's size (dedup_pass.cc) makes a member added to
// DedupStats without a decision about this list a compile error.
struct DedupCounter {
  const char* name;
  uint64_t DedupStats::*field;
};
std::span<const DedupCounter> DedupCounters();

// How the pass reaches files: dedupd lends its open exports; the command
// line opens files on the volume (taking their locks). Every check and
// change the pass makes to a file's blocks is a Volume::ApplyBlockOps
// operation, atomic with respect to the file's writers, so the pass needs
// no lock of dedupd's data path.
class FileAccess {
 public:
  struct Handle {
    File* file = nullptr;
  };
  virtual ~FileAccess() = default;
  // kLocked: held by another process or host. kNotFound: gone (or another
  // generation). The handle stays valid until the access object dies or
  // GiveBackIfWanted gives the file back.
  virtual Result<Handle> Get(const FileInfo& info) = 0;
  // If this access opened the file only for the pass (no VM of this host
  // uses it) and another process or host waits to open it
  // (File::WantedElsewhere), closes it and returns true: its handle is
  // invalid from then on. Never waits. By default nothing is given back.
  virtual bool GiveBackIfWanted(const FileInfo& info) {
    (void)info;
    return false;
  }
};

// Opens files on the volume and keeps them open (locked) until destroyed.
class VolumeFileAccess : public FileAccess {
 public:
  explicit VolumeFileAccess(Volume* vol) : vol_(vol) {}
  Result<Handle> Get(const FileInfo& info) override;
  bool GiveBackIfWanted(const FileInfo& info) override;

 private:
  Volume* vol_;
  std::map<uint64_t, std::unique_ptr<File>> open_;  // by inode
};

// Borrows (or opens as exports) dedupd's files; releases them when destroyed.
// kOnlyOpen lends only exports open now, and answers kNotFound for the
// others: dedupd's merge timer, which must not reopen a file whose VM has
// just left (another host may be about to take it).
class ExportFileAccess : public FileAccess {
 public:
  enum Scope { kOpenAny, kOnlyOpen };
  explicit ExportFileAccess(ExportTable* table, Scope scope = kOpenAny)
      : table_(table), scope_(scope) {}
  ~ExportFileAccess() override;
  Result<Handle> Get(const FileInfo& info) override;
  bool GiveBackIfWanted(const FileInfo& info) override;

 private:
  ExportTable* table_;
  const Scope scope_;
  std::map<uint64_t, std::shared_ptr<Export>> held_;  // by inode
};

Result<DedupStats> RunDedupPass(Volume* vol, FileAccess* access, const DedupOptions& opts);

// Applies the merge requests posted for files `access` can lend (DeDe:
// "hosts periodically check for merge requests to the files they have
// exclusive locks on"): for every request file on the volume whose target
// `wanted` accepts (all when empty), the target is taken through `access`
// (kLocked, kNotFound: skipped, its holder applies them) and
// ApplyMergeRequests runs on it. Request files whose target inode no
// longer holds a regular file are removed. A pass does this at its start
// and at its end; dedupd also on a timer, for the exports it has open.
// Never waits for a lock held elsewhere.
Result<MergeApplyStats> ApplyMergeRequestsForHeldFiles(
    Volume* vol, FileAccess* access, VerifyMode verify,
    const std::function<bool(const FileInfo&)>& wanted = nullptr);

}  // namespace dede
