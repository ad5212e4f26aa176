// Tests for the resolution of the live shard partition from file names
// (index/shard_map.h): versions, completed and half-finished splits at
// several depths, virtual slots, stale files, SlotFor at range boundaries,
// and (for random name sets) that the live slots always tile [0, 2^64).
#include "index/shard_map.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

using namespace dede;

namespace {

constexpr uint64_t kHalf = 1ull << 63;
constexpr uint64_t kQuarter = 1ull << 62;

struct Files {
  std::vector<FileInfo> list;
  uint64_t next_ino = 100;

  FileInfo& Add(const std::string& name, FileKind kind) {
    FileInfo fi;
    fi.id = FileId{next_ino++, 1};
    fi.name = name;
    fi.kind = kind;
    fi.size = 4096 * fi.id.ino;
    list.push_back(fi);
    return list.back();
  }
  FileId Shard(const ShardRange& r, uint64_t version) {
    return Add(ShardFileName(r, version), FileKind::kIndexShard).id;
  }
  void Pending(const ShardRange& r) { Add(PendingFileName(r), FileKind::kIndexShard); }
  void Arena(uint64_t lo) { Add(ArenaFileName(lo), FileKind::kArena); }
};

ShardRange R(uint32_t depth, uint64_t lo) {
  return ShardRange{depth, lo};
}

// The live slots are sorted, contiguous and cover every prefix; SlotFor
// finds each slot at both of its ends.
void CheckPartition(const ShardMap& m) {
  REQUIRE_FALSE(m.live.empty());
  CHECK(m.live.front().range.lo == 0);
  CHECK(m.live.back().range.last() == ~0ull);
  for (size_t i = 0; i < m.live.size(); i++) {
    const ShardSlot& s = m.live[i];
    CAPTURE(i, s.range.ToString());
    CHECK(s.range.depth <= kMaxShardDepth);
    if (i > 0) {
      const ShardSlot& p = m.live[i - 1];
      CHECK(p.range.lo < s.range.lo);
      CHECK(p.range.last() + 1 == s.range.lo);
    }
    CHECK(&m.SlotFor(s.range.lo) == &s);
    CHECK(&m.SlotFor(s.range.last()) == &s);
    CHECK((s.version == 0) == s.name.empty());
    if (s.version != 0) {
      ShardRange pr;
      uint64_t pv = 0;
      REQUIRE(ParseShardFileName(s.name, &pr, &pv));
      CHECK(pr == s.range);
      CHECK(pv == s.version);
    }
  }
}

// Every shard file is exactly one of: live, stale.
void CheckStaleAccounting(const ShardMap& m) {
  std::multiset<std::string> all, seen;
  for (const IndexFile& f : m.shard_files) all.insert(f.name);
  for (const IndexFile& f : m.stale_shards) seen.insert(f.name);
  for (const ShardSlot& s : m.live) {
    if (s.version != 0) seen.insert(s.name);
  }
  CHECK(all == seen);
}

std::set<std::string> StaleNames(const ShardMap& m) {
  std::set<std::string> out;
  for (const IndexFile& f : m.stale_shards) out.insert(f.name);
  return out;
}

struct Want {
  ShardRange range;
  uint64_t version;
};

void CheckLive(const ShardMap& m, const std::vector<Want>& want) {
  REQUIRE(m.live.size() == want.size());
  for (size_t i = 0; i < want.size(); i++) {
    CAPTURE(i);
    CHECK(m.live[i].range == want[i].range);
    CHECK(m.live[i].version == want[i].version);
    if (want[i].version != 0)
      CHECK(m.live[i].name == ShardFileName(want[i].range, want[i].version));
  }
}

}  // namespace

