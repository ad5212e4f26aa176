#include "kmod/writemon/write_monitor.h"

#include <algorithm>
#include <cstring>
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
// A table of this many slots per record is still cheaper to fill and scan
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

// One change, as the write path appends it: a run of records, blocks
// [block, block + count) with their fingerprints at [fp_at, fp_at + count)
// of the list's fingerprint store, or the invalidation of [block, block +
// count) (fp_at == kNoFp). A 64 KiB write is one op and 16 packed
// fingerprints, 18 bytes a record: an op per block with its fingerprint
// inline took 64, and moving those bytes was most of what Append and Take
// cost (docs/BENCHMARKS.md, session 29).
struct WriteMonitor::Op {
  static constexpr uint64_t kNoFp = ~uint64_t{0};
  uint64_t block = 0;
  uint64_t count = 0;
  uint64_t time_ns = 0;
  uint64_t fp_at = kNoFp;
  bool records() const { return fp_at != kNoFp; }
  uint64_t end() const { return block + count; }
};

namespace {

// An entry (a record, or an invalidated range) is charged like the tree
// node it may become, so coalescing never raises a file's charge (except a
// record splitting a range in two). It is an estimate on the high side:
// buffered, a record takes a fraction of it.
constexpr uint64_t kEntryBytes = std::max<uint64_t>(kNodeBytes, 64);

// Ops and fingerprints are kept in fixed-size chunks, so growing a buffer
// never copies what is there (a vector doubling 2 MiB under the file's
// lock would stall the write path). Chunks are raw storage (no zeroing)
// and recycled through a small pool, so steady writing reuses memory that
// is already mapped instead of faulting in fresh pages.
constexpr size_t kChunkBytes = size_t{64} << 10;

constexpr uint32_t kMaxCoalesceBackoff = 64;

// A fingerprint of `size` bytes as packed in an OpList's store.
Fingerprint UnpackFingerprint(const uint8_t* p, size_t size) {
  Fingerprint f;
  std::memcpy(f.bytes.data(), p, size);
  f.size = static_cast<uint8_t>(size);
  return f;
}

}  // namespace

struct WriteMonitor::ChunkPool {
  explicit ChunkPool(size_t fp) : fp_size(fp), chunk_fps(kChunkBytes / fp) {}
  // Spare chunks kept for reuse, all files together (16 MiB); not charged to
  // the cap, which counts what is buffered. Sized for what one flush interval
  // of a busy VM buffers, with room to spare (500 MB/s for 1 s is 128k
  // records, 2 MiB of fingerprints): with fewer, every flush freed the
  // surplus and the next interval faulted it in again, at 7-30 us a page on
  // these guests (docs/BENCHMARKS.md, "NBD data path").
  static constexpr size_t kMaxSpareChunks = (size_t{16} << 20) / kChunkBytes;
  static constexpr size_t kAlign = 64;

  ~ChunkPool() {
    MutexLock l(&mu);
    for (void* c : spare) Free(c);
  }
  void* Get() {
    {
      MutexLock l(&mu);
      if (!spare.empty()) {
        void* c = spare.back();
        spare.pop_back();
        return c;
      }
    }
    return ::operator new(kChunkBytes, std::align_val_t{kAlign});
  }
  void Put(void* c) {
    {
      MutexLock l(&mu);
      if (spare.size() < kMaxSpareChunks) {
        spare.push_back(c);
        return;
      }
    }
    Free(c);
  }
  static void Free(void* c) { ::operator delete(c, std::align_val_t{kAlign}); }

  const size_t fp_size;    // bytes of a fingerprint (the monitor's algo)
  const size_t chunk_fps;  // fingerprints a chunk holds
  Mutex mu;  // a leaf: taken under a file's mutex, never the other way
  std::vector<void*> spare GUARDED_BY(mu);
};

// A file's ops in call order, and the fingerprints of their records packed
// in a store of their own (fp_size bytes each, in the order appended).
class WriteMonitor::OpList {
  static_assert(std::is_trivially_copyable_v<Op> && std::is_trivially_destructible_v<Op>);
  static constexpr size_t kChunkOps = kChunkBytes / sizeof(Op);

