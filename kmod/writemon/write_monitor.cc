#include "kmod/writemon/write_monitor.h"

#include <algorithm>
#include <limits>
#include <new>
#include <type_traits>

#include "kmod/writemon/write_log.h"
#include "volume/format.h"

namespace dede {

namespace {

// Block indexes of a file: byte offsets are u64, so blocks stay below 2^52
// and block + count never wraps.
constexpr uint64_t kBlockLimit = uint64_t{1} << 52;

struct RecVal {
  uint64_t time_ns = 0;
  Fingerprint fp;
};
struct RangeVal {
  uint64_t end = 0;  // one past the last block
  uint64_t time_ns = 0;
};

// Memory is charged by estimate, not measured: a red-black tree node is
// about 32 bytes of links and colour plus the value.
constexpr uint64_t kTreeNodeOverhead = 32;
constexpr uint64_t kNodeBytes =
    kTreeNodeOverhead + std::max(sizeof(std::pair<const uint64_t, RecVal>),
                                 sizeof(std::pair<const uint64_t, RangeVal>));

// Writes per hashing round of OnWrite: bounds the stack array and how long
// the file's mutex is held for one huge write.
constexpr size_t kOpsPerRound = 64;

// The coalesced state of a file: applying a sequence of ops in order to it
// is the meaning of the buffer. `records` and the blocks of `ranges` are
// disjoint; ranges are non-overlapping and non-adjacent (a map from first
// block to end), so one TRIM of a whole disk is one entry.
struct State {
  std::map<uint64_t, RecVal> records;
  std::map<uint64_t, RangeVal> ranges;

  uint64_t nodes() const { return records.size() + ranges.size(); }
  bool empty() const { return records.empty() && ranges.empty(); }

  // The range holding block b, or ranges.end().
  std::map<uint64_t, RangeVal>::iterator RangeAt(uint64_t b) {
    auto it = ranges.upper_bound(b);
    if (it == ranges.begin()) return ranges.end();
    --it;
    return b < it->second.end ? it : ranges.end();
  }

  void SetRecord(uint64_t b, uint64_t time_ns, const Fingerprint& fp) {
    if (records.empty() || b > records.rbegin()->first) {
      // Sequential writes append: O(1) with the end hint.
      records.emplace_hint(records.end(), b, RecVal{time_ns, fp});
    } else {
      records.insert_or_assign(b, RecVal{time_ns, fp});
    }
    if (ranges.empty()) return;
    auto it = RangeAt(b);
    if (it == ranges.end()) return;
    const RangeVal r = it->second;
    if (it->first == b) {
      ranges.erase(it);
    } else {
      it->second.end = b;
    }
    if (b + 1 < r.end) ranges.emplace(b + 1, RangeVal{r.end, r.time_ns});
  }

  // Drops the records of [first, end); returns how many.
  uint64_t EraseRecords(uint64_t first, uint64_t end) {
    if (records.empty() || first > records.rbegin()->first) return 0;
    auto it = records.lower_bound(first);
    uint64_t n = 0;
    while (it != records.end() && it->first < end) {
      it = records.erase(it);
      n++;
    }
    return n;
  }

  // Ranges that [first, end) overlaps or touches (they merge with it).
  uint64_t TouchingRanges(uint64_t first, uint64_t end) {
    uint64_t n = 0;
    auto it = ranges.upper_bound(first);
    if (it != ranges.begin() && std::prev(it)->second.end >= first) --it;
    for (; it != ranges.end() && it->first <= end; ++it) n++;
    return n;
  }

  void Invalidate(uint64_t first, uint64_t end, uint64_t time_ns) {
    EraseRecords(first, end);
    auto it = ranges.upper_bound(first);
    if (it != ranges.begin() && std::prev(it)->second.end >= first) --it;
    uint64_t lo = first, hi = end, t = time_ns;
    while (it != ranges.end() && it->first <= end) {
      lo = std::min(lo, it->first);
      hi = std::max(hi, it->second.end);
      t = std::max(t, it->second.time_ns);
      it = ranges.erase(it);
    }
    ranges.emplace_hint(it, lo, RangeVal{hi, t});
  }

  // Nodes a record of block b adds (a new record, maybe a range split in
  // two, maybe a one-block range gone).
  int64_t RecordNodeDelta(uint64_t b) {
    int64_t d = records.count(b) ? 0 : 1;
    auto it = RangeAt(b);
    if (it != ranges.end()) {
      const bool at_first = it->first == b, at_last = b + 1 == it->second.end;
      if (at_first && at_last) d -= 1;
      if (!at_first && !at_last) d += 1;
    }
    return d;
  }
};

// SortRecords's working memory, kept per thread (the flusher, and the
// writers that coalesce) so a flush does not fault in fresh pages for it
// (7-30 us a page on these guests; a sort of 40k ops needs 640 KiB). What
// grew past kMaxKeptBytes (a writer's coalesce of a backed-off buffer, a
// rare big batch) is given back: at most 2 MiB stays per thread.
struct SortKey {
  uint64_t block;
  uint64_t index;
};
// A table of this many slots per op is still cheaper to fill and scan
// than sorting the ops (4 bytes a slot against 16 bytes a key and log n
// passes).
constexpr uint64_t kDenseSpanFactor = 4;
struct SortScratch {
  static constexpr size_t kMaxKeptBytes = size_t{1} << 20;
  std::vector<uint32_t> slots;
  std::vector<SortKey> keys;
  static SortScratch& ForThread() {
    thread_local SortScratch scratch;
    return scratch;
  }
  void Trim() {
    if (slots.capacity() * sizeof(uint32_t) > kMaxKeptBytes) std::vector<uint32_t>().swap(slots);
    if (keys.capacity() * sizeof(SortKey) > kMaxKeptBytes) std::vector<SortKey>().swap(keys);
  }
};

}  // namespace

// One change, as the write path appends it: a record (count == 0) or the
// invalidation of [block, block + count).
struct WriteMonitor::Op {
  uint64_t block = 0;
  uint64_t count = 0;
  uint64_t time_ns = 0;
  Fingerprint fp;
};

namespace {

// An op is charged like the tree node it may become, so coalescing never
// raises a file's charge (except a record splitting a range in two).
constexpr uint64_t kOpBytes = std::max<uint64_t>(kNodeBytes, 64);

// Ops are kept in fixed-size chunks, so growing a buffer never copies what
// is there (a vector doubling 2 MiB under the file's lock would stall the
// write path). Chunks are raw storage (Op is trivially copyable: no
// zeroing) and recycled through a small pool, so steady writing reuses
// memory that is already mapped instead of faulting in fresh pages.
constexpr size_t kChunkOps = 1024;

constexpr uint32_t kMaxCoalesceBackoff = 64;

}  // namespace

struct WriteMonitor::ChunkPool {
  // Spare chunks kept for reuse, all files together (16 MiB); not charged to
  // the cap, which counts what is buffered. Sized for what one flush interval
  // of a busy VM buffers (500 MB/s for 1 s is 128k ops, 125 chunks): with
  // fewer, every flush freed the surplus and the next interval faulted it
  // in again, at 7-30 us a page on these guests (docs/BENCHMARKS.md, "NBD
  // data path").
  static constexpr size_t kMaxSpareChunks = (size_t{16} << 20) / (kChunkOps * sizeof(Op));

