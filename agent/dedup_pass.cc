#include "agent/dedup_pass.h"

#include <algorithm>
#include <deque>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>

#include "index/shard_io.h"
#include "index/shard_map.h"
#include "kmod/writemon/write_log.h"
#include "util/clock.h"
#include "util/log.h"
#include "volume/lock_watch.h"

namespace dede {

// ---------------------------------------------------------------- access

Result<FileAccess::Handle> VolumeFileAccess::Get(const FileInfo& info) {
  auto it = open_.find(info.id.ino);
  if (it != open_.end()) {
    if (!(it->second->id() == info.id)) return Status::NotFound("file changed");
    return Handle{it->second.get()};
  }
  ASSIGN_OR_RETURN(std::unique_ptr<File> f, vol_->OpenFileById(info.id));
  File* raw = f.get();
  open_[info.id.ino] = std::move(f);
  return Handle{raw};
}

bool VolumeFileAccess::GiveBackIfWanted(const FileInfo& info) {
  auto it = open_.find(info.id.ino);
  if (it == open_.end() || !(it->second->id() == info.id)) return false;
  Result<bool> wanted = it->second->WantedElsewhere();
  if (!wanted.ok() || !*wanted) return false;
  open_.erase(it);
  return true;
}

ExportFileAccess::~ExportFileAccess() {
  for (auto& [ino, e] : held_) table_->Release(e);
}

bool ExportFileAccess::GiveBackIfWanted(const FileInfo& info) {
  auto it = held_.find(info.id.ino);
  if (it == held_.end() || !(it->second->id() == info.id)) return false;
  // A VM of this host using the disk keeps it whatever we do.
  if (!table_->SoleClient(it->second)) return false;
  Result<bool> wanted = it->second->file()->WantedElsewhere();
  if (!wanted.ok() || !*wanted) return false;
  table_->Release(it->second);
  held_.erase(it);
  return true;
}

Result<FileAccess::Handle> ExportFileAccess::Get(const FileInfo& info) {
  auto it = held_.find(info.id.ino);
  if (it == held_.end()) {
    std::shared_ptr<Export> e;
    if (scope_ == kOnlyOpen) {
      e = table_->AcquireIfOpen(info.name);
      if (!e) return Status::NotFound("'" + info.name + "' is not open here");
    } else {
      ASSIGN_OR_RETURN(e, table_->Acquire(info.name));
    }
    it = held_.emplace(info.id.ino, std::move(e)).first;
  }
  if (!(it->second->id() == info.id)) return Status::NotFound("file changed");
  return Handle{it->second->file()};
}

namespace {

// The merge requests of the files `access` lends, given the volume's
// listing (see ApplyMergeRequestsForHeldFiles).
Result<MergeApplyStats> ApplyMergeRequestsIn(Volume* vol, FileAccess* access, VerifyMode verify,
                                             const std::vector<FileInfo>& all,
                                             const std::function<bool(const FileInfo&)>& wanted) {
  std::unordered_map<uint64_t, const FileInfo*> by_ino;
  for (const FileInfo& fi : all) by_ino[fi.id.ino] = &fi;
  MergeApplyStats total;
  for (const FileInfo& mi : all) {
    if (mi.kind != FileKind::kMergeRequest) continue;
    const std::optional<uint64_t> target_ino = ParseMergeRequestFileName(mi.name);
    if (!target_ino || mi.owner_ino != *target_ino) continue;  // not one of ours
    auto it = by_ino.find(*target_ino);
    if (it == by_ino.end() || it->second->kind != FileKind::kRegular) {
      // The target is gone: nobody will apply these. Removing the file
      // drops its clone references (one a poster holds open this moment
      // goes next time).
      Status st = vol->Remove(mi.name);
      if (st.ok()) {
        total.request_files_removed++;
      } else if (st.code() != Status::Code::kLocked && st.code() != Status::Code::kNotFound) {
        return st;
      }
      continue;
    }
    const FileInfo& target = *it->second;
    if (wanted && !wanted(target)) continue;
    Result<FileAccess::Handle> h = access->Get(target);
    if (!h.ok()) {
      // Held elsewhere: its holder applies them. Not open here (dedupd's
      // merge timer, ExportFileAccess::kOnlyOpen): whoever opens it next
      // does. Gone since the listing: the next sweep removes the request
      // file.
      if (h.status().code() == Status::Code::kLocked ||
          h.status().code() == Status::Code::kNotFound) {
        continue;
      }
      return h.status();
    }
    ASSIGN_OR_RETURN(MergeApplyStats one, ApplyMergeRequests(vol, h->file, verify));
    total.Add(one);
  }
  return total;
}

constexpr uint32_t kNoFile = ~0u;

struct PassRecord {
  FpKey fp{};
  uint64_t block = 0;
  uint32_t file = kNoFile;  // index into Pass::files_
};

bool RecordLess(const PassRecord& a, const PassRecord& b) {
  // One comparison of the keys (the sort of a pass's records is hot).
  if (int c = std::memcmp(a.fp.data(), b.fp.data(), a.fp.size()); c != 0) return c < 0;
  if (a.file != b.file) return a.file < b.file;
  return a.block < b.block;
}

struct PassFile {
  FileInfo info;
  bool tried = false;
  Status open_status;
  FileAccess::Handle h;
  bool given_back = false;  // to a client waiting to open it, during this pass
  std::vector<std::pair<uint64_t, uint64_t>> touched;  // coalesced [first, last]

  bool Touched(uint64_t block) const {
    auto it = std::upper_bound(touched.begin(), touched.end(), block,
                               [](uint64_t b, const auto& r) { return b < r.first; });
    return it != touched.begin() && (it - 1)->second >= block;
  }
  uint64_t WholeBlocks() const { return info.size / kBlockSize; }
};

void Coalesce(std::vector<std::pair<uint64_t, uint64_t>>* v) {
  std::sort(v->begin(), v->end());
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (const auto& r : *v) {
    if (!out.empty() && r.first <= out.back().second + 1) {
      out.back().second = std::max(out.back().second, r.second);
    } else {
      out.push_back(r);
    }
  }
  *v = std::move(out);
}


// The arena of one shard: a file made only of COW references to shared
// blocks. Indexes are handed out upward from the shard header's arena_next;
// dropped blocks become holes (no data, no refcount).
struct ArenaFile {
  std::unique_ptr<File> f;
  uint64_t next = 0;
  std::vector<uint64_t> to_punch;  // after the new shard version is durable

  Result<uint64_t> Allocate() {
    const uint64_t idx = next++;
    const uint64_t need = (idx + 1) * kBlockSize;
    if (f->size() < need) {
      RETURN_IF_ERROR(f->Truncate(std::max<uint64_t>({need, f->size() * 2, 1u << 20})));
    }
    return idx;
  }
  // Gives back the last index if it was just taken (a failed share).
  void Unallocate(uint64_t idx) {
    if (idx + 1 == next) next--;
  }
};

constexpr uint64_t kNoArena = ~0ull;

// One fingerprint of a shard update: its index entry (if any) and the
// records [next, end) not applied to it yet.
struct Group {
  FpKey key{};
  std::optional<IndexEntry> state;
  size_t next = 0;
  size_t end = 0;
  uint64_t anchor_arena = kNoArena;  // arena block planned this round
  size_t anchor_record = 0;          // its record
  // Planned this round: the indexed block G:c is in a file held by another
  // process or host, so it is not shared here; G's holder gets a merge
  // request for it instead.
  bool target_busy = false;
  // Records of files held elsewhere met while the entry was not Shared
  // (no arena block to offer their holders yet): they get merge requests
  // if an anchor makes it Shared later in the pass, else they are counted
  // in busy_targets when the group is done.
  std::vector<size_t> held_elsewhere;
};

// Where a --rescan round starts: files are rescanned in the order of their
// inodes, each from block 0, except the file of `id`, from `block` (a
// round that stopped inside it). Another file in that inode now (removed
// and created again) starts from block 0.
struct RescanCursor {
  FileId id;
  uint64_t block = 0;
};

class Pass {
 public:
  Pass(Volume* vol, FileAccess* access, const DedupOptions& opts, RescanCursor rescan_from = {})
      : vol_(vol),
        access_(access),
        opts_(opts),
        rescan_from_(rescan_from),
        clock_(opts.clock != nullptr ? opts.clock : Clock::Real()),
        uuid_(vol->superblock().uuid),
        algo_(vol->superblock().hash_algo) {
    std::vector<uint8_t> zero(kBlockSize, 0);
    zero_fp_ = ComputeFingerprint(algo_, zero.data(), zero.size());
    zero_key_ = KeyOf(zero_fp_);
  }

  // After Run with opts.rescan: whether every file was rescanned, and if
  // not (max_records reached), where the next round starts.
  bool rescan_done() const { return rescan_done_; }
  RescanCursor rescan_next() const { return rescan_next_; }

  Result<DedupStats> Run() {
    // Every device I/O of this thread (and the shard read-ahead it starts)
    // is dedup I/O, charged to the rate cap.
    ScopedIoBudget charged(opts_.io_budget);
    const uint64_t t0 = clock_->MonotonicNanos();
    if (opts_.verify == VerifyMode::kHashWitness && algo_ != HashAlgo::kSha256) {
      return Status::Invalid("hash-witness verification needs a volume formatted with --hash "
                             "sha256");
    }
    RETURN_IF_ERROR(Gather());
    if (opts_.rescan) RETURN_IF_ERROR(Rescan());
    const uint64_t t1 = clock_->MonotonicNanos();
    stats_.gather_ns = t1 - t0;
    RETURN_IF_ERROR(MergeRound(opts_.force || sweep_for_opt_out_));
    RETURN_IF_ERROR(RevisitBusyShards());
    // Everything the logs held is now in durable shard versions or pending
    // files (ShardWriter::Finish syncs; pending appends sync here), except
    // the records too young to use and the ranges left to rehash, which go
    // back into their logs. A failure there (ENOSPC, EIO) leaves the old
    // log, or one holding them (ReplaceOpenWriteLog): emptying the log and
    // then appending them lost them, with no mark, when the append failed.
    RETURN_IF_ERROR(vol_->Sync());
    for (ConsumedLog& log : logs_) {
      RETURN_IF_ERROR(ReplaceOpenWriteLog(vol_, log.file.get(), log.deferred));
      stats_.logs_consumed++;
    }
    logs_.clear();
    RETURN_IF_ERROR(vol_->Sync());
    // Requests other hosts posted while this pass ran, for files it holds
    // (their passes found them busy: held by this one) or that are free
    // now: applied before the pass lets the files go, not at the next
    // pass, which may be a window away. A pass stopped at its window's end
    // leaves them for the next one.
    if (!stats_.stopped && !StopAsked() && !Cancelled()) {
      Progress("applying merge requests posted during the pass");
      ASSIGN_OR_RETURN(std::vector<FileInfo> all, vol_->List());
      RETURN_IF_ERROR(ApplyPostedRequests(all));
      RETURN_IF_ERROR(vol_->Sync());
    }
    SettleIo();
    const uint64_t t2 = clock_->MonotonicNanos();
    stats_.merge_ns = t2 - t1;
    stats_.total_ns = t2 - t0;
    return stats_;
  }

 private:
  void Progress(const std::string& s) {
    if (opts_.progress) opts_.progress(s);
  }

  bool Cancelled() const { return opts_.cancel != nullptr && opts_.cancel->load(); }
  bool StopAsked() const { return opts_.stop != nullptr && opts_.stop->load(); }

  // Pays for the dedup I/O done so far (sleeps under a rate cap). Called
  // only where this thread holds no volume lock.
  void SettleIo() {
    if (opts_.settle_io) opts_.settle_io(nullptr);
  }
  // SettleIo where the pass may give back borrowed disks meanwhile
  // (GiveBackWantedFiles: no planned operation may use a handle, or the
  // caller skips those on the files in `given_back`): under a low rate cap
  // one settle can sleep for seconds.
  Status SettleIoGivingBack(std::set<uintptr_t>* given_back = nullptr) {
    if (!opts_.settle_io) return GiveBackWantedFiles(given_back);
    Status st;
    opts_.settle_io([&] {
      if (st.ok()) st = GiveBackWantedFiles(given_back);
    });
    RETURN_IF_ERROR(st);
    return GiveBackWantedFiles(given_back);
  }

  bool Young(uint64_t written_ns) const {
    return opts_.stable_after_ns > 0 && written_ns > young_after_ns_;
  }

  // ------------------------------------------------------------ files

  uint32_t FileIndex(const FileInfo& info) {
    auto it = file_index_.find(info.id.ino);
    if (it != file_index_.end()) return it->second;
    PassFile pf;
    pf.info = info;
    files_.push_back(std::move(pf));
    file_index_[info.id.ino] = uint32_t(files_.size() - 1);
    return uint32_t(files_.size() - 1);
  }

  // A file named by a record or an entry, if it still is that file.
  uint32_t FileIndexOf(FileId id) {
    auto it = by_ino_.find(id.ino);
    if (it == by_ino_.end() || !(it->second.id == id)) return kNoFile;
    return FileIndex(it->second);
  }