 public:
  explicit OpList(ChunkPool* pool) : pool_(pool) {}
  ~OpList() { clear(); }
  OpList(const OpList&) = delete;
  OpList& operator=(const OpList&) = delete;

  // Appends a run of `count` (> 0) records of blocks [block, block +
  // count), their fingerprints packed at `fps`. A run that continues the
  // last op (the next block, the same time) extends it.
  void PushRecords(uint64_t block, uint64_t count, uint64_t time_ns, const uint8_t* fps) {
    const uint64_t at = fps_;
    StoreFps(fps, count);
    if (size_ > 0) {
      Op& last = Last();
      if (last.records() && last.end() == block && last.time_ns == time_ns &&
          last.fp_at + last.count == at) {
        last.count += count;
        return;
      }
    }
    PushOp(Op{block, count, time_ns, at});
  }
  void PushInvalid(uint64_t block, uint64_t count, uint64_t time_ns) {
    PushOp(Op{block, count, time_ns, Op::kNoFp});
  }
  // Appends `op` of `from` (its fingerprints copied).
  void PushFrom(const OpList& from, const Op& op) {
    if (!op.records()) {
      PushOp(op);
      return;
    }
    const size_t per = pool_->chunk_fps;
    for (uint64_t done = 0; done < op.count;) {
      const uint64_t at = op.fp_at + done;
      const uint64_t n = std::min<uint64_t>(op.count - done, per - at % per);
      PushRecords(op.block + done, n, op.time_ns, from.Fp(at));
      done += n;
    }
  }
  // A record of `from`, one block of `op`.
  void PushRecordFrom(const OpList& from, const Op& op, uint64_t block) {
    PushRecords(block, 1, op.time_ns, from.Fp(op.fp_at + (block - op.block)));
  }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const Op& back() const { return ops_.back()[(size_ - 1) % kChunkOps]; }
  const Op& operator[](size_t i) const { return ops_[i / kChunkOps][i % kChunkOps]; }
  // The fingerprint bytes at store index `at`.
  const uint8_t* Fp(uint64_t at) const {
    return fp_chunks_[at / pool_->chunk_fps] + (at % pool_->chunk_fps) * pool_->fp_size;
  }
  Fingerprint FingerprintAt(uint64_t at) const { return UnpackFingerprint(Fp(at), pool_->fp_size); }
  void clear() {
    for (Op* c : ops_) pool_->Put(c);
    for (uint8_t* c : fp_chunks_) pool_->Put(c);
    ops_.clear();
    fp_chunks_.clear();
    size_ = 0;
    fps_ = 0;
  }
  void swap(OpList& o) {
    ops_.swap(o.ops_);
    fp_chunks_.swap(o.fp_chunks_);
    std::swap(size_, o.size_);
    std::swap(fps_, o.fps_);
    std::swap(pool_, o.pool_);
  }
  template <typename F>
  void ForEach(F&& f) const {
    for (size_t i = 0; i < size_; i++) f(ops_[i / kChunkOps][i % kChunkOps]);
  }
  // Calls f(block, time_ns, fp) for every record of every records op, in
  // call order.
  template <typename F>
  void ForEachRecord(F&& f) const {
    ForEach([&](const Op& op) {
      if (!op.records()) return;
      for (uint64_t j = 0; j < op.count; j++) f(op.block + j, op.time_ns, op.fp_at + j);
    });
  }