TEST_CASE("shardmap: no files is one virtual slot covering everything", "[index]") {
  const ShardMap m = ResolveShardMap({});
  CheckPartition(m);
  CheckLive(m, {{R(0, 0), 0}});
  CHECK(m.live[0].name.empty());
  CHECK(m.shard_files.empty());
  CHECK(m.stale_shards.empty());
  CHECK(m.pending.empty());
  CHECK(m.arenas.empty());
  CHECK(&m.SlotFor(0) == &m.live[0]);
  CHECK(&m.SlotFor(~0ull) == &m.live[0]);
  CHECK(&m.SlotFor(kHalf) == &m.live[0]);
}

TEST_CASE("shardmap: the newest version of a range is live and the rest stale", "[index]") {
  Files f;
  f.Shard(R(0, 0), 3);
  const FileId newest = f.Shard(R(0, 0), 0x20);
  f.Shard(R(0, 0), 1);
  f.Shard(R(0, 0), 0x1f);
  const ShardMap m = ResolveShardMap(f.list);
  CheckPartition(m);
  CheckStaleAccounting(m);
  CheckLive(m, {{R(0, 0), 0x20}});
  CHECK(m.live[0].id == newest);
  CHECK(m.shard_files.size() == 4);
  CHECK(StaleNames(m) == std::set<std::string>{ShardFileName(R(0, 0), 3), ShardFileName(R(0, 0), 1),
                                               ShardFileName(R(0, 0), 0x1f)});
}

TEST_CASE("shardmap: files are classified by kind and name", "[index]") {
  Files f;
  f.Shard(R(0, 0), 2);
  f.Pending(R(0, 0));
  f.Pending(R(1, kHalf));
  f.Arena(0);
  f.Arena(kHalf);
  // Right name, wrong kind (or the reverse): not part of the index.
  f.Add(ShardFileName(R(0, 0), 9), FileKind::kRegular);
  f.Add(ShardFileName(R(0, 0), 10), FileKind::kArena);
  f.Add(ArenaFileName(kQuarter), FileKind::kIndexShard);
  f.Add(PendingFileName(R(2, 0)), FileKind::kWriteLog);
  // Index kind, malformed names.
  f.Add(".dede-ix-00-0000000000000000-000000000000000B", FileKind::kIndexShard);
  f.Add(".dede-ix-29-0000000000000000-0000000000000001", FileKind::kIndexShard);
  f.Add("vm1.img", FileKind::kRegular);
  const ShardMap m = ResolveShardMap(f.list);
  CheckPartition(m);
  CheckStaleAccounting(m);
  CheckLive(m, {{R(0, 0), 2}});
  REQUIRE(m.shard_files.size() == 1);
  REQUIRE(m.pending.size() == 2);
  REQUIRE(m.arenas.size() == 2);
  CHECK(m.arenas[1].range.lo == kHalf);
  CHECK(m.pending[1].range == R(1, kHalf));
  CHECK(m.IsLivePending(R(0, 0)));
  CHECK_FALSE(m.IsLivePending(R(1, kHalf)));
  CHECK(m.IsLiveArena(0));
  CHECK_FALSE(m.IsLiveArena(kHalf));
  // Sizes and ids carried through.
  CHECK(m.shard_files[0].id == f.list[0].id);
  CHECK(m.shard_files[0].size == f.list[0].size);
}

TEST_CASE("shardmap: a completed split hides its parent", "[index]") {
  Files f;
  f.Shard(R(0, 0), 5);
  f.Shard(R(1, 0), 6);
  f.Shard(R(1, kHalf), 7);
  f.Arena(0);
  f.Arena(kHalf);
  f.Pending(R(0, 0));
  f.Pending(R(1, kHalf));
  const ShardMap m = ResolveShardMap(f.list);
  CheckPartition(m);
  CheckStaleAccounting(m);
  CheckLive(m, {{R(1, 0), 6}, {R(1, kHalf), 7}});
  CHECK(StaleNames(m) == std::set<std::string>{ShardFileName(R(0, 0), 5)});
  CHECK(m.SlotFor(kHalf - 1).version == 6);
  CHECK(m.SlotFor(kHalf).version == 7);
  CHECK(m.IsLiveArena(kHalf));
  CHECK(m.IsLivePending(R(1, kHalf)));
  CHECK_FALSE(m.IsLivePending(R(0, 0)));
}

