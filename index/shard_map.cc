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

bool ShardMap::IsLiveArena(uint64_t lo) const {
  for (const ShardSlot& s : live) {
    if (s.range.lo == lo) return true;
  }
  return false;
}

ShardMap ResolveShardMap(const std::vector<FileInfo>& files,
                         const std::set<std::string>& incomplete) {
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

Result<ShardMap> LoadShardMap(Volume* vol, const ShardRange* locked) {
  ASSIGN_OR_RETURN(std::vector<FileInfo> files, vol->List());
  std::set<std::string> incomplete, gone;
  std::vector<uint8_t> blk(kBlockSize);
  for (const FileInfo& fi : files) {
    ShardRange r;
    uint64_t version;
    if (fi.kind != FileKind::kIndexShard || !ParseShardFileName(fi.name, &r, &version)) continue;
    if (fi.size < kBlockSize) {
      incomplete.insert(fi.name);
      continue;
    }
    // Under our lock: the versions whose lock is the one we hold (a stale
    // guess's range may also hold a split half under another lock).
    const bool ours =
        locked != nullptr && locked->Contains(r.lo) && ShardLockId(r) == ShardLockId(*locked);
    const auto until = std::chrono::steady_clock::now() + kLockedRangeWait;
    Result<std::unique_ptr<File>> f = vol->OpenFileById(fi.id);
    while (ours && f.status().code() == Status::Code::kLocked &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      f = vol->OpenFileById(fi.id);
    }
    if (!f.ok()) {
      if (f.status().code() == Status::Code::kNotFound) {
        gone.insert(fi.name);
        continue;
      }
      if (f.status().code() == Status::Code::kLocked) {
        if (!ours) continue;
        return Status::Locked("index shard version '" + fi.name +
                              "' stays open elsewhere; its header cannot be checked");
      }
      return f.status();
    }
    RETURN_IF_ERROR((*f)->Read(0, blk.data(), kBlockSize));
    if (!DecodeShardHeader(blk.data(), vol->superblock().uuid, fi.id, fi.name).ok()) {
      incomplete.insert(fi.name);
    }
  }
  if (!gone.empty()) {
    files.erase(std::remove_if(files.begin(), files.end(),
                               [&](const FileInfo& fi) { return gone.count(fi.name) > 0; }),
                files.end());
  }
  return ResolveShardMap(files, incomplete);
}

}  // namespace dede