  ~ChunkPool() {
    MutexLock l(&mu);
    for (Op* c : spare) Free(c);
  }
  Op* Get() {
    {
      MutexLock l(&mu);
      if (!spare.empty()) {
        Op* c = spare.back();
        spare.pop_back();
        return c;
      }
    }
    return static_cast<Op*>(::operator new(kChunkOps * sizeof(Op), std::align_val_t{alignof(Op)}));
  }
  void Put(Op* c) {
    {
      MutexLock l(&mu);
      if (spare.size() < kMaxSpareChunks) {
        spare.push_back(c);
        return;
      }
    }
    Free(c);
  }
  static void Free(Op* c) { ::operator delete(c, std::align_val_t{alignof(Op)}); }

  Mutex mu;  // a leaf: taken under a file's mutex, never the other way
  std::vector<Op*> spare GUARDED_BY(mu);
};

class WriteMonitor::OpList {
  static_assert(std::is_trivially_copyable_v<Op> && std::is_trivially_destructible_v<Op>);

 public:
  explicit OpList(ChunkPool* pool) : pool_(pool) {}
  ~OpList() { clear(); }
  OpList(const OpList&) = delete;
  OpList& operator=(const OpList&) = delete;

  void push_back(const Op& v) {
    if (size_ % kChunkOps == 0) chunks_.push_back(pool_->Get());
    // Placement copy into raw storage: no zeroing first.
    new (chunks_.back() + size_ % kChunkOps) Op(v);
    size_++;
  }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const Op& back() const { return chunks_.back()[(size_ - 1) % kChunkOps]; }
  const Op& operator[](size_t i) const { return chunks_[i / kChunkOps][i % kChunkOps]; }
  void clear() {
    for (Op* c : chunks_) pool_->Put(c);
    chunks_.clear();
    size_ = 0;
  }
  void swap(OpList& o) {
    chunks_.swap(o.chunks_);
    std::swap(size_, o.size_);
    std::swap(pool_, o.pool_);
  }
  template <typename F>
  void ForEach(F&& f) const {
    for (size_t i = 0; i < size_; i++) f(chunks_[i / kChunkOps][i % kChunkOps]);
  }

 private:
  ChunkPool* pool_;
  std::vector<Op*> chunks_;
  size_t size_ = 0;
};

struct WriteMonitor::FileBuffer {
  FileBuffer(FileId i, bool on, ChunkPool* pool) : id(i), dedup(on), ops(pool) {}

  const FileId id;
  // Changed under mu; read without it on the write path to skip hashing.
  std::atomic<bool> dedup;
  // Paused because the write log is full (PauseForFullLog); changed under
  // mu, read without it first on the write path, and again under mu before
  // a write is skipped (so LogTaken happens-after every skipped write).
  std::atomic<bool> log_full{false};
  std::atomic<uint64_t> hashed{0};
  std::atomic<uint64_t> unrecorded{0};

  // The flusher's last append to the file's write log found the volume
  // full (SetLogNoSpace); changed by the flusher, read on the write path.
  std::atomic<bool> log_no_space{false};

  bool Recording() const {
    return dedup.load(std::memory_order_relaxed) && !log_full.load(std::memory_order_relaxed);
  }
  // Recording with fingerprints: while the log takes nothing, writes are
  // buffered as invalidations (no hashing; the pass rehashes the blocks).
  bool Hashing() const { return Recording() && !log_no_space.load(std::memory_order_relaxed); }
  // Not recording only because the write log is full: the writes that
  // find it so are counted as unrecorded.
  bool PausedForFullLog() const {
    return dedup.load(std::memory_order_relaxed) && log_full.load(std::memory_order_relaxed);
  }
  // Whether coalescing this file's ops pays: 1 after a coalesce that
  // removed at least an eighth of them, doubled (up to kMaxCoalesceBackoff)
  // after each one that did not. One sequential writer whose requests the
  // workers finish out of order never rewrites a block, yet its ops are
  // not increasing: sorting them early only costs CPU (4x the hash, in
  // dede-bench-monitor's "shuffled" pattern). Append then waits that many
  // times longer before coalescing, and DueFiles trusts the bound instead
  // of sorting to size the file exactly. Kept across Takes.
  std::atomic<uint32_t> coalesce_backoff{1};
  bool BackedOff() const { return coalesce_backoff.load(std::memory_order_relaxed) > 1; }