  Result<FileAccess::Handle> Open(PassFile* pf) {
    if (!pf->tried) {
      pf->tried = true;
      Result<FileAccess::Handle> h = access_->Get(pf->info);
      if (h.ok()) {
        pf->h = *h;
        // The dedup flag as it is now that the file is held: an opt-out
        // (`dede set NAME dedup=off`) after the pass listed the files used
        // to have the file rehashed, its zero blocks punched and entries
        // added for it all the same.
        if (Result<FileInfo> now = h->file->Info(); now.ok() && now->dedup != pf->info.dedup) {
          pf->info.dedup = now->dedup;
          if (auto bi = by_ino_.find(pf->info.id.ino); bi != by_ino_.end()) {
            bi->second.dedup = now->dedup;
          }
        }
      } else {
        pf->open_status = h.status();
      }
    }
    if (!pf->open_status.ok()) return pf->open_status;
    return pf->h;
  }

  // A client waiting to open a file this pass only borrowed (a VM starting
  // on another host, Volume::AnnounceOpenWait) gets it at the pass's next
  // step, not when the pass ends: the file is given back and counts as held
  // elsewhere for the rest of the pass (its records are parked for a later
  // pass, entries that name it get merge requests). Called only where no
  // planned operation can use a handle, or where the caller skips those
  // on the files whose handles' addresses it gets in `given_back` (only
  // compared, never used). Looks at most once a second (a lock-table read
  // per borrowed file with sanlock).
  Status GiveBackWantedFiles(std::set<uintptr_t>* given_back = nullptr) {
    const uint64_t now = clock_->MonotonicNanos();
    if (now < next_give_back_ns_) return Status::Ok();
    next_give_back_ns_ = now + kGiveBackEveryNs;
    RETURN_IF_ERROR(FlushZeroBlocks());  // its operations hold handles
    for (PassFile& pf : files_) {
      if (!pf.tried || !pf.open_status.ok()) continue;
      const uintptr_t handle = reinterpret_cast<uintptr_t>(pf.h.file);
      if (!access_->GiveBackIfWanted(pf.info)) continue;
      if (given_back != nullptr) given_back->insert(handle);
      pf.h = FileAccess::Handle{};
      pf.given_back = true;
      pf.open_status = Status::Locked("'" + pf.info.name +
                                      "' was given back to a client waiting to open it");
      stats_.files_given_back++;
      LOG(kInfo) << "dedup pass: gave '" << pf.info.name
                 << "' back to a client waiting to open it";
    }
    return Status::Ok();
  }

  // Is a Unique hint for (file, block), older than this pass's logs, still
  // worth keeping?
  bool UniqueStillValid(const IndexEntry& e) {
    auto it = by_ino_.find(e.file.ino);
    if (it == by_ino_.end()) return false;
    const FileInfo& fi = it->second;
    if (!(fi.id == e.file) || fi.kind != FileKind::kRegular || !fi.dedup) return false;
    if ((e.block + 1) * kBlockSize > fi.size) return false;
    auto pi = file_index_.find(e.file.ino);
    if (pi != file_index_.end() && TouchedThisPass(pi->second, e.block)) return false;
    return true;
  }

  // Did this pass's logs change the block after the hint (an older entry or
  // parked record) about it was made? On a revisit (RevisitBusyShards) the
  // answer is no: the shard's first rewrite in this pass already dropped
  // every hint its logs superseded, and what it wrote since (the Unique
  // entries and parked records made from this pass's own records) is
  // current, though its blocks are "touched". (A hint another host added in
  // between could be stale: every share verifies the content under the
  // files' locks, so a stale hint costs a failed compare, never data.)
  bool TouchedThisPass(uint32_t file_index, uint64_t block) const {
    return !revisiting_ && files_[file_index].Touched(block);
  }

  // ------------------------------------------------------------ gather

  // The merge requests for the files of `all` this pass holds or can take
  // without waiting (ApplyMergeRequestsIn), counted in its statistics.
  Status ApplyPostedRequests(const std::vector<FileInfo>& all) {
    ASSIGN_OR_RETURN(MergeApplyStats merged,
                     ApplyMergeRequestsIn(vol_, access_, opts_.verify, all, nullptr));
    stats_.merge_requests_applied += merged.applied;
    stats_.merge_requests_failed_verification += merged.failed_verification;
    stats_.merge_requests_busy += merged.busy;
    stats_.merge_requests_stale += merged.stale;
    stats_.merge_corrupt_groups += merged.corrupt_groups;
    stats_.merge_files_removed += merged.request_files_removed;
    stats_.newer_format_left_alone += merged.newer_files_kept;
    return Status::Ok();
  }

  Status Gather() {
    const uint64_t now = clock_->NowNanos();
    young_after_ns_ = now > opts_.stable_after_ns ? now - opts_.stable_after_ns : 0;
    ASSIGN_OR_RETURN(std::vector<FileInfo> all, vol_->List());
    for (const FileInfo& fi : all) by_ino_[fi.id.ino] = fi;
    // First the merge requests other hosts posted for the files this pass
    // holds (DeDe 3.3.2), and the request files of deleted files.
    Progress("applying merge requests");
    RETURN_IF_ERROR(ApplyPostedRequests(all));
    Progress("gathering write logs");
    // Hosts passing at once would all reach for the same logs first, find
    // them taken and pay a lock round for each: start each host's walk
    // elsewhere (golden-ratio spacing keeps any few host ids apart).
    std::vector<const FileInfo*> walk;
    for (const FileInfo& fi : all) {
      if (fi.kind == FileKind::kWriteLog) walk.push_back(&fi);
    }
    if (!walk.empty()) {
      const double frac = std::fmod(0.6180339887498949 * vol_->host_id(), 1.0);
      const size_t start = std::min(walk.size() - 1, static_cast<size_t>(frac * walk.size()));
      std::rotate(walk.begin(), walk.begin() + static_cast<ptrdiff_t>(start), walk.end());
    }
    for (size_t w = 0; w < walk.size(); w++) {
      const FileInfo* walked = walk[w];
      // Pays for the previous log's reads and rehash: a waiting client
      // may take its disk back meanwhile.
      RETURN_IF_ERROR(SettleIoGivingBack());
      // A stop (the window's end, Ctrl-C) leaves the logs not read yet for
      // the next pass; what was gathered is parked by the merge round.
      if (Cancelled()) return Status::Unavailable("dedup pass cancelled");
      if (StopAsked()) break;
      // Bounded memory: past max_records, the logs not read yet are left
      // for another round (RunDedupPass runs it at once). Merging in rounds
      // within one pass would judge the entries an earlier round made
      // against blocks a later round's logs touched.
      if (records_.size() >= opts_.max_records) {
        stats_.logs_left_over = walk.size() - w;
        break;
      }
      const FileInfo& li = *walked;
      std::optional<FileId> owner = ParseWriteLogName(li.name);
      if (!owner) continue;
      auto oi = by_ino_.find(owner->ino);
      if (oi == by_ino_.end() || !(oi->second.id == *owner) ||
          oi->second.kind != FileKind::kRegular) {
        // The file is gone (or recreated): its log describes nothing.
        Status s = vol_->Remove(li.name);
        if (s.ok()) stats_.orphan_logs_removed++;
        continue;
      }
      const FileInfo& owner_info = oi->second;
      const uint32_t fidx = FileIndex(owner_info);
      PassFile* pf = &files_[fidx];
      Result<FileAccess::Handle> h = Open(pf);
      if (!h.ok()) {
        if (h.status().code() == Status::Code::kLocked) {
          stats_.files_busy++;
          continue;
        }
        if (h.status().code() == Status::Code::kNotFound) continue;
        return h.status();
      }
      std::unique_ptr<File> lent = opts_.borrow_log ? opts_.borrow_log(owner_info.id) : nullptr;
      Result<std::unique_ptr<File>> log =
          lent ? Result<std::unique_ptr<File>>(std::move(lent)) : OpenWriteLog(vol_, owner_info.id);
      if (!log.ok()) {
        if (log.status().code() == Status::Code::kLocked ||
            log.status().code() == Status::Code::kNotFound) {
          stats_.files_busy++;
          continue;
        }
        return log.status();
      }
      if (opts_.log_taken) opts_.log_taken(owner_info.id);
      // At most max_records of one log in memory (more: the log stands for
      // "every block changed", and the file is rehashed instead).
      ASSIGN_OR_RETURN(WriteLogState st,
                       ReplayWriteLog(log->get(), algo_, uuid_, owner_info.id, opts_.max_records));
      if (st.stats.newer_frames > 0) {
        // A newer dede wrote part of it: consuming the log would cut away
        // what this one cannot read. Left whole for that dede's pass.
        stats_.newer_format_left_alone++;
        continue;
      }
      stats_.log_corrupt_frames += st.stats.corrupt_frames;
      stats_.log_dropped_records += st.stats.dropped_records;
      if (st.saturated) stats_.logs_saturated++;
      if (st.over_budget) stats_.logs_over_budget++;
      logs_.push_back(ConsumedLog{std::move(*log), MonitorBatch{}});
      MonitorBatch& deferred = logs_.back().deferred;
      deferred.file = owner_info.id;
      // Punches held back from here on are this log's blocks (RelogHeldBackZeros).
      relog_zeros_ = true;
      zero_held_.clear();
      SettleIo();
      for (const InvalidRange& r : st.invalidated) {
        if (r.count > 0) pf->touched.emplace_back(r.first, r.first + r.count - 1);
      }
      if (!owner_info.dedup) {
        // Opted out (its log holds what it wrote before, or the opt-out
        // marker): its index entries may be in any shard, so this pass
        // rewrites them all.
        stats_.files_dedup_off++;
        sweep_for_opt_out_ = true;
        continue;
      }
      const uint64_t whole = pf->WholeBlocks();
      // Blocks changed without a fingerprint too recently to use: rehashed
      // by a later pass, not now.
      std::vector<std::pair<uint64_t, uint64_t>> young_ranges;
      uint64_t young_ranges_ns = 0;
      for (const InvalidRange& ir : st.invalidated) {
        if (ir.count == 0 || !Young(ir.time_ns)) continue;
        young_ranges.emplace_back(ir.first, ir.first + ir.count - 1);
        young_ranges_ns = std::max(young_ranges_ns, ir.time_ns);
      }
      Coalesce(&young_ranges);
      auto in_young_range = [&](uint64_t b) {
        auto it = std::upper_bound(young_ranges.begin(), young_ranges.end(), b,
                                   [](uint64_t x, const auto& r) { return x < r.first; });
        return it != young_ranges.begin() && (it - 1)->second >= b;
      };
      for (const auto& [block, rec] : st.records) {
        pf->touched.emplace_back(block, block);
        stats_.log_records++;
        if (block >= whole) continue;
        if (Young(rec.time_ns)) {
          deferred.records.push_back(rec);
          stats_.young_records_deferred++;
          continue;
        }
        PassRecord r;
        r.fp = KeyOf(rec.fp);
        r.block = block;
        r.file = fidx;
        if (r.fp == zero_key_) {
          RETURN_IF_ERROR(QueueZeroBlock(pf, block));
          continue;
        }
        records_.push_back(r);
      }
      // Blocks changed without a fingerprint (partial writes, zeroing,
      // discards, a saturated log) are read and hashed here, so what the
      // monitor could not see is deduplicated too. What the pass's rehash
      // budget leaves over goes back into the log for the next pass (a
      // saturated log of a big file takes several passes).
      struct LaterRange {
        uint64_t first, last, time_ns;
      };
      std::vector<LaterRange> later;
      for (const auto& [first, last] : young_ranges) {
        later.push_back({first, last, young_ranges_ns});
        stats_.young_ranges_deferred++;
      }
      for (const InvalidRange& ir : st.invalidated) {
        if (Young(ir.time_ns)) continue;
        const uint64_t end = std::min(ir.first + ir.count, whole);
        for (uint64_t blk = ir.first; blk < end;) {
          // What the budget leaves over, or a stop interrupts (a saturated
          // log's rehash can read gigabytes at the rate cap), waits in the
          // log for a later pass.
          if (rehashed_ >= opts_.rehash_limit || StopAsked() || Cancelled()) {
            later.push_back({blk, end - 1, ir.time_ns});
            stats_.rehash_ranges_deferred++;
            break;
          }
          if (in_young_range(blk)) {
            blk++;
            continue;
          }
          uint64_t n = std::min<uint64_t>({end - blk, 64, opts_.rehash_limit - rehashed_});
          for (uint64_t k = 1; k < n; k++) {
            if (in_young_range(blk + k)) n = k;
          }
          RETURN_IF_ERROR(Rehash(pf, fidx, blk, n, st.records));
          blk += n;
          SettleIo();
        }
      }
      // Those ranges go back into the log, merged (a frame's ranges are
      // disjoint and do not touch) and minus the blocks a record describes
      // (the log's own invariant: a record never lies in a range).
      std::sort(later.begin(), later.end(),
                [](const LaterRange& a, const LaterRange& b) { return a.first < b.first; });
      std::vector<LaterRange> write_back;
      for (const LaterRange& r : later) {
        if (!write_back.empty() && r.first <= write_back.back().last + 1) {
          write_back.back().last = std::max(write_back.back().last, r.last);
          write_back.back().time_ns = std::max(write_back.back().time_ns, r.time_ns);
        } else {
          write_back.push_back(r);
        }
      }
      for (const LaterRange& r : write_back) {
        uint64_t b = r.first;
        while (b <= r.last) {
          auto rec = st.records.lower_bound(b);
          const uint64_t stop =
              rec == st.records.end() ? r.last + 1 : std::min(rec->first, r.last + 1);
          if (stop > b) {
            deferred.invalidated.push_back(InvalidRange{b, stop - b, r.time_ns});
          }
          b = stop + 1;
        }
      }
      // (Before the batch's times: held-back punches add records.)
      RETURN_IF_ERROR(FlushZeroBlocks());
      RelogHeldBackZeros(&deferred);
      for (const BlockRecord& r : deferred.records) {
        deferred.first_ns = deferred.first_ns ? std::min(deferred.first_ns, r.time_ns) : r.time_ns;
        deferred.last_ns = std::max(deferred.last_ns, r.time_ns);
      }
      for (const InvalidRange& r : deferred.invalidated) {
        deferred.first_ns = deferred.first_ns ? std::min(deferred.first_ns, r.time_ns) : r.time_ns;
        deferred.last_ns = std::max(deferred.last_ns, r.time_ns);
      }
      Coalesce(&pf->touched);
    }
    relog_zeros_ = false;
    return Status::Ok();
  }

