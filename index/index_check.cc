#include "index/index_check.h"

#include <algorithm>
#include <bit>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <unordered_map>

#include "index/shard_format.h"
#include "index/shard_io.h"
#include "index/shard_map.h"
#include "kmod/writemon/write_log.h"

namespace dede {

namespace {

constexpr uint64_t kChunkBlocks = 256;       // 1 MiB reads
constexpr uint64_t kMaxBlockProblems = 16;   // per file; the rest summarized

bool Busy(const Status& s) { return s.code() == Status::Code::kLocked; }
bool Gone(const Status& s) { return s.code() == Status::Code::kNotFound; }

// The decoders prefix their messages with `what` and the block; the report
// carries those in `where`.
std::string Reason(const Status& s, const std::string& prefix) {
  const std::string& m = s.message();
  size_t at = 0;
  if (m.rfind(prefix, 0) == 0) {
    at = prefix.size();
    const size_t colon = m.find(": ", at);
    if (colon != std::string::npos) at = colon + 2;
  }
  return m.substr(at);
}

std::string AtBlock(const std::string& name, uint64_t block) {
  return name + " block " + std::to_string(block);
}

// The live slot starting exactly at lo with a real version, if any.
const ShardSlot* RealSlotAt(const ShardMap& m, uint64_t lo) {
  for (const ShardSlot& s : m.live) {
    if (s.range.lo == lo && s.version != 0) return &s;
  }
  return nullptr;
}

class Checker {
 public:
  Checker(Volume* vol, bool repair, std::function<void()> before_repair)
      : vol_(vol),
        repair_(repair),
        before_repair_(std::move(before_repair)),
        uuid_(vol->superblock().uuid),
        algo_(vol->superblock().hash_algo) {}

  Result<IndexCheckReport> Run() {
    ASSIGN_OR_RETURN(std::vector<FileInfo> files, vol_->List());
    for (const FileInfo& fi : files) by_ino_[fi.id.ino] = fi;
    ASSIGN_OR_RETURN(const ShardMap map, LoadShardMap(vol_));

    for (const ShardSlot& s : map.live) {
      if (s.version == 0) continue;
      RETURN_IF_ERROR(CheckShard(s));
    }
    for (const IndexFile& f : map.incomplete) {
      AddStale(f, "shard version " + std::to_string(f.version) + " of " + f.range.ToString() +
                      " is incomplete or its header is damaged (an update that died, or "
                      "damage); it hides nothing and the next pass or --repair removes it");
    }
    for (const IndexFile& f : map.stale_shards) {
      if (map.IsNewer(f.name)) {
        report_.newer.push_back(f.name);
        continue;
      }
      AddStale(f, "shard version " + std::to_string(f.version) + " of " + f.range.ToString() +
                      " is superseded (left by an update that did not finish cleaning up)");
    }
    for (const IndexFile& f : map.pending) {
      if (!map.IsLivePending(f.range)) {
        ASSIGN_OR_RETURN(const bool newer, PendingIsNewer(f));
        if (newer) {
          report_.newer.push_back(f.name);
          continue;
        }
        AddStale(f, "pending records of " + f.range.ToString() +
                        ", which is not a live shard (its records were applied before the "
                        "range changed)");
        continue;
      }
      RETURN_IF_ERROR(CheckPending(f));
    }
    for (const IndexFile& f : map.arenas) {
      // A damaged version's arena goes with the version (see Repair).
      if (RealSlotAt(map, f.range.lo) != nullptr) continue;
      // Held open: an update is writing this range right now.
      Result<std::unique_ptr<File>> a = vol_->OpenFile(f.name);
      if (!a.ok()) {
        if (Gone(a.status())) continue;
        if (Busy(a.status())) {
          report_.busy.push_back(f.name);
          continue;
        }
        return a.status();
      }
      AddStale(f, "arena of a range with no usable shard version (" +
                      std::to_string(f.mapped_blocks) +
                      " block references no entry names; files keep their data)");
    }
    RETURN_IF_ERROR(CheckWriteLogs(files));
    if (repair_) {
      if (before_repair_) before_repair_();
      RETURN_IF_ERROR(Repair());
    }
    return std::move(report_);
  }

 private:
  struct Action {
    enum class Op { kRemoveVersion, kRemoveStale, kCutPending } op;
    std::string name;
    FileId id;                       // the file the check found under `name`
    uint64_t lo = 0;
    uint64_t cut_block = 0;          // kCutPending
    std::vector<size_t> problems;    // indexes into report_.problems
  };