TEST_CASE("shardmap: a half-finished split keeps the parent live", "[index]") {
  for (bool upper : {false, true}) {
    CAPTURE(upper);
    Files f;
    f.Shard(R(0, 0), 5);
    const ShardRange half = upper ? R(1, kHalf) : R(1, 0);
    f.Shard(half, 6);
    const ShardMap m = ResolveShardMap(f.list);
    CheckPartition(m);
    CheckStaleAccounting(m);
    CheckLive(m, {{R(0, 0), 5}});
    CHECK(StaleNames(m) == std::set<std::string>{ShardFileName(half, 6)});
    CHECK(m.SlotFor(kHalf).version == 5);
    CHECK(m.SlotFor(0).version == 5);
  }
}

TEST_CASE("shardmap: halves not newer than the parent do not split it", "[index]") {
  SECTION("both halves older (a merge back or a stale split)") {
    Files f;
    f.Shard(R(0, 0), 9);
    f.Shard(R(1, 0), 3);
    f.Shard(R(1, kHalf), 4);
    const ShardMap m = ResolveShardMap(f.list);
    CheckPartition(m);
    CheckStaleAccounting(m);
    CheckLive(m, {{R(0, 0), 9}});
    CHECK(StaleNames(m).size() == 2);
  }
  SECTION("one half newer and one older") {
    Files f;
    f.Shard(R(0, 0), 5);
    f.Shard(R(1, 0), 6);
    f.Shard(R(1, kHalf), 4);
    const ShardMap m = ResolveShardMap(f.list);
    CheckPartition(m);
    CheckStaleAccounting(m);
    CheckLive(m, {{R(0, 0), 5}});
    CHECK(StaleNames(m) ==
          std::set<std::string>{ShardFileName(R(1, 0), 6), ShardFileName(R(1, kHalf), 4)});
  }
  SECTION("a half as old as the parent") {
    Files f;
    f.Shard(R(0, 0), 5);
    f.Shard(R(1, 0), 6);
    f.Shard(R(1, kHalf), 5);
    const ShardMap m = ResolveShardMap(f.list);
    CheckPartition(m);
    CheckLive(m, {{R(0, 0), 5}});
  }
}

TEST_CASE("shardmap: a missing parent with one half leaves a virtual slot", "[index]") {
  SECTION("lower half only") {
    Files f;
    f.Shard(R(1, 0), 2);
    const ShardMap m = ResolveShardMap(f.list);
    CheckPartition(m);
    CheckStaleAccounting(m);
    CheckLive(m, {{R(1, 0), 2}, {R(1, kHalf), 0}});
    CHECK(m.stale_shards.empty());
    CHECK(m.SlotFor(kHalf).version == 0);
    CHECK(m.SlotFor(kHalf).name.empty());
    CHECK(m.SlotFor(kHalf - 1).version == 2);
  }
  SECTION("upper half only") {
    Files f;
    f.Shard(R(1, kHalf), 2);
    const ShardMap m = ResolveShardMap(f.list);
    CheckPartition(m);
    CheckLive(m, {{R(1, 0), 0}, {R(1, kHalf), 2}});
  }
  SECTION("one deep shard: virtual slots at every level around it") {
    Files f;
    const ShardRange deep = R(40, 0x1234560000000000ull);
    f.Shard(deep, 1);
    const ShardMap m = ResolveShardMap(f.list);
    CheckPartition(m);
    CheckStaleAccounting(m);
    CHECK(m.live.size() == 41);
    const ShardSlot& s = m.SlotFor(deep.lo + 5);
    CHECK(s.range == deep);
    CHECK(s.version == 1);
    // Its neighbours are virtual siblings ending / starting right there.
    CHECK(m.SlotFor(deep.lo - 1).version == 0);
    CHECK(m.SlotFor(deep.lo - 1).range.last() == deep.lo - 1);
    CHECK(m.SlotFor(deep.last() + 1).version == 0);
    CHECK(m.SlotFor(deep.last() + 1).range.lo == deep.last() + 1);
    // Its sibling at depth 40 (lo has bit 2^24 clear) is virtual.
    CHECK(m.SlotFor(deep.lo + (1ull << 24)).range == ShardRange{40, deep.lo + (1ull << 24)});
    size_t real = 0;
    for (const ShardSlot& x : m.live) real += x.version != 0;
    CHECK(real == 1);
  }
}