  void NoteCoalesce(uint64_t ops_before, uint64_t entries_after) {
    if (ops_before == 0) return;
    const uint32_t b = coalesce_backoff.load(std::memory_order_relaxed);
    const bool paid = entries_after * 8 < ops_before * 7;
    coalesce_backoff.store(paid ? 1 : std::min(2 * b, kMaxCoalesceBackoff),
                           std::memory_order_relaxed);
  }

  // Held by whoever replaces the file's ops or state wholesale: a
  // coalesce, Take, PutBack, the at-cap path of Append, Discard. A coalesce
  // holds it across its sort or tree build and releases `mu` meanwhile, so
  // writes keep appending (sorting 100k ops takes tens of milliseconds;
  // under `mu` every worker's append waited for it, docs/BENCHMARKS.md).
  // Lock order: restructure_mu, then mu, then the pool's mutex.
  Mutex restructure_mu;
  Mutex mu;
  // Changed under mu; read without it by Resolve, to tell a handle's
  // buffer from the file's current one.
  std::atomic<bool> removed{false};
  uint64_t log_epoch GUARDED_BY(mu) = 0;  // LogTaken calls
  OpList ops GUARDED_BY(mu);  // since the last coalesce, in call order
  uint64_t record_ops GUARDED_BY(mu) = 0;  // ops with count == 0
  // `ops` are records of strictly increasing blocks (kept up to date in
  // O(1) per op). With an empty `state` too the ops are already their own
  // coalesced form (sequential writing): sizing is exact, coalescing gains
  // nothing, and Take needs no tree.
  bool ops_increasing GUARDED_BY(mu) = true;
  State state GUARDED_BY(mu);              // everything before `ops`
  uint64_t charged GUARDED_BY(mu) = 0;     // this file's part of buffered_bytes_
  uint64_t dropped_total GUARDED_BY(mu) = 0;
  uint64_t dropped_pending GUARDED_BY(mu) = 0;  // not yet taken in a batch
  uint64_t dropped_since_ns GUARDED_BY(mu) = 0;
  // The flush-due hook was called for the buffer as it is (ReachedFlushBytes).
  bool flush_due_signalled GUARDED_BY(mu) = false;
  // While a coalesce runs with `mu` released (`detached`): the ops and state
  // it took out are still charged and counted through these. Appends go to
  // the emptied `ops` meanwhile (after the taken ones, in call order) and
  // never coalesce themselves.
  bool detached GUARDED_BY(mu) = false;
  uint64_t detached_charge GUARDED_BY(mu) = 0;
  uint64_t detached_records GUARDED_BY(mu) = 0;

  uint64_t Charge() const REQUIRES(mu) {
    return ops.size() * kOpBytes + state.nodes() * kNodeBytes + detached_charge;
  }

  // Brings the shared counter in line with what the file holds now.
  void Recharge(std::atomic<uint64_t>* total) REQUIRES(mu) {
    const uint64_t now = Charge();
    if (now >= charged) {
      total->fetch_add(now - charged, std::memory_order_relaxed);
    } else {
      total->fetch_sub(charged - now, std::memory_order_relaxed);
    }
    charged = now;
  }

  void Append(const Op* in, size_t n) REQUIRES(mu) {
    for (size_t i = 0; i < n; i++) {
      const Op& op = in[i];
      record_ops += op.count == 0;
      ops_increasing =
          ops_increasing && op.count == 0 && (ops.empty() || op.block > ops.back().block);
      ops.push_back(op);
    }
  }

  bool Sequential() const REQUIRES(mu) { return ops_increasing && state.empty(); }

  // Only records, nothing coalesced before them: coalescing is a sort of
  // the ops by block, latest first (SortRecords), no tree.
  bool RecordsOnly() const REQUIRES(mu) { return record_ops == ops.size() && state.empty(); }

  // Ops at which Append coalesces in place again: past the threshold and
  // at least twice what the last in-place sort left, so hot rewrites cost
  // O(log n) per op, not a re-sort per write.
  size_t sorted_ops GUARDED_BY(mu) = 0;
  // `threshold`: the monitor's, times the backoff (CoalesceAt).
  bool CoalesceDue(size_t threshold) const REQUIRES(mu) {
    return !detached && ops.size() >= std::max(threshold, 2 * sorted_ops) && !Sequential();
  }

  // Calls f for the latest op of each block of `list` (records only), in
  // block order. The first `sorted_prefix` ops are known to be in strictly
  // increasing block order (what the last coalescing sort left).
  //
  // Callers order only ops that are not increasing (increasing records
  // are Sequential: their own coalesced form). Without a comparison sort
  // when it can: ops whose blocks are dense (a span of at most
  // kDenseSpanFactor slots per op) are placed by block into a table, the
  // latest op of a block overwriting the earlier ones, then read back in
  // block order: linear. That is the common case of one sequential writer
  // whose requests dedupd's workers finish out of order (never increasing,
  // never a rewrite), which a sort paid n log n for at every flush (two
  // fifths of the flusher thread's CPU, docs/BENCHMARKS.md, session 28).
  // Sparse blocks (random writes over a big file) are sorted.
  template <typename F>
  static void SortRecords(const OpList& list, size_t sorted_prefix, F&& f) {
    const size_t n = list.size();
    if (n == 0) return;
    uint64_t lo = list[0].block, hi = lo;
    for (size_t i = 1; i < n; i++) {
      lo = std::min(lo, list[i].block);
      hi = std::max(hi, list[i].block);
    }
    SortScratch& scratch = SortScratch::ForThread();
    const uint64_t span = hi - lo + 1;  // blocks stay below 2^52: no wrap
    if (n < std::numeric_limits<uint32_t>::max() && span / kDenseSpanFactor <= n) {
      std::vector<uint32_t>& slot = scratch.slots;
      slot.assign(span, 0);
      for (size_t i = 0; i < n; i++) slot[list[i].block - lo] = static_cast<uint32_t>(i + 1);
      for (uint32_t s : slot) {
        if (s != 0) f(list[s - 1]);
      }
      scratch.Trim();
      return;
    }
    std::vector<SortKey>& keys = scratch.keys;
    keys.clear();
    keys.reserve(n);
    for (size_t i = 0; i < n; i++) keys.push_back(SortKey{list[i].block, i});
    auto less = [](const SortKey& a, const SortKey& b) {
      return a.block < b.block || (a.block == b.block && a.index < b.index);
    };
    const auto mid = keys.begin() + static_cast<ptrdiff_t>(std::min(sorted_prefix, n));
    std::sort(mid, keys.end(), less);
    std::inplace_merge(keys.begin(), mid, keys.end(), less);
    for (size_t i = 0; i < n; i++) {
      if (i + 1 < n && keys[i + 1].block == keys[i].block) continue;  // a later write wins
      f(list[keys[i].index]);
    }
    scratch.Trim();
  }