  size_t Add(IndexProblem::Kind kind, const std::string& file, const std::string& where,
             const std::string& what) {
    IndexProblem p;
    p.kind = kind;
    p.file = file;
    p.where = where;
    p.what = what;
    report_.problems.push_back(std::move(p));
    return report_.problems.size() - 1;
  }

  Action* ActionFor(Action::Op op, const std::string& name, FileId id, uint64_t lo) {
    for (Action& a : actions_) {
      if (a.name == name) return &a;
    }
    actions_.push_back(Action{op, name, id, lo, 0, {}});
    return &actions_.back();
  }

  void AddStale(const IndexFile& f, const std::string& what) {
    const size_t p = Add(IndexProblem::Kind::kStaleFile, f.name, f.name, "stale: " + what);
    ActionFor(Action::Op::kRemoveStale, f.name, f.id, f.range.lo)->problems.push_back(p);
  }

  void AddShardDamage(const ShardSlot& s, const std::string& where, const std::string& what) {
    const size_t p = Add(IndexProblem::Kind::kShardDamaged, s.name, where, what);
    ActionFor(Action::Op::kRemoveVersion, s.name, s.id, s.range.lo)->problems.push_back(p);
    damaged_.insert(s.name);
  }

  // ------------------------------------------------------------ shards

