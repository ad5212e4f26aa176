#include "index/shard_map.h"

#include <algorithm>
#include <map>
#include <thread>

namespace dede {

namespace {

struct Resolver {
  // Newest version per exact range.
  std::map<ShardRange, const IndexFile*> newest;

  bool AnyInside(const ShardRange& r, uint64_t newer_than) const {
    for (const auto& [range, f] : newest) {
      if (range.depth > r.depth && r.Contains(range.lo) && f->version > newer_than) return true;
    }
    return false;
  }

  void Resolve(const ShardRange& r, uint64_t newer_than, std::vector<ShardSlot>* out) const {
    const IndexFile* f = nullptr;
    auto it = newest.find(r);
    if (it != newest.end() && it->second->version > newer_than) f = it->second;
    const uint64_t fv = f ? f->version : newer_than;
    if (r.depth < kMaxShardDepth && AnyInside(r, fv)) {
      std::vector<ShardSlot> halves;
      Resolve(r.Lower(), fv, &halves);
      Resolve(r.Upper(), fv, &halves);
      const bool complete = std::all_of(halves.begin(), halves.end(),
                                        [](const ShardSlot& s) { return s.version != 0; });
      if (f == nullptr || complete) {
        out->insert(out->end(), halves.begin(), halves.end());
        return;
      }
    }
    ShardSlot s;
    s.range = r;
    if (f) {
      s.version = f->version;
      s.name = f->name;
      s.id = f->id;
    }
    out->push_back(s);
  }
};

}  // namespace

const ShardSlot& ShardMap::SlotFor(uint64_t prefix) const {
  // live is sorted by lo and covers everything: the last slot with lo <= p.
  auto it = std::upper_bound(live.begin(), live.end(), prefix,
                             [](uint64_t p, const ShardSlot& s) { return p < s.range.lo; });
  return *(it - 1);
}

bool ShardMap::IsLivePending(const ShardRange& r) const {
  for (const ShardSlot& s : live) {
    if (s.range == r) return true;
  }
  return false;
}

bool ShardMap::IsPendingListed(const ShardRange& r) const {
  for (const IndexFile& f : pending) {
    if (f.range == r) return true;
  }
  return false;
}

bool ShardMap::IsNewer(const std::string& name) const {
  for (const IndexFile& f : newer) {
    if (f.name == name) return true;
  }
  return false;
}

bool ShardMap::IsLiveArena(uint64_t lo) const {
  for (const ShardSlot& s : live) {
    if (s.range.lo == lo) return true;
  }
  return false;
}

ShardMap ResolveShardMap(const std::vector<FileInfo>& files,
                         const std::set<std::string>& incomplete,
                         const std::set<std::string>& newer) {
  ShardMap m;
  for (const FileInfo& fi : files) {
    IndexFile f;
    f.name = fi.name;
    f.id = fi.id;
    f.size = fi.size;
    f.mapped_blocks = fi.mapped_blocks;
    uint64_t lo;
    if (fi.kind == FileKind::kIndexShard && ParseShardFileName(fi.name, &f.range, &f.version)) {
      if (incomplete.count(fi.name)) {
        m.incomplete.push_back(f);
        continue;
      }
      if (newer.count(fi.name)) m.newer.push_back(f);
      m.shard_files.push_back(f);
    } else if (fi.kind == FileKind::kIndexShard && ParsePendingFileName(fi.name, &f.range)) {
      m.pending.push_back(f);
    } else if (fi.kind == FileKind::kArena && ParseArenaFileName(fi.name, &lo)) {
      f.range = ShardRange{0, lo};
      m.arenas.push_back(f);
    }
  }
  Resolver r;
  for (const IndexFile& f : m.shard_files) {
    auto [it, fresh] = r.newest.try_emplace(f.range, &f);
    if (!fresh && it->second->version < f.version) it->second = &f;
  }
  r.Resolve(ShardRange{0, 0}, 0, &m.live);
  for (const IndexFile& f : m.shard_files) {
    bool live = false;
    for (const ShardSlot& s : m.live) live |= (s.version != 0 && s.name == f.name);
    if (!live) m.stale_shards.push_back(f);
  }
  return m;
}

namespace {

bool Overlap(const ShardRange& a, const ShardRange& b) {
  return a.Contains(b.lo) || b.Contains(a.lo);
}

// The live slots of `m` that overlap `r`, as (range, version).
std::vector<std::pair<ShardRange, uint64_t>> LiveNear(const ShardMap& m, const ShardRange& r) {
  std::vector<std::pair<ShardRange, uint64_t>> out;
  for (const ShardSlot& s : m.live) {
    if (Overlap(s.range, r)) out.emplace_back(s.range, s.version);
  }
  return out;
}

}  // namespace

Result<ShardMap> LoadShardMap(Volume* vol, const ShardRange* locked) {
  ASSIGN_OR_RETURN(std::vector<FileInfo> files, vol->List());
  std::set<std::string> incomplete, gone, newer;
  std::vector<uint8_t> blk(kBlockSize);
  // Checks the header of an open version.
  auto check = [&](const FileInfo& fi, File* f) -> Status {
    RETURN_IF_ERROR(f->Read(0, blk.data(), kBlockSize));
    Result<ShardHeader> h = DecodeShardHeader(blk.data(), vol->superblock().uuid, fi.id, fi.name);
    if (h.status().code() == Status::Code::kUnsupported) {
      newer.insert(fi.name);
    } else if (!h.ok()) {
      incomplete.insert(fi.name);
    }
    return Status::Ok();
  };
  // Versions held open elsewhere (only looked at when `locked` is given):
  // whether each is under our lock (ShardLockId).
  struct Held {
    const FileInfo* fi;
    bool ours;
  };
  std::vector<Held> held;
  for (const FileInfo& fi : files) {
    ShardRange r;
    uint64_t version;
    if (fi.kind != FileKind::kIndexShard || !ParseShardFileName(fi.name, &r, &version)) continue;
    if (fi.size < kBlockSize) {
      incomplete.insert(fi.name);
      continue;
    }
    Result<std::unique_ptr<File>> f = vol->OpenFileById(fi.id);
    if (!f.ok()) {
      if (f.status().code() == Status::Code::kNotFound) {
        gone.insert(fi.name);
        continue;
      }
      if (f.status().code() == Status::Code::kLocked) {
        // Without a lock of ours: taken as complete.
        if (locked == nullptr) continue;
        // Under our lock: the versions whose lock is the one we hold (a
        // stale guess's range may also hold a split half under another
        // lock).
        const bool ours = locked->Contains(r.lo) && ShardLockId(r) == ShardLockId(*locked);
        held.push_back({&fi, ours});
        continue;
      }
      return f.status();
    }
    RETURN_IF_ERROR(check(fi, f->get()));
  }
  auto present = [&] {
    std::vector<FileInfo> out;
    out.reserve(files.size());
    for (const FileInfo& fi : files) {
      if (!gone.count(fi.name)) out.push_back(fi);
    }
    return out;
  };
  // Does the map around the locked range depend on a held version being
  // complete? One under our lock always does (nobody else writes it: its
  // holder is a reader, and readers open incomplete versions too). One
  // under another lock does when taking it for incomplete resolves the
  // slots overlapping ours differently: the upper half of a split that
  // died is under the upper half's lock, and taken as complete it made the
  // split look finished, the parent stale, and the parent's lock holder
  // (the lower half's) deleted the live parent.
  auto matters = [&] {
    if (held.empty()) return false;
    for (const Held& h : held) {
      if (h.ours) return true;
    }
    const std::vector<FileInfo> now = present();
    std::set<std::string> pessimistic = incomplete;
    for (const Held& h : held) pessimistic.insert(h.fi->name);
    return LiveNear(ResolveShardMap(now, incomplete, newer), *locked) !=
           LiveNear(ResolveShardMap(now, pessimistic, newer), *locked);
  };
  // Such versions are opened again until free (a reader's look is brief);
  // still held after kLockedRangeWait: kLocked, the caller looks again.
  const auto until = std::chrono::steady_clock::now() + kLockedRangeWait;
  while (matters()) {
    if (std::chrono::steady_clock::now() >= until) {
      return Status::Locked("index shard version '" + held.front().fi->name +
                            "' stays open elsewhere; its header cannot be checked");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    for (size_t k = 0; k < held.size();) {
      const FileInfo& fi = *held[k].fi;
      Result<std::unique_ptr<File>> f = vol->OpenFileById(fi.id);
      if (!f.ok() && f.status().code() == Status::Code::kLocked) {
        k++;
        continue;
      }
      if (!f.ok() && f.status().code() != Status::Code::kNotFound) return f.status();
      if (f.ok()) {
        RETURN_IF_ERROR(check(fi, f->get()));
      } else {
        gone.insert(fi.name);
      }
      held.erase(held.begin() + static_cast<ptrdiff_t>(k));
    }
  }
  // What is still held does not change the map around our range: taken as
  // complete, as without a lock.
  return ResolveShardMap(present(), incomplete, newer);
}

}  // namespace dede