  // Drops the ops (applied or discarded by the caller).
  void ClearOps() REQUIRES(mu) {
    ops.clear();
    record_ops = 0;
    ops_increasing = true;
    sorted_ops = 0;
  }

  void Coalesce(std::atomic<uint64_t>* total) REQUIRES(mu) {
    if (ops.empty()) return;
    State* s = &state;
    ops.ForEach([s](const Op& op) { ApplyOp(s, op); });
    ClearOps();
    Recharge(total);
  }

  // Discards everything buffered (the lost entries are not counted).
  void Discard(std::atomic<uint64_t>* total) REQUIRES(mu) {
    ClearOps();
    flush_due_signalled = false;
    state = State{};
    Recharge(total);
  }

  void Drop(uint64_t n, uint64_t since_ns) REQUIRES(mu) {
    dropped_total += n;
    dropped_pending += n;
    if (dropped_since_ns == 0 || (since_ns != 0 && since_ns < dropped_since_ns)) {
      dropped_since_ns = since_ns;
    }
  }

  // The log bytes of what is buffered, every op counted as a new entry
  // after the coalesced state: exact when the ops are Sequential or empty.
  uint64_t LogBytesBound(size_t record_bytes, size_t range_bytes) const REQUIRES(mu) {
    return (state.records.size() + record_ops) * record_bytes +
           (state.ranges.size() + ops.size() - record_ops) * range_bytes;
  }

  uint64_t BufferedRecords() const REQUIRES(mu) {
    return state.records.size() + record_ops + detached_records;
  }