  Status CheckShard(const ShardSlot& s) {
    Result<std::unique_ptr<File>> opened = vol_->OpenFile(s.name);
    if (!opened.ok()) {
      if (Gone(opened.status())) return Status::Ok();
      if (Busy(opened.status())) {
        report_.busy.push_back(s.name);
        return Status::Ok();
      }
      return opened.status();
    }
    File* f = opened->get();
    const FileId id = f->id();
    const std::string& name = s.name;
    const uint64_t size = f->size();
    std::vector<uint8_t> blk(kBlockSize);
    if (size >= kBlockSize) {
      RETURN_IF_ERROR(f->Read(0, blk.data(), kBlockSize));
      if (DecodeShardHeader(blk.data(), uuid_, id, name).status().code() ==
          Status::Code::kUnsupported) {
        report_.newer.push_back(name);
        return Status::Ok();
      }
    }
    report_.shards_checked++;
    if (size < kBlockSize) {
      AddShardDamage(s, AtBlock(name, 0),
                     "incomplete shard version: " + std::to_string(size) +
                         " bytes, shorter than its header (an update that died?)");
      return Status::Ok();
    }
    Result<ShardHeader> hr = DecodeShardHeader(blk.data(), uuid_, id, name);
    if (!hr.ok()) {
      AddShardDamage(s, AtBlock(name, 0),
                     "bad or incomplete header (" + Reason(hr.status(), name) +
                         "): the version is unusable");
      return Status::Ok();
    }
    const ShardHeader h = *hr;
    if (!(h.range == s.range) || h.version != s.version) {
      AddShardDamage(s, AtBlock(name, 0),
                     "header describes " + h.range.ToString() + " version " +
                         std::to_string(h.version) + ", the file name " + s.range.ToString() +
                         " version " + std::to_string(s.version));
      return Status::Ok();
    }
    const uint64_t blocks = 1 + h.entry_blocks + h.file_blocks;
    if (size < blocks * kBlockSize) {
      const uint64_t have = size / kBlockSize;
      AddShardDamage(s, AtBlock(name, have),
                     "truncated: the file is " + std::to_string(size) + " bytes, its header needs " +
                         std::to_string(blocks * kBlockSize) + " (blocks " +
                         std::to_string(have) + ".." + std::to_string(blocks - 1) + " missing)");
      return Status::Ok();
    }

    // File table.
    std::vector<FileId> table;
    bool table_ok = true;
    if (h.file_blocks > 0) {
      std::vector<uint8_t> ft(h.file_blocks * kBlockSize);
      RETURN_IF_ERROR(f->Read((1 + h.entry_blocks) * kBlockSize, ft.data(), ft.size()));
      for (uint64_t i = 0; i < h.file_blocks; i++) {
        const uint64_t index = 1 + h.entry_blocks + i;
        Status st = DecodeFileTableBlock(ft.data() + i * kBlockSize, uuid_, id, index, &table, name);
        if (!st.ok()) {
          AddShardDamage(s, AtBlock(name, index),
                         "corrupt file table block (" + Reason(st, name) +
                             "): its Unique entries cannot be resolved");
          table_ok = false;
          break;
        }
      }
      if (table_ok && table.size() != h.file_count) {
        AddShardDamage(s, AtBlock(name, 1 + h.entry_blocks),
                       "file table holds " + std::to_string(table.size()) +
                           " files, the header says " + std::to_string(h.file_count));
        table_ok = false;
      }
    }

    // Entry blocks.
    uint64_t bad_blocks = 0;
    uint64_t unique = 0, shared = 0, total = 0;
    FpKey last{};
    bool have_last = false;
    std::vector<uint8_t> chunk;
    std::vector<EncodedEntry> decoded;
    auto block_problem = [&](uint64_t index, const std::string& what) {
      if (++bad_blocks <= kMaxBlockProblems) AddShardDamage(s, AtBlock(name, index), what);
    };
    for (uint64_t b = 1; b < 1 + h.entry_blocks;) {
      const uint64_t n = std::min(kChunkBlocks, 1 + h.entry_blocks - b);
      chunk.resize(n * kBlockSize);
      RETURN_IF_ERROR(f->Read(b * kBlockSize, chunk.data(), chunk.size()));
      for (uint64_t i = 0; i < n; i++) {
        const uint64_t index = b + i;
        report_.entry_blocks_checked++;
        decoded.clear();
        Status st = DecodeEntryBlock(chunk.data() + i * kBlockSize, h, uuid_, id, index, &decoded,
                                     name);
        if (!st.ok()) {
          block_problem(index, "corrupt entry block (" + Reason(st, name) + ")");
          continue;
        }
        uint64_t order = 0, outside = 0, bad_ref = 0, bad_arena = 0;
        for (const EncodedEntry& ee : decoded) {
          if (!h.range.Contains(KeyPrefix(ee.e.fp))) {
            outside++;
            continue;
          }
          if (have_last && !(last < ee.e.fp)) {
            order++;
            continue;
          }
          if (ee.e.kind == EntryKind::kUnique) {
            if (table_ok && ee.file_ref >= table.size()) {
              bad_ref++;
              continue;
            }
            unique++;
          } else {
            if (ee.e.arena >= h.arena_next) {
              bad_arena++;
              continue;
            }
            shared++;
          }
          last = ee.e.fp;
          have_last = true;
          total++;
        }
        report_.entries_checked += decoded.size();
        if (order + outside + bad_ref + bad_arena > 0) {
          std::string what = "damaged entries in a block whose checksum holds:";
          if (order) what += " " + std::to_string(order) + " out of order";
          if (outside) what += " " + std::to_string(outside) + " outside the shard's range";
          if (bad_ref) what += " " + std::to_string(bad_ref) + " naming no file-table slot";
          if (bad_arena) what += " " + std::to_string(bad_arena) + " naming arena blocks past its end";
          block_problem(index, what);
        }
      }
      b += n;
    }
    if (bad_blocks > kMaxBlockProblems) {
      AddShardDamage(s, name,
                     std::to_string(bad_blocks - kMaxBlockProblems) +
                         " more damaged entry blocks (not listed)");
    }
    if (bad_blocks == 0 && table_ok &&
        (total != h.entry_count || unique != h.unique_count || shared != h.shared_count)) {
      AddShardDamage(s, AtBlock(name, 0),
                     "header counts " + std::to_string(h.entry_count) + " entries (" +
                         std::to_string(h.unique_count) + " unique, " +
                         std::to_string(h.shared_count) + " shared), the entry blocks hold " +
                         std::to_string(total) + " (" + std::to_string(unique) + ", " +
                         std::to_string(shared) + ")");
    }
    return Status::Ok();
  }

  // ------------------------------------------------------------ pending

  // A stale pending file holding frames of a newer format version is not
  // ours to remove. One that cannot be opened is not (the caller reports
  // it as it would anyway).
  Result<bool> PendingIsNewer(const IndexFile& pf) {
    Result<std::unique_ptr<File>> opened = vol_->OpenFile(pf.name);
    if (!opened.ok()) {
      if (Gone(opened.status()) || Busy(opened.status())) return false;
      return opened.status();
    }
    return PendingHasNewerFrame(opened->get(), algo_, uuid_);
  }