TEST_CASE("shardmap: deeper splits mixing depths", "[index]") {
  SECTION("upper half split again, parent of the quarters missing") {
    Files f;
    f.Shard(R(0, 0), 1);
    f.Shard(R(1, 0), 2);
    f.Shard(R(2, kHalf), 3);
    f.Shard(R(2, kHalf | kQuarter), 4);
    // A half-finished split below the lower half: the lower half stays.
    f.Shard(R(2, 0), 5);
    const ShardMap m = ResolveShardMap(f.list);
    CheckPartition(m);
    CheckStaleAccounting(m);
    CheckLive(m, {{R(1, 0), 2}, {R(2, kHalf), 3}, {R(2, kHalf | kQuarter), 4}});
    CHECK(StaleNames(m) ==
          std::set<std::string>{ShardFileName(R(0, 0), 1), ShardFileName(R(2, 0), 5)});
    CHECK(m.SlotFor(kHalf | kQuarter).version == 4);
    CHECK(m.SlotFor((kHalf | kQuarter) - 1).version == 3);
  }
  SECTION("upper half split again, its parent present and older") {
    Files f;
    f.Shard(R(0, 0), 1);
    f.Shard(R(1, 0), 2);
    f.Shard(R(1, kHalf), 3);
    f.Shard(R(2, kHalf), 4);
    f.Shard(R(2, kHalf | kQuarter), 5);
    const ShardMap m = ResolveShardMap(f.list);
    CheckPartition(m);
    CheckStaleAccounting(m);
    CheckLive(m, {{R(1, 0), 2}, {R(2, kHalf), 4}, {R(2, kHalf | kQuarter), 5}});
    CHECK(StaleNames(m) ==
          std::set<std::string>{ShardFileName(R(0, 0), 1), ShardFileName(R(1, kHalf), 3)});
  }
  SECTION("an incomplete grandchild split keeps the root") {
    // Root v1; lower half v2; upper half missing, only one of its
    // quarters: the root's split is not complete.
    Files f;
    f.Shard(R(0, 0), 1);
    f.Shard(R(1, 0), 2);
    f.Shard(R(2, kHalf), 3);
    const ShardMap m = ResolveShardMap(f.list);
    CheckPartition(m);
    CheckStaleAccounting(m);
    CheckLive(m, {{R(0, 0), 1}});
    CHECK(m.stale_shards.size() == 2);
  }
  SECTION("quarters older than a newer half are stale") {
    Files f;
    f.Shard(R(1, 0), 9);
    f.Shard(R(1, kHalf), 10);
    f.Shard(R(2, 0), 3);
    f.Shard(R(2, kQuarter), 4);
    const ShardMap m = ResolveShardMap(f.list);
    CheckPartition(m);
    CheckStaleAccounting(m);
    CheckLive(m, {{R(1, 0), 9}, {R(1, kHalf), 10}});
    CHECK(m.stale_shards.size() == 2);
  }
  SECTION("mixed depths down to 40") {
    Files f;
    f.Shard(R(0, 0), 1);
    // Split the whole space down a path of lower halves to depth 40,
    // completing each level with its upper half.
    uint64_t v = 2;
    for (uint32_t d = 1; d <= 40; d++) {
      f.Shard(R(d - 1, 0).Upper(), v++);
    }
    f.Shard(R(40, 0), v++);
    const ShardMap m = ResolveShardMap(f.list);
    CheckPartition(m);
    CheckStaleAccounting(m);
    REQUIRE(m.live.size() == 41);
    CHECK(m.live[0].range == R(40, 0));
    for (uint32_t i = 1; i <= 40; i++) {
      CHECK(m.live[i].range.depth == 41 - i);
      CHECK(m.live[i].version != 0);
    }
    CHECK(StaleNames(m) == std::set<std::string>{ShardFileName(R(0, 0), 1)});
    CHECK(m.SlotFor(0xffffff).range == R(40, 0));
    CHECK(m.SlotFor(0x1000000).range == R(40, 0x1000000));
  }
}