 private:
  Op& Last() { return ops_.back()[(size_ - 1) % kChunkOps]; }
  void PushOp(const Op& v) {
    if (size_ % kChunkOps == 0) ops_.push_back(static_cast<Op*>(pool_->Get()));
    // Placement copy into raw storage: no zeroing first.
    new (ops_.back() + size_ % kChunkOps) Op(v);
    size_++;
  }
  void StoreFps(const uint8_t* fps, uint64_t count) {
    const size_t per = pool_->chunk_fps, fp = pool_->fp_size;
    while (count > 0) {
      if (fps_ % per == 0) fp_chunks_.push_back(static_cast<uint8_t*>(pool_->Get()));
      const uint64_t n = std::min<uint64_t>(count, per - fps_ % per);
      std::memcpy(fp_chunks_.back() + (fps_ % per) * fp, fps, n * fp);
      fps += n * fp;
      fps_ += n;
      count -= n;
    }
  }

  ChunkPool* pool_;
  std::vector<Op*> ops_;
  std::vector<uint8_t*> fp_chunks_;
  size_t size_ = 0;   // ops
  uint64_t fps_ = 0;  // fingerprints in the store
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

  bool Recording() const {
    return dedup.load(std::memory_order_relaxed) && !log_full.load(std::memory_order_relaxed);
  }
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
  uint64_t op_records GUARDED_BY(mu) = 0;   // records in `ops`' runs
  uint64_t invalid_ops GUARDED_BY(mu) = 0;  // invalidations in `ops`
  // `ops` are runs of records of strictly increasing blocks (kept up to
  // date in O(1) per op). With an empty `state` too the ops are already
  // their own coalesced form (sequential writing): sizing is exact,
  // coalescing gains nothing, and Take needs no tree.
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

  // Records and invalidations in `ops`, each an entry of the log to be.
  uint64_t OpEntries() const REQUIRES(mu) { return op_records + invalid_ops; }