  Status CheckPending(const IndexFile& pf) {
    Result<std::unique_ptr<File>> opened = vol_->OpenFile(pf.name);
    if (!opened.ok()) {
      if (Gone(opened.status())) return Status::Ok();
      if (Busy(opened.status())) {
        report_.busy.push_back(pf.name);
        return Status::Ok();
      }
      return opened.status();
    }
    File* f = opened->get();
    report_.pending_files_checked++;
    const uint64_t size = f->size();
    const uint64_t blocks = size / kBlockSize;
    // Frame by frame, each read whole only once its header checks out (as
    // ReadPendingFile): memory follows the frames really there, not the
    // file's size, which a damaged inode may put anywhere up to 2^60.
    std::vector<uint8_t> buf;
    std::vector<PendingRecord> recs;
    uint64_t block = 0;
    while (block < blocks) {
      buf.resize(kBlockSize);
      RETURN_IF_ERROR(f->Read(block * kBlockSize, buf.data(), kBlockSize));
      uint64_t frame_blocks = 0;
      recs.clear();
      Status st = DecodePendingFrame(buf.data(), kBlockSize, algo_, uuid_, f->id(), block, &recs,
                                     &frame_blocks, pf.name);
      if (!st.ok() && frame_blocks > 1 && frame_blocks <= blocks - block) {
        buf.resize(frame_blocks * kBlockSize);
        RETURN_IF_ERROR(f->Read((block + 1) * kBlockSize, buf.data() + kBlockSize,
                                (frame_blocks - 1) * kBlockSize));
        recs.clear();
        st = DecodePendingFrame(buf.data(), buf.size(), algo_, uuid_, f->id(), block, &recs,
                                &frame_blocks, pf.name);
      }
      if (st.code() == Status::Code::kUnsupported) {
        // A newer dede's frame: neither damage nor ours to cut.
        report_.newer.push_back(pf.name);
        return Status::Ok();
      }
      if (!st.ok()) {
        const size_t p =
            Add(IndexProblem::Kind::kPendingDamaged, pf.name, AtBlock(pf.name, block),
                "bad pending frame (" + Reason(st, pf.name) + "): the " +
                    std::to_string(size - block * kBlockSize) +
                    " bytes from here on are skipped by dedup passes");
        Action* a = ActionFor(Action::Op::kCutPending, pf.name, pf.id, pf.range.lo);
        a->cut_block = block;
        a->problems.push_back(p);
        return Status::Ok();
      }
      block += frame_blocks;
    }
    if (size % kBlockSize != 0) {
      const size_t p = Add(IndexProblem::Kind::kPendingDamaged, pf.name, AtBlock(pf.name, blocks),
                           "pending file ends inside a block (" + std::to_string(size) + " bytes)");
      Action* a = ActionFor(Action::Op::kCutPending, pf.name, pf.id, pf.range.lo);
      a->cut_block = blocks;
      a->problems.push_back(p);
    }
    return Status::Ok();
  }

  // ------------------------------------------------------------ logs

  Status CheckWriteLogs(const std::vector<FileInfo>& files) {
    for (const FileInfo& li : files) {
      if (li.kind != FileKind::kWriteLog) continue;
      std::optional<FileId> owner = ParseWriteLogName(li.name);
      if (!owner) {
        Add(IndexProblem::Kind::kWriteLog, li.name, li.name,
            "write log whose name names no file; the next dedup pass ignores it");
        continue;
      }
      auto oi = by_ino_.find(owner->ino);
      const bool orphan = oi == by_ino_.end() || !(oi->second.id == *owner) ||
                          oi->second.kind != FileKind::kRegular;
      Result<std::unique_ptr<File>> opened = vol_->OpenFile(li.name);
      if (!opened.ok()) {
        if (Gone(opened.status())) continue;
        if (Busy(opened.status())) {
          report_.busy.push_back(li.name);
          continue;
        }
        return opened.status();
      }
      report_.logs_checked++;
      if (orphan) {
        Add(IndexProblem::Kind::kWriteLog, li.name, li.name,
            "orphan write log: its file (inode " + std::to_string(owner->ino) + " generation " +
                std::to_string(owner->generation) +
                ") is gone; the next dedup pass removes it");
        continue;
      }
      WriteLogReader reader(opened->get(), algo_, uuid_, *owner);
      WriteLogFrame frame;
      uint64_t expect = 0;
      std::optional<uint64_t> first_bad;
      while (true) {
        ASSIGN_OR_RETURN(bool more, reader.Next(&frame));
        if (!more) break;
        report_.log_frames_checked++;
        if (frame.log_offset > expect && !first_bad) first_bad = expect;
        expect = frame.log_offset + frame.encoded_bytes;
      }
      const WriteLogScanStats& st = reader.stats();
      if (st.corrupt_frames == 0 && st.skipped_bytes == 0) continue;
      if (!first_bad) first_bad = expect;
      Add(IndexProblem::Kind::kWriteLog, li.name, li.name + " byte " + std::to_string(*first_bad),
          std::to_string(st.corrupt_frames) + " corrupt frame" +
              (st.corrupt_frames == 1 ? "" : "s") + ", " + std::to_string(st.skipped_bytes) +
              " bytes skipped (" + std::to_string(st.frames) +
              " good frames kept); the next dedup pass skips them and consumes the rest");
    }
    return Status::Ok();
  }