  // Sorts the records gathered so far and merges them into the index.
  Status MergeRound(bool force) {
    std::sort(records_.begin(), records_.end(), RecordLess);
    const bool saved = opts_.force;
    opts_.force = force;
    swept_all_ = false;
    Status st = MergeAll();
    opts_.force = saved;
    records_.clear();
    return st;
  }

  // --rescan: every block of every regular file this process can lock is
  // read and fingerprinted, as if just written (rebuilds a lost or damaged
  // index, or indexes data written before dedup ran), from rescan_from_ on.
  // Bounded memory: once max_records are held (and this round has read
  // something), the round stops there and rescan_next() says where the next
  // round starts; RunDedupPass runs it as a new Pass. Not a merge within
  // this pass: a rescanned block is "touched" for the rest of its pass (it
  // supersedes every hint made before), so a later merge of the same pass
  // would take the entries and parked records an earlier merge made from
  // the rescan for stale and drop them, and nothing rescanned in one round
  // would ever share with another round. A new pass marks only its own
  // rounds' blocks; a block written after an earlier round read it is in
  // its file's log, which the new pass gathers first (and a hint that is
  // stale all the same costs a failed compare, never data).
  Status Rescan() {
    static const std::map<uint64_t, BlockRecord> kNone;
    std::vector<FileInfo> regular;
    for (const auto& [ino, fi] : by_ino_) {
      if (fi.kind == FileKind::kRegular && fi.dedup && ino >= rescan_from_.id.ino) {
        regular.push_back(fi);
      }
    }
    std::sort(regular.begin(), regular.end(),
              [](const FileInfo& a, const FileInfo& b) { return a.id.ino < b.id.ino; });
    bool read_any = false;  // every round gets further
    for (const FileInfo& fi : regular) {
      // Stopping: what was read so far is parked by the final merge round.
      if (StopAsked()) return Status::Ok();
      RETURN_IF_ERROR(GiveBackWantedFiles());
      const uint32_t fidx = FileIndex(fi);
      PassFile* pf = &files_[fidx];
      Result<FileAccess::Handle> h = Open(pf);
      if (!h.ok()) {
        if (h.status().code() == Status::Code::kLocked) {
          stats_.files_busy++;
          continue;
        }
        if (h.status().code() == Status::Code::kNotFound) continue;
        return h.status();
      }
      const uint64_t whole = pf->WholeBlocks();
      const uint64_t first = fi.id == rescan_from_.id ? std::min(rescan_from_.block, whole) : 0;
      Progress("rescanning '" + fi.name + "'");
      uint64_t b = first;
      bool full = false, stopping = false;
      while (b < whole) {
        if (read_any && records_.size() >= opts_.max_records) {
          full = true;
          break;
        }
        // A big disk takes minutes to read: a stop (Ctrl-C, the window's
        // end) is seen between runs, not only between files.
        if (StopAsked()) {
          stopping = true;
          break;
        }
        const uint64_t n = std::min<uint64_t>(whole - b, 256);
        RETURN_IF_ERROR(Rehash(pf, fidx, b, n, kNone));
        b += n;
        read_any = true;
        SettleIo();
      }
      if (b > first) {
        pf->touched.emplace_back(first, b - 1);
        Coalesce(&pf->touched);
      }
      RETURN_IF_ERROR(FlushZeroBlocks());
      if (full || stopping) {
        rescan_next_ = RescanCursor{fi.id, b};
        return Status::Ok();
      }
      stats_.files_rescanned++;
    }
    rescan_done_ = true;
    return Status::Ok();
  }

  // Reads and hashes blocks [first, first + n) of a file; a record for each
  // (those the log has a record for are skipped).
  Status Rehash(PassFile* pf, uint32_t fidx, uint64_t first, uint64_t n,
                const std::map<uint64_t, BlockRecord>& logged) {
    buf_.resize(n * kBlockSize);
    RETURN_IF_ERROR(pf->h.file->Read(first * kBlockSize, buf_.data(), n * kBlockSize));
    for (uint64_t i = 0; i < n; i++) {
      if (logged.count(first + i)) continue;
      rehashed_++;
      stats_.blocks_rehashed++;
      PassRecord r;
      r.fp = KeyOf(ComputeFingerprint(algo_, buf_.data() + i * kBlockSize, kBlockSize));
      r.block = first + i;
      r.file = fidx;
      if (r.fp == zero_key_) {
        RETURN_IF_ERROR(QueueZeroBlock(pf, first + i));
      } else {
        records_.push_back(r);
      }
    }
    return Status::Ok();
  }

  // A block recorded (or read) as all zeros becomes a hole: it reads the
  // same and costs no block. The volume checks it is zeros when it punches.
  Status QueueZeroBlock(PassFile* pf, uint64_t block) {
    Volume::BlockOp op;
    op.kind = Volume::BlockOp::Kind::kPunchIfZero;
    op.dst = pf->h.file;
    op.dst_index = block;
    zero_ops_.push_back(op);
    if (zero_ops_.size() >= opts_.batch_ops) return FlushZeroBlocks();
    return Status::Ok();
  }

  Status FlushZeroBlocks() {
    if (zero_ops_.empty()) return Status::Ok();
    // Never wait for another host (issue 5). A punch drops its block's
    // reference and asks for room in the drop list first: with the list
    // full of drops in groups held elsewhere, a waiting ApplyBlockOps
    // drained it waiting for those groups (up to the lock wait, 60 s)
    // holding the volume mutex, which every write of every VM on this
    // host needs, and then failed the pass. Held back (kLocked), a punch
    // changed nothing: the block is logged again for a later pass.
    Volume::BlockOpsOptions no_wait;
    no_wait.no_wait = true;
    RETURN_IF_ERROR(vol_->ApplyBlockOps(&zero_ops_, opts_.verify, &read_buf_, no_wait));
    SettleIo();
    for (const Volume::BlockOp& op : zero_ops_) {
      if (op.result.ok()) {
        stats_.zero_blocks_freed += op.changed;
      } else if (op.result.code() == Status::Code::kMismatch) {
        stats_.stale_records++;
      } else if (op.result.code() == Status::Code::kLocked) {
        stats_.zero_blocks_busy++;
        if (relog_zeros_) zero_held_.push_back(op.dst_index);
      } else {
        return op.result;
      }
    }
    zero_ops_.clear();
    return Status::Ok();
  }

  // The held-back punches of the log being gathered go back into it as
  // zero records (the volume checks the block is zeros when it punches),
  // so the next pass punches them; as of young_after_ns_, which the pass
  // took them for (not young). Their blocks are neither young records nor
  // in the ranges left for later (those were not read), but the log's
  // order rules are kept whatever: records sorted and unique, none inside
  // a range. A punch held back in a --rescan is only counted: the next
  // rescan finds the block again.
  void RelogHeldBackZeros(MonitorBatch* deferred) {
    if (zero_held_.empty()) return;
    auto in_range = [&](uint64_t b) {
      for (const InvalidRange& r : deferred->invalidated) {
        if (b >= r.first && b - r.first < r.count) return true;
      }
      return false;
    };
    for (uint64_t b : zero_held_) {
      if (!in_range(b)) deferred->records.push_back(BlockRecord{b, young_after_ns_, zero_fp_});
    }
    zero_held_.clear();
    std::sort(deferred->records.begin(), deferred->records.end(),
              [](const BlockRecord& a, const BlockRecord& b) { return a.block < b.block; });
    deferred->records.erase(
        std::unique(deferred->records.begin(), deferred->records.end(),
                    [](const BlockRecord& a, const BlockRecord& b) { return a.block == b.block; }),
        deferred->records.end());
  }

  // ------------------------------------------------------------ shards

  Status LockShard(uint64_t id) {
    LockManager* lm = vol_->lock_manager();
    const LockId lock{LockKind::kIndexShard, id};
    if (parking_) {
      // Stopping must not wait for another host's shard update: give up
      // parking and keep the logs (what was parked is applied again later,
      // which is harmless).
      Status s = lm->Acquire(lock, LockMode::kExclusive, false);
      if (s.code() != Status::Code::kLocked) return s;
      return Status::Unavailable("dedup pass stopped; " + lock.ToString() +
                                 " was busy while parking, the logs are kept");
    }
    // Another pass (here or on another host) may merge into this shard.
    // Watch the lock and try when it looks free (WatchAndTake); disks that
    // clients wait for go back meanwhile (the other pass's update can take
    // seconds).
    LockWatch watch;
    watch.max_poll = std::chrono::milliseconds(50);
    watch.between = [this, lock, waiting = false]() mutable -> Status {
      if (!waiting) {
        waiting = true;
        Progress("waiting for " + lock.ToString());
        stats_.shard_waits++;
      }
      if (Cancelled()) return Status::Unavailable("dedup pass cancelled");
      // Stopping while another pass updates this shard: like a busy shard
      // while parking, the pass ends with its logs kept.
      if (StopAsked()) {
        return Status::Unavailable("dedup pass stopped while waiting for " + lock.ToString() +
                                   "; the logs are kept");
      }
      return GiveBackWantedFiles();
    };
    return WatchAndTake(lm, lock, LockMode::kExclusive, &watch);
  }

  void UnlockShard(uint64_t id) {
    (void)vol_->lock_manager()->Release(LockId{LockKind::kIndexShard, id});
  }

  Status MergeAll() {
    size_t i = 0;    // next unprocessed record
    uint64_t p = 0;  // next prefix to look at
    uint64_t retries = 0;
    std::set<uint64_t> pending_los;  // ranges with pending files
    {
      ASSIGN_OR_RETURN(ShardMap map, LoadShardMap(vol_));
      for (const IndexFile& f : map.pending) pending_los.insert(f.range.lo);
    }
    // Shards earlier passes asked to see again (as they were when this
    // pass began: those this pass adds are revisited by RevisitBusyShards).
    const std::set<uint64_t> asked_los =
        opts_.busy_parked_shards != nullptr ? *opts_.busy_parked_shards : std::set<uint64_t>{};
    while (true) {
      if (Cancelled()) return Status::Unavailable("dedup pass cancelled");
      if (!parking_ && StopAsked()) {
        parking_ = true;
        stats_.stopped = true;
        Progress("stopping: parking the records not merged yet");
      }
      SettleIo();
      if (swept_all_) break;
      if (!opts_.force) {
        // The next shard with records of this pass, or with records parked
        // by an earlier one (a pass stopped at its window's end leaves
        // them; they are applied once they pass the batching fraction).
        std::optional<uint64_t> next;
        if (i < records_.size()) next = std::max(p, KeyPrefix(records_[i].fp));
        if (!parking_) {
          auto pend = pending_los.lower_bound(p);
          if (pend != pending_los.end()) next = next ? std::min(*next, *pend) : *pend;
          auto ask = asked_los.lower_bound(p);
          if (ask != asked_los.end()) next = next ? std::min(*next, *ask) : *ask;
        }
        if (!next) break;
        p = *next;
      }
      ASSIGN_OR_RETURN(const bool done, ProcessSlotAt(&p, &i));
      if (!done) {
        // The map changed under us, or a broken version was removed.
        if (++retries > 1000) return Status::Corruption("index shard map keeps changing");
        continue;
      }
      retries = 0;
    }
    return Status::Ok();
  }

  // One try at the live slot covering prefix *p under its shard lock
  // (ProcessUnderLock); false: the map changed meanwhile, try again.
  // Whether an earlier pass asked for this range's shard to be rewritten
  // (busy_parked_shards: records parked for a busy group, an arena punch
  // held back). By any key in the range: the shard may have been split or
  // joined since it was asked.
  bool AskedBack(const ShardRange& r) const {
    if (opts_.busy_parked_shards == nullptr) return false;
    auto it = opts_.busy_parked_shards->lower_bound(r.lo);
    return it != opts_.busy_parked_shards->end() && r.Contains(*it);
  }
  // The range's shard was rewritten: what was asked of it is done.
  void SettleAskedBack(const ShardRange& r) {
    if (opts_.busy_parked_shards == nullptr) return;
    auto it = opts_.busy_parked_shards->lower_bound(r.lo);
    while (it != opts_.busy_parked_shards->end() && r.Contains(*it)) {
      it = opts_.busy_parked_shards->erase(it);
    }
  }

  Result<bool> ProcessSlotAt(uint64_t* p, size_t* i) {
    ASSIGN_OR_RETURN(ShardMap map, LoadShardMap(vol_));
    const ShardRange guess = map.SlotFor(*p).range;
    RETURN_IF_ERROR(LockShard(ShardLockId(guess)));
    const uint64_t start = clock_->NowNanos();
    Result<bool> done = ProcessUnderLock(p, guess, i);
    UnlockShard(ShardLockId(guess));
    const uint64_t end = std::max(start, clock_->NowNanos());
    stats_.AddShardSpan(start, end);
    return done;
  }