  uint64_t Charge() const REQUIRES(mu) {
    return OpEntries() * kEntryBytes + state.nodes() * kNodeBytes + detached_charge;
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

  // Appends one call's ops; a records op's fingerprints are at `fps` +
  // op.fp_at * fp_size (packed).
  void Append(const Op* in, size_t n, const uint8_t* fps, size_t fp_size) REQUIRES(mu) {
    for (size_t i = 0; i < n; i++) {
      const Op& op = in[i];
      if (op.records()) {
        ops_increasing = ops_increasing && (ops.empty() || op.block >= ops.back().end());
        op_records += op.count;
        ops.PushRecords(op.block, op.count, op.time_ns, fps + op.fp_at * fp_size);
      } else {
        ops_increasing = false;
        invalid_ops++;
        ops.PushInvalid(op.block, op.count, op.time_ns);
      }
    }
  }

  bool Sequential() const REQUIRES(mu) { return ops_increasing && state.empty(); }

  // Only records, nothing coalesced before them: coalescing is a sort of
  // the ops by block, latest first (SortRecords), no tree.
  bool RecordsOnly() const REQUIRES(mu) { return invalid_ops == 0 && state.empty(); }

  // The first sorted_ops of `ops` are what the last in-place sort left:
  // sorted_records records in increasing block order. Append coalesces in
  // place again past the threshold and at least twice that, so hot
  // rewrites cost O(log n) per record, not a re-sort per write.
  size_t sorted_ops GUARDED_BY(mu) = 0;
  uint64_t sorted_records GUARDED_BY(mu) = 0;
  // `threshold`: the monitor's, times the backoff (CoalesceAt).
  bool CoalesceDue(uint64_t threshold) const REQUIRES(mu) {
    return !detached && OpEntries() >= std::max(threshold, 2 * sorted_records) && !Sequential();
  }

  // Calls f(block, time_ns, fp_at) for the latest record of each block of
  // `list` (records ops only), in block order; fp_at indexes `list`'s
  // fingerprints. The first `sorted_prefix` ops are known to hold strictly
  // increasing blocks (what the last coalescing sort left).
  //
  // Callers order only ops that are not increasing (increasing records
  // are Sequential: their own coalesced form). Without a comparison sort
  // when it can: records whose blocks are dense (a span of at most
  // kDenseSpanFactor slots per record) are placed by block into a table,
  // the latest op of a block overwriting the earlier ones, then read back
  // in block order: linear. That is the common case of one sequential
  // writer whose requests dedupd's workers finish out of order (never
  // increasing, never a rewrite), which a sort paid n log n for at every
  // flush (two fifths of the flusher thread's CPU, docs/BENCHMARKS.md,
  // session 28). Sparse blocks (random writes over a big file) are sorted.
  template <typename F>
  static void SortRecords(const OpList& list, size_t sorted_prefix, F&& f) {
    const size_t n = list.size();
    if (n == 0) return;
    uint64_t lo = list[0].block, hi = list[0].end() - 1, records = 0;
    list.ForEach([&](const Op& op) {
      lo = std::min(lo, op.block);
      hi = std::max(hi, op.end() - 1);
      records += op.count;
    });
    SortScratch& scratch = SortScratch::ForThread();
    const uint64_t span = hi - lo + 1;  // blocks stay below 2^52: no wrap
    if (n < std::numeric_limits<uint32_t>::max() && span / kDenseSpanFactor <= records) {
      std::vector<uint32_t>& slot = scratch.slots;
      slot.assign(span, 0);
      for (size_t i = 0; i < n; i++) {
        const Op& op = list[i];
        std::fill_n(slot.begin() + static_cast<ptrdiff_t>(op.block - lo), op.count,
                    static_cast<uint32_t>(i + 1));
      }
      for (uint64_t b = 0; b < span; b++) {
        if (slot[b] == 0) continue;
        const Op& op = list[slot[b] - 1];
        f(lo + b, op.time_ns, op.fp_at + (lo + b - op.block));
      }
      scratch.Trim();
      return;
    }
    // Keys of one block in op order, so the last of equal blocks is the
    // latest (ops of one call never repeat a block).
    std::vector<SortKey>& keys = scratch.keys;
    keys.clear();
    keys.reserve(records);
    size_t prefix_keys = 0;
    for (size_t i = 0; i < n; i++) {
      const Op& op = list[i];
      for (uint64_t j = 0; j < op.count; j++) keys.push_back(SortKey{op.block + j, i});
      if (i < sorted_prefix) prefix_keys = keys.size();
    }
    auto less = [](const SortKey& a, const SortKey& b) {
      return a.block < b.block || (a.block == b.block && a.index < b.index);
    };
    const auto mid = keys.begin() + static_cast<ptrdiff_t>(prefix_keys);
    std::sort(mid, keys.end(), less);
    std::inplace_merge(keys.begin(), mid, keys.end(), less);
    for (size_t i = 0; i < keys.size(); i++) {
      if (i + 1 < keys.size() && keys[i + 1].block == keys[i].block) continue;  // a later write wins
      const Op& op = list[keys[i].index];
      f(keys[i].block, op.time_ns, op.fp_at + (keys[i].block - op.block));
    }
    scratch.Trim();
  }

  // Drops the ops (applied or discarded by the caller).
  void ClearOps() REQUIRES(mu) {
    ops.clear();
    op_records = 0;
    invalid_ops = 0;
    ops_increasing = true;
    sorted_ops = 0;
    sorted_records = 0;
  }

  void Coalesce(std::atomic<uint64_t>* total) REQUIRES(mu) {
    if (ops.empty()) return;
    ApplyOps(&state, ops);
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

  // The log bytes of what is buffered, every entry of the ops counted as
  // a new one after the coalesced state: exact when the ops are Sequential
  // or empty.
  uint64_t LogBytesBound(size_t record_bytes, size_t range_bytes) const REQUIRES(mu) {
    return (state.records.size() + op_records) * record_bytes +
           (state.ranges.size() + invalid_ops) * range_bytes;
  }

  uint64_t BufferedRecords() const REQUIRES(mu) {
    return state.records.size() + op_records + detached_records;
  }

  // Applies `list`'s ops, in order, to `s`.
  static void ApplyOps(State* s, const OpList& list) {
    list.ForEach([&](const Op& op) {
      if (!op.records()) {
        s->Invalidate(op.block, op.end(), op.time_ns);
        return;
      }
      for (uint64_t j = 0; j < op.count; j++) {
        s->SetRecord(op.block + j, op.time_ns, list.FingerprintAt(op.fp_at + j));
      }
    });
  }
};

WriteMonitor::WriteMonitor(const WriteMonitorOptions& opts)
    : pool_(std::make_unique<ChunkPool>(HashAlgoSize(opts.algo))),
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
      max_coalesce_ops_(std::max<size_t>(coalesce_ops_, opts.memory_cap_bytes / kEntryBytes / 4)),
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

  // A call appends at most three ops (two partial edges, one run) per
  // round; the round's fingerprints are packed here. Raw storage: every
  // byte used is written first (no zeroing per call).
  Op ops[3];
  size_t n = 0;
  if (first_full >= end_full) {
    // No whole block: the one or two blocks touched are invalidated.
    ops[n++] = Op{head, tail - head + 1, now, Op::kNoFp};
    Append(fb, ops, n, nullptr, 0);
    return;
  }
  if (offset % kBlockSize != 0) ops[n++] = Op{head, 1, now, Op::kNoFp};
  if (end % kBlockSize != 0) ops[n++] = Op{tail, 1, now, Op::kNoFp};
  uint8_t fps[kOpsPerRound * sizeof(Fingerprint::bytes)];
  const size_t fp_size = pool_->fp_size;
  const uint8_t* p = static_cast<const uint8_t*>(data) + (first_full * kBlockSize - offset);
  const Fingerprint* pre =
      precomputed != nullptr && precomputed->size() == w.whole()
          ? precomputed->data()
          : nullptr;
  for (uint64_t b = first_full; b < end_full;) {
    const uint64_t round = std::min<uint64_t>(end_full - b, kOpsPerRound);
    for (uint64_t j = 0; j < round; j++, p += kBlockSize) {
      // Hashing happens here (unless it happened earlier), with no lock held.
      const Fingerprint f =
          pre ? pre[b + j - first_full] : ComputeFingerprint(opts_.algo, p, kBlockSize);
      std::memcpy(fps + j * fp_size, f.bytes.data(), fp_size);
    }
    ops[n++] = Op{b, round, now, 0};
    Append(fb, ops, n, fps, round);
    n = 0;
    b += round;
  }
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
  const Op op{first, last - first + 1, clock_->NowNanos(), Op::kNoFp};
  Append(fb, &op, 1, nullptr, 0);
}

void WriteMonitor::Append(FileBuffer* fb, const Op* ops, size_t n, const uint8_t* fps,
                          size_t hashed) {
  if (n == 0) return;
  fb->hashed.fetch_add(hashed, std::memory_order_relaxed);
  hashed_blocks_.fetch_add(hashed, std::memory_order_relaxed);
  uint64_t entries = 0;
  for (size_t i = 0; i < n; i++) entries += ops[i].records() ? ops[i].count : 1;
  const uint64_t charge = entries * kEntryBytes;
  if (!Reserve(charge)) {
    AppendAtCap(fb, ops, n, fps, hashed);
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
    fb->Append(ops, n, fps, pool_->fp_size);
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
  uint64_t detached_entries, state_entries;
  bool records_only;
  {
    MutexLock l(&fb->mu);
    if (fb->removed || fb->ops.empty() || fb->Sequential()) return;
    records_only = fb->RecordsOnly();
    sorted_prefix = fb->sorted_ops;
    detached_entries = fb->OpEntries();
    state_entries = fb->state.nodes();
    fb->detached_charge = fb->Charge();
    fb->detached_records = fb->BufferedRecords();
    ops.swap(fb->ops);
    std::swap(state, fb->state);
    fb->ClearOps();
    fb->detached = true;
  }
  OpList sorted(pool_.get());
  uint64_t sorted_records = 0;
  if (records_only) {
    FileBuffer::SortRecords(ops, sorted_prefix, [&](uint64_t block, uint64_t time_ns, uint64_t at) {
      sorted.PushRecords(block, 1, time_ns, ops.Fp(at));
      sorted_records++;
    });
    fb->NoteCoalesce(detached_entries, sorted_records);
  } else {
    FileBuffer::ApplyOps(&state, ops);
    fb->NoteCoalesce(detached_entries + state_entries, state.records.size() + state.ranges.size());
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
    uint64_t records = sorted_records, invalid = 0;
    bool increasing = true;
    for (size_t i = 0; i < fb->ops.size(); i++) {
      const Op& op = fb->ops[i];
      if (op.records()) {
        records += op.count;
        increasing = increasing && (sorted.empty() || op.block >= sorted.back().end());
      } else {
        invalid++;
        increasing = false;
      }
      sorted.PushFrom(fb->ops, op);
    }
    fb->ops.swap(sorted);
    fb->op_records = records;
    fb->invalid_ops = invalid;
    fb->ops_increasing = increasing;
    fb->sorted_ops = n;
    fb->sorted_records = sorted_records;
  } else {
    fb->state = std::move(state);  // before `ops`, as they were appended
  }
  fb->Recharge(&buffered_bytes_);
}

void WriteMonitor::AppendAtCap(FileBuffer* fb, const Op* ops, size_t n, const uint8_t* fps,
                               size_t hashed) {
  if (AppendAtCapLocked(fb, ops, n, fps, hashed)) CallFlushDueHook();
}

bool WriteMonitor::AppendAtCapLocked(FileBuffer* fb, const Op* ops, size_t n, const uint8_t* fps,
                                     size_t hashed) {
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
  const size_t fp_size = pool_->fp_size;
  for (size_t i = 0; i < n; i++) {
    const Op& op = ops[i];
    if (op.records()) {
      for (uint64_t j = 0; j < op.count; j++) {
        const uint64_t b = op.block + j;
        const int64_t d = s.RecordNodeDelta(b);
        const uint64_t need = d > 0 ? static_cast<uint64_t>(d) * kNodeBytes : 0;
        if (need == 0 || Reserve(need)) {
          fb->charged += need;
          s.SetRecord(b, op.time_ns, UnpackFingerprint(fps + (op.fp_at + j) * fp_size, fp_size));
        } else {
          fb->Drop(1, op.time_ns);
          dropped_records_.fetch_add(1, std::memory_order_relaxed);
        }
        fb->Recharge(&buffered_bytes_);
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
      fb->Recharge(&buffered_bytes_);
    }
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
  uint64_t op_entries, state_entries, op_records;
  {
    MutexLock restructure(&fb->restructure_mu);  // nothing detached by a coalesce
    MutexLock l(&fb->mu);
    sequential = fb->Sequential();
    records_only = fb->RecordsOnly();
    sorted_prefix = fb->sorted_ops;
    op_entries = fb->OpEntries();
    op_records = fb->op_records;
    state_entries = fb->state.nodes();
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
  auto add_record = [&](uint64_t block, uint64_t time_ns, uint64_t at) {
    batch.records.push_back(BlockRecord{block, time_ns, ops.FingerprintAt(at)});
  };
  if (sequential) {
    batch.records.reserve(op_records);
    ops.ForEach([&](const Op& op) {
      for (uint64_t j = 0; j < op.count; j++) add_record(op.block + j, op.time_ns, op.fp_at + j);
      note_time(op.time_ns);
    });
    return batch;
  }
  if (records_only) {
    // Coalesced outside the file's lock by a sort: no tree.
    batch.records.reserve(op_records);
    FileBuffer::SortRecords(ops, sorted_prefix, [&](uint64_t block, uint64_t time_ns, uint64_t at) {
      add_record(block, time_ns, at);
      note_time(time_ns);
    });
    fb->NoteCoalesce(op_entries, batch.records.size());
    return batch;
  }
  // Coalesced outside the file's lock: writes go on into a fresh buffer.
  FileBuffer::ApplyOps(&state, ops);
  fb->NoteCoalesce(op_entries + state_entries, state.records.size() + state.ranges.size());
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
  return fb != nullptr && fb->Recording();
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