  // ------------------------------------------------------------ repair

  Status Repair() {
    LockManager* lm = vol_->lock_manager();
    std::map<uint64_t, std::vector<Action*>> by_lo;
    for (Action& a : actions_) by_lo[a.lo].push_back(&a);
    for (auto& [lo, acts] : by_lo) {
      const LockId lock{LockKind::kIndexShard, ShardLockId(ShardRange{0, lo})};
      Status ls = lm->Acquire(lock, LockMode::kExclusive, false);
      if (!ls.ok()) {
        if (ls.code() != Status::Code::kLocked) return ls;
        for (Action* a : acts) {
          for (size_t p : a->problems) {
            report_.problems[p].what += " (not repaired: the shard range is locked by a dedup pass)";
          }
        }
        continue;
      }
      Status st = RepairRange(lo, acts);
      (void)lm->Release(lock);
      RETURN_IF_ERROR(st);
    }
    return Status::Ok();
  }

  Status RemoveIfThere(const std::string& name, bool* done) {
    Status s = vol_->Remove(name);
    if (s.ok() || s.code() == Status::Code::kNotFound) {
      *done = true;
      return Status::Ok();
    }
    if (s.code() == Status::Code::kLocked) {
      *done = false;
      return Status::Ok();
    }
    return s;
  }

  void MarkRepaired(const Action* a, bool done, const std::string& why_not) {
    for (size_t p : a->problems) {
      if (done) {
        report_.problems[p].repaired = true;
      } else {
        report_.problems[p].what += " (not repaired: " + why_not + ")";
      }
    }
  }

  // Is what the check decided on `a` still so? Called under the range's
  // lock, where no update of the range runs, with the map loaded there.
  // (The check ran without it: a version an update was writing was still
  // empty, so it looked incomplete, and may be complete and live now.)
  // Matching is by name and file id: a name may have been removed and
  // created again meanwhile (a pass re-creating a pending file or a
  // version of the same name), and the new file is not what was checked.
  static bool StillSo(const Action& a, const ShardMap& now) {
    auto same = [&](const IndexFile& f) { return f.name == a.name && f.id == a.id; };
    auto named = [&](const std::vector<IndexFile>& v) {
      return std::any_of(v.begin(), v.end(), same);
    };
    const bool live = std::any_of(now.live.begin(), now.live.end(), [&](const ShardSlot& s) {
      return s.version != 0 && s.name == a.name && s.id == a.id;
    });
    switch (a.op) {
      case Action::Op::kRemoveVersion:
        return live;  // a damaged version, still the live one
      case Action::Op::kCutPending:
        for (const IndexFile& f : now.pending) {
          if (same(f)) return now.IsLivePending(f.range);
        }
        return false;
      case Action::Op::kRemoveStale:
        if (named(now.incomplete) || named(now.stale_shards)) return true;
        for (const IndexFile& f : now.pending) {
          if (same(f)) return !now.IsLivePending(f.range);
        }
        for (const IndexFile& f : now.arenas) {
          if (same(f)) return RealSlotAt(now, f.range.lo) == nullptr;
        }
        return false;
    }
    return false;
  }