  // The shards that parked records this pass because an allocation group
  // was busy elsewhere are rewritten again, up to busy_revisits times, after
  // a pause that holds no lock of ours: each pause starts and ends with a
  // flush point (Sync), which hands our cached locks to hosts that asked
  // and takes the groups we announced once their holders have handed them
  // over at their own flush points. So the held-back work is done within
  // the pass, without ever waiting for another host inside a lock; what is
  // still held back after the last revisit waits for the next pass.
  Status RevisitBusyShards() {
    uint64_t delay_ms = opts_.busy_revisit_delay_ms;
    for (uint32_t round = 0; round < opts_.busy_revisits && !busy_parked_here_.empty(); round++) {
      RETURN_IF_ERROR(vol_->Sync());
      Progress("revisiting " + std::to_string(busy_parked_here_.size()) +
               " index shards whose records waited for a busy allocation group");
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(delay_ms);
      while (std::chrono::steady_clock::now() < until) {
        if (Cancelled()) return Status::Ok();  // the parked records wait for the next pass
        if (StopAsked()) {
          stats_.stopped = true;  // nothing more of this pass runs
          return Status::Ok();
        }
        // Nothing is planned during the pause: disks clients wait for go back.
        RETURN_IF_ERROR(GiveBackWantedFiles());
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      delay_ms *= 2;
      RETURN_IF_ERROR(vol_->Sync());
      const std::set<uint64_t> los = std::move(busy_parked_here_);
      busy_parked_here_.clear();
      RETURN_IF_ERROR(Revisit(los));
    }
    return Status::Ok();
  }

  // Rewrites the shards starting at `los` with their pending records only
  // (records_ is empty by now), as a revisit (revisiting_).
  Status Revisit(const std::set<uint64_t>& los) {
    revisiting_ = true;
    struct EndRevisit {
      bool* flag;
      ~EndRevisit() { *flag = false; }
    } end_revisit{&revisiting_};
    for (uint64_t lo : los) {
      uint64_t p = lo;
      size_t i = records_.size();
      for (int tries = 0;; tries++) {
        ASSIGN_OR_RETURN(const bool done, ProcessSlotAt(&p, &i));
        if (done) break;
        if (tries > 1000) return Status::Corruption("index shard map keeps changing");
      }
      stats_.shards_revisited++;
    }
    return Status::Ok();
  }

  // Processes the live slot covering prefix *p if its lock is the one held
  // (`guess`), advancing *p and *i past it; false: call again with a fresh
  // map.
  Result<bool> ProcessUnderLock(uint64_t* p, const ShardRange& guess, size_t* i) {
    // Every version inside our range is checked, not assumed complete
    // because a reader has it open: what this map calls stale is deleted.
    // One held open past kLockedRangeWait: look again with a fresh map.
    Result<ShardMap> loaded = LoadShardMap(vol_, &guess);
    if (loaded.status().code() == Status::Code::kLocked) {
      LOG(kInfo) << loaded.status().message() << "; trying the range again";
      return false;
    }
    ASSIGN_OR_RETURN(ShardMap map, std::move(loaded));
    SettleIo();  // listing the namespace reads the inode table
    const ShardSlot slot = map.SlotFor(*p);
    if (slot.range.lo != guess.lo) return false;
    size_t end = *i;
    while (end < records_.size() && KeyPrefix(records_[end].fp) <= slot.range.last()) end++;
    auto next_slot = [&] {
      *i = end;
      if (slot.range.last() == ~0ull) {
        swept_all_ = true;
      } else {
        *p = slot.range.last() + 1;
      }
    };
    for (const IndexFile& f : map.newer) {
      // A newer dede's version, live or not: not ours to read, rewrite,
      // remove or clean up around (docs/FORMAT.md section 9), and a new
      // version (or a split's halves) could take its name. The range is
      // left alone.
      if (!slot.range.Contains(f.range.lo)) continue;
      LeaveNewerAlone(slot, "shard version '" + f.name + "'", end - *i);
      next_slot();
      return true;
    }
    // Our lock covers every index file inside the slot's range (nobody can
    // be splitting it: that takes this lock too): clear out what is stale
    // there first (superseded and incomplete versions, pending files of
    // ranges that are no longer shards, arenas of half-finished splits).
    auto remove = [&](const IndexFile& f, uint64_t* counter) -> Status {
      Status st = vol_->Remove(f.name);
      if (st.ok()) {
        (*counter)++;
        return st;
      }
      // Held open by a reader (stats, fsck) or already gone: next time.
      if (st.code() == Status::Code::kLocked || st.code() == Status::Code::kNotFound) {
        return Status::Ok();
      }
      return st;
    };
    for (const IndexFile& f : map.stale_shards) {
      if (!slot.range.Contains(f.range.lo)) continue;
      RETURN_IF_ERROR(remove(f, &stats_.stale_files_removed));
    }
    for (const IndexFile& f : map.incomplete) {
      if (slot.range.Contains(f.range.lo)) {
        RETURN_IF_ERROR(remove(f, &stats_.incomplete_versions_removed));
      }
    }
    for (const IndexFile& f : map.pending) {
      if (!slot.range.Contains(f.range.lo) || map.IsLivePending(f.range)) continue;
      // One holding a newer dede's frames is not ours to remove.
      Result<std::unique_ptr<File>> pf = vol_->OpenFile(f.name);
      if (!pf.ok()) {
        // Held open by a reader or already gone: next time.
        if (pf.status().code() == Status::Code::kLocked ||
            pf.status().code() == Status::Code::kNotFound) {
          continue;
        }
        return pf.status();
      }
      ASSIGN_OR_RETURN(const bool newer, PendingHasNewerFrame(pf->get(), algo_, uuid_));
      pf->reset();
      if (newer) {
        LOG(kWarning) << "stale pending file '" << f.name
                      << "' holds frames of a newer format version; left alone";
        stats_.newer_format_left_alone++;
        continue;
      }
      RETURN_IF_ERROR(remove(f, &stats_.stale_files_removed));
    }
    for (const IndexFile& f : map.arenas) {
      if (slot.range.Contains(f.range.lo) && !map.IsLiveArena(f.range.lo)) {
        RETURN_IF_ERROR(remove(f, &stats_.stale_files_removed));
      }
    }
    const bool has_pending = map.IsPendingListed(slot.range);
    // A shard an earlier pass asked to see again (busy_parked_shards: an
    // arena punch held back leaves no pending file and no records) is
    // visited even when nothing new came for it.
    const bool asked_back = AskedBack(slot.range);
    if (end > *i || (!parking_ && (opts_.force || has_pending || asked_back))) {
      Result<bool> r = ProcessSlot(slot, has_pending, *i, end);
      if (!r.ok() || !*r) return r;
    }
    next_slot();
    return true;
  }

  // A shard range whose live version or pending file a newer dede wrote
  // is not updated: this pass's `records` for it are dropped (hints: only
  // an opportunity goes), nothing there is rewritten or removed.
  void LeaveNewerAlone(const ShardSlot& slot, const std::string& what, size_t records) {
    LOG(kWarning) << "index shard " << slot.range.ToString() << ": " << what
                  << " is of a newer format version than this dede supports; the range is left "
                     "alone ("
                  << records << " records of this pass dropped)";
    stats_.newer_format_left_alone++;
  }

  // The index files of a range (its shard versions, pending file and
  // arena) are written only by the holder of the range's shard lock. Every
  // other process that has one open while we hold that lock is a reader:
  // `dede stats`, fsck, or a dedupd summing up the volume after its own
  // pass (SummarizeSpace opens the arenas and pending files). A reader
  // holds the file for milliseconds, so the calls below give readers
  // kReaderGrace before they report the file busy; failing the pass at
  // the first kLocked made a pass that started while another host was
  // summing up fail outright (the three-host cross-dedup test, under load).
  static constexpr auto kReaderGrace = std::chrono::seconds(5);

  template <typename Fn>
  auto RetryWhileReaderHolds(Fn fn) -> decltype(fn()) {
    const auto deadline = std::chrono::steady_clock::now() + kReaderGrace;
    while (true) {
      auto r = fn();
      if (StatusOf(r).code() != Status::Code::kLocked ||
          std::chrono::steady_clock::now() >= deadline) {
        return r;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  static const Status& StatusOf(const Status& s) { return s; }
  template <typename T>
  static Status StatusOf(const Result<T>& r) {
    return r.status();
  }

  // The reference count of arena block `index` without waiting for another
  // host's group (File::TryBlockRefCount); nullopt, counted in
  // gc_checks_busy, when that group is held elsewhere: the caller leaves
  // its question for a later pass.
  Result<std::optional<uint32_t>> ArenaRefsIfFree(File* arena, uint64_t index) {
    Result<uint32_t> counted = arena->TryBlockRefCount(index);
    if (counted.ok()) return std::optional<uint32_t>(*counted);
    if (counted.status().code() != Status::Code::kLocked) return counted.status();
    stats_.gc_checks_busy++;
    return std::optional<uint32_t>();
  }

  // Opens (creating it if it does not exist) an index file of a range whose
  // shard lock we hold.
  Result<std::unique_ptr<File>> OpenOrCreate(const std::string& name, FileKind kind) {
    return RetryWhileReaderHolds([&]() -> Result<std::unique_ptr<File>> {
      Result<std::unique_ptr<File>> f = vol_->OpenFile(name);
      if (f.ok() || f.status().code() != Status::Code::kNotFound) return f;
      RETURN_IF_ERROR(vol_->Create(name, 0, kind).status());
      return vol_->OpenFile(name);
    });
  }

  // Removes an index file of a range whose shard lock we hold; one that
  // does not exist is fine.
  Status RemoveIndexFile(const std::string& name) {
    Status st = RetryWhileReaderHolds([&] { return vol_->Remove(name); });
    return st.code() == Status::Code::kNotFound ? Status::Ok() : st;
  }

  // One shard update (or deferral) with the shard's lock held. False: the
  // current version turned out incomplete and was removed; look again.
  Result<bool> ProcessSlot(const ShardSlot& slot, bool has_pending, size_t b, size_t e) {
    const uint64_t t0 = clock_->MonotonicNanos();
    parked_busy_.clear();
    parked_later_.clear();
    const std::string what = "index shard " + slot.range.ToString();
    Progress(what + ": " + std::to_string(e - b) + " records" + (parking_ ? " (parking)" : ""));
    std::unique_ptr<File> cur;
    std::unique_ptr<ShardReader> reader;
    if (slot.version != 0) {
      Result<std::unique_ptr<File>> opened = vol_->OpenFileById(slot.id);
      if (!opened.ok() && opened.status().code() == Status::Code::kLocked) {
        // A reader (stats, fsck, another host's map) has it for a moment.
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        return false;
      }
      if (!opened.ok()) return opened.status();
      cur = std::move(*opened);
      Result<std::unique_ptr<ShardReader>> r = ShardReader::Open(cur.get(), uuid_, what);
      if (!r.ok() && r.status().code() == Status::Code::kUnsupported) {
        LeaveNewerAlone(slot, "its live version '" + slot.name + "'", e - b);
        return true;
      }
      if (!r.ok()) {
        if (r.status().code() != Status::Code::kCorruption) return r.status();
        // An update that died before its header, or a damaged header: the
        // version is not usable. Its entries are hints; dropping them loses
        // dedup opportunities, never data (its arena blocks stay shared by
        // their files and are swept below when the range is rebuilt).
        LOG(kWarning) << what << ": " << r.status().message() << "; removing '" << slot.name
                      << "'";
        cur.reset();
        RETURN_IF_ERROR(RemoveIndexFile(slot.name));
        stats_.incomplete_versions_removed++;
        return false;
      }
      reader = std::move(*r);
    }
    // Pending records from passes that deferred this shard.
    std::unique_ptr<File> pending_file;
    std::vector<PendingRecord> pending;
    if (has_pending) {
      Result<std::unique_ptr<File>> pf =
          RetryWhileReaderHolds([&] { return vol_->OpenFile(PendingFileName(slot.range)); });
      if (pf.ok()) {
        pending_file = std::move(*pf);
        PendingScanStats ps;
        ASSIGN_OR_RETURN(pending, ReadPendingFile(pending_file.get(), algo_, uuid_, &ps,
                                                  "pending file of " + what));
        if (ps.newer_frame) {
          // Frames a newer dede parked: a rewrite would retire them with
          // the file, and frames appended behind them are never read here.
          LeaveNewerAlone(slot, "its pending file", e - b);
          return true;
        }
        if (ps.corrupt_frames) {
          // Nothing past a bad frame is ever read: cut the file there (as
          // fsck --repair does), or every record parked from now on would
          // be appended behind it and lost as well.
          const uint64_t good = pending_file->size() - ps.skipped_bytes;
          LOG(kWarning) << what << ": pending file has a bad frame; " << ps.skipped_bytes
                        << " bytes from byte " << good << " on are lost and cut off";
          RETURN_IF_ERROR(pending_file->Truncate(good));
        }
      } else if (pf.status().code() != Status::Code::kNotFound) {
        return pf.status();
      }
    }
    const uint64_t entries = reader ? reader->header().entry_count : 0;
    const uint64_t fresh = e - b;
    const bool busy_parked = revisiting_ || AskedBack(slot.range);
    if (parking_ || (!opts_.force && !busy_parked && entries > 0 &&
                     double(pending.size() + fresh) <= opts_.rewrite_fraction * double(entries))) {
      // Batching: not worth a rewrite yet. Park the records.
      if (fresh > 0) {
        std::vector<PendingRecord> park;
        park.reserve(fresh);
        for (size_t k = b; k < e; k++) {
          park.push_back(PendingRecord{records_[k].fp, files_[records_[k].file].info.id,
                                       records_[k].block});
        }
        if (!pending_file) {
          const std::string pname = PendingFileName(slot.range);
          ASSIGN_OR_RETURN(pending_file, OpenOrCreate(pname, FileKind::kIndexShard));
        }
        RETURN_IF_ERROR(AppendPendingFrame(pending_file.get(), park, algo_, uuid_));
        stats_.pending_records_written += fresh;
        if (parking_) stats_.records_parked_at_stop += fresh;
      }
      stats_.shards_deferred++;
      return true;
    }

    // The records to apply: this pass's, then the parked ones that this
    // pass's logs did not supersede.
    std::vector<PassRecord> recs(records_.begin() + long(b), records_.begin() + long(e));
    for (const PendingRecord& pr : pending) {
      const uint32_t fi = FileIndexOf(pr.file);
      if (fi == kNoFile) continue;
      // A block this pass's logs changed: the parked record is superseded
      // (but see TouchedThisPass: not on a revisit).
      if (TouchedThisPass(fi, pr.block)) continue;
      if (!slot.range.Contains(KeyPrefix(pr.fp))) continue;
      // Past the file's end (a file shrunk since the record was parked;
      // nothing shrinks a VM file today): a block op on it is kInvalid,
      // which would fail this shard's rewrite in every pass from now on.
      if (pr.block >= files_[fi].WholeBlocks()) continue;
      recs.push_back(PassRecord{pr.fp, pr.block, fi});
      stats_.pending_records_applied++;
    }
    std::sort(recs.begin(), recs.end(), RecordLess);
    recs.erase(std::unique(recs.begin(), recs.end(),
                           [](const PassRecord& x, const PassRecord& y) {
                             return x.fp == y.fp && x.file == y.file && x.block == y.block;
                           }),
               recs.end());

    bool split = reader && slot.range.depth < kMaxShardDepth &&
                 reader->header().update_ns > opts_.split_threshold_ms * 1'000'000ull &&
                 entries >= opts_.split_min_entries;
    if (split) {
      ASSIGN_OR_RETURN(split, SplitGroupsReady(cur.get(), slot));
      if (!split) stats_.splits_deferred_busy++;
    }
    const uint64_t new_version = slot.version + 1;
    std::vector<ShardRange> outs;
    if (split) {
      outs = {slot.range.Lower(), slot.range.Upper()};
      RETURN_IF_ERROR(LockShard(ShardLockId(outs[1])));
    } else {
      outs = {slot.range};
    }
    arena_punch_held_ = false;
    Status st = RewriteSlot(slot, cur.get(), std::move(reader), std::move(recs), outs,
                            new_version, t0);
    if (st.ok()) {
      if (split) stats_.shards_split++;
      stats_.shards_rewritten++;
      st = RetireAndPark(slot, &cur, &pending_file, outs);
    }
    // An arena punch held back: the shard's next rewrite sweeps the block;
    // dedupd's next pass rewrites the shard for it, whatever the batching
    // fraction says. (After RetireAndPark, which takes the shard out.)
    if (st.ok() && arena_punch_held_ && opts_.busy_parked_shards != nullptr) {
      opts_.busy_parked_shards->insert(slot.range.lo);
    }
    if (split) UnlockShard(ShardLockId(outs[1]));
    RETURN_IF_ERROR(st);
    return true;
  }

  // A split moves the references of the upper half's arena blocks to a
  // new arena (CloneBlock: a count increment in each block's allocation
  // group), and a clone never waits for another host here (issue 5): the
  // groups of the current version's upper-half Shared entries are taken
  // first, without waiting. False when one is held elsewhere: the shard is
  // rewritten unsplit this time and splits at a later update (its update
  // still takes too long), by when the holder has handed the group over
  // (TakeBlockGroup announced the want) and one of our flush points took
  // it. The blocks the rewrite itself makes Shared are in groups it has
  // just taken. (A flush point that hands a group over between this check
  // and the clone still makes that clone wait, bounded, as before.)
  Result<bool> SplitGroupsReady(File* cur, const ShardSlot& slot) {
    Result<std::unique_ptr<File>> arena = RetryWhileReaderHolds(
        [&] { return vol_->OpenFile(ArenaFileName(slot.range.lo)); });
    if (!arena.ok() && arena.status().code() == Status::Code::kNotFound) return true;
    if (!arena.ok()) return arena.status();
    ASSIGN_OR_RETURN(std::unique_ptr<ShardReader> reader,
                     ShardReader::Open(cur, uuid_, "index shard " + slot.range.ToString()));
    const ShardRange upper = slot.range.Upper();
    bool ready = true;
    uint64_t busy = 0, scanned = 0;
    IndexEntry en;
    while (true) {
      ASSIGN_OR_RETURN(const bool more, reader->Next(&en));
      if (!more) break;
      if ((++scanned & 1023) == 0) SettleIo();
      if (en.kind != EntryKind::kShared || !upper.Contains(KeyPrefix(en.fp))) continue;
      Status st = (*arena)->TakeBlockGroup(en.arena);
      if (st.code() == Status::Code::kLocked) {
        ready = false;
        // Each busy group is announced once; a few are enough to know
        // (and every announcement is a lock operation).
        if (++busy >= 8) break;
        continue;
      }
      RETURN_IF_ERROR(st);
    }
    return ready;
  }

  // After a shard update's new version is durable: retires the old version
  // and the pending file it consumed (one a reader holds this moment stays
  // stale until a later pass; its parked records are applied again then,
  // which is harmless), then parks the records held back because an
  // allocation group was busy elsewhere (parked_busy_) in the pending file
  // of the new range holding each. They go in after the retire, into a
  // file created afresh, so the retire cannot take them. A crash between
  // the two loses them: records are hints, and only an opportunity goes.
  // The caller holds the lock of every range in `outs`.
  Status RetireAndPark(const ShardSlot& slot, std::unique_ptr<File>* cur,
                       std::unique_ptr<File>* pending_file, const std::vector<ShardRange>& outs) {
    auto retire = [&](const std::string& name) -> Status {
      Status st = vol_->Remove(name);
      if (st.ok() || st.code() == Status::Code::kLocked || st.code() == Status::Code::kNotFound) {
        return Status::Ok();
      }
      return st;
    };
    if (*cur) {
      cur->reset();
      RETURN_IF_ERROR(retire(slot.name));
    }
    if (*pending_file) {
      pending_file->reset();
      RETURN_IF_ERROR(retire(PendingFileName(slot.range)));
    }
    SettleAskedBack(slot.range);
    for (const ShardRange& r : outs) {
      std::vector<PendingRecord> park;
      for (const PendingRecord& pr : parked_busy_) {
        if (r.Contains(KeyPrefix(pr.fp))) park.push_back(pr);
      }
      const bool revisit = !park.empty();
      const size_t busy_records = park.size();  // the rest: files given back
      for (const PendingRecord& pr : parked_later_) {
        if (r.Contains(KeyPrefix(pr.fp))) park.push_back(pr);
      }
      if (park.empty()) continue;
      // Pending files are opened only under their range's lock, which we
      // hold; a reader (stats, fsck) has one for a moment at most.
      const std::string pname = PendingFileName(r);
      Result<std::unique_ptr<File>> pf = OpenOrCreate(pname, FileKind::kIndexShard);
      if (!pf.ok()) {
        if (pf.status().code() != Status::Code::kLocked) return pf.status();
        LOG(kWarning) << "index shard " << r.ToString() << ": " << park.size()
                      << " records held back by a busy allocation group not parked ("
                      << pf.status().message() << ")";
        continue;
      }
      RETURN_IF_ERROR(AppendPendingFrame(pf->get(), park, algo_, uuid_));
      stats_.pending_records_written += park.size();
      // Records of files given back to a client waiting to open them are
      // not held back by a busy group: neither counted so nor a reason to
      // rewrite the shard at the next pass.
      stats_.records_parked_busy += busy_records;
      if (revisit) {
        if (opts_.busy_parked_shards != nullptr) opts_.busy_parked_shards->insert(r.lo);
        busy_parked_here_.insert(r.lo);
      }
    }
    parked_busy_.clear();
    parked_later_.clear();
    return Status::Ok();
  }

  Status RewriteSlot(const ShardSlot& slot, File* cur, std::unique_ptr<ShardReader> reader,
                     std::vector<PassRecord> recs, const std::vector<ShardRange>& outs,
                     uint64_t version, uint64_t t0) {
    // Arenas: the slot's own (inherited by the lower half of a split) and,
    // for a split, a fresh one for the upper half.
    std::vector<ArenaFile> arenas(outs.size());
    ASSIGN_OR_RETURN(arenas[0].f, OpenOrCreate(ArenaFileName(slot.range.lo), FileKind::kArena));
    arenas[0].next = reader ? reader->header().arena_next : 0;
    if (!reader) {
      // No usable version: whatever the arena holds is referenced by no
      // entry. Start it afresh (files keep their data; only the arena's
      // references go).
      arenas[0].f.reset();
      RETURN_IF_ERROR(RemoveIndexFile(ArenaFileName(slot.range.lo)));
      ASSIGN_OR_RETURN(arenas[0].f, OpenOrCreate(ArenaFileName(slot.range.lo), FileKind::kArena));
    }
    if (outs.size() == 2) {
      const std::string upper = ArenaFileName(outs[1].lo);
      RETURN_IF_ERROR(RemoveIndexFile(upper));  // a leftover of a split that died
      ASSIGN_OR_RETURN(arenas[1].f, OpenOrCreate(upper, FileKind::kArena));
    }
    // Nothing is planned on the files yet (the gather's I/O is paid here).
    RETURN_IF_ERROR(SettleIoGivingBack());
    std::vector<std::unique_ptr<File>> out_files;
    std::vector<std::unique_ptr<ShardWriter>> writers;
    for (const ShardRange& r : outs) {
      const std::string name = ShardFileName(r, version);
      RETURN_IF_ERROR(RemoveIndexFile(name));  // an incomplete leftover of the same name
      ASSIGN_OR_RETURN(FileId id, vol_->Create(name, 0, FileKind::kIndexShard));
      (void)id;
      ASSIGN_OR_RETURN(std::unique_ptr<File> f, vol_->OpenFile(name));
      RETURN_IF_ERROR(SettleIoGivingBack());  // a create reads the inode table
      ShardHeader proto;
      proto.range = r;
      proto.version = version;
      proto.algo = algo_;
      proto.created_ns = clock_->NowNanos();
      proto.host_id = vol_->host_id();
      writers.push_back(std::make_unique<ShardWriter>(vol_, f.get(), proto));
      out_files.push_back(std::move(f));
    }

    // Arena blocks named by the entries written (the lower arena's).
    std::vector<bool> arena_used;
    auto mark_used = [&](uint64_t idx) {
      if (idx >= arena_used.size()) arena_used.resize(idx + 1, false);
      arena_used[idx] = true;
    };
    auto emit = [&](IndexEntry& en) -> Status {
      const size_t w = outs.size() == 2 && outs[1].Contains(KeyPrefix(en.fp)) ? 1 : 0;
      if (en.kind == EntryKind::kShared) mark_used(en.arena);
      if (en.kind == EntryKind::kShared && w == 1) {
        // The upper half gets its own arena: move the reference. Never
        // waits for another host under the volume mutex: SplitGroupsReady
        // took the block's group, but a flush point of ours may have
        // handed it over since (someone announced a want). Held back
        // (kLocked, nothing changed), the entry is dropped: the files
        // keep sharing the block, only the index forgets it (a later
        // record of that content starts a new entry; a --rescan joins
        // the two), and the lower arena's reference goes with the
        // punches below.
        ASSIGN_OR_RETURN(uint64_t idx, arenas[1].Allocate());
        Volume::BlockOpsOptions no_wait;
        no_wait.no_wait = true;
        Status moved =
            vol_->CloneBlock(arenas[0].f.get(), en.arena, arenas[1].f.get(), idx, no_wait);
        arenas[0].to_punch.push_back(en.arena);
        if (moved.code() == Status::Code::kLocked) {
          arenas[1].Unallocate(idx);
          stats_.split_clones_busy++;
          return Status::Ok();
        }
        RETURN_IF_ERROR(moved);
        en.arena = idx;
      }
      stats_.entries_written++;
      return writers[w]->Add(en);
    };

    // Phase 1: the entries of the fingerprints that have records (one
    // merge-scan of the old version, nothing written).
    std::vector<Group> groups;
    {
      IndexEntry old;
      bool have_old = false;
      uint64_t skipped = 0;
      if (reader) {
        ASSIGN_OR_RETURN(have_old, reader->Next(&old));
      }
      for (size_t k = 0; k < recs.size();) {
        Group g;
        const FpKey key = recs[k].fp;
        while (have_old && old.fp < key) {
          ASSIGN_OR_RETURN(have_old, reader->Next(&old));
          if ((++skipped & 1023) == 0) SettleIo();
        }
        if (have_old && old.fp == key) {
          g.state = old;
          if (g.state->kind == EntryKind::kUnique && !UniqueStillValid(*g.state)) {
            g.state.reset();
            stats_.gc_unique_entries++;
          }
        }
        g.key = key;
        g.next = k;
        while (k < recs.size() && recs[k].fp == key) k++;
        g.end = k;
        groups.push_back(std::move(g));
      }
    }
    // Phase 2: the transitions, as batches of block operations in block
    // order (so the volume reads runs of neighbouring blocks).
    RETURN_IF_ERROR(ResolveGroups(&groups, recs, &arenas[0]));
    // Phase 3: the new version: every old entry (garbage collected) with
    // the resolved groups merged in, in fingerprint order.
    if (reader) {
      ASSIGN_OR_RETURN(reader, ShardReader::Open(cur, uuid_, "index shard " + slot.range.ToString()));
    }
    IndexEntry old;
    bool have_old = false;
    auto advance = [&]() -> Status {
      if (!reader) {
        have_old = false;
        return Status::Ok();
      }
      ASSIGN_OR_RETURN(have_old, reader->Next(&old));
      if (have_old && (++stats_.entries_scanned & 1023) == 0) SettleIo();
      return Status::Ok();
    };
    auto finish = [&](std::optional<IndexEntry> st) -> Status {
      if (st && st->kind == EntryKind::kShared) {
        // Garbage: an arena block no file refers to any more. Never waits
        // for another host's group (issue 5): unanswered, the entry stays
        // (it is true, or at worst names garbage until a later pass).
        ASSIGN_OR_RETURN(const std::optional<uint32_t> counted,
                         ArenaRefsIfFree(arenas[0].f.get(), st->arena));
        const uint32_t refs = counted.value_or(2);
        if (refs <= 1) {
          if (refs == 1) arenas[0].to_punch.push_back(st->arena);
          stats_.gc_arena_blocks++;
          st.reset();
        }
      }
      if (st) RETURN_IF_ERROR(emit(*st));
      return Status::Ok();
    };
    RETURN_IF_ERROR(advance());
    size_t gi = 0;
    uint64_t n = 0;
    while (have_old || gi < groups.size()) {
      if (gi < groups.size() && (!have_old || !(old.fp < groups[gi].key))) {
        // A resolved group (it replaces the old entry of its fingerprint).
        if (have_old && old.fp == groups[gi].key) RETURN_IF_ERROR(advance());
        RETURN_IF_ERROR(finish(groups[gi].state));
        gi++;
      } else {
        std::optional<IndexEntry> st = old;
        RETURN_IF_ERROR(advance());
        if (st->kind == EntryKind::kUnique && !UniqueStillValid(*st)) {
          st.reset();
          stats_.gc_unique_entries++;
        }
        RETURN_IF_ERROR(finish(st));
      }
      if (++n % 65536 == 0) {
        Progress(slot.range.ToString() + ": " + std::to_string(stats_.entries_scanned) +
                 " entries scanned");
      }
    }
    if (reader) {
      const ShardScanStats& ss = reader->stats();
      stats_.corrupt_shard_blocks += ss.corrupt_blocks;
      stats_.index_bytes_read += (1 + reader->header().entry_blocks +
                                  reader->header().file_blocks) * kBlockSize;
      if (ss.corrupt_blocks || ss.file_table_corrupt) {
        LOG(kWarning) << "index shard " << slot.range.ToString() << ": "
                      << ss.corrupt_blocks << " corrupt entry blocks skipped"
                      << (ss.file_table_corrupt ? ", file table corrupt" : "");
      }
    }
    const bool damaged = reader && (reader->stats().corrupt_blocks > 0 ||
                                    reader->stats().file_table_corrupt ||
                                    reader->stats().lost_entries > 0);
    // Arena blocks this version names or this rewrite punches.
    std::vector<bool> accounted = arena_used;
    uint64_t known = uint64_t(std::count(accounted.begin(), accounted.end(), true));
    for (uint64_t idx : arenas[0].to_punch) {
      if (idx >= accounted.size()) accounted.resize(idx + 1, false);
      if (!accounted[idx]) {
        accounted[idx] = true;
        known++;
      }
    }
    // A pass that died after making its version durable but before its
    // punches (below) left arena blocks no entry names: the arena maps more
    // blocks than are accounted for. One inode read tells; the sweep then
    // finds them.
    bool leaked = false;
    if (!damaged && !opts_.force) {
      ASSIGN_OR_RETURN(const FileInfo ai, arenas[0].f->Info());
      if (ai.mapped_blocks > known) {
        leaked = true;
        LOG(kInfo) << "index shard " << slot.range.ToString() << ": its arena maps "
                   << ai.mapped_blocks - known << " blocks no entry names (an update died "
                   << "before dropping them); sweeping";
      }
    }
    if (damaged || opts_.force || leaked) {
      // Sweep: arena blocks no entry names (their entries were lost with
      // a damaged block, or an update died before punching them) are only
      // the arena's references; drop them.
      // Up to the arena's end, not arena_next: an update that died after
      // cloning into new arena blocks left references past arena_next.
      const uint64_t arena_blocks = arenas[0].f->size() / kBlockSize;
      for (uint64_t i = 0; i < arena_blocks; i++) {
        if (i < accounted.size() && accounted[i]) continue;
        ASSIGN_OR_RETURN(const std::optional<uint32_t> counted,
                         ArenaRefsIfFree(arenas[0].f.get(), i));
        const uint32_t refs = counted.value_or(0);  // busy: swept by a later sweep
        if (refs > 0) {
          arenas[0].to_punch.push_back(i);
          stats_.arena_blocks_swept++;
        }
      }
    }
    const uint64_t took = clock_->MonotonicNanos() - t0;
    for (size_t w = 0; w < writers.size(); w++) {
      RETURN_IF_ERROR(writers[w]->Finish(arenas[w].next, took));
      stats_.index_bytes_written += writers[w]->bytes_written();
    }
    // The new versions are durable: drop the arena references they no
    // longer name. Never waiting for another host under the volume mutex
    // (a punch needs drop-list room, and a full list would be drained
    // waiting for groups held elsewhere): a punch held back leaves a
    // block no entry names, which the shard's next rewrite finds (its
    // arena maps more blocks than it accounts for) and sweeps; dedupd's
    // next pass rewrites the shard for it (busy_parked_shards).
    for (ArenaFile& a : arenas) {
      for (uint64_t idx : a.to_punch) {
        Status st = a.f->TryPunch(idx);
        if (st.code() == Status::Code::kLocked) {
          stats_.arena_punches_busy++;
          arena_punch_held_ = true;
          continue;
        }
        RETURN_IF_ERROR(st);
      }
    }
    return Status::Ok();
  }

  // Applies the records of the groups to their entries (the transitions),
  // then posts the merge requests they left for files held elsewhere: one
  // post per target file, before the shard's new version is written, so
  // the version's flush makes them durable with it.
  Status ResolveGroups(std::vector<Group>* groups, const std::vector<PassRecord>& recs,
                       ArenaFile* arena) {
    merge_posts_.clear();
    RETURN_IF_ERROR(ResolveRounds(groups, recs, arena));
    for (Group& g : *groups) {
      // Never made Shared: nothing to offer their holders.
      stats_.busy_targets += g.held_elsewhere.size();
      g.held_elsewhere.clear();
    }
    for (auto& [ino, post] : merge_posts_) {
      // The request file is held only for a moment by another poster or by
      // the target's holder applying it (every --merge-interval): retry for
      // up to ~2 s, then give up rather than wait on another host. Only
      // then: a clone that waited the volume's lock_wait (60 s) for a group
      // held elsewhere is kLocked too, and retrying that held the shard
      // lock for 40 minutes and posted the groups done before it again.
      MergePostOutcome outcome;
      Status st = PostMergeRequests(vol_, post.target, post.requests, arena->f.get(), &outcome);
      for (int attempt = 0; attempt < 40 && outcome.file_busy && !StopAsked() && !Cancelled();
           attempt++) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        st = PostMergeRequests(vol_, post.target, post.requests, arena->f.get(), &outcome);
      }
      stats_.merge_requests_posted += outcome.posted;
      if (st.ok()) continue;
      if (st.code() == Status::Code::kLocked) {
        // Held back: the request file stayed open elsewhere (another
        // poster, or the target's holder applying it, which holds it while
        // it verifies and shares every request: seconds on a slow LUN), or
        // a clone's source block's allocation group is held elsewhere
        // (posts never wait for it under the volume mutex). The entry is
        // Shared all the same. The requests not posted go into the shard's
        // pending file as records of their own, held back by a busy group
        // like any record parked so: the shard is revisited within this
        // pass after a pause (its revisits, 1.5 + 3 + 6 s by default), then
        // at dedupd's next pass; a revisit posts them again (a pass looks
        // at a file once, so G is still held elsewhere for it), and a
        // later pass that finds G free shares G:c with the entry itself.
        // Dropped, or left to the batching fraction, the opportunity
        // could be lost for good: the three-host cross-dedup test stopped
        // short of its exact figure by exactly the requests of one post.
        stats_.merge_posts_busy++;
        for (size_t i = outcome.posted; i < post.requests.size(); i++) {
          const MergeRequest& r = post.requests[i];
          parked_busy_.push_back(PendingRecord{KeyOf(r.witness), post.target, r.target_block});
        }
      } else if (st.code() == Status::Code::kCorruption) {
        LOG(kWarning) << "merge requests for inode " << ino << " not posted: " << st.message();
        stats_.merge_posts_busy++;
      } else {
        return st;
      }
    }
    merge_posts_.clear();
    return Status::Ok();
  }

  // Each round plans at most one anchor per group, then runs every planned
  // clone, each followed by the shares from its arena block (sorted by the
  // clone's source block), and the shares of Shared entries (sorted by
  // destination block), through Volume::ApplyBlockOps in batches. A group
  // whose anchor block turned out stale retries with its next record in
  // the following round.
  Status ResolveRounds(std::vector<Group>* groups, const std::vector<PassRecord>& recs,
                       ArenaFile* arena) {
    using Op = Volume::BlockOp;
    struct Planned {
      Op op;
      size_t group;
      size_t record;  // index into recs; kIndexed for the indexed block G:c
      uint64_t order_ino, order_block;
    };
    constexpr size_t kIndexed = ~size_t{0};
    while (true) {
      // Between rounds no planned operation holds a file handle.
      RETURN_IF_ERROR(GiveBackWantedFiles());
      // Reserved for the most a round can plan, so the vectors are not
      // copied as they grow (untouched reserved pages cost nothing).
      std::vector<Planned> clones, shares;
      clones.reserve(groups->size());
      shares.reserve(recs.size());
      for (size_t gi = 0; gi < groups->size(); gi++) {
        Group& g = (*groups)[gi];
        g.anchor_arena = kNoArena;
        g.target_busy = false;
        while (g.next < g.end) {
          const PassRecord& r = recs[g.next];
          PassFile* pf = &files_[r.file];
          if (!g.state) {
            g.state = IndexEntry{r.fp, EntryKind::kUnique, pf->info.id, r.block, 0};
            stats_.unique_added++;
            g.next++;
            continue;
          }
          IndexEntry& en = *g.state;
          Result<FileAccess::Handle> fh = Open(pf);
          if (!fh.ok()) {
            // A parked record of a file now held elsewhere (or gone).
            if (fh.status().code() == Status::Code::kLocked) {
              if (en.kind == EntryKind::kShared) {
                AskHolderToShare(r, en.arena);
              } else if (pf->given_back) {
                ParkBusy(r);
              } else {
                g.held_elsewhere.push_back(g.next);
              }
            } else if (fh.status().code() == Status::Code::kNotFound) {
              stats_.stale_records++;
            } else {
              return fh.status();
            }
            g.next++;
            continue;
          }
          if (en.kind == EntryKind::kShared) {
            // Shared: every record becomes a reference to the arena block.
            for (size_t j = g.next; j < g.end; j++) {
              Result<FileAccess::Handle> h = Open(&files_[recs[j].file]);
              if (!h.ok()) {
                if (h.status().code() == Status::Code::kLocked) {
                  AskHolderToShare(recs[j], en.arena);
                } else if (h.status().code() == Status::Code::kNotFound) {
                  stats_.stale_records++;
                } else {
                  return h.status();
                }
                continue;
              }
              shares.push_back({Op{Op::Kind::kShare, arena->f.get(), en.arena, h->file,
                                   recs[j].block, FingerprintOf(recs[j].fp, algo_), Status()},
                                gi, j, files_[recs[j].file].info.id.ino, recs[j].block});
            }
            g.next = g.end;
            break;
          }
          // Unique(G, c): a new arena block from this record's block (if it
          // still holds the fingerprint's content), shared with G:c and
          // with the other records. When G is held by another process or
          // host, G:c cannot be checked or repointed here: the arena block
          // is made all the same (from the record's own, verified block)
          // and G's holder gets a merge request for G:c (DeDe 3.3.2).
          if (en.file == pf->info.id && en.block == r.block) {
            g.next++;
            continue;
          }
          const uint32_t gfi = FileIndexOf(en.file);
          Result<FileAccess::Handle> gh = gfi == kNoFile
                                              ? Result<FileAccess::Handle>(Status::NotFound("gone"))
                                              : Open(&files_[gfi]);
          const bool indexed_whole =
              gfi != kNoFile && (en.block + 1) * kBlockSize <= files_[gfi].info.size;
          const bool target_busy =
              !gh.ok() && gh.status().code() == Status::Code::kLocked && indexed_whole;
          if (!target_busy && (!gh.ok() || !indexed_whole)) {
            if (!gh.ok() && gh.status().code() != Status::Code::kNotFound &&
                gh.status().code() != Status::Code::kLocked) {
              return gh.status();
            }
            // The indexed file is gone: the record is the hint now.
            en = IndexEntry{r.fp, EntryKind::kUnique, pf->info.id, r.block, 0};
            stats_.stale_entries++;
            g.next++;
            continue;
          }
          ASSIGN_OR_RETURN(uint64_t a, arena->Allocate());
          g.anchor_arena = a;
          g.anchor_record = g.next;
          g.target_busy = target_busy;
          const Fingerprint fp = FingerprintOf(r.fp, algo_);
          clones.push_back({Op{Op::Kind::kCloneIfHash, fh->file, r.block, arena->f.get(), a, fp,
                               Status()},
                            gi, g.next, pf->info.id.ino, r.block});
          if (!target_busy) {
            shares.push_back({Op{Op::Kind::kShare, arena->f.get(), a, gh->file, en.block, fp,
                                 Status()},
                              gi, kIndexed, en.file.ino, en.block});
          }
          for (size_t j = g.next + 1; j < g.end; j++) {
            Result<FileAccess::Handle> h = Open(&files_[recs[j].file]);
            if (!h.ok()) {
              // Held elsewhere: a merge request once this anchor makes
              // the entry Shared (AskHoldersOfTheRest), parked if its
              // group is, seen again if the anchor turns out stale. Given
              // back during this pass: parked now, since an anchor that
              // works ends the group.
              if (files_[recs[j].file].given_back) ParkBusy(recs[j]);
              continue;
            }
            shares.push_back({Op{Op::Kind::kShare, arena->f.get(), a, h->file, recs[j].block, fp,
                                 Status()},
                              gi, j, files_[recs[j].file].info.id.ino, recs[j].block});
          }
          break;
        }
      }
      if (clones.empty() && shares.empty()) return Status::Ok();
      // One sequence of operations, cut into batches: every clone
      // immediately followed by the shares from its arena block, clones in
      // the order of their source blocks; the shares of Shared entries in
      // the order of their destination blocks. A share right after its
      // clone finds the arena block's content already read in the batch
      // (the volume applies a batch in order and reads each block once),
      // so the anchor is read once, not once to clone it and again to
      // share it. Sort small keys, not the operations (each carries a
      // fingerprint and a Status).
      struct Key {
        uint64_t ino, block;
        size_t group;
        size_t at;  // < clones.size(): clones[at], else shares[at - clones.size()]
      };
      std::vector<size_t> clone_of(groups->size(), SIZE_MAX);
      for (size_t j = 0; j < clones.size(); j++) clone_of[clones[j].group] = j;
      std::vector<Key> order;
      order.reserve(clones.size() + shares.size());
      for (size_t j = 0; j < clones.size(); j++) {
        order.push_back({clones[j].order_ino, clones[j].order_block, clones[j].group, j});
      }
      for (size_t j = 0; j < shares.size(); j++) {
        const Planned& p = shares[j];
        const size_t c = clone_of[p.group];
        const Planned& by = c == SIZE_MAX ? p : clones[c];
        order.push_back({by.order_ino, by.order_block, p.group, clones.size() + j});
      }
      // Ties (a clone and its shares): the clone first (its index is lower).
      std::sort(order.begin(), order.end(), [](const Key& x, const Key& y) {
        if (x.ino != y.ino) return x.ino < y.ino;
        if (x.block != y.block) return x.block < y.block;
        if (x.group != y.group) return x.group < y.group;
        return x.at < y.at;
      });
      auto planned_at = [&](size_t at) -> Planned& {
        return at < clones.size() ? clones[at] : shares[at - clones.size()];
      };
      {
        // Never wait for an allocation group another host holds (issue 5):
        // what needs one comes back kLocked and is parked below.
        Volume::BlockOpsOptions no_wait;
        no_wait.no_wait = true;
        std::vector<Op> batch;
        std::vector<size_t> batched;  // order index of each batch entry
        batch.reserve(std::min(order.size(), opts_.batch_ops));
        batched.reserve(batch.capacity());
        std::set<uintptr_t> given_back;
        auto on = [&](const File* f) {
          return given_back.count(reinterpret_cast<uintptr_t>(f)) > 0;
        };
        for (size_t i = 0; i < order.size(); i += opts_.batch_ops) {
          const size_t e = std::min(order.size(), i + opts_.batch_ops);
          // A round can be long (every share of a common block): a waiting
          // client may take its disk back between batches (the settle
          // below). What was planned on that disk is skipped as busy
          // (kLocked: nothing changed), the same as a group held elsewhere.
          batch.clear();
          batched.clear();
          for (size_t j = i; j < e; j++) {
            Op& op = planned_at(order[j].at).op;
            if (on(op.src) || on(op.dst)) {
              op.result = Status::Locked("file given back to a client waiting to open it");
              continue;
            }
            batch.push_back(op);
            batched.push_back(j);
          }
          if (batch.empty()) continue;
          RETURN_IF_ERROR(vol_->ApplyBlockOps(&batch, opts_.verify, &read_buf_, no_wait));
          // What it gives back is skipped from the next batch on.
          RETURN_IF_ERROR(SettleIoGivingBack(&given_back));
          for (size_t k = 0; k < batch.size(); k++) {
            Op& done = batch[k];
            if (!done.result.ok() && done.result.code() != Status::Code::kMismatch &&
                done.result.code() != Status::Code::kLocked) {
              return done.result;
            }
            Op& op = planned_at(order[batched[k]].at).op;
            op.result = std::move(done.result);
            op.changed = done.changed;
          }
        }
      }
      // A share from a failed anchor found a hole (kMismatch, nothing
      // changed): it does not count; its record gets its turn again. One
      // from an anchor held back (kLocked) was held back with it: the
      // group's records are parked below.
      std::vector<bool> anchored(groups->size(), true);
      for (const Planned& c : clones) anchored[c.group] = c.op.result.ok();
      shares.erase(std::remove_if(shares.begin(), shares.end(),
                                  [&](const Planned& p) { return !anchored[p.group]; }),
                   shares.end());

      // Outcomes. kLocked: nothing changed for that operation, and it is
      // no failure: its record is parked for a later pass (ParkBusy).
      std::vector<uint64_t> shared_with(groups->size(), 0);
      std::vector<bool> indexed_ok(groups->size(), false);
      std::vector<bool> indexed_busy(groups->size(), false);
      for (const Planned& p : shares) {
        Group& g = (*groups)[p.group];
        const bool busy = p.op.result.code() == Status::Code::kLocked;
        if (p.record == kIndexed) {
          indexed_ok[p.group] = p.op.result.ok();
          indexed_busy[p.group] = busy;
          shared_with[p.group] += p.op.result.ok();
          stats_.indexed_shared += p.op.result.ok() && p.op.changed;
          continue;
        }
        if (busy) {
          ParkBusy(recs[p.record]);
          continue;
        }
        if (p.op.result.ok()) {
          shared_with[p.group]++;
          if (p.op.changed) {
            stats_.shared_hits++;
          } else {
            stats_.already_shared++;
          }
          continue;
        }
        if (g.anchor_arena == kNoArena && g.state->kind == EntryKind::kShared) {
          // (A group held elsewhere leaves the question open: the record
          // counts as stale, the entry stays.)
          ASSIGN_OR_RETURN(const std::optional<uint32_t> counted,
                           ArenaRefsIfFree(arena->f.get(), g.state->arena));
          const uint32_t refs = counted.value_or(1);
          if (refs == 0) {
            // The arena block is gone (a damaged or lost index version):
            // the entry names nothing; the record becomes the hint.
            const PassRecord& r = recs[p.record];
            g.state = IndexEntry{r.fp, EntryKind::kUnique, files_[r.file].info.id, r.block, 0};
            stats_.stale_entries++;
            continue;
          }
        }
        stats_.stale_records++;
      }
      for (const Planned& c : clones) {
        Group& g = (*groups)[c.group];
        if (c.op.result.code() == Status::Code::kLocked) {
          // The anchor's block is in a group held elsewhere (or its clone
          // depended on one that was): nothing was cloned, the entry stays
          // as it is, and this fingerprint is left alone for the rest of
          // the pass (another anchor would most likely meet the same
          // group, round after round): its records from the anchor on are
          // parked, and so are those of files held elsewhere met before
          // (they get merge requests once a later pass makes the entry
          // Shared; dropped, they were lost for good).
          arena->Unallocate(g.anchor_arena);
          ParkHeldElsewhere(&g, recs);
          for (size_t j = g.anchor_record; j < g.end; j++) {
            Result<FileAccess::Handle> h = Open(&files_[recs[j].file]);
            if (h.ok()) {
              ParkBusy(recs[j]);
            } else if (h.status().code() == Status::Code::kLocked) {
              if (!IsIndexedBlock(recs[j], *g.state)) ParkBusy(recs[j]);
            } else if (h.status().code() == Status::Code::kNotFound) {
              stats_.stale_records++;
            } else {
              return h.status();
            }
          }
          g.next = g.end;
          continue;
        }
        if (!c.op.result.ok()) {
          // The record's block changed since it was logged: try the next.
          stats_.stale_records++;
          arena->Unallocate(g.anchor_arena);
          g.next = g.anchor_record + 1;
          continue;
        }
        const PassRecord& ar = recs[g.anchor_record];
        if (g.target_busy) {
          // The arena block holds the record's verified content: the entry
          // is Shared now, whatever G:c turns out to hold. G's holder
          // verifies G:c against the fingerprint when it applies the
          // request; a stale G:c just fails there.
          const IndexEntry indexed = *g.state;
          MergePost& post = merge_posts_[indexed.file.ino];
          post.target = indexed.file;
          post.requests.push_back(
              MergeRequest{indexed.block, FingerprintOf(ar.fp, algo_), g.anchor_arena});
          g.state = IndexEntry{ar.fp, EntryKind::kShared, FileId{}, 0, g.anchor_arena};
          stats_.shared_new++;
          AskHoldersOfTheRest(&g, recs, indexed);
        } else if (shared_with[c.group] == 0 && indexed_busy[c.group]) {
          // Only the indexed block G:c could have shared the arena block,
          // and its group is held elsewhere: undo the clone (the arena's
          // reference is dropped; never waited for), keep Unique(G, c) and
          // park the anchor's record, so a later pass tries again, and
          // the group's records of files held elsewhere with it.
          RETURN_IF_ERROR(UndoAnchor(arena, g.anchor_arena));
          ParkBusy(ar);
          AddHeldAfterAnchor(&g, recs);
          ParkHeldElsewhere(&g, recs);
        } else if (shared_with[c.group] == 0) {
          // Nothing else holds this content any more: the indexed block is
          // stale, and the anchor becomes the hint (not shared with the
          // arena, so it keeps being written in place).
          RETURN_IF_ERROR(UndoAnchor(arena, g.anchor_arena));
          g.state = IndexEntry{ar.fp, EntryKind::kUnique, files_[ar.file].info.id, ar.block, 0};
          stats_.stale_entries++;
        } else {
          if (indexed_busy[c.group]) {
            // Shared without G:c, whose group is held elsewhere: the entry
            // claims only what is true (the arena block holds the content);
            // G:c is parked as a record of its own, shared with the arena
            // block by a later pass.
            ParkBusy(PassRecord{g.key, g.state->block, FileIndexOf(g.state->file)});
          } else if (!indexed_ok[c.group]) {
            stats_.stale_entries++;
          }
          const IndexEntry indexed = *g.state;
          g.state = IndexEntry{ar.fp, EntryKind::kShared, FileId{}, 0, g.anchor_arena};
          stats_.shared_new++;
          AskHoldersOfTheRest(&g, recs, indexed);
        }
        g.next = g.end;
      }
    }
  }

  // Takes back the arena block `idx` of an anchor no record shared (its
  // clone's reference dropped). Never waits under the volume mutex: a
  // punch held back (a full drop list that cannot be drained without
  // waiting) is punched with the rewrite's others, after the new version
  // is durable (it names no entry there), or, held back again, swept by
  // a later rewrite; its index is not given back meanwhile.
  Status UndoAnchor(ArenaFile* arena, uint64_t idx) {
    Status st = arena->f->TryPunch(idx);
    if (st.code() == Status::Code::kLocked) {
      arena->to_punch.push_back(idx);
      return Status::Ok();
    }
    RETURN_IF_ERROR(st);
    arena->Unallocate(idx);
    return Status::Ok();
  }

  // Keeps a record whose share or clone was held back (an allocation group
  // busy elsewhere) for a later pass: RetireAndPark writes it into the
  // pending file of its shard once the shard's new version is durable.
  void ParkBusy(const PassRecord& r) {
    if (r.file == kNoFile) return;
    // A record of a file given back during this pass waits for a later
    // pass: a revisit within this one would only find the file held again.
    std::vector<PendingRecord>& to = files_[r.file].given_back ? parked_later_ : parked_busy_;
    to.push_back(PendingRecord{r.fp, files_[r.file].info.id, r.block});
  }
  // A record of a file held elsewhere (kLocked) against a Shared entry:
  // only the file's holder may read or repoint its blocks, so it gets a
  // merge request for the record's block, with a clone of the entry's
  // arena block `arena_idx` (DeDe 3.3.2), as the indexed block G:c of a
  // Unique entry does when the entry becomes Shared. A pass gathers the
  // logs of the files it can open only, so such records were parked: a
  // merge request whose post was held back (its request file open
  // elsewhere for longer than the post's retries), a share held back by
  // a busy group before the file's holder took it. Skipped, they were
  // lost for good: the holder's own passes never see them again (the
  // three-host cross-dedup test stopped short of its exact figure by the
  // 74 blocks of one post held back). The holder verifies the block
  // against the record's fingerprint and byte-compares it with the clone
  // before it shares; a stale record costs a failed share there. A file
  // given back during this pass is parked for a later pass instead (its
  // new holder may be this host again).
  // (Should the arena block have gone meanwhile, a damaged or lost index
  // version, the request clones a hole and the holder counts it as a
  // failed verification; the rewrite drops the entry.)
  void AskHolderToShare(const PassRecord& r, uint64_t arena_idx) {
    if (r.file == kNoFile) return;
    const PassFile& pf = files_[r.file];
    if (pf.given_back) {
      ParkBusy(r);
      return;
    }
    if (!pf.info.dedup || (r.block + 1) * kBlockSize > pf.info.size) {
      stats_.stale_records++;  // the holder would find it stale
      return;
    }
    MergePost& post = merge_posts_[pf.info.id.ino];
    post.target = pf.info.id;
    post.requests.push_back(MergeRequest{r.block, FingerprintOf(r.fp, algo_), arena_idx});
  }
  // After the anchor of a Unique entry `indexed` made it Shared: the
  // group's other records of files held elsewhere (planning skipped them:
  // there was no arena block yet) get their merge requests; a record of
  // the indexed block itself has had its own already, if G is held
  // elsewhere.
  void AskHoldersOfTheRest(Group* g, const std::vector<PassRecord>& recs,
                           const IndexEntry& indexed) {
    AddHeldAfterAnchor(g, recs);
    for (size_t j : g->held_elsewhere) {
      if (!IsIndexedBlock(recs[j], indexed)) AskHolderToShare(recs[j], g->anchor_arena);
    }
    g->held_elsewhere.clear();
  }
  // Adds to held_elsewhere the group's records after its anchor whose
  // files are held elsewhere (planning skipped them; those given back
  // during this pass were parked when planned).
  void AddHeldAfterAnchor(Group* g, const std::vector<PassRecord>& recs) {
    for (size_t j = g->anchor_record + 1; j < g->end; j++) {
      PassFile& pf = files_[recs[j].file];
      Result<FileAccess::Handle> h = Open(&pf);
      if (!h.ok() && h.status().code() == Status::Code::kLocked && !pf.given_back) {
        g->held_elsewhere.push_back(j);
      }
    }
  }
  // Whether `r` is the block a Unique entry names (G:c itself).
  bool IsIndexedBlock(const PassRecord& r, const IndexEntry& en) const {
    return en.kind == EntryKind::kUnique && files_[r.file].info.id == en.file &&
           r.block == en.block;
  }
  // A group parked for a busy allocation group keeps the records of files
  // held elsewhere met before its anchor too (the indexed block G:c aside:
  // the entry keeps naming it).
  void ParkHeldElsewhere(Group* g, const std::vector<PassRecord>& recs) {
    for (size_t j : g->held_elsewhere) {
      if (!IsIndexedBlock(recs[j], *g->state)) ParkBusy(recs[j]);
    }
    g->held_elsewhere.clear();
  }

  Volume* vol_;
  FileAccess* access_;
  DedupOptions opts_;
  const RescanCursor rescan_from_;
  RescanCursor rescan_next_;  // where the next round starts, unless rescan_done_
  bool rescan_done_ = false;
  Clock* clock_;
  static constexpr uint64_t kGiveBackEveryNs = 1'000'000'000;
  uint64_t next_give_back_ns_ = 0;  // GiveBackWantedFiles looks again from then
  const Uuid uuid_;
  const HashAlgo algo_;
  Fingerprint zero_fp_;
  FpKey zero_key_{};
  std::vector<Volume::BlockOp> zero_ops_;  // punches of zero blocks, batched
  // While a log is gathered: its blocks whose punches were held back.
  bool relog_zeros_ = false;
  std::vector<uint64_t> zero_held_;
  // Every batch of the pass reads into this (Volume::ReadBuffer: pages
  // touched before are much cheaper to read into and compare).
  Volume::ReadBuffer read_buf_;
  std::unordered_map<uint64_t, FileInfo> by_ino_;
  // A deque: a PassFile* stays valid while FileIndex adds files (a
  // vector's growth left ResolveRounds reading a freed PassFile after it
  // looked up an indexed file the pass had not met yet).
  std::deque<PassFile> files_;
  std::unordered_map<uint64_t, uint32_t> file_index_;
  std::vector<PassRecord> records_;
  // The logs this pass consumes (held open, so no one appends meanwhile)
  // and what goes back into each once it is truncated.
  struct ConsumedLog {
    std::unique_ptr<File> file;
    MonitorBatch deferred;  // records and ranges younger than stable_after
  };
  std::vector<ConsumedLog> logs_;
  uint64_t young_after_ns_ = 0;  // records written after this are young
  bool parking_ = false;         // stopping: park records, merge nothing
  bool sweep_for_opt_out_ = false;  // a dedup=off file's log was gathered
  std::vector<uint8_t> buf_;
  // Merge requests of the shard update in progress, by target inode.
  struct MergePost {
    FileId target;
    std::vector<MergeRequest> requests;
  };
  std::map<uint64_t, MergePost> merge_posts_;
  // Records of the shard update in progress held back by a busy group
  // (revisited within this pass), and those of files given back during it
  // (left to a later pass).
  std::vector<PendingRecord> parked_busy_;
  std::vector<PendingRecord> parked_later_;
  // Shards (range lo) that parked records held back by a busy group during
  // this pass, and whether RevisitBusyShards is rewriting them now.
  std::set<uint64_t> busy_parked_here_;
  // The shard update in progress held back an arena punch (TryPunch).
  bool arena_punch_held_ = false;
  bool revisiting_ = false;
  bool swept_all_ = false;
  uint64_t rehashed_ = 0;
  DedupStats stats_;
};

}  // namespace

Result<DedupStats> RunDedupPass(Volume* vol, FileAccess* access, const DedupOptions& opts) {
  DedupStats total;
  DedupOptions round_opts = opts;
  RescanCursor rescan_from;
  uint64_t left_before = 0;
  while (true) {
    // Every round is a pass of its own (see Pass::Rescan: merging twice
    // within one pass would take the first merge's entries for stale).
    Pass pass(vol, access, round_opts, rescan_from);
    ASSIGN_OR_RETURN(DedupStats st, pass.Run());
    total.Add(st);
    total.rounds++;
    if (st.stopped) break;
    const bool rescan_more = round_opts.rescan && !pass.rescan_done();
    if (!rescan_more) {
      if (st.logs_left_over == 0) break;
      // Each round must get further: one that re-read only what earlier
      // rounds left in their logs (rehashes past its budget) leaves the
      // rest to the next pass instead of going round again. (A rescan
      // round always gets further: it reads at least one run of blocks.)
      if (total.rounds > 1 && st.logs_left_over >= left_before) break;
    }
    left_before = st.logs_left_over;
    // The next round reads the logs this one left (and what was left of
    // the ones it read: their deferred records), and rescans from where
    // this one stopped. The sweep was done.
    round_opts.force = false;
    if (rescan_more) {
      rescan_from = pass.rescan_next();
    } else {
      round_opts.rescan = false;
    }
  }
  return total;
}

namespace {

constexpr DedupCounter kDedupCounters[] = {
    {"logs_consumed", &DedupStats::logs_consumed},
    {"files_busy", &DedupStats::files_busy},
    {"files_dedup_off", &DedupStats::files_dedup_off},
    {"orphan_logs_removed", &DedupStats::orphan_logs_removed},
    {"log_records", &DedupStats::log_records},
    {"log_corrupt_frames", &DedupStats::log_corrupt_frames},
    {"log_dropped_records", &DedupStats::log_dropped_records},
    {"logs_saturated", &DedupStats::logs_saturated},
    {"logs_over_budget", &DedupStats::logs_over_budget},
    {"blocks_rehashed", &DedupStats::blocks_rehashed},
    {"files_rescanned", &DedupStats::files_rescanned},
    {"zero_blocks_freed", &DedupStats::zero_blocks_freed},
    {"zero_blocks_busy", &DedupStats::zero_blocks_busy},
    {"arena_punches_busy", &DedupStats::arena_punches_busy},
    {"split_clones_busy", &DedupStats::split_clones_busy},
    {"unique_added", &DedupStats::unique_added},
    {"shared_new", &DedupStats::shared_new},
    {"shared_hits", &DedupStats::shared_hits},
    {"indexed_shared", &DedupStats::indexed_shared},
    {"already_shared", &DedupStats::already_shared},
    {"stale_records", &DedupStats::stale_records},
    {"stale_entries", &DedupStats::stale_entries},
    {"busy_targets", &DedupStats::busy_targets},
    {"records_parked_busy", &DedupStats::records_parked_busy},
    {"shards_revisited", &DedupStats::shards_revisited},
    {"merge_requests_posted", &DedupStats::merge_requests_posted},
    {"merge_posts_busy", &DedupStats::merge_posts_busy},
    {"merge_requests_applied", &DedupStats::merge_requests_applied},
    {"merge_requests_failed_verification", &DedupStats::merge_requests_failed_verification},
    {"merge_requests_busy", &DedupStats::merge_requests_busy},
    {"merge_requests_stale", &DedupStats::merge_requests_stale},
    {"merge_corrupt_groups", &DedupStats::merge_corrupt_groups},
    {"merge_files_removed", &DedupStats::merge_files_removed},
    {"gc_arena_blocks", &DedupStats::gc_arena_blocks},
    {"gc_unique_entries", &DedupStats::gc_unique_entries},
    {"arena_blocks_swept", &DedupStats::arena_blocks_swept},
    {"gc_checks_busy", &DedupStats::gc_checks_busy},
    {"shards_rewritten", &DedupStats::shards_rewritten},
    {"shards_deferred", &DedupStats::shards_deferred},
    {"shards_split", &DedupStats::shards_split},
    {"splits_deferred_busy", &DedupStats::splits_deferred_busy},
    {"shard_waits", &DedupStats::shard_waits},
    {"pending_records_written", &DedupStats::pending_records_written},
    {"pending_records_applied", &DedupStats::pending_records_applied},
    {"entries_scanned", &DedupStats::entries_scanned},
    {"entries_written", &DedupStats::entries_written},
    {"index_bytes_read", &DedupStats::index_bytes_read},
    {"index_bytes_written", &DedupStats::index_bytes_written},
    {"corrupt_shard_blocks", &DedupStats::corrupt_shard_blocks},
    {"incomplete_versions_removed", &DedupStats::incomplete_versions_removed},
    {"stale_files_removed", &DedupStats::stale_files_removed},
    {"newer_format_left_alone", &DedupStats::newer_format_left_alone},
    {"files_given_back", &DedupStats::files_given_back},
    {"records_parked_at_stop", &DedupStats::records_parked_at_stop},
    {"young_records_deferred", &DedupStats::young_records_deferred},
    {"young_ranges_deferred", &DedupStats::young_ranges_deferred},
    {"rehash_ranges_deferred", &DedupStats::rehash_ranges_deferred},
};

// Everything in DedupStats that is not in kDedupCounters: rounds,
// logs_left_over, shard_lock_ns, shard_lock_spans, the span list and its
// count, `stopped` (padded to 8 bytes) and the three times. A new member
// changes the size: add it to the list above, or here if it is not summed.
static_assert(sizeof(DedupStats) == sizeof(uint64_t) * (std::size(kDedupCounters) + 2 + 2 + 1 + 3) +
                                        sizeof(size_t) + sizeof(DedupStats::shard_span_list),
              "DedupStats has a member kDedupCounters does not list");

}  // namespace

std::span<const DedupCounter> DedupCounters() {
  return kDedupCounters;
}

void DedupStats::Add(const DedupStats& o) {
  // The spans kept are counted in the totals already: add the totals, then
  // the kept spans' list only.
  const uint64_t lock_ns = shard_lock_ns + o.shard_lock_ns;
  const uint64_t lock_spans = shard_lock_spans + o.shard_lock_spans;
  for (const ShardSpan& span : o.shard_spans()) AddShardSpan(span.start_ns, span.end_ns);
  shard_lock_ns = lock_ns;
  shard_lock_spans = lock_spans;
  stopped = stopped || o.stopped;
  logs_left_over = o.logs_left_over;
  for (const DedupCounter& c : kDedupCounters) this->*c.field += o.*c.field;
  gather_ns += o.gather_ns;
  merge_ns += o.merge_ns;
  total_ns += o.total_ns;
}

Result<MergeApplyStats> ApplyMergeRequestsForHeldFiles(
    Volume* vol, FileAccess* access, VerifyMode verify,
    const std::function<bool(const FileInfo&)>& wanted) {
  ASSIGN_OR_RETURN(std::vector<FileInfo> all, vol->List());
  return ApplyMergeRequestsIn(vol, access, verify, all, wanted);
}

}  // namespace dede