TEST_CASE("shardmap: SlotFor at range boundaries", "[index]") {
  Files f;
  f.Shard(R(2, 0), 1);
  f.Shard(R(2, kQuarter), 1);
  f.Shard(R(3, kHalf), 1);
  f.Shard(R(3, kHalf | (1ull << 61)), 1);
  f.Shard(R(2, kHalf | kQuarter), 1);
  const ShardMap m = ResolveShardMap(f.list);
  CheckPartition(m);
  CheckStaleAccounting(m);
  REQUIRE(m.live.size() == 5);
  CHECK(m.SlotFor(0).range == R(2, 0));
  CHECK(m.SlotFor(kQuarter - 1).range == R(2, 0));
  CHECK(m.SlotFor(kQuarter).range == R(2, kQuarter));
  CHECK(m.SlotFor(kHalf - 1).range == R(2, kQuarter));
  CHECK(m.SlotFor(kHalf).range == R(3, kHalf));
  CHECK(m.SlotFor(kHalf + (1ull << 61) - 1).range == R(3, kHalf));
  CHECK(m.SlotFor(kHalf + (1ull << 61)).range == R(3, kHalf | (1ull << 61)));
  CHECK(m.SlotFor((kHalf | kQuarter) - 1).range == R(3, kHalf | (1ull << 61)));
  CHECK(m.SlotFor(kHalf | kQuarter).range == R(2, kHalf | kQuarter));
  CHECK(m.SlotFor(~0ull).range == R(2, kHalf | kQuarter));
  for (uint64_t lo :
       {uint64_t(0), kQuarter, kHalf, uint64_t(kHalf | (1ull << 61)), uint64_t(kHalf | kQuarter)}) {
    CHECK(m.IsLiveArena(lo));
  }
  CHECK_FALSE(m.IsLiveArena(1ull << 61));
}

TEST_CASE("shardmap: random name sets always resolve to a partition", "[index]") {
  std::mt19937_64 rng(2024);
  for (int round = 0; round < 400; round++) {
    CAPTURE(round);
    Files f;
    std::map<ShardRange, uint64_t> newest;
    const int n = int(rng() % 12);
    for (int i = 0; i < n; i++) {
      // Depths 0..5 so ranges overlap often; now and then a deep one.
      const uint32_t depth = rng() % 8 == 0 ? uint32_t(rng() % 41) : uint32_t(rng() % 6);
      const uint64_t lo = depth == 0 ? 0 : rng() & ~((~0ull) >> depth);
      const uint64_t version = 1 + rng() % 20;
      const ShardRange r{depth, lo};
      bool dup = false;
      for (const FileInfo& fi : f.list) dup |= fi.name == ShardFileName(r, version);
      if (dup) continue;
      f.Shard(r, version);
      newest[r] = std::max(newest[r], version);
    }
    const ShardMap m = ResolveShardMap(f.list);
    CheckPartition(m);
    CheckStaleAccounting(m);
    for (const ShardSlot& s : m.live) {
      if (s.version == 0) continue;
      // A live version is the newest at its exact range, and newer than
      // every version of a range that contains it (an ancestor at least
      // as new would still be live).
      CHECK(newest.at(s.range) == s.version);
      for (const auto& [r, v] : newest) {
        if (r.depth < s.range.depth && r.Contains(s.range.lo)) CHECK(v < s.version);
      }
    }
  }
}