  Status RepairRange(uint64_t lo, const std::vector<Action*>& acts) {
    // The map under the range's lock, as a pass loads it (LoadShardMap's
    // `locked`): a version a reader holds open is not taken as complete
    // where that decides what is stale here. Taken so, a dead split's
    // upper half held by a reader (a pass's map load, `dede stats`) made
    // the split look finished, and the repair removed the live parent.
    // The widest range the actions name at lo (a split's parent); with
    // only arenas named, the widest range that can start at lo.
    std::optional<ShardRange> named;
    for (const Action* a : acts) {
      ShardRange r;
      uint64_t version;
      if ((ParseShardFileName(a->name, &r, &version) || ParsePendingFileName(a->name, &r)) &&
          r.lo == lo && (!named || r.depth < named->depth)) {
        named = r;
      }
    }
    const ShardRange locked = named.value_or(
        ShardRange{lo == 0 ? 0u : static_cast<uint32_t>(64 - std::countr_zero(lo)), lo});
    Result<ShardMap> loaded = LoadShardMap(vol_, &locked);
    if (loaded.status().code() == Status::Code::kLocked) {
      for (Action* a : acts) MarkRepaired(a, false, loaded.status().message());
      return Status::Ok();
    }
    ASSIGN_OR_RETURN(const ShardMap now, std::move(loaded));
    bool removed_version = false;
    // Stale files first, so removing a damaged version cannot bring an
    // older (superseded) one back to life.
    for (int pass = 0; pass < 3; pass++) {
      for (Action* a : acts) {
        if (pass == 0 && a->op != Action::Op::kRemoveStale) continue;
        if (pass == 1 && a->op != Action::Op::kRemoveVersion) continue;
        if (pass == 2 && a->op != Action::Op::kCutPending) continue;
        if (!StillSo(*a, now)) {
          MarkRepaired(a, false, "a dedup pass changed the range since the check; check again");
          continue;
        }
        bool done = false;
        if (a->op == Action::Op::kCutPending) {
          Result<std::unique_ptr<File>> f = vol_->OpenFile(a->name);
          if (f.ok()) {
            RETURN_IF_ERROR((*f)->Truncate(a->cut_block * kBlockSize));
            done = true;
          } else if (f.status().code() == Status::Code::kNotFound) {
            done = true;
          } else if (f.status().code() != Status::Code::kLocked) {
            return f.status();
          }
        } else {
          RETURN_IF_ERROR(RemoveIfThere(a->name, &done));
          if (done && a->op == Action::Op::kRemoveVersion) removed_version = true;
        }
        MarkRepaired(a, done, "the file is in use");
      }
    }
    if (removed_version) {
      // The arena of the range: if no usable version starts at lo now, its
      // references are described by nothing. Drop them (files keep theirs).
      ASSIGN_OR_RETURN(ShardMap map, LoadShardMap(vol_));
      const ShardSlot* real = RealSlotAt(map, lo);
      if (real == nullptr || damaged_.count(real->name)) {
        bool done = false;
        RETURN_IF_ERROR(RemoveIfThere(ArenaFileName(lo), &done));
        if (!done) {
          for (Action* a : acts) {
            if (a->op != Action::Op::kRemoveVersion) continue;
            for (size_t p : a->problems) {
              report_.problems[p].repaired = false;
              report_.problems[p].what += " (not repaired: the range's arena is in use)";
            }
          }
        }
      }
    }
    return vol_->Sync();
  }