  static void ApplyOp(State* s, const Op& op) {
    if (op.count == 0) {
      s->SetRecord(op.block, op.time_ns, op.fp);
    } else {
      s->Invalidate(op.block, op.block + op.count, op.time_ns);
    }
  }
};

WriteMonitor::WriteMonitor(const WriteMonitorOptions& opts)
    : pool_(std::make_unique<ChunkPool>()),
      opts_(opts),
      clock_(opts.clock != nullptr ? opts.clock : Clock::Real()),
      record_bytes_(WriteLogRecordBytes(opts.algo)),
      range_bytes_(WriteLogRangeBytes()),
      // A file is normally taken once its records reach flush_bytes; if the
      // flusher lags, coalescing at twice that keeps hot rewrites from
      // filling the cap with superseded ops.
      coalesce_ops_(std::max<size_t>(2 * (opts.flush_bytes / WriteLogRecordBytes(opts.algo) + 1),
                                     4 * kOpsPerRound)),
      // Backed off, a file still coalesces before its ops fill a quarter
      // of the cap: a writer that turns to hot rewrites then costs memory
      // for a while, never the other files' room.
      max_coalesce_ops_(std::max<size_t>(coalesce_ops_, opts.memory_cap_bytes / kOpBytes / 4)),
      // The least bound b with b / 8 * 7 >= flush_bytes.
      backed_off_due_bytes_(8 * ((opts.flush_bytes + 6) / 7)) {}

size_t WriteMonitor::CoalesceAt(const FileBuffer& fb) const {
  const uint64_t backoff = fb.coalesce_backoff.load(std::memory_order_relaxed);
  return static_cast<size_t>(std::min<uint64_t>(coalesce_ops_ * backoff, max_coalesce_ops_));
}

WriteMonitor::~WriteMonitor() = default;

std::shared_ptr<WriteMonitor::FileBuffer> WriteMonitor::Find(FileId id) {
  ReaderLock l(&mu_);
  auto it = files_.find(id);
  return it == files_.end() ? nullptr : it->second;
}

bool WriteMonitor::Reserve(uint64_t bytes) {
  uint64_t cur = buffered_bytes_.load(std::memory_order_relaxed);
  do {
    if (cur > opts_.memory_cap_bytes || bytes > opts_.memory_cap_bytes - cur) return false;
  } while (!buffered_bytes_.compare_exchange_weak(cur, cur + bytes, std::memory_order_relaxed));
  return true;
}

void WriteMonitor::Release(uint64_t bytes) {
  buffered_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
}

WriteMonitor::FileHandle WriteMonitor::AddFile(FileId id, bool dedup_on) {
  std::shared_ptr<FileBuffer> fb;
  {
    WriterLock l(&mu_);
    auto& slot = files_[id];
    if (slot == nullptr) {
      slot = std::make_shared<FileBuffer>(id, dedup_on, pool_.get());
      return FileHandle(id, slot);
    }
    fb = slot;
  }
  SetDedup(id, dedup_on);  // already monitored: only the setting changes
  return FileHandle(id, std::move(fb));
}

WriteMonitor::FileBuffer* WriteMonitor::Resolve(const FileHandle& file,
                                                std::shared_ptr<FileBuffer>* found) {
  // A handle's buffer taken out by RemoveFile is never used again: the
  // file may have been added anew, with a new buffer.
  if (file.fb_ != nullptr && !file.fb_->removed.load(std::memory_order_acquire)) {
    return file.fb_.get();
  }
  *found = Find(file.id_);
  return found->get();
}

void WriteMonitor::RemoveFile(FileId id) {
  std::shared_ptr<FileBuffer> fb;
  {
    WriterLock l(&mu_);
    auto it = files_.find(id);
    if (it == files_.end()) return;
    fb = std::move(it->second);
    files_.erase(it);
  }
  // A write that found the file before it left the map may still come:
  // `removed` turns it away.
  MutexLock restructure(&fb->restructure_mu);
  MutexLock l(&fb->mu);
  fb->removed.store(true, std::memory_order_release);
  fb->Discard(&buffered_bytes_);
}

void WriteMonitor::SetDedup(FileId id, bool on) {
  std::shared_ptr<FileBuffer> fb = Find(id);
  if (fb == nullptr) return;
  MutexLock restructure(&fb->restructure_mu);
  MutexLock l(&fb->mu);
  fb->dedup.store(on, std::memory_order_relaxed);
  if (!on) fb->Discard(&buffered_bytes_);
}

bool WriteMonitor::SkipForFullLog(FileBuffer* fb, uint64_t blocks) {
  if (!fb->log_full.load(std::memory_order_relaxed)) return false;
  MutexLock l(&fb->mu);
  if (!fb->log_full.load(std::memory_order_relaxed)) return false;  // a pass took the log
  CountUnrecorded(fb, blocks);
  return true;
}

void WriteMonitor::CountUnrecorded(FileBuffer* fb, uint64_t blocks) {
  fb->unrecorded.fetch_add(blocks, std::memory_order_relaxed);
  unrecorded_blocks_.fetch_add(blocks, std::memory_order_relaxed);
}

namespace {

// The blocks a write of `len` (> 0) bytes at `offset` touches, [head,
// tail], and the whole ones among them, [first_full, end_full).
struct WriteBlocks {
  WriteBlocks(uint64_t offset, size_t len) {
    end = offset + len;
    if (end < offset) end = std::numeric_limits<uint64_t>::max();  // nonsense; stay in range
    head = offset / kBlockSize;
    tail = (end - 1) / kBlockSize;
    first_full = head + (offset % kBlockSize != 0);
    end_full = end / kBlockSize;
  }
  uint64_t whole() const { return end_full > first_full ? end_full - first_full : 0; }
  uint64_t end, head, tail, first_full, end_full;
};

}  // namespace

std::vector<Fingerprint> WriteMonitor::FingerprintWrite(uint64_t offset, const void* data,
                                                        size_t len) const {
  std::vector<Fingerprint> out;
  if (len == 0) return out;
  const WriteBlocks w(offset, len);
  out.reserve(w.whole());
  const uint8_t* p = static_cast<const uint8_t*>(data) + (w.first_full * kBlockSize - offset);
  for (uint64_t b = w.first_full; b < w.end_full; b++, p += kBlockSize) {
    out.push_back(ComputeFingerprint(opts_.algo, p, kBlockSize));
  }
  return out;
}

void WriteMonitor::OnWrite(const FileHandle& file, uint64_t offset, const void* data, size_t len,
                           const std::vector<Fingerprint>* precomputed) {
  if (len == 0) return;
  std::shared_ptr<FileBuffer> found;
  FileBuffer* const fb = Resolve(file, &found);
  if (fb == nullptr || !fb->dedup.load(std::memory_order_relaxed)) return;
  const WriteBlocks w(offset, len);
  const uint64_t end = w.end, head = w.head, tail = w.tail;
  const uint64_t first_full = w.first_full, end_full = w.end_full;
  if (SkipForFullLog(fb, w.whole())) return;
  const uint64_t now = clock_->NowNanos();
  if (first_full >= end_full || fb->log_no_space.load(std::memory_order_relaxed)) {
    // Nothing to fingerprint: the write has no whole block, or the file's
    // log found the volume full, so its records would only be dropped
    // untried (LogFlusher's no-space files). The blocks it touches are
    // invalidated, one op and no hashing; the log takes the range with the
    // next batch that fits, and the pass that reads it rehashes them.
    const Op op{head, tail - head + 1, now, {}};
    Append(fb, &op, 1, 0);
    return;
  }

  // Raw storage: every slot used is assigned first (no 4 KiB zeroing per call).
  union OpArray {
    OpArray() {}
    Op v[kOpsPerRound];
  } storage;
  Op* const ops = storage.v;
  size_t n = 0;
  if (offset % kBlockSize != 0) new (&ops[n++]) Op{head, 1, now, {}};
  if (end % kBlockSize != 0) new (&ops[n++]) Op{tail, 1, now, {}};
  const uint8_t* p = static_cast<const uint8_t*>(data) + (first_full * kBlockSize - offset);
  const Fingerprint* pre =
      precomputed != nullptr && precomputed->size() == w.whole()
          ? precomputed->data()
          : nullptr;
  size_t hashed = 0;
  for (uint64_t b = first_full; b < end_full; b++, p += kBlockSize) {
    if (n == kOpsPerRound) {
      Append(fb, ops, n, hashed);
      n = 0;
      hashed = 0;
    }
    // Hashing happens here (unless it happened earlier), with no lock held.
    new (&ops[n++])
        Op{b, 0, now, pre ? pre[b - first_full] : ComputeFingerprint(opts_.algo, p, kBlockSize)};
    hashed++;
  }
  Append(fb, ops, n, hashed);
}

void WriteMonitor::OnInvalidate(const FileHandle& file, uint64_t offset, uint64_t len) {
  if (len == 0) return;
  std::shared_ptr<FileBuffer> found;
  FileBuffer* const fb = Resolve(file, &found);
  if (fb == nullptr || !fb->dedup.load(std::memory_order_relaxed)) return;
  if (SkipForFullLog(fb, 0)) return;
  uint64_t end = offset + len;
  if (end < offset) end = std::numeric_limits<uint64_t>::max();
  const uint64_t first = offset / kBlockSize, last = (end - 1) / kBlockSize;
  // One op whatever the length: a TRIM of a whole disk stays O(1).
  Op op{first, last - first + 1, clock_->NowNanos(), {}};
  Append(fb, &op, 1, 0);
}

void WriteMonitor::Append(FileBuffer* fb, const Op* ops, size_t n, size_t hashed) {
  if (n == 0) return;
  fb->hashed.fetch_add(hashed, std::memory_order_relaxed);
  hashed_blocks_.fetch_add(hashed, std::memory_order_relaxed);
  const uint64_t charge = n * kOpBytes;
  if (!Reserve(charge)) {
    AppendAtCap(fb, ops, n, hashed);
    return;
  }
  bool coalesce, due;
  {
    MutexLock l(&fb->mu);
    if (fb->removed || !fb->Recording()) {
      // Paused for its full log after these blocks were hashed: they are
      // written without a record, like the writes SkipForFullLog turns away.
      if (!fb->removed && fb->PausedForFullLog()) CountUnrecorded(fb, hashed);
      Release(charge);
      return;
    }
    // The common case: append, nothing else. Sequential ops have nothing
    // to coalesce.
    fb->Append(ops, n);
    fb->charged += charge;
    coalesce = fb->CoalesceDue(CoalesceAt(*fb));
    due = ReachedFlushBytes(fb);
  }
  if (due) CallFlushDueHook();
  // Whoever holds restructure_mu is coalescing or taking the buffer
  // already: this write need not wait for it.
  if (coalesce && fb->restructure_mu.TryLock()) {
    CoalesceOutsideLock(fb);
    fb->restructure_mu.Unlock();
  }
}

uint64_t WriteMonitor::DueBound(const FileBuffer* fb) const NO_THREAD_SAFETY_ANALYSIS {
  return fb->BackedOff() && !fb->Sequential() ? backed_off_due_bytes_ : opts_.flush_bytes;
}

bool WriteMonitor::ReachedFlushBytes(FileBuffer* fb) NO_THREAD_SAFETY_ANALYSIS {
  if (fb->flush_due_signalled) return false;
  // A backed-off file is signalled when DueFiles will take it as it is:
  // signalled at flush_bytes, it was coalesced there once per flush, only
  // to be found as big and sorted again by Take.
  if (fb->LogBytesBound(record_bytes_, range_bytes_) < DueBound(fb)) return false;
  fb->flush_due_signalled = true;
  return true;
}

void WriteMonitor::SetFlushDueHook(std::function<void()> hook) {
  std::function<void()> old;  // destroyed outside the lock
  MutexLock l(&hook_mu_);
  old = std::move(flush_due_hook_);
  flush_due_hook_ = std::move(hook);
}

void WriteMonitor::CallFlushDueHook() {
  MutexLock l(&hook_mu_);
  if (flush_due_hook_) flush_due_hook_();
}

void WriteMonitor::CoalesceOutsideLock(FileBuffer* fb) {
  OpList ops(pool_.get());
  State state;
  size_t sorted_prefix;
  bool records_only;
  {
    MutexLock l(&fb->mu);
    if (fb->removed || fb->ops.empty() || fb->Sequential()) return;
    records_only = fb->RecordsOnly();
    sorted_prefix = fb->sorted_ops;
    fb->detached_charge = fb->Charge();
    fb->detached_records = fb->BufferedRecords();
    ops.swap(fb->ops);
    std::swap(state, fb->state);
    fb->ClearOps();
    fb->detached = true;
  }
  OpList sorted(pool_.get());
  if (records_only) {
    FileBuffer::SortRecords(ops, sorted_prefix, [&sorted](const Op& op) { sorted.push_back(op); });
    fb->NoteCoalesce(ops.size(), sorted.size());
  } else {
    const uint64_t before = ops.size() + state.records.size() + state.ranges.size();
    ops.ForEach([&state](const Op& op) { FileBuffer::ApplyOp(&state, op); });
    fb->NoteCoalesce(before, state.records.size() + state.ranges.size());
  }
  ops.clear();
  MutexLock l(&fb->mu);
  // Nothing else replaced ops or state meanwhile (restructure_mu): `state`
  // is still empty and `ops` holds what was appended since, all newer.
  fb->detached = false;
  fb->detached_charge = 0;
  fb->detached_records = 0;
  if (records_only) {
    // The sorted records first, then the newer ops after them.
    const size_t n = sorted.size();
    uint64_t records = n;
    bool increasing = true;
    fb->ops.ForEach([&](const Op& op) {
      records += op.count == 0;
      increasing = increasing && op.count == 0 && (sorted.empty() || op.block > sorted.back().block);
      sorted.push_back(op);
    });
    fb->ops.swap(sorted);
    fb->record_ops = records;
    fb->ops_increasing = increasing;
    fb->sorted_ops = n;
  } else {
    fb->state = std::move(state);  // before `ops`, as they were appended
  }
  fb->Recharge(&buffered_bytes_);
}

void WriteMonitor::AppendAtCap(FileBuffer* fb, const Op* ops, size_t n, size_t hashed) {
  if (AppendAtCapLocked(fb, ops, n, hashed)) CallFlushDueHook();
}

bool WriteMonitor::AppendAtCapLocked(FileBuffer* fb, const Op* ops, size_t n, size_t hashed) {
  MutexLock restructure(&fb->restructure_mu);
  MutexLock l(&fb->mu);
  if (fb->removed || !fb->Recording()) {
    if (!fb->removed && fb->PausedForFullLog()) CountUnrecorded(fb, hashed);
    return false;
  }
  // At the cap. Coalesce first: afterwards ops apply straight to the state
  // (in call order, as `ops` is empty), so a rewrite of a buffered block
  // costs nothing and only growth needs room.
  fb->Coalesce(&buffered_bytes_);
  State& s = fb->state;
  for (size_t i = 0; i < n; i++) {
    const Op& op = ops[i];
    if (op.count == 0) {
      const int64_t d = s.RecordNodeDelta(op.block);
      const uint64_t need = d > 0 ? static_cast<uint64_t>(d) * kNodeBytes : 0;
      if (need == 0 || Reserve(need)) {
        fb->charged += need;
        s.SetRecord(op.block, op.time_ns, op.fp);
      } else {
        fb->Drop(1, op.time_ns);
        dropped_records_.fetch_add(1, std::memory_order_relaxed);
      }
    } else {
      const uint64_t op_end = op.block + op.count;
      // Removing the covered records only frees memory: always done, so a
      // shed invalidation leaves no stale buffered record behind.
      s.EraseRecords(op.block, op_end);
      fb->Recharge(&buffered_bytes_);
      const bool grows = s.TouchingRanges(op.block, op_end) == 0;
      if (!grows || Reserve(kNodeBytes)) {
        if (grows) fb->charged += kNodeBytes;
        s.Invalidate(op.block, op_end, op.time_ns);
      } else {
        fb->Drop(1, op.time_ns);
        dropped_records_.fetch_add(1, std::memory_order_relaxed);
      }
    }
    fb->Recharge(&buffered_bytes_);
  }
  return ReachedFlushBytes(fb);
}

std::vector<FileId> WriteMonitor::DueFiles(bool all) {
  std::vector<std::shared_ptr<FileBuffer>> files;
  {
    ReaderLock l(&mu_);
    files.reserve(files_.size());
    for (const auto& [key, fb] : files_) files.push_back(fb);
  }
  std::vector<FileId> due;
  for (const auto& fb : files) {
    MutexLock restructure(&fb->restructure_mu);
    {
      MutexLock l(&fb->mu);
      if (fb->removed) continue;
      if (all) {
        if (!fb->ops.empty() || !fb->state.empty() || fb->dropped_pending > 0) due.push_back(fb->id);
        continue;
      }
      // Cheap bound first; coalesce only when it passes the threshold, then
      // decide on the real sizes.
      const uint64_t b = fb->LogBytesBound(record_bytes_, range_bytes_);
      if (b < opts_.flush_bytes || b == 0) {
        fb->flush_due_signalled = false;
        continue;
      }
      if (fb->Sequential()) {
        due.push_back(fb->id);
        continue;
      }
      // Coalescing this file has not paid lately: the bound less an eighth
      // will do (DueBound), and Take coalesces once.
      if (fb->BackedOff() && b >= backed_off_due_bytes_) {
        due.push_back(fb->id);
        continue;
      }
    }
    // Random writes: a sort (records only; the result is Sequential, so
    // Take needs no coalescing) or the tree, with the file's lock released.
    CoalesceOutsideLock(fb.get());
    MutexLock l(&fb->mu);
    if (fb->removed) continue;
    if (fb->LogBytesBound(record_bytes_, range_bytes_) >= opts_.flush_bytes) {
      due.push_back(fb->id);
    } else {
      fb->flush_due_signalled = false;  // coalescing shrank it: arm again
    }
  }
  return due;
}

MonitorBatch WriteMonitor::Take(FileId id, std::vector<BlockRecord> reuse) {
  MonitorBatch batch;
  batch.file = id;
  reuse.clear();
  batch.records = std::move(reuse);
  std::shared_ptr<FileBuffer> fb = Find(id);
  if (fb == nullptr) return batch;
  OpList ops(pool_.get());
  State state;
  bool sequential, records_only;
  size_t sorted_prefix;
  {
    MutexLock restructure(&fb->restructure_mu);  // nothing detached by a coalesce
    MutexLock l(&fb->mu);
    sequential = fb->Sequential();
    records_only = fb->RecordsOnly();
    sorted_prefix = fb->sorted_ops;
    ops.swap(fb->ops);
    std::swap(state, fb->state);
    fb->ClearOps();
    fb->flush_due_signalled = false;
    fb->Recharge(&buffered_bytes_);
    batch.dropped_records = fb->dropped_pending;
    batch.dropped_since_ns = fb->dropped_since_ns;
    batch.log_epoch = fb->log_epoch;
    fb->dropped_pending = 0;
    fb->dropped_since_ns = 0;
  }
  auto note_time = [&](uint64_t t) {
    if (batch.first_ns == 0 || t < batch.first_ns) batch.first_ns = t;
    batch.last_ns = std::max(batch.last_ns, t);
  };
  if (sequential) {
    batch.records.reserve(ops.size());
    ops.ForEach([&](const Op& op) {
      batch.records.push_back(BlockRecord{op.block, op.time_ns, op.fp});
      note_time(op.time_ns);
    });
    return batch;
  }
  if (records_only) {
    // Coalesced outside the file's lock by a sort: no tree.
    batch.records.reserve(ops.size());
    FileBuffer::SortRecords(ops, sorted_prefix, [&](const Op& op) {
      batch.records.push_back(BlockRecord{op.block, op.time_ns, op.fp});
      note_time(op.time_ns);
    });
    fb->NoteCoalesce(ops.size(), batch.records.size());
    return batch;
  }
  // Coalesced outside the file's lock: writes go on into a fresh buffer.
  const uint64_t before = ops.size() + state.records.size() + state.ranges.size();
  ops.ForEach([&state](const Op& op) { FileBuffer::ApplyOp(&state, op); });
  fb->NoteCoalesce(before, state.records.size() + state.ranges.size());
  batch.records.reserve(state.records.size());
  batch.invalidated.reserve(state.ranges.size());
  for (const auto& [first, r] : state.ranges) {
    batch.invalidated.push_back(InvalidRange{first, r.end - first, r.time_ns});
    note_time(r.time_ns);
  }
  for (const auto& [block, r] : state.records) {
    batch.records.push_back(BlockRecord{block, r.time_ns, r.fp});
    note_time(r.time_ns);
  }
  return batch;
}

void WriteMonitor::PutBack(MonitorBatch batch) {
  std::shared_ptr<FileBuffer> fb = Find(batch.file);
  if (fb == nullptr) return;
  MutexLock restructure(&fb->restructure_mu);
  MutexLock l(&fb->mu);
  if (fb->removed || !fb->Recording()) return;
  fb->Coalesce(&buffered_bytes_);
  // Whoever could not write the batch retries on its own schedule: the
  // hook firing at the next write would retry at once and, while a pass
  // holds the log, put back again (a loop of tree merges).
  fb->flush_due_signalled = true;
  // Old batch first, then what was buffered since: newer entries win.
  State merged;
  for (const InvalidRange& r : batch.invalidated) {
    if (r.count == 0 || r.first >= kBlockLimit) continue;
    merged.Invalidate(r.first, r.first + std::min(r.count, kBlockLimit - r.first), r.time_ns);
  }
  for (const BlockRecord& r : batch.records) {
    if (r.block < kBlockLimit) merged.SetRecord(r.block, r.time_ns, r.fp);
  }
  for (const auto& [first, r] : fb->state.ranges) merged.Invalidate(first, r.end, r.time_ns);
  for (const auto& [block, r] : fb->state.records) merged.SetRecord(block, r.time_ns, r.fp);

  const uint64_t before = fb->state.nodes() * kNodeBytes;
  const uint64_t after = merged.nodes() * kNodeBytes;
  if (after <= before || Reserve(after - before)) {
    if (after > before) fb->charged += after - before;
    fb->state = std::move(merged);
    fb->Recharge(&buffered_bytes_);
  } else {
    const uint64_t lost = batch.records.size() + batch.invalidated.size();
    fb->Drop(lost, batch.first_ns != 0 ? batch.first_ns : clock_->NowNanos());
    dropped_records_.fetch_add(lost, std::memory_order_relaxed);
  }
  // The batch's own losses were never recorded anywhere else: keep them.
  if (batch.dropped_records > 0) {
    fb->dropped_pending += batch.dropped_records;
    if (batch.dropped_since_ns != 0 &&
        (fb->dropped_since_ns == 0 || batch.dropped_since_ns < fb->dropped_since_ns)) {
      fb->dropped_since_ns = batch.dropped_since_ns;
    }
    if (fb->dropped_since_ns == 0) fb->dropped_since_ns = clock_->NowNanos();
  }
}

void WriteMonitor::MarkDropped(FileId id, uint64_t n, uint64_t since_ns, uint64_t carried) {
  if (n == 0) return;
  carried = std::min(carried, n);
  std::shared_ptr<FileBuffer> fb = Find(id);
  if (fb == nullptr) return;
  MutexLock l(&fb->mu);
  if (fb->removed) return;
  fb->Drop(n - carried, since_ns != 0 ? since_ns : clock_->NowNanos());
  fb->dropped_pending += carried;
  dropped_records_.fetch_add(n - carried, std::memory_order_relaxed);
}

void WriteMonitor::PauseForFullLog(FileId id, uint64_t log_epoch) {
  std::shared_ptr<FileBuffer> fb = Find(id);
  if (fb == nullptr) return;
  MutexLock restructure(&fb->restructure_mu);
  MutexLock l(&fb->mu);
  if (fb->removed || fb->log_epoch != log_epoch) return;
  fb->log_full.store(true, std::memory_order_relaxed);
  fb->Discard(&buffered_bytes_);
}

void WriteMonitor::LogTaken(FileId id) {
  std::shared_ptr<FileBuffer> fb = Find(id);
  if (fb == nullptr) return;
  MutexLock l(&fb->mu);
  fb->log_epoch++;
  fb->log_full.store(false, std::memory_order_relaxed);
}

uint64_t WriteMonitor::LogEpoch(FileId id) {
  std::shared_ptr<FileBuffer> fb = Find(id);
  if (fb == nullptr) return 0;
  MutexLock l(&fb->mu);
  return fb->log_epoch;
}

bool WriteMonitor::Recording(const FileHandle& file) {
  std::shared_ptr<FileBuffer> found;
  const FileBuffer* fb = Resolve(file, &found);
  return fb != nullptr && fb->Hashing();
}

void WriteMonitor::SetLogNoSpace(FileId id, bool no_space) {
  std::shared_ptr<FileBuffer> fb = Find(id);
  if (fb != nullptr) fb->log_no_space.store(no_space, std::memory_order_relaxed);
}

MonitorFileStats WriteMonitor::FileStats(FileId id) {
  MonitorFileStats st;
  std::shared_ptr<FileBuffer> fb = Find(id);
  if (fb == nullptr) {
    st.dedup = false;  // not monitored: nothing is hashed
    return st;
  }
  MutexLock l(&fb->mu);
  st.buffered_records = fb->BufferedRecords();
  st.buffered_bytes = fb->charged;
  st.hashed_blocks = fb->hashed.load(std::memory_order_relaxed);
  st.dropped_records = fb->dropped_total;
  st.dropped_since_ns = fb->dropped_since_ns;
  st.dedup = fb->dedup.load(std::memory_order_relaxed);
  st.log_full = fb->log_full.load(std::memory_order_relaxed);
  st.log_no_space = fb->log_no_space.load(std::memory_order_relaxed);
  st.unrecorded_blocks = fb->unrecorded.load(std::memory_order_relaxed);
  return st;
}

MonitorStats WriteMonitor::Stats() {
  std::vector<std::shared_ptr<FileBuffer>> files;
  {
    ReaderLock l(&mu_);
    for (const auto& [key, fb] : files_) files.push_back(fb);
  }
  MonitorStats st;
  st.files = files.size();
  for (const auto& fb : files) {
    MutexLock l(&fb->mu);
    st.buffered_records += fb->BufferedRecords();
    st.log_full_files += fb->log_full.load(std::memory_order_relaxed);
  }
  st.unrecorded_blocks = unrecorded_blocks_.load(std::memory_order_relaxed);
  st.buffered_bytes = buffered_bytes_.load(std::memory_order_relaxed);
  st.memory_cap_bytes = opts_.memory_cap_bytes;
  st.hashed_blocks = hashed_blocks_.load(std::memory_order_relaxed);
  st.dropped_records = dropped_records_.load(std::memory_order_relaxed);
  return st;
}

}  // namespace dede
