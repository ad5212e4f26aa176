// Test helper: what the dedup index says about a file, read straight from
// the live shard versions (unit and integration tests).
#pragma once

#include <catch2/catch.hpp>
#include <cstdint>

#include "index/shard_io.h"
#include "index/shard_map.h"
#include "volume/volume.h"

namespace dede::test {

// Calls fn(slot, reader) for every live shard version, each opened afresh.
template <typename Fn>
void ForEachLiveShard(Volume* vol, Fn&& fn) {
  auto map = LoadShardMap(vol);
  REQUIRE(map.ok());
  for (const ShardSlot& slot : map->live) {
    if (slot.version == 0) continue;
    auto f = vol->OpenFileById(slot.id);
    REQUIRE(f.ok());
    auto r = ShardReader::Open(f->get(), vol->superblock().uuid, "index shard " + slot.name);
    REQUIRE(r.ok());
    fn(slot, r->get());
  }
}

// Unique entries (hints) naming inode `ino` over every live shard.
inline uint64_t UniqueEntriesOf(Volume* vol, uint64_t ino) {
  uint64_t n = 0;
  ForEachLiveShard(vol, [&](const ShardSlot&, ShardReader* r) {
    IndexEntry e;
    while (true) {
      auto more = r->Next(&e);
      REQUIRE(more.ok());
      if (!*more) break;
      if (e.kind == EntryKind::kUnique && e.file.ino == ino) n++;
    }
  });
  return n;
}

}  // namespace dede::test