  Volume* vol_;
  const bool repair_;
  const std::function<void()> before_repair_;
  const Uuid uuid_;
  const HashAlgo algo_;
  std::unordered_map<uint64_t, FileInfo> by_ino_;
  std::set<std::string> damaged_;
  std::vector<Action> actions_;
  IndexCheckReport report_;
};

}  // namespace

// ---------------------------------------------------------------- summary

Result<IndexSummary> SummarizeIndex(Volume* vol) {
  IndexSummary s;
  const Uuid uuid = vol->superblock().uuid;
  const HashAlgo algo = vol->superblock().hash_algo;
  ASSIGN_OR_RETURN(ShardMap map, LoadShardMap(vol));
  for (const ShardSlot& slot : map.live) {
    if (slot.version == 0) {
      s.empty_ranges++;
      continue;
    }
    s.shards++;
    Result<std::unique_ptr<File>> f = vol->OpenFile(slot.name);
    if (!f.ok()) {
      if (Busy(f.status()) || Gone(f.status())) {
        s.busy_shards++;
        continue;
      }
      return f.status();
    }
    if ((*f)->size() < kBlockSize) {
      s.unreadable_shards++;
      continue;
    }
    std::vector<uint8_t> blk(kBlockSize);
    RETURN_IF_ERROR((*f)->Read(0, blk.data(), kBlockSize));
    Result<ShardHeader> h = DecodeShardHeader(blk.data(), uuid, (*f)->id(), slot.name);
    if (!h.ok()) {
      s.unreadable_shards++;
      continue;
    }
    s.entries += h->entry_count;
    s.unique_entries += h->unique_count;
    s.shared_entries += h->shared_count;
  }
  for (const IndexFile& f : map.shard_files) {
    s.shard_files++;
    s.shard_blocks += f.mapped_blocks;
  }
  s.stale_files += map.stale_shards.size();
  for (const IndexFile& pf : map.pending) {
    s.pending_files++;
    s.pending_blocks += pf.mapped_blocks;
    if (!map.IsLivePending(pf.range)) {
      s.stale_files++;
      continue;
    }
    Result<std::unique_ptr<File>> f = vol->OpenFile(pf.name);
    if (!f.ok()) {
      if (Busy(f.status()) || Gone(f.status())) {
        s.busy_pending++;
        continue;
      }
      return f.status();
    }
    ASSIGN_OR_RETURN(uint64_t n, CountPendingRecords(f->get(), algo, uuid));
    s.pending_records += n;
  }
  for (const IndexFile& af : map.arenas) {
    s.arena_files++;
    s.arena_blocks += af.mapped_blocks;
    if (RealSlotAt(map, af.range.lo) == nullptr) s.stale_files++;
    Result<std::unique_ptr<File>> f = vol->OpenFile(af.name);
    if (!f.ok()) {
      if (Busy(f.status()) || Gone(f.status())) {
        s.busy_arenas++;
        continue;
      }
      return f.status();
    }
    ASSIGN_OR_RETURN(FileUsage u, (*f)->Usage());
    // metadata_blocks counts the inode too; it lives in the inode table.
    s.arena_pointer_blocks += u.metadata_blocks > 0 ? u.metadata_blocks - 1 : 0;
    s.arena_only_blocks += u.unique_blocks;
  }
  return s;
}

// ---------------------------------------------------------------- check

Result<IndexCheckReport> CheckIndex(Volume* vol, bool repair,
                                    const std::function<void()>& before_repair) {
  Checker c(vol, repair, before_repair);
  return c.Run();
}

}  // namespace dede

namespace dede {

Result<SpaceSummary> SummarizeSpace(Volume* vol) {
  SpaceSummary out;
  ASSIGN_OR_RETURN(out.stats, vol->Stats());
  ASSIGN_OR_RETURN(std::vector<FileInfo> files, vol->List());
  Result<IndexSummary> index = SummarizeIndex(vol);
  if (!index.ok()) return index.status().WithContext("index");
  out.index = *index;
  // Mapped blocks per kind of file. Regular files are the VM disks; the
  // rest are dede's own: index shards and pending files, arenas (whose
  // blocks are references to blocks files share), write logs, others.
  uint64_t index_mapped = 0, other_internal_blocks = 0;
  for (const FileInfo& fi : files) {
    switch (fi.kind) {
      case FileKind::kRegular:
        out.regular_files++;
        out.logical_blocks += fi.mapped_blocks;
        continue;
      case FileKind::kIndexShard:
        index_mapped += fi.mapped_blocks;
        break;
      // A merge-request file's blocks are clones of shared blocks (and one
      // header block per group): like an arena's, not data of their own.
      case FileKind::kArena:
      case FileKind::kMergeRequest:
        break;
      case FileKind::kWriteLog:
        out.log_files++;
        out.log_blocks += fi.mapped_blocks;
        break;
      default:
        other_internal_blocks += fi.mapped_blocks;
        break;
    }
    out.internal_files++;
  }
  // Used blocks are distinct data blocks plus block-map blocks. Internal
  // files other than arenas never share their blocks; an arena's blocks
  // are the files' shared blocks, except the few only the arena still
  // references (garbage until the shard's next rewrite).
  auto minus = [](uint64_t a, uint64_t b) { return a >= b ? a - b : 0; };
  const uint64_t data_used = minus(out.stats.used_blocks, out.stats.pointer_blocks);
  out.physical_blocks = minus(data_used, index_mapped + out.log_blocks + other_internal_blocks +
                                             out.index.arena_only_blocks);
  return out;
}

}  // namespace dede
